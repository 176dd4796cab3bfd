"""The largest micro-batch under a memory budget: predicted by the planner (the run's step rehearsed),
confirmed by two runs. The predicted batch must fit (one correction if it lands over, by the planner's
measured miss), and a run a few percent larger must not: both together say the batch is the largest, within
that margin."""

import math
from collections.abc import Sequence
from typing import Any

from modelwright import fmt
from modelwright.errors import one_line
from modelwright.planner import cuda, memory
from modelwright.planner.memory import with_values
from modelwright.record import get_path
from modelwright.study.plan import Entry, build_spec
from modelwright.study.runner import Progress, Study, say
from modelwright.study_rows import peak_mib
from modelwright.techniques import precision

#: How much larger than the confirmed batch the run that must exceed the budget is.
OVER_FRACTION = 0.05
#: ``study.prediction_method`` of a confirming run: how its batch was chosen.
PLANNER = "planner"
CORRECTED = "planner, corrected by the miss"


def budget_phase(study: Study, entries: Sequence[Entry], progress: Progress, budget_mib: float) -> None:
    """Predict and confirm the largest micro-batch under ``budget_mib`` for each of the plan's budget runs."""
    by_name = {}
    for index, entry in enumerate(study.plan.entries):
        if entry in entries:
            by_name[entry.name] = (index, entry)
    for name in study.plan.budget_runs:
        if name in by_name:
            index, entry = by_name[name]
            _largest_batch(_BudgetRuns(study, index, entry, progress, budget_mib))


class _BudgetRuns:
    """One plan entry's budget runs: the planner's predictions (its step rehearsed), and runs at a given
    micro-batch."""

    def __init__(self, study: Study, index: int, entry: Entry, progress: Progress, budget_mib: float) -> None:
        self.study = study
        self.index = index
        self.entry = entry
        self.progress = progress
        self.budget_mib = budget_mib
        plain = build_spec(entry, index, study.settings).resolved
        # A budget run has no accumulation (its micro-batch is the step): so its predictions.
        self.config = with_values(plain, {"trainer.accumulate_grad_batches": 1})
        settings = study.settings
        # On a GPU the run's peak is the allocator's, each tensor a rounded block and cuBLAS's workspaces
        # beside them (planner.cuda).
        self.on_cuda = settings.accelerator in ("cuda", "gpu") or settings.slug.startswith("cuda-")
        self.precision = precision(get_path(plain, "trainer.precision")).name
        self.rehearsal = None
        self.why_not = None
        try:
            self.rehearsal = memory.rehearsal(self.config)
        except Exception as err:  # no prediction: the phase says why and skips the entry
            self.why_not = one_line(err)

    def largest(self, budget_mib: float) -> int:
        """The planner's largest micro-batch under ``budget_mib`` (0 without a prediction)."""
        if self.rehearsal is None:
            return 0
        if self.on_cuda:
            return cuda.largest_cuda_batch(self.rehearsal, self.precision, budget_mib)
        return self.rehearsal.largest_batch(budget_mib)

    def predicted_peak(self, batch: int) -> float | None:
        if not batch or self.rehearsal is None:
            return None
        if self.on_cuda:
            return cuda.predict_cuda_peak(self.rehearsal, batch, self.precision).allocated_mib
        return self.rehearsal.peak(batch)["total"]

    def run(self, batch: int, **extra: Any) -> dict:
        # The run a few percent over may share its batch with an attempt that missed the budget: as repeat 1
        # it is run for what it is, not skipped as that attempt's record.
        repeat = int(extra["role"] == "over")
        spec = build_spec(self.entry, self.index, self.study.settings, repeat=repeat, kind="budget",
                          batch_size=batch, extra={"budget_mib": self.budget_mib, **extra})
        return self.study.run(spec, self.progress)

    def fits(self, record: dict) -> bool:
        peak = peak_mib(record)
        return record.get("status") == "ok" and peak is not None and peak <= self.budget_mib


def _confirmed_batch(runs: _BudgetRuns, batch: int) -> int | None:
    """The planner's ``batch`` if a run confirms it fits, else one corrected attempt; None if neither fits."""
    predicted = runs.predicted_peak(batch)
    method = PLANNER
    for attempt in (1, 2):
        record = runs.run(batch, role="confirm", attempt=attempt, predicted_batch=batch,
                          predicted_peak_mib=predicted, prediction_method=method)
        if runs.fits(record):
            return batch
        peak = peak_mib(record)
        if peak is None and record.get("status") == "ok":
            say(f"{runs.entry.name} (budget): batch {batch} recorded no peak: it took too few steps (is the "
                "training set smaller than one batch? an image folder is not grown to fit)")
        if attempt == 2 or peak is None:
            return None
        # The planner missed by a measured amount: predict again for a budget less that much.
        missed = batch
        method = CORRECTED
        batch = min(runs.largest(runs.budget_mib - (peak - predicted)), missed - 1)
        if batch < 1:
            return None
        # of the batch run, also where the correction was capped below the missed one
        predicted = runs.predicted_peak(batch)
        runs.progress.add_runs(1)
    return None


def _largest_batch(runs: _BudgetRuns) -> None:
    name = runs.entry.name
    batch = runs.largest(runs.budget_mib)
    if batch < 1:
        why = "the fixed part alone exceeds it"
        if runs.rehearsal is None:
            why = f"no prediction: {runs.why_not}"
        say(f"{name} (budget): skipped ({why})")
        return
    runs.progress.add_runs(2)
    confirmed = _confirmed_batch(runs, batch)
    if confirmed is None:
        runs.progress.add_runs(-1)
        say(f"{name} (budget, over): skipped (no batch was confirmed under the budget)")
        return
    over = confirmed + max(1, math.ceil(confirmed * OVER_FRACTION))
    peak = peak_mib(runs.run(over, role="over", confirmed_batch=confirmed))
    over_peak = f"peaks at {fmt.sig(peak)} MiB"
    verdict = f"not the largest (batch + {fmt.pct(OVER_FRACTION)} fits)"
    if peak is None:
        over_peak = "recorded no peak"
        verdict = "not known to be the largest"
    elif peak > runs.budget_mib:
        verdict = "the largest"
    say(f"{name}: batch {confirmed} fits {fmt.sig(runs.budget_mib)} MiB, batch {over} {over_peak}: {verdict}")
