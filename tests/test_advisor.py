"""The advisor's choices with a stand-in for the rehearsal: each config's peak is a line in the micro-batch,
known by hand, so every option, recommendation and sharding below is computed here, with budgets exactly at
the boundaries and cases where the first option that fits is not the best one."""

from __future__ import annotations

import io
import sys

import pytest

from modelwright.planner import memory
from modelwright.planner.advisor import (
    Option,
    Sharding,
    Slowdown,
    StepTimes,
    advise,
    checkpointing_policies,
    choose,
    machine_text,
    machine_warning,
    measurably_faster,
    options,
    predicted_step_ms,
    recommend,
    sharded_peak_mib,
    shardings,
    slowdowns,
    slug_vector_isa,
    step_times,
)
from modelwright.record import get_path
from modelwright.study_rows import SpreadBand
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
    assert shown.endswith("\r") and "\n" not in shown  # cleared, not left on its own line


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


# -- the advisor's whole answer: header, warning, table, recommendation or sharding -------------------------

EPYC = {"accelerator": "cpu", "cpu_model": "AMD EPYC 9B14", "cpu_cores": 2}
#: A job of the user's module (no ``network``: checkpointing off alone) at a batch of 2: four options, peaks
#: 20 + 10 × micro-batch in 32-true (40, 30 MiB) and 20 + 6 × in bf16 (32, 26 MiB).
SMALL_JOB = {"model": {"class_path": "my.Module", "init_args": {"lr": 0.1}}, "data": {"batch_size": 2}}
HEADER = ("| precision | checkpointing | accumulation | predicted peak (MiB) | predicted step | step vs the plain run "
          "| fits |\n|:--|:--|:--|--:|--:|:--|:--|\n")


def _timed_study(baseline_ms: tuple[float, ...], hardware: dict, slug: str | None = None) -> list[dict]:
    """The baseline's repeats (the first record names the machine), accumulation at 1.02× and checkpointing
    by stage at 1.2× in 1 repeat each; effective batch 8."""
    records = [_study("baseline", step_ms, repeat) for repeat, step_ms in enumerate(baseline_ms)]
    records[0]["hardware"] = hardware
    if slug:
        records[0]["study"]["slug"] = slug
    return records + [_study("accumulate", 102.0), _study("checkpointing-stage", 120.0)]


#: bf16 at 0.5× the baseline in 3 repeats: a check folder's runs (the study left amp out).
BF16_CHECK = [_study("amp", step_ms, repeat) for repeat, step_ms in enumerate((49.0, 50.0, 51.0))]


def test_the_advice_with_a_faster_technique_that_fits(rehearsed):
    """Steps scaled from the baseline's 100 ms at 8 samples to 25 ms at 2; bf16 at 0.50× is outside the ±5%
    spread of the baseline's repeats: recommended over the plain run, which fits. The machine's vector
    instruction set is read from the study's folder name where its record does not name it."""
    records = _timed_study((95.0, 100.0, 105.0), EPYC, slug="cpu-amd-epyc-9b14-avx512-2cores") + BF16_CHECK
    text = advise(SMALL_JOB, 2, 100.0, records, " (given)", this_machine={**EPYC, "vector_isa": "avx512"})
    assert text == (
        "Budget 0.0977 GiB (given); batch 2; peaks predicted by rehearsing each option's step on this machine; "
        "step times of resnet18 measured on AMD EPYC 9B14, 2 cores, avx512: bf16-mixed 0.50× (amp, 3 repeats), "
        "stage 1.2× (checkpointing-stage, 1 repeat), accumulate 1.0× (accumulate, 1 repeat)\n\n" + HEADER +
        "| 32-true | off | 1 | 40.0 | 25.0 ms | 1.0× (no measurable change) | yes |\n"
        "| 32-true | off | 2 | 30.0 | 25.5 ms | 1.02× (no measurable change) | yes |\n"
        "| bf16-mixed | off | 1 | 32.0 | 12.5 ms | 0.50× (faster) | yes |\n"
        "| bf16-mixed | off | 2 | 26.0 | 12.8 ms | 0.51× (faster) | yes |\n\n"
        "Recommended: bf16-mixed, 1 × off — predicted peak 32.0 MiB. Why: its predicted step is 0.50× of "
        "32-true, 1 × off's, outside the baseline's spread (-5.0% / +5.0%): measurably faster.")


