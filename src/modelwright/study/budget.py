"""The largest micro-batch under a memory budget: predicted by the planner from the baseline's profile, confirmed by
two runs. The predicted batch must fit (one correction if it lands over, by the planner's measured miss), and a run a
few percent larger must not: both together say the batch is the largest, within that margin."""

import math
from collections.abc import Sequence
from typing import Any

from modelwright import planner
from modelwright.record import get_path
from modelwright.report import fmt, tables
from modelwright.study.plan import Entry, build_spec
from modelwright.study.runner import Progress, Study, say

#: How much larger than the confirmed batch the run that must exceed the budget is.
OVER_FRACTION = 0.05


def budget_phase(study: Study, entries: Sequence[Entry], progress: Progress, budget_mib: float) -> None:
    """Predict and confirm the largest micro-batch under ``budget_mib`` for each of the plan's budget runs."""
    by_name = {e.name: (i, e) for i, e in enumerate(study.plan.entries) if e in entries}
    for name in [n for n in study.plan.budget_runs if n in by_name]:
        _largest_batch(study, *by_name[name], progress, budget_mib)


def _largest_batch(study: Study, index: int, entry: Entry, progress: Progress, budget_mib: float) -> None:
    plain = build_spec(entry, index, study.settings)
    profile = study.baseline(get_path(plain.resolved, "model.model_name"))

    def peak_at(batch: int) -> float | None:
        cfg = {**plain.resolved, "data": {**plain.resolved["data"], "batch_size": batch}}
        return planner.predict_peak_mib(profile, cfg)["total"] if batch else None

    def run_at(batch: int, **extra: Any) -> dict:
        # The run a few percent over may share its batch with an attempt that missed the budget: as repeat 1 it is
        # run for what it is, not skipped as that attempt's record.
        spec = build_spec(entry, index, study.settings, repeat=int(extra["role"] == "over"), kind="budget",
                          batch_size=batch, extra={"budget_mib": budget_mib, **extra})
        return study.run(spec, progress)

    batch = int(planner.largest_batch(profile, plain.resolved, budget_mib)) if profile is not None else 0
    predicted = peak_at(batch) if batch else None
    if batch < 1:
        why = "no profile of the baseline to predict from" if profile is None else "the fixed part alone exceeds it"
        return say(f"{entry.name} (budget): skipped ({why})")
    progress.add_runs(2)
    how = "planner"
    for attempt in (1, 2):
        record = run_at(batch, role="confirm", attempt=attempt, predicted_batch=batch, predicted_peak_mib=predicted,
                        prediction=how, from_run_id=profile.get("run_id"))
        peak = tables.peak_mib(record)
        fits = record.get("status") == "ok" and peak is not None and peak <= budget_mib
        if fits or attempt == 2 or peak is None:
            break
        # The planner missed by a measured amount: predict again for a budget less that much.
        missed, how = batch, "planner, corrected by the miss"
        batch = min(int(planner.largest_batch(profile, plain.resolved, budget_mib - (peak - predicted))), missed - 1)
        if batch < 1:
            break
        predicted = peak_at(batch)  # of the batch run, also where the correction was capped below the missed one
        progress.add_runs(1)
    if not fits:
        progress.add_runs(-1)
        return say(f"{entry.name} (budget, over): skipped (no batch was confirmed under the budget)")
    over = batch + max(1, math.ceil(batch * OVER_FRACTION))
    peak = tables.peak_mib(run_at(over, role="over", confirmed_batch=batch))
    largest = peak is not None and peak > budget_mib
    say(f"{entry.name}: batch {batch} fits {fmt.sig(budget_mib)} MiB, batch {over} peaks at {fmt.sig(peak)} MiB: "
        + ("the largest" if largest else f"not the largest (batch + {fmt.pct(OVER_FRACTION)} fits)"))
