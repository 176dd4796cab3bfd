"""Rows from a study's records, for the report's tables and the planner's advisor alike.

Per plan entry only the records of its latest resolved config (``study.config_hash``) count, so a changed
plan replaces a row instead of mixing old and new measurements; their ``ok`` ones make the row (medians over
repeats), an entry with none shows its last failure. Ratios are to the model's run named ``baseline`` (or
``*-baseline``), else its first run.
"""

from __future__ import annotations

import functools
import random
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from modelwright.fmt import DASH, finite, pct, sig
from modelwright.record import get_path

ANATOMY = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
#: Training-loss points averaged for the quality column (compared only at equal samples seen).
LOSS_STEPS = 3


def median(values: Sequence[Any]) -> float | None:
    """The median of the finite numbers among ``values``; None when there are none."""
    numbers = [number for number in map(finite, values) if number is not None]
    return statistics.median(numbers) if numbers else None


def div(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None where either is missing or the denominator is zero (a figure that
    cannot be computed prints a dash)."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def provenance_group(record: Mapping) -> str:
    """Records of one commit and one definitions version share a group (and a mark where a table mixes
    groups)."""
    provenance = record.get("provenance") or {}
    return f"commit {str(provenance.get('commit'))[:10]}, definitions {provenance.get('definitions')}"


def tracked_eagerly(record: Mapping) -> bool:
    """A compiled run on a CPU: MemTracker is a TorchDispatchMode, under it Dynamo falls back to eager, so
    its memory figures are eager code's, not the compiled run's."""
    return bool(get_path(record, "techniques.compile")) and get_path(record, "hardware.accelerator") == "cpu"


def peak_mib(record: Mapping) -> float | None:
    """The measured peak; None where the memory tracker saw eager code only."""
    if tracked_eagerly(record):
        return None
    return finite(get_path(record, "memory.peak_allocated_mib"))


@dataclass(frozen=True)
class LastLoss:
    """Mean training loss of the last :data:`LOSS_STEPS` logged steps, and the samples seen by the last
    one."""

    mean: float | None = None
    samples: int | None = None


def last_loss(record: Mapping) -> LastLoss:
    history = get_path(record, "history.train/loss") or []
    points = [point for point in history if finite(point[1]) is not None]
    if len(points) < LOSS_STEPS:
        return LastLoss()
    batch = get_path(record, "techniques.effective_batch_size")
    samples = points[-1][0] * batch if isinstance(batch, int) else None
    return LastLoss(statistics.fmean(point[1] for point in points[-LOSS_STEPS:]), samples)


class SpreadBand(NamedTuple):
    """The spread of a row's repeats: the lowest and the highest of their median steps relative to the median
    of them (``lo/med − 1``, ``hi/med − 1``)."""

    low: float
    high: float

    def around(self, time_ratio: float) -> tuple[float, float]:
        """The ratios a predicted ``time_ratio`` could be, by this spread of the baseline's repeats: it
        contains 1 where ``1 + low <= time_ratio <= 1 + high``."""
        return time_ratio / (1 + self.high), time_ratio / (1 + self.low)

    def text(self) -> str:
        """``-7.6% / +7.0%``."""
        return f"{pct(self.low, signed=True)} / {pct(self.high, signed=True)}"


#: Why a row compared with another plan's baseline has no interval.
UNPAIRED = "another plan's baseline"
#: The paired comparison: a percentile bootstrap, seeded so that a report regenerates to the same text.
CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


class PairedInterval(NamedTuple):
    """A :data:`CONFIDENCE` interval on a row's step time over its reference's, from repeats paired by repeat
    index (the n-th fresh process of each), and the longest time between the records of a pair."""

    low: float
    high: float
    pairs: int
    apart_s: float | None

    def around(self, time_ratio: float) -> tuple[float, float]:
        return self.low, self.high

    def text(self) -> str:
        """``0.970–1.12× (3 pairs)``: three digits, so that an end near 1 does not read as 1.0."""
        return f"{sig(self.low)}–{sig(self.high, suffix='×')} ({self.pairs} pairs)"


def created_s(record: Mapping) -> float | None:
    """When the record was begun, in seconds since the epoch; None without a readable ``created_at``."""
    try:
        return datetime.fromisoformat(str(record.get("created_at"))).timestamp()
    except ValueError:
        return None


class Pair(NamedTuple):
    """The median steps of a run's and its reference's repeats of one index, and the time between them."""

    run_ms: float
    base_ms: float
    apart_s: float | None


def pairs_by_repeat(records: Sequence[Mapping], reference: Sequence[Mapping]) -> list[Pair]:
    """The repeats of ``records`` and ``reference`` paired by ``study.repeat``, where both have a step."""
    by_repeat = {get_path(record, "study.repeat"): record for record in reference}
    pairs = []
    for record in records:
        base = by_repeat.get(get_path(record, "study.repeat"))
        run_ms = finite(get_path(record, "timing.step_time_median_ms"))
        base_ms = finite(get_path(base, "timing.step_time_median_ms")) if base else None
        if run_ms is None or not base_ms:
            continue
        started = (created_s(record), created_s(base))
        pairs.append(Pair(run_ms, base_ms, None if None in started else abs(started[0] - started[1])))
    return pairs


def paired_interval(records: Sequence[Mapping], reference: Sequence[Mapping]) -> PairedInterval | None:
    """The bootstrap interval of the ratio of median steps over pairs of repeats drawn with replacement (the
    same pairs for both sides, so that a slow spell of the machine over a pair cancels); None with fewer
    than 2 pairs."""
    pairs = pairs_by_repeat(records, reference)
    if len(pairs) < 2:
        return None
    generator = random.Random(BOOTSTRAP_SEED)
    ratios = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        drawn = generator.choices(pairs, k=len(pairs))
        run_ms = statistics.median(pair.run_ms for pair in drawn)
        ratios.append(run_ms / statistics.median(pair.base_ms for pair in drawn))
    ratios.sort()
    tail = round(BOOTSTRAP_RESAMPLES * (1 - CONFIDENCE) / 2)
    apart = [pair.apart_s for pair in pairs if pair.apart_s is not None]
    return PairedInterval(ratios[tail], ratios[-tail - 1], len(pairs), max(apart, default=None))


@dataclass(frozen=True)
class Figures:
    """What a row shows: medians over its ``ok`` repeats (the anatomy by category, MiB), the repeats' median
    step times' ``step_lo``/``step_hi``, and the largest activations a repeat left after its step. The FLOP
    rates and MFU are those of the median step, so a sentence that takes several of them agrees with itself
    and with ``step_ms``."""

    peak_mib: float | None = None
    anatomy: dict[str, float | None] = field(default_factory=dict)
    end_activations: float | None = None
    step_ms: float | None = None
    step_lo: float | None = None
    step_hi: float | None = None
    repeats: int = 0
    samples_per_s: float | None = None
    flops_per_step: float | None = None
    peak_flops_per_s: float | None = None
    achieved_flops_per_s: float | None = None
    mfu: float | None = None
    loss: float | None = None
    loss_samples: int | None = None


def anatomy_medians(ok: Sequence[Mapping]) -> dict[str, float | None]:
    """Median MiB per anatomy category; buffers counted under ``other``. Categories a newer instrument adds
    (communication buffers, say) get columns of their own."""
    found = [key for record in ok for key in get_path(record, "memory.anatomy_mib") or {}]
    keys = list(dict.fromkeys([*ANATOMY, *found]))
    anatomy = {key: median([get_path(record, f"memory.anatomy_mib.{key}") for record in ok])
               for key in keys if key not in ("buffers", "total")}
    buffers = median([get_path(record, "memory.anatomy_mib.buffers") for record in ok])
    if anatomy["other"] is not None or buffers is not None:  # neither: no anatomy (a compiled run)
        anatomy["other"] = (anatomy["other"] or 0.0) + (buffers or 0.0)
    return anatomy


def median_step_rates(ok: Sequence[Mapping], step_ms: float | None) -> dict[str, float | None]:
    """FLOPs per step, the hardware peak, and the achieved FLOP/s and MFU at the median step (the records'
    own medians of them where the FLOPs per step are not recorded)."""
    flops = median([get_path(record, "flops.flops_per_step") for record in ok])
    peak = median([get_path(record, "flops.peak_flops_per_s") for record in ok])
    if flops and step_ms:
        achieved = flops / (step_ms / 1000)
        mfu = div(achieved, peak)
    else:
        achieved = median([get_path(record, "flops.achieved_flops_per_s") for record in ok])
        mfu = median([get_path(record, "flops.mfu") for record in ok])
    return {"flops_per_step": flops, "peak_flops_per_s": peak, "achieved_flops_per_s": achieved, "mfu": mfu}


def figures_of(ok: Sequence[Mapping]) -> Figures:
    """A row's figures from its ``ok`` records (one per repeat)."""
    medians = [finite(get_path(record, "timing.step_time_median_ms")) for record in ok]
    steps = [step for step in medians if step is not None]
    step_ms = median(steps)
    losses = [last_loss(record) for record in ok]
    measured = [record for record in ok if not tracked_eagerly(record)]
    left = [finite(get_path(record, "memory.anatomy_end_mib.activations")) for record in measured]
    end_activations = max((mib for mib in left if mib is not None), default=None)
    return Figures(
        peak_mib=median([peak_mib(record) for record in ok]),
        anatomy=anatomy_medians(measured),
        end_activations=end_activations,
        step_ms=step_ms,
        step_lo=min(steps, default=None),
        step_hi=max(steps, default=None),
        repeats=len(steps),
        samples_per_s=median([get_path(record, "timing.samples_per_s") for record in ok]),
        **median_step_rates(ok, step_ms),
        loss=median([loss.mean for loss in losses]),
        loss_samples=losses[0].samples,
    )


@dataclass(frozen=True)
class EpochFigures:
    """One full configured epoch of a plan entry (a record of ``study.kind`` ``epoch``): its wall time, data
    loading and the validations inside it included, and its parts."""

    time_s: float
    steps: int | None
    validation_s: float | None
    validations: int | None
    samples: int | None
    record: Mapping

    @property
    def validation_share(self) -> float | None:
        return div(self.validation_s, self.time_s)

    @property
    def training_step_s(self) -> float | None:
        """The epoch's time outside its validations per optimizer step (data loading included)."""
        return div(self.time_s - (self.validation_s or 0.0), self.steps)


def epoch_figures(records: Sequence[Mapping]) -> EpochFigures | None:
    """The latest ``ok`` epoch record's figures; None where no epoch was measured."""
    for record in reversed(records):
        time_s = finite(get_path(record, "timing.epoch_time_s"))
        if record.get("status") != "ok" or time_s is None:
            continue
        steps = get_path(record, "timing.epoch_steps")
        batch = get_path(record, "techniques.effective_batch_size")
        samples = steps * batch if isinstance(steps, int) and isinstance(batch, int) else None
        return EpochFigures(time_s, steps, finite(get_path(record, "timing.epoch_validation_s")),
                            get_path(record, "timing.epoch_validations"), samples, record)
    return None


@dataclass
class Row:
    """One plan entry: the figures of its ``ok`` repeats, or its last failure; and its latest measured
    epoch."""

    name: str
    records: list[dict]
    status: str
    error: str | None = None
    reference: Row | None = None
    figures: Figures = field(default_factory=Figures)
    epoch: EpochFigures | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def model(self) -> Any:
        return get_path(self.records[0], "techniques.model_name")

    def vs(self, name: str) -> float | None:
        """This row's figure ``name`` over its reference row's."""
        reference = getattr(self.reference.figures, name) if self.reference else None
        return div(getattr(self.figures, name), reference)

    @property
    def band(self) -> SpreadBand | None:
        """The spread of the repeats' median steps; None with fewer than 2 repeats."""
        figures = self.figures
        if figures.repeats < 2 or not figures.step_ms:
            return None
        return SpreadBand(figures.step_lo / figures.step_ms - 1, figures.step_hi / figures.step_ms - 1)

    @property
    def paired(self) -> bool:
        """Whether this row ran in turn with its reference: both of one plan. A baseline of another plan
        ran at another time, so a drift of the machine between them would be in the ratio."""
        return self.reference is not None and plan_of(self) == plan_of(self.reference)

    @functools.cached_property
    def interval(self) -> PairedInterval | None:
        """The paired interval on this row's step over its reference's (:func:`paired_interval`); None
        where the two did not run in turn."""
        return paired_interval(self.records, self.reference.records) if self.paired else None

    @property
    def verdict(self) -> str:
        if self.reference is not None and not self.paired and self.vs("step_ms") is not None:
            return f"no verdict: {UNPAIRED}"
        return verdict(self.vs("step_ms"), self.interval)


def verdict(time_ratio: float | None, spread: PairedInterval | SpreadBand | None) -> str:
    """``faster``/``slower`` only where the interval on the ratio leaves out 1.0, else ``no measurable
    change``. ``spread``: a measured ratio's :class:`PairedInterval`, or around a predicted ratio (the
    advisor's) the baseline's :class:`SpreadBand`."""
    if time_ratio is None:
        return DASH
    if spread is None:
        return "no verdict: 1 repeat"
    low, high = spread.around(time_ratio)
    if low <= 1 <= high:
        return "no measurable change"
    return "faster" if high < 1 else "slower"


def records_by_entry(records: Sequence[dict], kind: str) -> dict[str, list[dict]]:
    """The records a study wrote of ``kind`` (``run`` or ``budget``) per plan entry, in the order they were
    written."""
    by_entry: dict[str, list[dict]] = {}
    for record in records:
        study = record.get("study")
        if isinstance(study, Mapping) and isinstance(study.get("name"), str) and study.get("kind") == kind:
            by_entry.setdefault(study["name"], []).append(record)
    return by_entry


def is_baseline_name(name: str) -> bool:
    return re.fullmatch(r"(.*[-_])?baseline", name) is not None


def build_rows(records: Sequence[dict]) -> list[Row]:
    """The table's rows in plan order, each with its reference row set."""
    rows = []
    plans: dict[Any, int] = {}
    for name, group in records_by_entry(records, "run").items():
        last = group[-1]
        plans.setdefault(last["study"].get("plan"), len(plans))  # plans in the order they were first run
        latest = last["study"].get("config_hash")
        ok = [record for record in group
              if record["study"].get("config_hash") == latest and record.get("status") == "ok"]
        if ok:
            rows.append(Row(name, ok, "ok", figures=figures_of(ok)))
        else:
            rows.append(Row(name, [last], str(last.get("status")), error=last.get("error")))

    def plan_order(row: Row) -> tuple:
        return plans[plan_of(row)], row.records[-1]["study"].get("index", 0), row.name

    rows.sort(key=plan_order)
    epochs = records_by_entry(records, "epoch")
    for row in rows:
        row.epoch = epoch_figures(epochs.get(row.name, []))
    ranked = sorted((row for row in rows if row.ok), key=lambda row: not is_baseline_name(row.name))
    # A plan's own baseline, run in turn with its rows; else the model's first baseline, else its first run.
    references = {row.model: row for row in reversed(ranked)}
    own = {(plan_of(row), row.model): row for row in reversed(ranked) if is_baseline_name(row.name)}
    for row in rows:
        row.reference = own.get((plan_of(row), row.model), references.get(row.model))
    return rows


def plan_of(row: Row) -> Any:
    return row.records[-1]["study"].get("plan")


@dataclass
class BudgetRow:
    """One budget entry's latest series of confirming runs and where it ended."""

    name: str
    budget_mib: float
    batch: int | None
    predicted_mib: float | None
    measured_mib: float | None
    status: str
    attempts: int
    wall_s: float
    records: list[dict]
    vs_reference: float | None = None
    over_batch: int | None = None  # the run at batch + a few percent, which must exceed the budget
    over_mib: float | None = None

    @property
    def fits(self) -> bool:  # confirmed under the budget by a measured peak
        return self.measured_mib is not None and self.measured_mib <= self.budget_mib


def budget_row(name: str, series: list[dict], over: list[dict]) -> BudgetRow:
    """The row of one budget entry from its latest series of attempts and the runs a few percent over it."""
    last = series[-1]
    study = last["study"]
    row = BudgetRow(
        name=name,
        budget_mib=float(study["budget_mib"]),
        batch=study.get("predicted_batch"),
        predicted_mib=finite(study.get("predicted_peak_mib")),
        measured_mib=peak_mib(last) if last.get("status") == "ok" else None,
        status=str(last.get("status")),
        attempts=len(series),
        wall_s=sum(finite(get_path(record, "study.process_wall_s")) or 0 for record in series),
        records=series,
    )
    if over and over[-1]["study"].get("confirmed_batch") == row.batch:
        row.over_batch = get_path(over[-1], "techniques.micro_batch_size")
        row.over_mib = peak_mib(over[-1]) if over[-1].get("status") == "ok" else None
    return row


def build_budget_rows(records: Sequence[dict], rows: Sequence[Row]) -> list[BudgetRow]:
    """Per budget run, its latest series of attempts (from attempt 1) and where it ended, in plan order."""
    budget = []
    for name, entry_records in records_by_entry(records, "budget").items():
        over = [record for record in entry_records if record["study"].get("role") == "over"]
        confirming = [record for record in entry_records if record["study"].get("role") != "over"]
        starts = [index for index, record in enumerate(confirming) if record["study"].get("attempt") == 1]
        if starts:
            budget.append(budget_row(name, confirming[starts[-1]:], over))
    budget.sort(key=lambda row: row.records[-1]["study"].get("index", 0))
    references = {row.name: row.reference.name for row in rows if row.reference}
    fitted = {row.name: row.batch for row in budget if row.fits}
    for row in budget:
        row.vs_reference = div(row.batch, fitted.get(references.get(row.name))) if row.fits else None
    return budget
