"""The advisor for a memory budget: every precision × checkpointing × accumulation at one batch, with its
predicted peak and step time, and a recommendation with its reason; the sharding that fits where nothing fits
one device.

A technique is recommended only for a reason the records show: the plain run does not fit and it does, or its
step is measurably faster, outside the baseline's repeat spread (:class:`modelwright.study_rows.SpreadBand`).
"""

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from tqdm import tqdm

from modelwright.fmt import ratio, sig, table
from modelwright.planner.memory import (
    MIB,
    param_state_bytes,
    predict_peak_mib,
    state_bytes_per_rank,
    with_values,
)
from modelwright.record import get_path
from modelwright.study_rows import Row, SpreadBand, build_rows, verdict
from modelwright.techniques import declared_policies

#: The study run whose step time, over the baseline's, is each technique's slowdown.
TECHNIQUE_RUNS = {"bf16-mixed": "amp", "stage": "checkpointing-stage", "block": "checkpointing-block",
                  "accumulate": "accumulate"}
PRECISIONS = ("32-true", "bf16-mixed")
ACCUMULATIONS = (1, 2, 4, 8)
SHARDED_RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512)
#: The strategy a rehearsal of FSDP2 runs: Lightning's ModelParallelStrategy (``fully_shard`` per block).
FSDP2_STRATEGY = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}


class Option(NamedTuple):
    precision: str
    accumulate: int
    checkpointing: str
    peak_mib: float
    step_ms: float | None

    @property
    def techniques(self) -> list[str]:
        """The techniques the option uses, by the names of :data:`TECHNIQUE_RUNS`."""
        used = [self.precision, "accumulate" if self.accumulate > 1 else None, self.checkpointing]
        return [name for name in used if name not in (None, "32-true", "off")]

    @property
    def is_plain(self) -> bool:
        return not self.techniques

    def text(self) -> str:
        return f"{self.precision}, {self.accumulate} × {self.checkpointing}"


class Slowdown(NamedTuple):
    """A technique's step time over the baseline's, and the run it was measured in."""

    factor: float
    source: str


class StepTimes(NamedTuple):
    """What the records say about step times: each technique's slowdown, the baseline's step and repeat
    spread, and the machine they were measured on (the baseline's ``hardware``)."""

    slowdowns: dict[str, Slowdown]
    base_ms: float | None
    band: SpreadBand | None
    hardware: Mapping
    base_batch: int | None = None  # the baseline's samples per optimizer step
    model: str | None = None  # the network they were measured on

    def verdict(self, factor: float) -> str:
        """A step ratio to the plain run, judged against the baseline's spread."""
        return verdict(factor, self.band)


def timed_rows(records: Sequence[Mapping], check_records: Sequence[Mapping] = ()) -> dict[str, Row]:
    """The ``ok`` rows with a step time of a study's records, and of the runs a check folder beside it adds
    (a bf16 check: amp and all, where the study left them out)."""
    rows = {row.name: row for row in build_rows(records) if row.ok and row.figures.step_ms}
    for row in build_rows(check_records):
        if row.ok and row.figures.step_ms and row.name not in rows:
            rows[row.name] = row
    return rows


def step_times(records: Sequence[Mapping], check_records: Sequence[Mapping] = ()) -> StepTimes:
    """Each technique's measured slowdown over the baseline, as the study's table has it (medians over the
    repeats of each run's latest config), with where it comes from."""
    rows = timed_rows(records, check_records)
    baseline = rows.get("baseline")
    if baseline is None:
        return StepTimes({}, None, None, {})
    base_ms = baseline.figures.step_ms
    found = {}
    for technique, run in TECHNIQUE_RUNS.items():
        if run in rows:
            figures = rows[run].figures
            repeats = "1 repeat" if figures.repeats == 1 else f"{figures.repeats} repeats"
            found[technique] = Slowdown(figures.step_ms / base_ms, f"{run}, {repeats}")
    record = baseline.records[0]
    hardware = dict(record.get("hardware") or {})
    if not hardware.get("vector_isa"):  # a record made before hardware named it: its folder does
        hardware["vector_isa"] = slug_vector_isa(get_path(record, "study.slug") or "")
    base_batch = get_path(record, "techniques.effective_batch_size")
    model = get_path(record, "techniques.model_name")
    return StepTimes(found, base_ms, baseline.band, hardware, base_batch, model)