def test_the_advice_from_one_repeat_of_another_machine(rehearsed):
    """One repeat of the baseline: no spread, so no verdict and nothing measurably faster; the plain run at
    40 MiB fits a budget of 40 exactly. The times are another vector instruction set's: a warning. bf16 is
    timed in the check folder; accumulation in neither (its steps unknown); the records do not name their
    network."""
    records = [record for record in _timed_study((100.0,), {**EPYC, "vector_isa": "avx512"})
               if record["study"]["name"] != "accumulate"]
    for record in records:
        del record["techniques"]["model_name"]
    text = advise(SMALL_JOB, 2, 40.0, records, check_records=BF16_CHECK, this_machine={**EPYC, "vector_isa": "avx2"})
    assert text == (
        "Budget 0.0391 GiB; batch 2; peaks predicted by rehearsing each option's step on this machine; "
        "step times measured on AMD EPYC 9B14, 2 cores, avx512: bf16-mixed 0.50× (amp, 3 repeats), "
        "stage 1.2× (checkpointing-stage, 1 repeat)\n\n"
        "Warning: the step times are from AMD EPYC 9B14, 2 cores, avx512, not this machine (AMD EPYC 9B14, "
        "2 cores, avx2; another vector instruction set): a technique's speed there (bf16 above all) need not be "
        "its speed here; run the study here to time it.\n\n" + HEADER +
        "| 32-true | off | 1 | 40.0 | 25.0 ms | 1.0× (no verdict: 1 repeat) | yes |\n"
        "| 32-true | off | 2 | 30.0 | unknown | – | yes |\n"
        "| bf16-mixed | off | 1 | 32.0 | 12.5 ms | 0.50× (no verdict: 1 repeat) | yes |\n"
        "| bf16-mixed | off | 2 | 26.0 | unknown | – | yes |\n\n"
        "Recommended: the plain run, 32-true, 1 × off — predicted peak 40.0 MiB. Why: the plain run fits, and "
        "no technique is measurably faster: bf16-mixed 0.50× (no verdict: 1 repeat), stage 1.2× (no verdict: "
        "1 repeat) (the baseline ran once).")


def _untimed_advice(budget_gib: str, fits: str, answer: str) -> str:
    """The advice without study records: no step times; ``fits`` the last column, row by row."""
    peaks = (("32-true", 1, "40.0"), ("32-true", 2, "30.0"), ("bf16-mixed", 1, "32.0"), ("bf16-mixed", 2, "26.0"))
    rows = "".join(f"| {precision} | off | {accumulate} | {peak} | unknown | – | {fit} |\n"
                   for (precision, accumulate, peak), fit in zip(peaks, fits.split(), strict=True))
    return (f"Budget {budget_gib} GiB; batch 2; peaks predicted by rehearsing each option's step on this machine; "
            f"step times unknown (no study records)\n\n{HEADER}{rows}\n{answer}")


