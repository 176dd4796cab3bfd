"""The advisor's choices with a stand-in for the rehearsal: each config's peak is a line in the micro-batch,
known by hand, so every option, recommendation and sharding below is computed here, with budgets exactly at
the boundaries and cases where the first option that fits is not the best one."""

from __future__ import annotations

import io
import sys

import pytest

from modelwright.planner import memory
from modelwright.planner.advisor import Option, Sharding, options, recommend, sharded_peak_mib, shardings
from modelwright.record import get_path
from modelwright.train.rehearse import strategy_kind, world_size

#: What a stand-in rehearsal holds, MiB: at zero samples by precision (FSDP2 shards it over its ranks), and
#: a sample's activations by precision and checkpointing.
FIXED_MIB = {"32-true": 20.0, "bf16-mixed": 20.0}
PER_SAMPLE_MIB = {("32-true", "off"): 10.0, ("32-true", "stage"): 6.0, ("32-true", "block"): 4.0,
                  ("bf16-mixed", "off"): 6.0, ("bf16-mixed", "stage"): 4.0, ("bf16-mixed", "block"): 3.0}


class StandIn:
    """A rehearsal of ``config`` whose peak is ``fixed / world + per_sample × micro-batch`` (world 1 but under
    FSDP2, whose ranks share the fixed part)."""

    def __init__(self, config, fixed_mib, per_sample_mib):
        precision = get_path(config, "trainer.precision", "32-true")
        checkpointing = get_path(config, "model.gradient_checkpointing", "off")
        sharded_over = world_size(config) if strategy_kind(config) == "fsdp2" else 1
        self.fixed = fixed_mib[precision] / sharded_over
        self.per_sample = per_sample_mib[precision, checkpointing]

    def peak(self, micro_batch: int) -> dict[str, float]:
        return {"total": self.fixed + self.per_sample * micro_batch}


@pytest.fixture
def rehearsed(monkeypatch) -> list[dict]:
    """Every config the advisor rehearses, in order; each rehearsed by :class:`StandIn` with the tables
    above (a test may change them with ``monkeypatch.setitem``)."""
    seen = []

    def rehearsal(config):
        seen.append(config)
        return StandIn(config, FIXED_MIB, PER_SAMPLE_MIB)

    monkeypatch.setattr(memory, "rehearsal", rehearsal)
    return seen


#: A job of ResNet18 (checkpointing off, by stage, by block) at a batch of 8: accumulation 1, 2, 4, 8.
RESNET_JOB = {"model": {"init_args": {"network": {"class_path": "modelwright.train.models.ResNet18"}}},
              "data": {"batch_size": 8}, "trainer": {}}


def _study(name: str, step_ms: float, repeat: int = 0) -> dict:
    return {"run_id": f"{name}-{repeat}", "status": "ok", "timing": {"step_time_median_ms": step_ms},
            "techniques": {"effective_batch_size": 8, "model_name": "resnet18"},
            "study": {"name": name, "kind": "run", "repeat": repeat, "config_hash": name}}


#: The baseline at 100 ms (repeats ±5%: the spread), bf16 0.5×, accumulation 1.1×, checkpointing 1.2× and 1.3×.
STUDY = [_study("baseline", step_ms, repeat) for repeat, step_ms in enumerate((95.0, 100.0, 105.0))]
STUDY += [_study("amp", 50.0), _study("accumulate", 110.0), _study("checkpointing-stage", 120.0),
          _study("checkpointing-block", 130.0)]

#: (precision, checkpointing) → step factor over the baseline's 100 ms, and accumulation's 1.1 beside it.
FACTORS = {("32-true", "off"): 1.0, ("32-true", "stage"): 1.2, ("32-true", "block"): 1.3,
           ("bf16-mixed", "off"): 0.5, ("bf16-mixed", "stage"): 0.5 * 1.2, ("bf16-mixed", "block"): 0.5 * 1.3}