def slowdowns(records: Sequence[Mapping]) -> tuple[dict[str, Slowdown], float | None]:
    """:func:`step_times`'s slowdowns and baseline step ms of one study's records."""
    times = step_times(records)
    return times.slowdowns, times.base_ms


def predicted_step_ms(option_techniques: Sequence[str], batch: int, times: StepTimes) -> float | None:
    """The baseline's step scaled to ``batch`` samples, times each technique's measured slowdown; None where
    one is unknown."""
    known = all(technique in times.slowdowns for technique in option_techniques)
    if not times.base_ms or not times.base_batch or not known:
        return None
    factors = [times.slowdowns[technique].factor for technique in option_techniques]
    return math.prod([times.base_ms * batch / times.base_batch, *factors])


def checkpointing_policies(config: Mapping) -> list[str]:
    """The checkpointing policies the advisor tries on ``config``'s network: off, and those its class
    declares (a LightningModule of the user's, without the project's ``network``: off alone)."""
    model = get_path(config, "model") or {}
    if "network" not in (model.get("init_args") or {}):
        return ["off"]
    network = get_path(config, "model.network") or {"class_path": "modelwright.train.models.ResNet18"}
    class_path = network.get("class_path") if isinstance(network, Mapping) else str(network)
    return ["off", *declared_policies(str(class_path))]


def options(config: Mapping, batch: int, records: Sequence[Mapping] = (),
            times: StepTimes | None = None) -> list[Option]:
    """Every precision × checkpointing × accumulation at ``batch`` samples per step, in that order, with its
    peak predicted by rehearsing its step and its step time (from ``times``, else from ``records``)."""
    times = times or step_times(records)
    accumulations = [accumulate for accumulate in ACCUMULATIONS if batch % accumulate == 0]
    found = []
    combinations = list(itertools.product(PRECISIONS, checkpointing_policies(config), accumulations))
    for precision, checkpointing, accumulate in tqdm(combinations, desc="rehearsing", unit="option",
                                                     leave=False, disable=None):
        option_config = with_values(config, {"trainer.precision": precision,
                                             "trainer.accumulate_grad_batches": accumulate,
                                             "data.batch_size": batch // accumulate,
                                             "model.gradient_checkpointing": checkpointing})
        peak = predict_peak_mib(option_config)["total"]
        option = Option(precision, accumulate, checkpointing, peak, None)
        step_ms = predicted_step_ms(option.techniques, batch, times)
        found.append(option._replace(step_ms=step_ms))
    return found


class Recommendation(NamedTuple):
    option: Option
    reason: str


def measurably_faster(option: Option, than: Option, times: StepTimes) -> bool:
    """Whether ``option``'s predicted step is below ``than``'s by more than the baseline's spread."""
    if option.step_ms is None or than.step_ms is None or times.band is None:
        return False
    return option.step_ms / than.step_ms < 1 + times.band.low


def choose(ranked: Sequence[Option], budget_mib: float, times: StepTimes) -> Recommendation | None:
    """The first option that fits in the table's order (the plain run first: fewest techniques), unless
    another that fits is measurably faster; None when nothing fits."""
    fitting = [option for option in ranked if option.peak_mib <= budget_mib]
    if not fitting:
        return None
    simplest = fitting[0]
    faster = [option for option in fitting if measurably_faster(option, simplest, times)]
    if faster:
        best = min(faster, key=lambda option: option.step_ms)
        factor = best.step_ms / simplest.step_ms
        return Recommendation(best, f"its predicted step is {ratio(factor)} of {simplest.text()}'s, outside "
                                    f"the baseline's spread ({times.band.text()}): measurably faster")
    plain = next((option for option in ranked if option.is_plain), None)
    if simplest.is_plain:
        return Recommendation(simplest, "the plain run fits, and no technique is measurably faster: "
                                        + technique_verdicts(times))
    reason = (f"the plain run does not fit ({sig(plain.peak_mib)} MiB); this is the first that fits with the "
              "fewest techniques (precision, then checkpointing, then accumulation), and no option that fits "
              "is measurably faster")
    return Recommendation(simplest, reason)


