"""The largest micro-batch under a memory budget: predicted, then confirmed by two runs.

The prediction is the planner's (``largest_batch`` from the baseline's profile) where it has one, else the measured
anatomy's: activations and backward temporaries grow with the batch, the rest of the peak is fixed. A run that
accumulates is first measured at its micro-batch without accumulation (a probe), so prediction and confirmation
share one setup. The predicted batch must fit (one two-point correction if it lands over), and a run a few percent
larger must not: both together say the batch is the largest, within that margin.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from modelwright.errors import require
from modelwright.record import get_path
from modelwright.report import fmt
from modelwright.study.plan import Entry, RunSpec, build_spec
from modelwright.study.runner import Progress, Study, planner_functions

#: Anatomy categories that grow linearly with the micro-batch (backward temporaries at the peak are mostly
#: gradients of activations).
SCALES_WITH_BATCH = ("activations", "temporaries")
#: How much larger than the confirmed batch the run that must exceed the budget is.
OVER_FRACTION = 0.05


def record_peak_mib(record: Mapping) -> float | None:
    """The measured peak of a run: the allocator's peak (CUDA), else the anatomy total (tensor memory on CPU)."""
    for key in ("memory.peak_allocated_mib", "memory.anatomy_mib.total"):
        value = fmt.finite(get_path(record, key))
        if value is not None:
            return value
    return None


def _fit_line(per_sample: float, fixed: float, budget_mib: float) -> dict[str, Any]:
    best = max(0, math.floor((budget_mib - fixed) / per_sample + 1e-9)) if per_sample > 0 else 0
    return {"per_sample_mib": per_sample, "fixed_mib": fixed, "batch": best,
            "predicted_peak_mib": fixed + per_sample * best}


def predict_largest_batch(anatomy_mib: Mapping[str, float], peak_mib: float, batch: int, budget_mib: float) -> dict:
    """The largest micro-batch whose predicted peak fits ``budget_mib``, from one measured anatomy.

    Returns:
        ``per_sample_mib``, ``fixed_mib``, ``batch`` (0 if not even one sample fits) and ``predicted_peak_mib``.
    """
    require(batch >= 1, f"batch: must be >= 1, got {batch}")
    scaled = sum(float(anatomy_mib.get(k) or 0.0) for k in SCALES_WITH_BATCH)
    return _fit_line(scaled / batch, max(0.0, peak_mib - scaled), budget_mib)


def predict_from_two_points(b0: int, m0: float, b1: int, m1: float, budget_mib: float) -> dict:
    """The same prediction from two measured (batch, peak) points: the line through them."""
    require(b0 != b1, "two budget points need different batches")
    slope = (m1 - m0) / (b1 - b0)
    return _fit_line(slope, m0 - slope * b0, budget_mib)