def _by_hand(with_times: bool) -> list[Option]:
    """The 24 options in the advisor's order, peak 20 + per sample × 8 / accumulation, step 100 ms × factors."""
    table = []
    for precision in ("32-true", "bf16-mixed"):
        for checkpointing in ("off", "stage", "block"):
            for accumulate in (1, 2, 4, 8):
                peak = 20.0 + PER_SAMPLE_MIB[precision, checkpointing] * (8 // accumulate)
                factor = FACTORS[precision, checkpointing] * (1.1 if accumulate > 1 else 1.0)
                step_ms = pytest.approx(100.0 * factor) if with_times else None
                table.append(Option(precision, accumulate, checkpointing, peak, step_ms))
    return table


def test_every_option_is_rehearsed_at_its_micro_batch_with_its_step_time(rehearsed):
    assert options(RESNET_JOB, 8, STUDY) == _by_hand(with_times=True)
    assert [(get_path(config, "trainer.precision"), get_path(config, "trainer.accumulate_grad_batches"),
             get_path(config, "model.gradient_checkpointing"), get_path(config, "data.batch_size"))
            for config in rehearsed] == [option[:3] + (8 // option.accumulate,) for option in _by_hand(False)]
    # without records no step is known; a batch of 6 takes accumulation 1 and 2 alone
    assert options(RESNET_JOB, 8) == _by_hand(with_times=False)
    assert [option.accumulate for option in options(RESNET_JOB, 6)] == [1, 2] * 6


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_sees_the_rehearsals_progress_and_a_log_does_not(rehearsed, monkeypatch, capsys):
    """A bar of the 24 options while they are rehearsed, cleared from the line once they are; nothing where
    stderr is a file or a pipe."""
    options(RESNET_JOB, 8)
    assert capsys.readouterr().err == ""
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    options(RESNET_JOB, 8)
    shown = terminal.getvalue()
    assert shown.startswith("\rrehearsing:   0%|") and "| 0/24 [00:00<?, ?option/s]" in shown
    assert shown.endswith("\r") and "\n" not in shown and "24/24" not in shown


#: budget MiB → what the advisor recommends (precision, accumulation, checkpointing), with no study records
#: (the first option that fits, in the table's order) and with STUDY's (the fastest one that fits, where it is
#: measurably faster than that first one). Peaks by hand: 32-true off 100, 60, 40, 30 at accumulation 1, 2, 4, 8;
#: 32-true stage 68 … 26; bf16 off 68, 44, 32, 26; bf16 block 44, 32, 26, 23, the smallest.
RECOMMENDATIONS = [
    (100.0, ("32-true", 1, "off"), ("bf16-mixed", 1, "off")),  # the plain run fits; bf16 at 50 ms is faster
    (99.9, ("32-true", 2, "off"), ("bf16-mixed", 1, "off")),
    (68.0, ("32-true", 2, "off"), ("bf16-mixed", 1, "off")),  # bf16 1 × off at 68 MiB: exactly the budget
    (67.9, ("32-true", 2, "off"), ("bf16-mixed", 2, "off")),  # the first of bf16's 55 ms accumulations
    (43.9, ("32-true", 4, "off"), ("bf16-mixed", 4, "off")),
    (29.0, ("32-true", 8, "stage"), ("bf16-mixed", 8, "off")),  # 32-true 8 × off at 30 MiB is over
    (23.0, ("bf16-mixed", 8, "block"), ("bf16-mixed", 8, "block")),  # alone: nothing to be faster than
    (22.9, None, None),
]


@pytest.mark.parametrize(("budget_mib", "first", "fastest"), RECOMMENDATIONS)
def test_the_recommendation_is_the_first_that_fits_unless_a_faster_one_fits(rehearsed, budget_mib, first,
                                                                            fastest):
    by_hand = {option[:3]: option for option in _by_hand(with_times=True)}
    assert recommend(RESNET_JOB, 8, budget_mib) == (by_hand[first]._replace(step_ms=None) if first else None)
    assert recommend(RESNET_JOB, 8, budget_mib, STUDY) == (by_hand[fastest] if fastest else None)


#: 4 Mi parameters of 32-true AdamW: 16 MiB of weights, 16 of gradients, 32 of optimizer state, and 1 MiB a
#: sample. One rank at N ranks of a batch of 64 (64 / N samples each): ZeRO-1 keeps all but 32 − 32 / N MiB of
#: the device's 64 + 64 / N, ZeRO-2 all but 48 − 48 / N; FSDP2 holds 64 / N + 64 / N.
PARAMS = 4 * 2**20
ZERO1 = {2: 80.0, 4: 56.0, 8: 44.0, 16: 38.0, 32: 35.0, 64: 33.5}
ZERO2 = {2: 72.0, 4: 44.0, 8: 30.0, 16: 23.0, 32: 19.5, 64: 17.75}
FSDP2 = {2: 64.0, 4: 32.0, 8: 16.0, 16: 8.0, 32: 4.0, 64: 2.0}
#: A 2-node job of 8 devices a node: a sharding's rehearsal runs on one node of N ranks.
BIG_JOB = {"data": {"batch_size": 64}, "trainer": {"devices": 8, "num_nodes": 2}}


@pytest.mark.parametrize(("budget_mib", "expected"), [
    (44.0, [("zero1", 8), ("zero2", 4), ("fsdp", 4)]),  # ZeRO-1 at 8 and ZeRO-2 at 4: exactly the budget
    (43.9, [("zero1", 16), ("zero2", 8), ("fsdp", 4)]),
    (30.0, [("zero2", 8), ("fsdp", 8)]),  # ZeRO-1 fits at no N (33.5 MiB at 64)
    (1.9, []),
])
def test_the_fewest_ranks_at_which_each_sharding_fits(rehearsed, monkeypatch, budget_mib, expected):
    monkeypatch.setitem(FIXED_MIB, "32-true", 64.0)
    monkeypatch.setitem(PER_SAMPLE_MIB, ("32-true", "off"), 1.0)
    peaks = {"zero1": ZERO1, "zero2": ZERO2, "fsdp": FSDP2}
    assert shardings(BIG_JOB, 64, budget_mib, PARAMS) == [Sharding(strategy, ranks, peaks[strategy][ranks])
                                                          for strategy, ranks in expected]


def test_each_sharding_rehearses_its_own_config_once_a_rank_count(rehearsed, monkeypatch):
    """ZeRO rehearses the device's step at the per-rank batch; FSDP2 rehearses its step alone, over a process
    group of N ranks in one node. A batch of 96 splits over 2, 4, 8, 16 and 32 ranks."""
    monkeypatch.setitem(FIXED_MIB, "32-true", 64.0)
    monkeypatch.setitem(PER_SAMPLE_MIB, ("32-true", "off"), 1.0)
    # at 32 ranks: ZeRO-1 32 + 1 + 3 = 36 MiB, ZeRO-2 16 + 1.5 + 3 = 20.5, FSDP2 2 + 3 = 5
    assert shardings({**BIG_JOB, "data": {"batch_size": 96}}, 96, 4.0, PARAMS) == []
    rehearsed_as = [(strategy_kind(config), world_size(config), get_path(config, "data.batch_size"),
                     config.get("model_parameters")) for config in rehearsed]
    zero = [("single", 16, 96 // ranks, PARAMS) for ranks in (2, 4, 8, 16, 32)]
    fsdp = [("fsdp2", ranks, 96 // ranks, PARAMS) for ranks in (2, 4, 8, 16, 32)]
    assert rehearsed_as == zero + zero + fsdp


@pytest.mark.parametrize(("config", "zero1", "zero2"), [
    # playbook-mixed SGD: weights 2 B, gradients 2 B, optimizer 4 (fp32 master) + 4 B; 4 ranks keep a quarter
    ({"trainer": {"precision": "playbook-mixed"}, "model": {"optimizer": "sgd"}}, 100 - 8 * 3 / 4, 100 - 10 * 3 / 4),
    ({}, 100 - 8 * 3 / 4, 100 - 12 * 3 / 4),  # 32-true AdamW unless the config names others: 4, 4, 8 B
    ({"trainer": {"precision": "bf16-true"}, "model": {"init_args": {"optimizer": "sgd"}}},
     100 - 2 * 3 / 4, 100 - 4 * 3 / 4),  # 2, 2, 2 B; a model section by class path read through init_args
])
def test_zero_saves_the_state_it_shards_from_the_devices_peak(config, zero1, zero2):
    """1 Mi parameters (``model_parameters``): their bytes per parameter are MiB; the device's peak is 100."""
    config = {**config, "model_parameters": 2**20}
    assert sharded_peak_mib(config, "zero1", 4, 100.0) == zero1
    assert sharded_peak_mib(config, "zero2", 4, 100.0) == zero2
    unknown = {key: value for key, value in config.items() if key != "model_parameters"}
    for no_parameters in (unknown, {**unknown, "model_parameters": 0}):  # nothing to shard away
        assert sharded_peak_mib(no_parameters, "zero1", 4, 100.0) == 100.0
        assert sharded_peak_mib(no_parameters, "zero2", 4, 100.0) == 100.0


def test_fsdp_is_rehearsed_over_its_ranks_in_one_node(rehearsed, monkeypatch):
    monkeypatch.setitem(FIXED_MIB, "32-true", 64.0)
    monkeypatch.setitem(PER_SAMPLE_MIB, ("32-true", "off"), 1.0)
    job = {"data": {"batch_size": 16}, "trainer": {"devices": 8, "num_nodes": 2, "strategy": "ddp"}}
    assert sharded_peak_mib(job, "fsdp", 4, 0.0) == 64 / 4 + 16
    assert sharded_peak_mib(job, "fsdp", 2, 500.0) == 64 / 2 + 16  # the device's peak is not FSDP2's
    assert [(strategy_kind(config), world_size(config)) for config in rehearsed] == [("fsdp2", 4), ("fsdp2", 2)]