def technique_verdicts(times: StepTimes) -> str:
    """Each measured technique's step over the baseline's, with the study's verdict on it."""
    if not times.slowdowns:
        return "no step times (no study records) to show one"
    spread = f"the baseline's repeats spread {times.band.text()}" if times.band else "the baseline ran once"
    verdicts = [f"{technique} {ratio(found.factor)} ({times.verdict(found.factor)})"
                for technique, found in times.slowdowns.items()]
    return ", ".join(verdicts) + f" ({spread})"


def recommend(config: Mapping, batch: int, budget_mib: float,
              records: Sequence[Mapping] = ()) -> Option | None:
    """The advisor's choice (:func:`choose`), or None when nothing fits one device."""
    times = step_times(records)
    found = choose(options(config, batch, times=times), budget_mib, times)
    return found.option if found else None


class Sharding(NamedTuple):
    strategy: str
    ranks: int
    peak_mib: float


def sharded_peak_mib(config: Mapping, strategy: str, ranks: int, single_peak_mib: float) -> float:
    """One rank's predicted peak under ZeRO-1, ZeRO-2 or FSDP2 over ``ranks`` (``config`` at the per-rank
    batch, whose single-device peak is ``single_peak_mib``): FSDP2 rehearsed over a process group of
    ``ranks``; ZeRO-1/2 modelled, the device's peak less the state they shard away."""
    if strategy == "fsdp":
        sharded = with_values(config, {"trainer.strategy": FSDP2_STRATEGY, "trainer.devices": ranks,
                                       "trainer.num_nodes": 1})
        return predict_peak_mib(sharded)["total"]
    num_params = int(get_path(config, "model_parameters", 0) or 0)
    precision = get_path(config, "trainer.precision", "32-true")
    state = param_state_bytes(precision, get_path(config, "model.optimizer", "adamw"))
    full = state_bytes_per_rank(num_params, state, "dp", 1)
    sharded = state_bytes_per_rank(num_params, state, strategy, ranks)
    saved = sum(full[key] - sharded[key] for key in full)
    return single_peak_mib - saved / MIB