def _measured(study: Study, specs: Sequence[RunSpec], name: str) -> dict | None:
    """The median-peak ok record with an anatomy among ``name``'s runs."""
    ok = [study.done[s.key] for s in specs if s.name == name and s.key in study.done]
    ok = [r for r in ok if r.get("status") == "ok" and get_path(r, "memory.anatomy_mib") and record_peak_mib(r)]
    return sorted(ok, key=record_peak_mib)[(len(ok) - 1) // 2] if ok else None


def _run_at(study: Study, entry: Entry, index: int, progress: Progress, batch: int, **extra: Any) -> dict:
    # The run a few percent over may share its batch with an attempt that missed the budget: as repeat 1 it is run
    # for what it is, not skipped as that attempt's record.
    repeat = int(extra.get("role") == "over")
    spec = build_spec(entry, index, study.settings, repeat=repeat, kind="budget", batch_size=batch, extra=extra)
    return study.run(spec, progress)


def _predict(study: Study, specs: Sequence[RunSpec], entry: Entry, index: int, progress: Progress,
             budget_mib: float) -> dict | str:
    """A prediction (``batch`` and how it was made), or why there is none."""
    predict_peak_mib, largest_batch = planner_functions()
    plain = build_spec(entry, index, study.settings)
    profile = study.baseline(get_path(plain.resolved, "model.model_name")) if largest_batch else None
    if profile is not None:
        def at(budget: float) -> dict:
            batch = int(largest_batch(profile, plain.resolved, budget))
            cfg = {**plain.resolved, "data": {**plain.resolved["data"], "batch_size": batch}}
            return {"batch": batch, "predicted_peak_mib": predict_peak_mib(profile, cfg)["total"] if batch else None}

        return {"prediction": "planner", "from_run_id": profile.get("run_id"), "at": at, **at(budget_mib)}
    base = _measured(study, specs, entry.name)
    if base is None:
        return "no measured anatomy to predict from"
    b0 = get_path(base, "techniques.micro_batch_size")
    if get_path(base, "techniques.accumulate_grad_batches", 1) != 1:
        progress.add_runs(1)
        base = _run_at(study, entry, index, progress, b0, budget_mib=budget_mib, role="probe", attempt=0,
                       prediction="probe", from_run_id=base.get("run_id"))
        if base.get("status") != "ok" or not get_path(base, "memory.anatomy_mib") or not record_peak_mib(base):
            return "the probe run measured no anatomy"
    m0 = record_peak_mib(base)
    return {"prediction": "anatomy", "from_run_id": base.get("run_id"), "from_batch": b0, "from_peak_mib": m0,
            **predict_largest_batch(base["memory"]["anatomy_mib"], m0, b0, budget_mib)}


def budget_phase(study: Study, specs: Sequence[RunSpec], entries: Sequence[Entry], progress: Progress,
                 budget_mib: float, attempts: int = 2) -> None:
    """Predict and confirm the largest micro-batch under ``budget_mib`` for each of the plan's budget runs."""
    by_name = {e.name: (i, e) for i, e in enumerate(study.plan.entries) if e in entries}
    for name in [n for n in study.plan.budget_runs if n in by_name]:
        index, entry = by_name[name]
        progress.add_runs(2)
        pred = _predict(study, specs, entry, index, progress, budget_mib)
        if isinstance(pred, str) or pred["batch"] < 1:
            why = pred if isinstance(pred, str) else "the fixed part alone exceeds it"
            progress.skipped(f"{name} (budget)", why)
            progress.add_runs(-2)
            continue
        fits = False
        for attempt in range(1, attempts + 1):
            extra = {k: v for k, v in pred.items() if k not in ("batch", "at")}
            record = _run_at(study, entry, index, progress, pred["batch"], budget_mib=budget_mib, role="confirm",
                             attempt=attempt, predicted_batch=pred["batch"], **extra)
            peak = record_peak_mib(record)
            fits = record.get("status") == "ok" and peak is not None and peak <= budget_mib
            if fits or attempt == attempts or peak is None:
                break
            b1 = pred["batch"]
            if "at" in pred:  # the planner missed by a measured amount: predict again for a budget less that much
                miss = peak - pred["predicted_peak_mib"]
                pred = {**pred, **pred["at"](budget_mib - miss), "prediction": "planner, corrected by the miss"}
                pred["batch"] = min(pred["batch"], b1 - 1)
                if pred["batch"] < 1:
                    break
                progress.add_runs(1)
                continue
            if "from_peak_mib" not in pred:
                break
            line = predict_from_two_points(pred["from_batch"], pred["from_peak_mib"], b1, peak, budget_mib)
            pred = {**pred, **line, "prediction": "two-point", "batch": min(line["batch"], b1 - 1)}
            if pred["batch"] < 1:
                break
            progress.add_runs(1)
        if not fits:
            progress.skipped(f"{name} (budget, over)", "no batch was confirmed under the budget")
            progress.add_runs(-1)
            continue
        batch = pred["batch"]
        over = batch + max(1, math.ceil(batch * OVER_FRACTION))
        peak = record_peak_mib(_run_at(study, entry, index, progress, over, budget_mib=budget_mib, role="over",
                                       confirmed_batch=batch))
        verdict = "the largest" if peak is not None and peak > budget_mib else (
            f"not the largest (batch + {fmt.pct(OVER_FRACTION)} fits)")
        progress.say(f"{name}: batch {batch} fits {fmt.sig(budget_mib)} MiB, batch {over} peaks at "
                     f"{fmt.sig(peak)} MiB: {verdict}")
