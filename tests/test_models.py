"""The networks: shapes, checkpointing equivalence, attention through SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modelwright.errors import ConfigError
from modelwright.train.models import (
    MODEL_NAMES,
    apply_gradient_checkpointing,
    build_model,
    checkpoint_segments,
    checkpointed_modules,
)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_output_shape(name):
    model = build_model(name, num_classes=7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_resnet18_has_cifar_stem():
    model = build_model("resnet18")
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert sum(p.numel() for p in model.parameters()) == 11_173_962


def test_unknown_model_is_a_config_error():
    with pytest.raises(ConfigError, match="model.model_name"):
        build_model("resnet1000")


@pytest.mark.parametrize(
    "name,granularity",
    [(n, g) for n in MODEL_NAMES for g in ("stage", "block") if not (n == "vit" and g == "stage")],
)
def test_checkpointing_gives_same_loss_and_gradients(name, granularity):
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    reference = build_model(name).double()
    checkpointed = build_model(name).double()
    checkpointed.load_state_dict(reference.state_dict())
    segments = apply_gradient_checkpointing(checkpointed, granularity)
    assert segments, "no segment was checkpointed"
    # Dropout-free and BN in train mode both sides: the recomputed forward must match exactly.
    losses, grads = [], []
    for model in (reference, checkpointed):
        loss = F.cross_entropy(model(x.double()), y)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-6, atol=1e-9, msg=f"gradient of {n}")
    # The recomputation must not fold the batch into BatchNorm's running statistics a second time.
    buffers = dict(reference.named_buffers())
    for n, b in checkpointed.named_buffers():
        torch.testing.assert_close(b, buffers[n], rtol=1e-9, atol=0, msg=f"buffer {n}")


# Counted from the architectures: resnet18 has 4 stages (layer1..layer4) of 2 BasicBlocks; the small CNN 3
# stages of 2 conv blocks; the ViT 6 encoder blocks and no stages.
@pytest.mark.parametrize(
    ("name", "granularity", "count"),
    [("resnet18", "stage", 4), ("resnet18", "block", 8), ("smallcnn", "stage", 3), ("smallcnn", "block", 6),
     ("vit", "block", 6), ("resnet18", "off", 0)],
)
def test_checkpointed_segment_counts(name, granularity, count):
    model = build_model(name)
    assert checkpointed_modules(model) == []
    apply_gradient_checkpointing(model, granularity)
    assert len(checkpointed_modules(model)) == count


def test_the_last_segment_recomputes_too():
    model = build_model("resnet18")
    apply_gradient_checkpointing(model, "block")
    calls = []
    model.layer4[1].bn2.register_forward_hook(lambda *_: calls.append(1))  # inside the last block
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert len(calls) == 2, "the last block runs forward once more in backward"
    assert checkpointed_modules(model)[-1] is model.layer4[1]


def test_checkpointing_keeps_state_dict_keys():
    plain, checkpointed = build_model("resnet18"), build_model("resnet18")
    apply_gradient_checkpointing(checkpointed, "block")
    assert list(plain.state_dict()) == list(checkpointed.state_dict())


def test_checkpointing_recomputes_forward():
    model = build_model("smallcnn")
    calls = []
    inner = checkpoint_segments(model, "stage")[0][0]  # a block inside the first checkpointed stage
    inner.register_forward_hook(lambda *_: calls.append(1))
    apply_gradient_checkpointing(model, "stage")
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert len(calls) == 2, "a checkpointed stage runs forward once more in backward"


def test_vit_has_no_stages():
    with pytest.raises(ConfigError, match="valid: off, block"):
        checkpoint_segments(build_model("vit"), "stage")


def test_vit_attention_runs_through_sdpa(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    model = build_model("vit")
    model.train()
    model(torch.randn(2, 3, 32, 32))
    assert len(calls) == len(model.encoder.layers)