@pytest.mark.parametrize(("budget_mib", "budget_gib", "fits", "answer"), [
    (40.0, "0.0391", "yes yes yes yes", "Recommended: the plain run, 32-true, 1 × off — predicted peak 40.0 MiB. "
     "Why: the plain run fits, and no technique is measurably faster: no step times (no study records) to show "
     "one."),
    (31.0, "0.0303", "no yes no yes", "Recommended: 32-true, 2 × off — predicted peak 30.0 MiB. Why: the plain run "
     "does not fit (40.0 MiB); this is the first that fits with the fewest techniques (precision, then "
     "checkpointing, then accumulation), and no option that fits is measurably faster."),
    # 2 Mi parameters: ZeRO-1 over 2 ranks saves 8 MiB of 30 (22 MiB), ZeRO-2 12 (18 MiB); FSDP2 20 / 2 + 10
    (20.0, "0.0195", "no no no no", "Nothing fits one device. zero2 over 2 ranks fits (18.0 MiB per rank); fsdp "
     "over 2 ranks fits (20.0 MiB per rank)"),
    (5.0, "0.00488", "no no no no", "Nothing fits one device. No sharding up to 512."),
])
def test_the_advice_without_step_times(rehearsed, budget_mib, budget_gib, fits, answer):
    assert advise(SMALL_JOB, 2, budget_mib, num_params=2 * 2**20) == _untimed_advice(budget_gib, fits, answer)


def test_the_step_times_of_a_study_and_the_check_folder_beside_it():
    """The study's ok runs with a step time; the check folder adds the runs the study lacks (amp) and
    changes none it has (accumulate), failed ones nowhere."""
    study = _timed_study((95.0, 100.0, 105.0), {**EPYC, "vector_isa": "avx2"})[:3]
    failed = {**_study("checkpointing-stage", 0.0), "status": "failed", "timing": {}}
    study += [_study("accumulate", 102.0), failed, {**_study("checkpointing-block", 0.0), "timing": {}}]
    check = [*BF16_CHECK, _study("accumulate", 80.0), failed]
    times = step_times(study, check)
    assert times.slowdowns == {"bf16-mixed": Slowdown(0.5, "amp, 3 repeats"),
                               "accumulate": Slowdown(1.02, "accumulate, 1 repeat")}
    assert (times.base_ms, times.base_batch, times.model) == (100.0, 8, "resnet18")
    assert times.band == (pytest.approx(-0.05), pytest.approx(0.05))
    assert times.hardware == {**EPYC, "vector_isa": "avx2"}
    assert slowdowns(study) == ({"accumulate": Slowdown(1.02, "accumulate, 1 repeat")}, 100.0)
    assert step_times(check) == StepTimes({}, None, None, {})  # no baseline: nothing to scale


def test_without_a_parameter_count_zero_saves_nothing(rehearsed):
    """A batch of 16 over 16 ranks: 1 sample each, 30 MiB on one device, 1 byte over the budget; with no
    parameters to shard ZeRO stays there, and FSDP2 fits at 8 ranks (20 / 8 + 10 × 2 = 22.5 MiB)."""
    text = advise({**SMALL_JOB, "data": {"batch_size": 16}}, 16, 30.0 - 1 / 2**20)
    assert text.endswith("\n\nNothing fits one device. fsdp over 8 ranks fits (22.5 MiB per rank)")


def test_the_plain_runs_reason_gives_each_techniques_verdict():
    times = StepTimes({"accumulate": Slowdown(1.02, "accumulate, 1 repeat")}, 100.0, SpreadBand(-0.05, 0.05), {})
    plain = Option("32-true", 1, "off", 10.0, 100.0)
    assert choose([plain, plain._replace(accumulate=2, step_ms=102.0)], 10.0, times).reason == (
        "the plain run fits, and no technique is measurably faster: accumulate 1.02× (no measurable change) (the "
        "baseline's repeats spread -5.0% / +5.0%)")


@pytest.mark.parametrize(("times", "expected"), [
    (StepTimes({}, 100.0, None, {}, 8), 100.0 * 6 / 8),
    (StepTimes({}, 100.0, None, {}, None), None),  # a baseline that does not say its batch
    (StepTimes({}, None, None, {}, 8), None),
])
def test_a_step_is_predicted_only_from_a_baseline_with_its_batch(times, expected):
    assert predicted_step_ms([], 6, times) == expected
    assert predicted_step_ms(["accumulate"], 6, times) is None  # a technique not measured


