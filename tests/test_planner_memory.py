"""The memory predictor's bookkeeping (modelwright.planner.memory) on hand-made inputs: the names it accepts, the
bytes per rank of each strategy, the config a rehearsal runs and how often, and the peak and largest batch read
from a rehearsal made by hand (no step is run here: tests/test_predict.py rehearses real ones)."""

from __future__ import annotations

import functools
import re

import pytest

from modelwright.errors import ConfigError
from modelwright.measure.rehearsal import CATEGORIES, MIB, Rehearsal, Timeline
from modelwright.planner import memory
from modelwright.planner.memory import ParamStateBytes, normalize, state_bytes_per_rank, with_values
from modelwright.techniques import PRECISIONS

STRATEGY_NAMES = "dp, zero1, zero2, fsdp, tp, pp"


@pytest.mark.parametrize(("key", "given", "expected"), [
    ("strategy", " DDP ", "dp"),
    ("strategy", "auto", "dp"),
    ("strategy", "model_parallel", "fsdp"),
    ("strategy", "deepspeed_stage_2", "zero2"),
    ("strategy", "zero1", "zero1"),
    ("strategy", {"class_path": "lightning.pytorch.strategies.FSDPStrategy", "init_args": {}}, "fsdp"),
    ("strategy", {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}, "fsdp"),
    ("strategy", {"class_path": "lightning.pytorch.strategies.DDPStrategy"}, "dp"),
    ("strategy", {"init_args": {"find_unused_parameters": True}}, "dp"),
    ("optimizer", "Adam", "adamw"),
    ("optimizer", "adafactor", "adafactor"),
    ("precision", None, "32-true"),
    ("precision", 32, "32-true"),
    ("precision", "BF16", "bf16-mixed"),
])
def test_every_form_of_a_name_the_planner_accepts(key, given, expected):
    assert normalize(key, given) == expected