def shardings(config: Mapping, batch: int, budget_mib: float, num_params: int) -> list[Sharding]:
    """The fewest ranks at which ZeRO-1, ZeRO-2 and FSDP2 fit ``budget_mib`` (per-rank batch = batch / N)."""
    found = []
    for strategy in ("zero1", "zero2", "fsdp"):
        for ranks in (ranks for ranks in SHARDED_RANKS if batch % ranks == 0):
            rank_config = {**with_values(config, {"data.batch_size": batch // ranks}),
                           "model_parameters": num_params}
            single = predict_peak_mib(rank_config)["total"] if strategy != "fsdp" else 0.0
            peak = sharded_peak_mib(rank_config, strategy, ranks, single)
            if peak <= budget_mib:
                found.append(Sharding(strategy, ranks, peak))
                break
    return found


def machine_text(hardware: Mapping) -> str:
    """``AMD EPYC, 2 cores, avx2`` or ``1 × NVIDIA H100 80GB HBM3``: the machine a record names."""
    if hardware.get("accelerator") == "cpu":
        isa = f", {hardware['vector_isa']}" if hardware.get("vector_isa") else ""
        return f"{hardware.get('cpu_model') or '?'}, {hardware.get('cpu_cores') or '?'} cores{isa}"
    return f"{hardware.get('num_devices') or 1} × {hardware.get('device_name') or '?'}"


#: The vector instruction sets a results folder's name tells apart, widest first: ``measure.facts``'s, which
#: names the folders (not imported: it brings torch).
VECTOR_ISAS = ("avx512", "avx2", "neon", "asimd")
MACHINE_KEYS = {"accelerator": "kind of device", "cpu_model": "CPU model", "cpu_cores": "core count",
                "vector_isa": "vector instruction set", "device_name": "GPU"}


def slug_vector_isa(slug: str) -> str | None:
    """The vector instruction set a results slug names (``cpu-amd-epyc-avx2-2cores``: avx2), or None."""
    return next((isa for isa in VECTOR_ISAS if f"-{isa}-" in slug), None)


def machine_warning(measured_on: Mapping, this_machine: Mapping) -> str | None:
    """A warning when the step times were measured on another machine than this one (its CPU model, cores
    and vector instruction set, or its GPU), None when they match or either is unknown."""
    if not measured_on or not this_machine:
        return None
    if measured_on.get("accelerator") == "cpu":
        keys = ("accelerator", "cpu_model", "cpu_cores", "vector_isa")
    else:
        keys = ("accelerator", "device_name")
    differs = [MACHINE_KEYS[key] for key in keys if None not in (measured_on.get(key), this_machine.get(key))
               and measured_on.get(key) != this_machine.get(key)]
    if not differs:
        return None
    return (f"Warning: the step times are from {machine_text(measured_on)}, not this machine "
            f"({machine_text(this_machine)}; another {' and '.join(differs)}): a technique's speed there "
            "(bf16 above all) need not be its speed here; run the study here to time it.")


def options_table(ranked: Sequence[Option], budget_mib: float, times: StepTimes) -> str:
    plain = next((option for option in ranked if option.is_plain), None)
    body = []
    for option in ranked:
        versus = "–"
        if option.step_ms and plain is not None and plain.step_ms:
            factor = option.step_ms / plain.step_ms
            versus = f"{ratio(factor)} ({times.verdict(factor)})"
        step = sig(option.step_ms, 3, " ms") if option.step_ms else "unknown"
        body.append([option.precision, option.checkpointing, option.accumulate, sig(option.peak_mib), step,
                     versus, "yes" if option.peak_mib <= budget_mib else "no"])
    header = ["precision", "checkpointing", "accumulation", "predicted peak (MiB)", "predicted step",
              "step vs the plain run", "fits"]
    return table(header, body, "lllrrll")


def step_times_text(times: StepTimes) -> str:
    if not times.slowdowns:
        return "step times unknown (no study records)"
    factors = ", ".join(f"{technique} {sig(found.factor, 2)}× ({found.source})"
                        for technique, found in times.slowdowns.items())
    network = f" of {times.model}" if times.model else ""
    return f"step times{network} measured on {machine_text(times.hardware)}: {factors}"


def advise(config: Mapping, batch: int, budget_mib: float, records: Sequence[Mapping] = (),
           budget_label: str = "", check_records: Sequence[Mapping] = (),
           this_machine: Mapping | None = None, num_params: int = 0) -> str:
    """Markdown: every option with its predicted peak and step time, and the recommendation with its reason
    (or the sharding that fits); a warning when the step times are another machine's."""
    times = step_times(records, check_records)
    ranked = options(config, batch, times=times)
    lines = [f"Budget {sig(budget_mib / 1024)} GiB{budget_label}; batch {batch}; peaks predicted by "
             f"rehearsing each option's step on this machine; {step_times_text(times)}"]
    warning = machine_warning(times.hardware, this_machine or {})
    lines += ["", warning] if warning else []
    lines += ["", options_table(ranked, budget_mib, times), ""]
    chosen = choose(ranked, budget_mib, times)
    if chosen:
        option = chosen.option
        name = f"the plain run, {option.text()}" if option.is_plain else option.text()
        return "\n".join([*lines, f"Recommended: {name} — predicted peak {sig(option.peak_mib)} MiB. Why: "
                                  f"{chosen.reason}."])
    fitting = [f"{found.strategy} over {found.ranks} ranks fits ({sig(found.peak_mib)} MiB per rank)"
               for found in shardings(config, batch, budget_mib, num_params)]
    return "\n".join([*lines, "Nothing fits one device. " + ("; ".join(fitting) or "No sharding up to 512.")])
