"""The project's networks: classes like any a user brings, their shapes, and their checkpoint policies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modelwright.techniques import apply_checkpointing, checkpoint_segments, checkpointed_modules
from modelwright.train.models import SHORT_NAMES, ResNet18, SmallCNN, SmallViT

NETWORKS = {"resnet18": ResNet18, "smallcnn": SmallCNN, "vit": SmallViT}


def test_the_short_names_are_the_classes():
    assert {short: cls.__name__ for short, cls in NETWORKS.items()} == SHORT_NAMES


@pytest.mark.parametrize("name", NETWORKS)
def test_output_shape(name):
    model = NETWORKS[name](num_classes=7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


@pytest.mark.parametrize(("cls", "shape"), [(ResNet18, (1, 28, 28)), (SmallCNN, (1, 64, 64))])
def test_grey_images_of_another_size(cls, shape):
    model = cls(num_classes=3, in_channels=1)
    assert model(torch.randn(2, *shape)).shape == (2, 3)


def test_the_vit_takes_another_image_size():
    assert SmallViT(num_classes=4, image_size=48).eval()(torch.randn(2, 3, 48, 48)).shape == (2, 4)


def test_resnet18_has_cifar_stem_and_the_weights_of_torchvisions_builder():
    torch.manual_seed(0)
    model = ResNet18()
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert sum(p.numel() for p in model.parameters()) == 11_173_962
    from torchvision.models import resnet18

    torch.manual_seed(0)
    reference = resnet18(weights=None, num_classes=10)  # then the stem replaced, as the class does
    reference.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name


@pytest.mark.parametrize(
    "name,policy",
    [(n, g) for n in NETWORKS for g in ("stage", "block", "children") if not (n == "vit" and g == "stage")],
)
def test_checkpointing_gives_same_loss_and_gradients(name, policy):
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    reference = NETWORKS[name]().double()
    checkpointed = NETWORKS[name]().double()
    checkpointed.load_state_dict(reference.state_dict())
    segments = apply_checkpointing(checkpointed, policy)
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
    ("name", "policy", "modules"),
    [("resnet18", "stage", ["layer1", "layer2", "layer3", "layer4"]),
     ("resnet18", "block", [f"layer{stage}.{block}" for stage in range(1, 5) for block in (0, 1)]),
     ("smallcnn", "stage", ["stages.0", "stages.1", "stages.2"]),
     ("smallcnn", "block", [f"stages.{stage}.{block}" for stage in range(3) for block in (0, 1)]),
     ("vit", "block", [f"encoder.layers.encoder_layer_{index}" for index in range(6)]),
     ("resnet18", "off", [])],
)
def test_each_policy_recomputes_exactly_these_modules(name, policy, modules):
    model = NETWORKS[name]()
    names = {module: path for path, module in model.named_modules()}
    assert checkpointed_modules(model) == []
    apply_checkpointing(model, policy)
    assert [names[module] for module in checkpointed_modules(model)] == modules


def test_the_last_segment_recomputes_too():
    model = ResNet18()
    apply_checkpointing(model, "block")
    calls = []
    model.layer4[1].bn2.register_forward_hook(lambda *_: calls.append(1))  # inside the last block
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert len(calls) == 2, "the last block runs forward once more in backward"
    assert checkpointed_modules(model)[-1] is model.layer4[1]


def test_checkpointing_keeps_state_dict_keys():
    plain, checkpointed = ResNet18(), ResNet18()
    apply_checkpointing(checkpointed, "block")
    assert list(plain.state_dict()) == list(checkpointed.state_dict())


def test_checkpointing_recomputes_forward():
    model = SmallCNN()
    calls = []
    inner = checkpoint_segments(model, "stage")[0][0]  # a block inside the first checkpointed stage
    inner.register_forward_hook(lambda *_: calls.append(1))
    apply_checkpointing(model, "stage")
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert len(calls) == 2, "a checkpointed stage runs forward once more in backward"


def test_vit_attention_runs_through_sdpa(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    model = SmallViT()
    model.train()
    model(torch.randn(2, 3, 32, 32))
    assert len(calls) == len(model.encoder.layers)