def test_a_step_time_unknown_on_either_side_is_not_measurably_faster():
    times = StepTimes({}, 100.0, SpreadBand(-0.05, 0.05), {})
    known, unknown = Option("bf16-mixed", 1, "off", 1.0, 10.0), Option("32-true", 1, "off", 1.0, None)
    assert not measurably_faster(known, unknown, times) and not measurably_faster(unknown, known, times)
    assert measurably_faster(known, known._replace(step_ms=10.6), times)  # 0.943 < 0.95
    assert not measurably_faster(known, known._replace(step_ms=10.5), times)
    quarter = times._replace(band=SpreadBand(-0.25, 0.25))  # 7.5 / 10 = 0.75 exactly: on the edge, not outside
    assert not measurably_faster(known._replace(step_ms=7.5), known, quarter)
    assert measurably_faster(known._replace(step_ms=7.49), known, quarter)


@pytest.mark.parametrize(("model", "policies"), [
    ({"class_path": "my.Module", "init_args": {"lr": 0.1}}, ["off"]),  # the user's LightningModule
    ({}, ["off"]),
    ({"init_args": {"network": None}}, ["off", "stage", "block"]),  # the project's default network: ResNet18
    ({"init_args": {"network": {"class_path": "modelwright.train.models.SmallViT"}}}, ["off", "block"]),
    ({"init_args": {"network": "modelwright.train.models.SmallCNN"}}, ["off", "stage", "block"]),
    ({"init_args": {"network": "no.such.Network"}}, ["off"]),
])
def test_the_checkpointing_policies_the_advisor_tries(model, policies):
    assert checkpointing_policies({"model": model}) == policies


@pytest.mark.parametrize(("slug", "isa"), [
    ("cpu-amd-epyc-avx2-2cores", "avx2"), ("cpu-x-avx512-4cores", "avx512"), ("cpu-apple-m2-neon-8cores", "neon"),
    ("cuda-nvidia-h100", None), ("", None),
])
def test_the_vector_instruction_set_a_results_folder_names(slug, isa):
    assert slug_vector_isa(slug) == isa


@pytest.mark.parametrize(("hardware", "text"), [
    ({**EPYC, "vector_isa": "avx2"}, "AMD EPYC 9B14, 2 cores, avx2"),
    (EPYC, "AMD EPYC 9B14, 2 cores"),
    ({"accelerator": "cpu"}, "?, ? cores"),
    ({"accelerator": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "num_devices": 8}, "8 × NVIDIA H100 80GB HBM3"),
    ({"accelerator": "cuda"}, "1 × ?"),
])
def test_the_machine_a_record_names(hardware, text):
    assert machine_text(hardware) == text


H100 = {"accelerator": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "num_devices": 1, "cpu_model": "Xeon"}


@pytest.mark.parametrize(("measured_on", "this_machine", "differs"), [
    ({}, EPYC, None),
    (EPYC, {}, None),
    (EPYC, dict(EPYC), None),
    (EPYC, {**EPYC, "vector_isa": "avx512"}, None),  # unknown on one side: no difference
    (EPYC, {**EPYC, "cpu_model": "Intel Xeon", "cpu_cores": 4}, "CPU model and core count"),
    (EPYC, H100, "kind of device and CPU model"),
    (H100, {**H100, "cpu_model": "EPYC", "num_devices": 8}, None),  # a GPU's times: its CPU does not matter
    (H100, {**H100, "device_name": "NVIDIA A100"}, "GPU"),
    (H100, EPYC, "kind of device"),  # a CPU has no GPU name to compare
])
def test_the_warning_names_what_differs_between_the_machines(measured_on, this_machine, differs):
    warning = machine_warning(measured_on, this_machine)
    if differs is None:
        assert warning is None
    else:
        assert warning == (f"Warning: the step times are from {machine_text(measured_on)}, not this machine "
                           f"({machine_text(this_machine)}; another {differs}): a technique's speed there (bf16 "
                           "above all) need not be its speed here; run the study here to time it.")