@pytest.mark.parametrize(("key", "given", "message"), [
    ("strategy", None, f"strategy: unknown None; valid: {STRATEGY_NAMES}"),
    ("strategy", "ring", f"strategy: unknown 'ring'; valid: {STRATEGY_NAMES}"),
    ("optimizer", "lamb", "optimizer: unknown 'lamb'; valid: adamw, sgd, sgd-nomomentum, adafactor"),
    # a class path is read as a strategy's only: an optimizer's is named as given, not as 'dp'
    ("optimizer", {"class_path": "torch.optim.AdamW"},
     "optimizer: unknown {'class_path': 'torch.optim.AdamW'}; valid: adamw, sgd, sgd-nomomentum, adafactor"),
    ("precision", "8-true", f"precision: unknown precision '8-true'; valid: {', '.join(PRECISIONS)}"),
])
def test_an_unknown_name_is_refused_naming_the_key_and_each_valid_name_once(key, given, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        normalize(key, given)


@pytest.mark.parametrize(("precision", "optimizer", "measured", "weights", "gradients", "state", "wire"), [
    ("32-true", "adamw", None, 4, 4, 8, 4),
    ("bf16", "sgd", None, 4, 4, 4, 4),  # autocast: the state of 32-true
    ("bf16-true", "Adam", None, 2, 2, 4, 2),
    ("playbook-mixed", "adamw", None, 2, 2, 4 + 8, 2),  # fp32 master weights and moments, 16-bit gradients sent
    ("playbook-mixed-fp32-grads", "sgd-nomomentum", None, 2, 6, 4, 4),
    ("32-true", "adafactor", 1.5, 4, 4, 1.5, 4),  # a record's measured state
])
def test_bytes_per_parameter_of_each_part_and_on_the_wire(precision, optimizer, measured, weights, gradients, state,
                                                          wire):
    regime = PRECISIONS[normalize("precision", precision)].description
    expected = ParamStateBytes(weights, gradients, state, wire, regime)
    assert memory.param_state_bytes(precision, optimizer, measured) == expected


# 2 B weights, 4 B gradients, 12 B optimizer state a parameter; 1000 parameters over 8 ranks.
STATE = ParamStateBytes(weights=2, gradients=4, optimizer=12, grad_comm=4, regime="by hand")
PER_RANK = {
    "dp": (2000, 4000, 12000),
    "zero1": (2000, 4000, 1500),
    "zero2": (2000, 500, 1500),
    "fsdp": (250, 500, 1500),
    "tp": (250, 500, 1500),
    "pp": (250, 500, 1500),
}


@pytest.mark.parametrize("strategy", memory.STRATEGIES)
def test_each_strategy_divides_each_part_of_the_state_as_zero_and_fsdp_do(strategy):
    assert set(PER_RANK) == set(memory.STRATEGIES), "a new strategy: its bytes per rank by hand here"
    parameters, gradients, optimizer_state = PER_RANK[strategy]
    expected = {"parameters": parameters, "gradients": gradients, "optimizer_state": optimizer_state}
    assert state_bytes_per_rank(1000, STATE, strategy, 8) == pytest.approx(expected)


def test_lightnings_strategy_names_divide_the_state_as_the_planners_do():
    fsdp = {"class_path": "lightning.pytorch.strategies.FSDPStrategy"}
    assert state_bytes_per_rank(1000, STATE, fsdp, 8) == state_bytes_per_rank(1000, STATE, "fsdp", 8)
    assert state_bytes_per_rank(1000, STATE, "ddp", 8) == state_bytes_per_rank(1000, STATE, "dp", 8)


MODEL = {"class_path": "modelwright.models.ImageClassifier", "init_args": {"network": "SmallCNN", "lr": 0.1}}


@pytest.mark.parametrize(("config", "values", "expected"), [
    # a section missing, and a name under parents missing
    ({}, {"data.batch_size": 4}, {"data": {"batch_size": 4}}),
    ({"trainer": {"max_steps": 2}}, {"trainer.plugins.cluster.port": 1},
     {"trainer": {"max_steps": 2, "plugins": {"cluster": {"port": 1}}}}),
    # a section given by class path takes a name in its init_args, unless the name is its own
    ({"model": MODEL}, {"model.lr": 0.2, "model.width": 8},
     {"model": {**MODEL, "init_args": {"network": "SmallCNN", "lr": 0.2, "width": 8}}}),
    ({"model": MODEL}, {"model.class_path": "Other"}, {"model": {**MODEL, "class_path": "Other"}}),
    ({"model": {**MODEL, "dict_kwargs": {"depth": 1}}}, {"model.dict_kwargs.depth": 2},
     {"model": {**MODEL, "dict_kwargs": {"depth": 2}}}),
    ({"model": {**MODEL, "init_args": {**MODEL["init_args"], "net": {"width": 4}}}}, {"model.net.width": 8},
     {"model": {**MODEL, "init_args": {**MODEL["init_args"], "net": {"width": 8}}}}),
])
def test_with_values_sets_dotted_names_in_a_copy(config, values, expected):
    before = repr(config)
    assert with_values(config, values) == expected
    assert repr(config) == before, "the config given is left as it was"


def _timeline(micro_batch: int, points_mib: list[dict[str, int]]) -> Timeline:
    points = tuple({**dict.fromkeys(CATEGORIES, 0), **{key: mib * MIB for key, mib in point.items()}}
                   for point in points_mib)
    return Timeline(micro_batch, points, tuple(f"op{index}" for index in range(len(points))))


# Three operations, at micro-batches 2 and 4: weights loaded (100 MiB); the forward (+ 10 MiB a sample); the
# backward (+ 100 MiB of gradients, 40 MiB + 4 MiB a sample of activations). At a batch b the peak is the
# forward's 100 + 10 b from b = 24 on, the backward's 240 + 4 b below.
BY_HAND = Rehearsal.of([
    _timeline(2, [{"parameters": 100}, {"parameters": 100, "activations": 20},
                  {"parameters": 100, "gradients": 100, "activations": 48}]),
    _timeline(4, [{"parameters": 100}, {"parameters": 100, "activations": 40},
                  {"parameters": 100, "gradients": 100, "activations": 56}]),
], "by hand")


@pytest.fixture
def rehearsed(monkeypatch) -> list[dict]:
    """The configs rehearsed (each answered with :data:`BY_HAND`, no step run), with a cache of this test's own."""
    import modelwright.train.rehearse

    configs = []

    def rehearse(config: dict) -> Rehearsal:
        configs.append(config)
        return BY_HAND

    monkeypatch.setattr(modelwright.train.rehearse, "rehearse", rehearse)
    monkeypatch.setattr(memory, "_rehearsal", functools.lru_cache(maxsize=64)(memory._rehearsal.__wrapped__))
    return configs


def test_a_rehearsal_runs_the_config_at_batch_4_with_two_micro_batches_at_most_and_no_logger(rehearsed):
    data = {"class_path": "modelwright.data.CIFAR10DataModule", "init_args": {"batch_size": 64, "train_size": 500}}
    config = {"config": ["configs/base.yaml"], "data": data, "model": MODEL,
              "trainer": {"accumulate_grad_batches": 8, "logger": True, "precision": "bf16-mixed"}}
    assert memory.rehearsal(config) is BY_HAND
    # the data sizes the config has (no val_size here) cut down; the files it was read from left out
    assert rehearsed == [{"data": {**data, "init_args": {"batch_size": 4, "train_size": 64}}, "model": MODEL,
                          "trainer": {"accumulate_grad_batches": 2, "logger": False, "precision": "bf16-mixed"}}]
    assert config["data"]["init_args"]["batch_size"] == 64 and config["trainer"]["logger"] is True


@pytest.mark.parametrize(("trainer", "accumulation"), [
    ({}, 1), ({"accumulate_grad_batches": None}, 1), ({"accumulate_grad_batches": 1}, 1),
    ({"accumulate_grad_batches": 2}, 2), ({"accumulate_grad_batches": 3}, 2), ({"accumulate_grad_batches": 8}, 2),
])
def test_a_rehearsal_accumulates_as_the_config_does_up_to_two_micro_batches(rehearsed, trainer, accumulation):
    memory.rehearsal({"trainer": trainer})
    assert rehearsed == [{"trainer": {"accumulate_grad_batches": accumulation, "logger": False}}]


def test_one_rehearsal_serves_every_config_that_differs_only_in_what_it_sets(rehearsed):
    config = {"config": ["base.yaml"], "data": {"batch_size": 32},
              "trainer": {"precision": "32-true", "accumulate_grad_batches": 4, "logger": True}}
    alike = [
        config,
        {"trainer": {"logger": None, "accumulate_grad_batches": 8, "precision": "32-true"}, "data": {"batch_size": 8}},
        with_values(config, {"trainer.logger": {"class_path": "lightning.pytorch.loggers.CSVLogger"}}),
        {**config, "config": ["base.yaml", "amp.yaml"]},
    ]
    assert all(memory.rehearsal(each) is BY_HAND for each in alike)
    assert len(rehearsed) == 1
    memory.rehearsal(with_values(config, {"trainer.precision": "bf16-mixed"}))
    memory.rehearsal(with_values(config, {"trainer.accumulate_grad_batches": 1}))
    assert len(rehearsed) == 3


CONFIG = {"data": {"class_path": "modelwright.data.CIFAR10DataModule", "init_args": {"batch_size": 32}},
          "trainer": {"precision": "32-true"}}


def test_the_peak_is_predicted_at_the_configs_own_micro_batch(rehearsed):
    assert memory.micro_batch(CONFIG) == 32
    expected = {**dict.fromkeys(CATEGORIES, 0.0), "parameters": 100.0, "activations": 320.0, "total": 420.0}
    assert memory.predict_peak_mib(CONFIG) == pytest.approx(expected)
    at_16 = memory.predict_peak_mib(with_values(CONFIG, {"data.batch_size": 16}))
    assert at_16 == pytest.approx({**expected, "gradients": 100.0, "activations": 104.0, "total": 304.0})
    assert len(rehearsed) == 1, "one rehearsal for every batch size"


@pytest.mark.parametrize(("budget_mib", "batch"), [(99, 0), (239, 0), (500, 40), (509, 40), (510, 41), (1000, 90)])
def test_the_largest_batch_is_the_rehearsals_under_the_budget(rehearsed, budget_mib, batch):
    assert memory.largest_batch(CONFIG, budget_mib) == batch
    assert rehearsed[0]["data"]["init_args"]["batch_size"] == 4


def test_a_budget_given_in_bytes_is_refused(rehearsed):
    with pytest.raises(ConfigError, match=r"^budget_mib: fits more than 32 M samples; is the budget in MiB\?$"):
        memory.largest_batch(CONFIG, 80 * 2**30)
