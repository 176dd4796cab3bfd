"""The largest micro-batch under a memory budget: predicted, then confirmed by two runs.

The prediction is the planner's (``largest_batch`` from the baseline's profile) where it has one, else the measured
anatomy's: activations and backward temporaries grow with the batch, the rest of the peak is fixed. A run that
accumulates is first measured at its micro-batch without accumulation (a probe), so prediction and confirmation
share one setup. The predicted batch must fit (one correction if it lands over: by the planner's measured miss, or
the line through two measured points), and a run a few percent larger must not: both together say the batch is
the largest, within that margin.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from modelwright.errors import require
from modelwright.record import get_path
from modelwright.report import fmt, tables
from modelwright.study.plan import Entry, RunSpec, build_spec
from modelwright.study.runner import Progress, Study, say

#: How much larger than the confirmed batch the run that must exceed the budget is.
OVER_FRACTION = 0.05


def predict_largest_batch(anatomy_mib: Mapping[str, float], peak_mib: float, batch: int, budget_mib: float) -> dict:
    """The largest micro-batch whose predicted peak fits ``budget_mib``, from one measured anatomy: activations and
    backward temporaries (mostly gradients of activations) scale with the batch, the rest is fixed. Returns
    ``per_sample_mib``, ``fixed_mib``, ``batch`` (0 if not even one sample fits) and ``predicted_peak_mib``."""
    require(batch >= 1, f"batch: must be >= 1, got {batch}")
    scaled = sum(float(anatomy_mib.get(k) or 0.0) for k in ("activations", "temporaries"))
    fixed = max(0.0, peak_mib - scaled)
    return predict_from_two_points(0, fixed, batch, fixed + scaled, budget_mib)


def predict_from_two_points(b0: int, m0: float, b1: int, m1: float, budget_mib: float) -> dict:
    """The same prediction from two measured (batch, peak) points: the line through them."""
    require(b0 != b1, "two budget points need different batches")
    per_sample = (m1 - m0) / (b1 - b0)
    fixed = m0 - per_sample * b0
    best = max(0, math.floor((budget_mib - fixed) / per_sample + 1e-9)) if per_sample > 0 else 0
    return {"per_sample_mib": per_sample, "fixed_mib": fixed, "batch": best,
            "predicted_peak_mib": fixed + per_sample * best}


def _run_at(study: Study, entry: Entry, index: int, progress: Progress, batch: int, **extra: Any) -> dict:
    # The run a few percent over may share its batch with an attempt that missed the budget: as repeat 1 it is run
    # for what it is, not skipped as that attempt's record.
    spec = build_spec(entry, index, study.settings, repeat=int(extra.get("role") == "over"), kind="budget",
                      batch_size=batch, extra=extra)
    return study.run(spec, progress)


def _anatomy_ok(record: Mapping) -> bool:
    return record.get("status") == "ok" and bool(get_path(record, "memory.anatomy_mib") and tables.peak_mib(record))


def _predict(study: Study, specs: Sequence[RunSpec], entry: Entry, index: int, progress: Progress,
             budget_mib: float) -> dict | str:
    """A prediction (``batch`` and how it was made; ``at``: the planner's for another budget), or why there is none."""
    from modelwright import planner

    plain = build_spec(entry, index, study.settings)
    profile = study.baseline(get_path(plain.resolved, "model.model_name"))
    if profile is not None:
        def at(budget: float) -> dict:
            batch = int(planner.largest_batch(profile, plain.resolved, budget))
            cfg = {**plain.resolved, "data": {**plain.resolved["data"], "batch_size": batch}}
            return {"batch": batch, "predicted_peak_mib": planner.predict_peak_mib(profile, cfg)["total"] if batch
                    else None}

        return {"prediction": "planner", "from_run_id": profile.get("run_id"), "at": at, **at(budget_mib)}
    # The median-peak ok record with an anatomy among the entry's runs.
    ok = sorted((study.done[s.key] for s in specs if s.name == entry.name and s.key in study.done
                 and _anatomy_ok(study.done[s.key])), key=tables.peak_mib)
    if not ok:
        return "no measured anatomy to predict from"
    base = ok[(len(ok) - 1) // 2]
    b0 = get_path(base, "techniques.micro_batch_size")
    if get_path(base, "techniques.accumulate_grad_batches", 1) != 1:
        progress.add_runs(1)
        base = _run_at(study, entry, index, progress, b0, budget_mib=budget_mib, role="probe", attempt=0,
                       prediction="probe", from_run_id=base.get("run_id"))
        if not _anatomy_ok(base):
            return "the probe run measured no anatomy"
    m0 = tables.peak_mib(base)
    return {"prediction": "anatomy", "from_run_id": base.get("run_id"), "from_batch": b0, "from_peak_mib": m0,
            **predict_largest_batch(base["memory"]["anatomy_mib"], m0, b0, budget_mib)}


def budget_phase(study: Study, specs: Sequence[RunSpec], entries: Sequence[Entry], progress: Progress,
                 budget_mib: float) -> None:
    """Predict and confirm the largest micro-batch under ``budget_mib`` for each of the plan's budget runs."""
    by_name = {e.name: (i, e) for i, e in enumerate(study.plan.entries) if e in entries}
    for name in [n for n in study.plan.budget_runs if n in by_name]:
        index, entry = by_name[name]
        progress.add_runs(2)
        pred = _predict(study, specs, entry, index, progress, budget_mib)
        if isinstance(pred, str) or pred["batch"] < 1:
            progress.add_runs(-2)
            say(f"{name} (budget): skipped ({pred if isinstance(pred, str) else 'the fixed part alone exceeds it'})")
            continue
        for attempt in (1, 2):
            extra = {k: v for k, v in pred.items() if k not in ("batch", "at")}
            record = _run_at(study, entry, index, progress, pred["batch"], budget_mib=budget_mib, role="confirm",
                             attempt=attempt, predicted_batch=pred["batch"], **extra)
            peak = tables.peak_mib(record)
            fits = record.get("status") == "ok" and peak is not None and peak <= budget_mib
            if fits or attempt == 2 or peak is None:
                break
            missed = pred["batch"]
            if "at" in pred:  # the planner missed by a measured amount: predict again for a budget less that much
                pred = {**pred, **pred["at"](budget_mib - (peak - pred["predicted_peak_mib"])),
                        "prediction": "planner, corrected by the miss"}
            else:
                pred = {**pred, **predict_from_two_points(pred["from_batch"], pred["from_peak_mib"], missed, peak,
                                                          budget_mib), "prediction": "two-point"}
            pred["batch"] = min(pred["batch"], missed - 1)
            if pred["batch"] < 1:
                break
            progress.add_runs(1)
        if not fits:
            progress.add_runs(-1)
            say(f"{name} (budget, over): skipped (no batch was confirmed under the budget)")
            continue
        batch = pred["batch"]
        over = batch + max(1, math.ceil(batch * OVER_FRACTION))
        peak = tables.peak_mib(_run_at(study, entry, index, progress, over, budget_mib=budget_mib, role="over",
                                       confirmed_batch=batch))
        verdict = "the largest" if peak is not None and peak > budget_mib else (
            f"not the largest (batch + {fmt.pct(OVER_FRACTION)} fits)")
        say(f"{name}: batch {batch} fits {fmt.sig(budget_mib)} MiB, batch {over} peaks at {fmt.sig(peak)} MiB: "
            f"{verdict}")
