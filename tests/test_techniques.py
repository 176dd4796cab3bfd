"""Each technique of modelwright.techniques, on the project's networks and on networks it does not ship."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from modelwright import techniques
from modelwright.errors import ConfigError
from modelwright.techniques import (
    OPTIMIZERS,
    PRECISIONS,
    LoopFacts,
    TechniqueArgs,
    apply_checkpointing,
    checkpoint_segments,
    checkpointed_modules,
    freeze,
    load_weights,
    prepare_network,
    record_section,
    setup_words,
)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x))) + x


class Tiny(nn.Module):
    """A network the project does not ship: a stem, two blocks (one inside a Sequential), a head."""

    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.body = nn.Sequential(Block(4), nn.Sequential(Block(4)))
        self.head = nn.Linear(4, num_classes)

    def forward(self, x):
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def names(network, modules):
    paths = {module: path for path, module in network.named_modules()}
    return [paths[module] for module in modules]


@pytest.mark.parametrize(("policy", "expected"), [
    (["Block"], ["body.0", "body.1.0"]),
    ([f"{__name__}.Block"], ["body.0", "body.1.0"]),
    (["body.1"], ["body.1"]),
    (["body", "Block"], ["body"]),  # the outermost match only
    (["stem", "head"], ["stem", "head"]),
    ("children", ["stem", "body", "head"]),
    ("off", []),
])
def test_a_policy_names_modules_by_class_class_path_or_name(policy, expected):
    network = Tiny()
    assert names(network, checkpoint_segments(network, policy)) == expected


def test_a_policy_on_a_network_it_was_not_written_for_recomputes_and_keeps_the_results():
    torch.manual_seed(0)
    plain, checkpointed = Tiny().double(), Tiny().double()
    checkpointed.load_state_dict(plain.state_dict())
    apply_checkpointing(checkpointed, ["Block"])
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    for network in (plain, checkpointed):
        network(x).sum().backward()
    for (name, ours), theirs in zip(checkpointed.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)
    for (name, ours), theirs in zip(checkpointed.named_buffers(), plain.buffers(), strict=True):
        torch.testing.assert_close(ours, theirs, msg=name)
    assert len(checkpointed_modules(checkpointed)) == 2


@pytest.mark.parametrize(("policy", "message"), [
    (["Nothing"], "no module of Tiny matches \\['Nothing'\\]; its module classes: BatchNorm2d"),
    ("block", "Tiny has no policy 'block'; valid: off, children, a list"),
])
def test_a_policy_that_matches_nothing_is_one_line_naming_the_key(policy, message):
    with pytest.raises(ConfigError, match=f"^model.gradient_checkpointing: {message}"):
        checkpoint_segments(Tiny(), policy)


def test_freeze_leaves_no_gradient_and_no_optimizer_state_for_the_frozen():
    network = Tiny()
    frozen = freeze(network, ["stem", "body.0"])
    assert frozen == sum(p.numel() for name, p in network.named_parameters()
                         if name.startswith(("stem", "body.0")))
    optimizer = torch.optim.AdamW([p for p in network.parameters() if p.requires_grad])
    network(torch.randn(2, 1, 8, 8)).sum().backward()
    optimizer.step()
    for name, parameter in network.named_parameters():
        cold = name.startswith(("stem", "body.0"))
        assert (parameter.grad is None) == cold, name
        assert (parameter in optimizer.state) != cold, name


@pytest.mark.parametrize(("prefixes", "message"), [
    (["nope"], "'nope' starts no parameter name of Tiny; its top-level modules: body, head, stem"),
    (["stem", "body", "head"], "freezes every parameter: nothing would train"),
])
def test_a_freeze_that_names_nothing_or_everything_is_refused(prefixes, message):
    with pytest.raises(ConfigError, match=f"^model.freeze: .*{message}"):
        freeze(Tiny(), prefixes)


def test_weights_of_another_head_keep_their_initial_values_and_are_named(tmp_path):
    torch.manual_seed(1)
    source = Tiny(num_classes=5)
    path = tmp_path / "weights.pt"
    torch.save(source.state_dict(), path)
    torch.manual_seed(2)
    target = Tiny(num_classes=3)
    head = target.head.weight.detach().clone()
    reshaped = load_weights(target, path)
    assert reshaped == ["head.weight", "head.bias"]
    assert torch.equal(target.head.weight, head)
    assert torch.equal(target.stem.weight, source.stem.weight)


def test_weights_from_a_lightning_checkpoint_load_without_the_modules_prefix(tmp_path):
    source = Tiny()
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"net.{name}": value for name, value in source.state_dict().items()}}, path)
    target = Tiny()
    assert load_weights(target, path) == []
    assert torch.equal(target.head.bias, source.head.bias)


@pytest.mark.parametrize(("content", "message"), [
    ("not a torch file", "is not a file torch.load reads"),
    ({"stem.weight": torch.zeros(1)}, "lacks 17 entries of Tiny \\(first: stem.bias\\)"),
    ({**Tiny().state_dict(), "extra": torch.zeros(1)}, "has 1 entries Tiny lacks \\(first: extra\\)"),
    ([1, 2], "holds no state_dict"),
])
def test_a_weights_file_that_is_not_this_networks_is_one_line(tmp_path, content, message):
    path = tmp_path / "weights.pt"
    if isinstance(content, str):
        path.write_text(content)
    else:
        torch.save(content, path)
    with pytest.raises(ConfigError, match=f"^model.init_weights: .*{message}"):
        load_weights(Tiny(), path)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_each_optimizers_state_is_what_torch_allocates(name, momentum):
    network = Tiny()
    args = TechniqueArgs(optimizer=name)
    optimizer = techniques.build_optimizer(network.parameters(), args, lr=0.01, momentum=momentum,
                                           weight_decay=0.0)
    network(torch.randn(2, 1, 8, 8)).sum().backward()
    optimizer.step()
    held = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor))
    shapes = [p.shape for p in network.parameters()]
    assert OPTIMIZERS[name].state_bytes(shapes, momentum=momentum) == held


def test_adafactor_factors_a_matrix_and_keeps_a_vector_whole():
    adafactor = OPTIMIZERS["adafactor"]
    assert adafactor.state_elements(torch.Size([512, 256])) == 512 + 256
    assert adafactor.state_elements(torch.Size([64, 32, 3, 3])) == 64 * 32 * 3 + 64 * 32 * 3
    assert adafactor.state_elements(torch.Size([10])) == 10


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_every_precision_names_its_bytes_per_parameter(name):
    entry = PRECISIONS[name]
    width = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}[entry.compute_dtype]
    assert entry.autocast == ("-mixed" in name)
    assert entry.weights == (4 if entry.autocast and entry.lightning else width)
    assert entry.gradients >= entry.weights or not entry.lightning
    assert (entry.accelerate is not None) == (name in ("32-true", "bf16-mixed", "16-mixed"))


@pytest.mark.parametrize(("given", "name"), [("32", "32-true"), ("bf16", "bf16-mixed"), ("16", "16-mixed"),
                                             (None, "32-true"), (" BF16-Mixed ", "bf16-mixed")])
def test_short_precision_names(given, name):
    assert techniques.precision(given).name == name


def test_an_unknown_precision_names_the_key():
    with pytest.raises(ConfigError, match="^trainer.precision: unknown precision '8'; valid: 32-true"):
        techniques.precision("8")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("optimizer", "lamb", "model.optimizer: unknown 'lamb'; valid: adamw, sgd, adafactor"),
    ("optimizer_impl", "fused", "model.optimizer_impl: adafactor has no 'fused' kernel"),
    ("gradient_checkpointing", [], "model.gradient_checkpointing: \\[\\] is neither"),
    ("gradient_checkpointing", " ", "model.gradient_checkpointing: ' ' is neither"),
    ("init_weights", "no/such.pt", "model.init_weights: no file no/such.pt"),
    ("freeze", [""], "model.freeze: a list of parameter-name prefixes"),
])
def test_each_arguments_check(field, value, message):
    values = {"optimizer": "adafactor"} if field == "optimizer_impl" else {}
    with pytest.raises(ConfigError, match=f"^{message}"):
        TechniqueArgs(**{**values, field: value}).check()


def test_prepare_network_applies_every_technique_in_order(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(Tiny(num_classes=5).state_dict(), path)
    said = []
    args = TechniqueArgs(gradient_checkpointing=["Block"], channels_last=True, init_weights=str(path),
                         freeze=["stem"])
    network = Tiny()
    prepared = prepare_network(network, args, say=said.append)
    assert prepared.segments == 2 and prepared.reshaped == ("head.weight", "head.bias")
    assert prepared.frozen_elements == network.stem.weight.numel() + network.stem.bias.numel()
    assert network.body[0].conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert said == [f"model.init_weights: head.weight, head.bias of another shape in {path}: initialised anew "
                    "(a new head)"]


LOOP = LoopFacts("bf16-mixed", "16-mixed", 4, "ddp", "DDPStrategy", 2, 1)


def test_the_records_techniques_say_what_ran():
    network = Tiny()
    freeze(network, ["stem"])
    apply_checkpointing(network, ["Block"])
    measured = {"micro_batch_size": 8, "channels_last": None, "optimizer_impl": "torch.optim.SGD[for-loop]"}
    args = TechniqueArgs(optimizer="sgd", gradient_checkpointing=["Block"], freeze=["stem"], channels_last=True)
    section = record_section(args, network, LOOP, measured)
    assert section == {
        "micro_batch_size": 8, "channels_last": True, "optimizer_impl": "torch.optim.SGD[for-loop]",
        "model_name": "Tiny", "network": f"{__name__}.Tiny", "optimizer": "sgd",
        "gradient_checkpointing": "Block", "checkpointed_segments": 2, "init_weights": None, "frozen": ["stem"],
        "trainable_parameters": sum(p.numel() for p in network.parameters()) - 40,
        "precision": "bf16-mixed", "precision_requested": "16-mixed", "accumulate_grad_batches": 4,
        "strategy": "ddp", "strategy_class": "DDPStrategy", "world_size": 2, "num_nodes": 1}


def test_a_lightningmodule_of_ones_own_records_no_model_technique():
    section = record_section(None, Tiny(), LOOP, {})
    assert section["optimizer"] is None and section["gradient_checkpointing"] == "off"
    assert section["frozen"] == [] and section["init_weights"] is None


@pytest.mark.parametrize(("techniques_section", "malloc", "words"), [
    ({"precision": "32-true", "micro_batch_size": 128}, None, ["32-true", "128"]),
    ({"precision": "bf16-mixed", "micro_batch_size": 32, "accumulate_grad_batches": 4}, None,
     ["bf16-mixed", "32×4"]),
    ({"precision": "32-true", "micro_batch_size": 64, "world_size": 2, "strategy": "ddp"}, None,
     ["32-true", "64", "ddp ×2"]),
    ({"precision": "32-true", "micro_batch_size": 8, "gradient_checkpointing": "block"}, None,
     ["32-true", "8", "ckpt block"]),
    ({"precision": "32-true", "micro_batch_size": 8, "init_weights": "r18.pt", "frozen": ["layer1", "conv1"]},
     None, ["32-true", "8", "from r18.pt", "frozen layer1, conv1"]),
    ({"precision": "32-true", "micro_batch_size": 8, "channels_last": True, "compile": True}, "system",
     ["32-true", "8", "channels_last", "compile", "system malloc"]),
    ({"precision": "32-true", "micro_batch_size": 8, "optimizer_impl": "torch.optim.Adafactor[foreach]",
      "optimizer": "adafactor"}, None, ["32-true", "8", "Adafactor foreach"]),
    ({"precision": "32-true", "micro_batch_size": 8, "optimizer": "sgd"}, None, ["32-true", "8", "sgd"]),
])
def test_the_words_of_each_technique(techniques_section, malloc, words):
    assert setup_words(techniques_section, malloc) == words


def test_state_bytes_of_sgd_without_momentum_are_none():
    assert OPTIMIZERS["sgd"].state_bytes([torch.Size([3, 3])], momentum=0.0) == 0
    assert math.isclose(OPTIMIZERS["adamw"].state_bytes([torch.Size([3, 3])]), 2 * 9 * 4 + 4)


def test_the_summary_spells_the_batch_checkpointing_and_strategy_out():
    section = {"precision": "bf16-mixed", "micro_batch_size": 32, "accumulate_grad_batches": 4,
               "gradient_checkpointing": "block", "strategy": "ddp", "world_size": 2, "frozen": ["layer1"],
               "optimizer_impl": "torch.optim.AdamW[foreach]"}
    assert setup_words(section, spelled=True) == [
        "bf16-mixed", "micro-batch 32 × accumulate 4", "checkpointing block", "ddp ×2", "frozen layer1",
        "AdamW foreach"]


def test_a_network_sharded_by_fsdp2_is_named_by_its_own_class():
    """``fully_shard`` swaps the network's class for ``FSDP<name>``: the record names the network, not that (the
    study's fsdp2 row is compared with its baseline of the same model)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from modelwright.train._internals import fake_process_group
    from modelwright.train.models import SmallCNN

    with fake_process_group(2):
        network = SmallCNN()
        fully_shard(network, mesh=init_device_mesh("cpu", (2,)))
        assert type(network).__name__ == "FSDPSmallCNN"
        assert techniques.network_name(network) == "smallcnn"
        assert techniques.network_class(network) is SmallCNN
    plain = nn.Linear(2, 2)
    assert techniques.network_name(plain) == "Linear" and techniques.network_class(plain) is nn.Linear
