"""The study's report: records → ``table.md``, ``summary.json``, PNG plots and the README's results section.

To run: ``uv run python -m modelwright report results/<hardware-slug>`` (the study runs it at its end).

Everything is derived from ``records.jsonl`` (and ``study.json`` for the study's own wall time), so the
same records always give the same ``table.md``. Which records count:

* only records the study wrote (they carry a ``study`` section);
* per plan entry, the records of its most recent resolved config (``study.config_hash``): rerunning a
  changed plan replaces a row instead of mixing old and new measurements;
* ``ok`` records make the row (the median over repeats); an entry with none shows its last failure.

Ratios are to the reference of the same model: the run named ``baseline`` (or ending in
``-baseline``), else the model's first run in plan order.

The README section between ``<!-- results:start -->`` and ``<!-- results:end -->`` is rebuilt from
every ``<results root>/<slug>/records.jsonl`` (one subsection per hardware); a README without the
markers gets a ``## Results`` section appended.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelwright.errors import ConfigError, require
from modelwright.record import get_path as _get
from modelwright.record import read_records

START_MARKER = "<!-- results:start -->"
END_MARKER = "<!-- results:end -->"
#: Samples in the "time per epoch" column: CIFAR-10's training set, the data these models are shaped for.
EPOCH_SAMPLES = 50_000
PLOTS = {
    "memory_anatomy.png": "Peak tensor memory per run, by what holds it",
    "step_time.png": "Step time per run (median; bars span the fastest and slowest measured step)",
    "memory_vs_time.png": "Peak memory against step time: the trade-off at a glance",
    "loss_curves.png": "Training loss of the same runs",
    "largest_batch.png": "Largest micro-batch under the memory budget",
}
#: Anatomy columns of the table and plot; buffers go with "other" (a few KiB for these models).
ANATOMY_COLUMNS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")


# --------------------------------------------------------------------------------------------------
# Selecting and aggregating records
# --------------------------------------------------------------------------------------------------




def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _median(values: Sequence[Any]) -> float | None:
    nums = [v for v in (_num(x) for x in values) if v is not None]
    return statistics.median(nums) if nums else None


def peak_mib(record: Mapping) -> float | None:
    """The run's measured peak: CUDA allocator peak where there is one, else the anatomy total."""
    peak = _num(_get(record, "memory.peak_allocated_mib"))
    return peak if peak is not None else _num(_get(record, "memory.anatomy_mib.total"))


def anatomy_columns(anatomy: Mapping | None) -> dict[str, float | None]:
    if not isinstance(anatomy, Mapping):
        return dict.fromkeys(ANATOMY_COLUMNS)
    out = {k: _num(anatomy.get(k)) for k in ANATOMY_COLUMNS}
    buffers = _num(anatomy.get("buffers")) or 0.0
    out["other"] = (out["other"] or 0.0) + buffers
    return out


@dataclass
class Row:
    """One plan entry's result: the median over its ``ok`` repeats, or its last failure."""

    name: str
    index: int
    records: list[dict]  # the ok records (or the single last failure)
    status: str
    error: str | None = None
    reference: str | None = None
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def model(self) -> str | None:
        return _get(self.records[0], "techniques.model_name")


def _latest_groups(records: Sequence[dict], kind: str) -> dict[str, list[dict]]:
    """Per entry name, the records of its last-seen config hash (file order)."""
    latest_hash: dict[str, str] = {}
    for r in records:
        s = r["study"]
        if s.get("kind", "run") == kind:
            latest_hash[s["name"]] = s.get("config_hash")
    groups: dict[str, list[dict]] = {}
    for r in records:
        s = r["study"]
        if s.get("kind", "run") == kind and s.get("config_hash") == latest_hash.get(s["name"]):
            groups.setdefault(s["name"], []).append(r)
    return groups


def study_records(records: Sequence[dict]) -> list[dict]:
    return [r for r in records if isinstance(r.get("study"), Mapping) and isinstance(r["study"].get("name"), str)]


def _aggregate(ok: list[dict]) -> dict[str, Any]:
    t = [r.get("timing") or {} for r in ok]
    values: dict[str, Any] = {
        "peak_mib": _median([peak_mib(r) for r in ok]),
        "anatomy_mib": {
            k: _median([anatomy_columns(_get(r, "memory.anatomy_mib"))[k] for r in ok]) for k in ANATOMY_COLUMNS
        },
        "anatomy_total_mib": _median([_get(r, "memory.anatomy_mib.total") for r in ok]),
        "peak_reserved_mib": _median([_get(r, "memory.peak_reserved_mib") for r in ok]),
        "step_time_median_ms": _median([x.get("step_time_median_ms") for x in t]),
        "step_time_p90_ms": _median([x.get("step_time_p90_ms") for x in t]),
        "step_time_min_ms": min(
            (v for v in (_num(x.get("step_time_min_ms")) for x in t) if v is not None), default=None
        ),
        "step_time_max_ms": max(
            (v for v in (_num(x.get("step_time_max_ms")) for x in t) if v is not None), default=None
        ),
        "measured_steps": sum(int(x.get("measured_steps") or 0) for x in t),
        "samples_per_s": _median([x.get("samples_per_s") for x in t]),
        "mfu": _median([_get(r, "flops.mfu") for r in ok]),
        "val_acc": _median([_get(r, "metrics.val/acc") for r in ok]),
        "train_loss": _median([_get(r, "metrics.train/loss") for r in ok]),
        "repeats": len(ok),
    }
    sps = values["samples_per_s"]
    values["epoch_s"] = EPOCH_SAMPLES / sps if sps else None
    return values


def _is_reference_name(name: str) -> bool:
    return name == "baseline" or name.endswith("-baseline") or name.endswith("_baseline")


def build_rows(records: Sequence[dict]) -> list[Row]:
    """The table's rows in plan order, with each run's reference (for the ratios) set."""
    groups = _latest_groups(study_records(records), "run")
    rows: list[Row] = []
    for name, group in groups.items():
        ok = [r for r in group if r.get("status") == "ok"]
        index = int(group[-1]["study"].get("index", 0))
        if ok:
            rows.append(Row(name, index, ok, "ok", values=_aggregate(ok)))
        else:
            last = group[-1]
            rows.append(Row(name, index, [last], str(last.get("status")), error=last.get("error")))
    rows.sort(key=lambda r: (r.index, r.name))
    by_model: dict[Any, str] = {}
    for row in rows:
        if row.ok and _is_reference_name(row.name):
            by_model.setdefault(row.model, row.name)
    for row in rows:
        if row.ok:
            by_model.setdefault(row.model, row.name)
    for row in rows:
        row.reference = by_model.get(row.model)
    return rows


def _ratio(value: float | None, ref: float | None) -> float | None:
    return value / ref if value is not None and ref else None


@dataclass
class BudgetRow:
    name: str
    index: int
    budget_mib: float
    from_batch: int | None
    from_peak_mib: float | None
    per_sample_mib: float | None
    fixed_mib: float | None
    predicted_batch: int | None
    predicted_peak_mib: float | None
    measured_peak_mib: float | None
    status: str
    attempts: int
    effective_batch: int | None = None
    fits: bool = False
    vs_reference: float | None = None
    process_wall_s: float = 0.0
    probe: bool = False


def build_budget_rows(records: Sequence[dict], rows: Sequence[Row]) -> list[BudgetRow]:
    """Per budget run, the last confirmation attempt (the batch the study settled on)."""
    attempts: dict[str, list[dict]] = {}
    for r in study_records(records):
        if r["study"].get("kind") == "budget":
            attempts.setdefault(r["study"]["name"], []).append(r)
    out: list[BudgetRow] = []
    for name, recs in attempts.items():
        # The latest series: attempt numbers restart at 1 when the study predicts afresh, after the probe
        # run (attempt 0) that measured an accumulating run's micro-batch on its own.
        firsts = [i for i, r in enumerate(recs) if r["study"].get("attempt", 1) == 1]
        if not firsts:
            continue
        start = firsts[-1]
        probe = start > 0 and recs[start - 1]["study"].get("attempt") == 0
        series = recs[start - 1 if probe else start :]
        last = series[-1]
        s = last["study"]
        measured = peak_mib(last) if last.get("status") == "ok" else None
        budget = float(s.get("budget_mib") or 0.0)
        accumulate = next((_get(r.records[0], "techniques.accumulate_grad_batches") for r in rows if r.name == name), 1)
        batch = s.get("predicted_batch")
        out.append(
            BudgetRow(
                name=name,
                index=int(s.get("index", 0)),
                budget_mib=budget,
                from_batch=s.get("from_batch"),
                from_peak_mib=_num(s.get("from_peak_mib")),
                per_sample_mib=_num(s.get("per_sample_mib")),
                fixed_mib=_num(s.get("fixed_mib")),
                predicted_batch=batch,
                predicted_peak_mib=_num(s.get("predicted_peak_mib")),
                measured_peak_mib=measured,
                status=str(last.get("status")),
                attempts=len(series) - int(probe),
                probe=probe,
                effective_batch=batch * accumulate if isinstance(batch, int) and isinstance(accumulate, int) else None,
                fits=measured is not None and measured <= budget,
                process_wall_s=sum(_num(_get(r, "study.process_wall_s")) or 0.0 for r in series),
            )
        )
    out.sort(key=lambda b: (b.index, b.name))
    reference_of = {r.name: r.reference for r in rows}
    confirmed = {b.name: b.predicted_batch for b in out if b.fits}
    for b in out:
        ref_batch = confirmed.get(reference_of.get(b.name) or "")
        if b.fits and ref_batch:
            b.vs_reference = b.predicted_batch / ref_batch
    return out


# --------------------------------------------------------------------------------------------------
# Formatting (deterministic: fixed formats, rows in plan order)
# --------------------------------------------------------------------------------------------------


def _f(value: float | None, fmt: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{suffix}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> str:
    marks = {"l": ":--", "r": "--:", "c": ":-:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def cpu_malloc(record: Mapping) -> str | None:
    """The run's ``cpu_malloc`` (a process setting, in the resolved config); None for records made before it existed."""
    config = record.get("config")
    value = config.get("cpu_malloc") if isinstance(config, Mapping) else None
    return value if isinstance(value, str) else None


def setup_text(record: Mapping) -> str:
    """The run's techniques in a few words: ``bf16-mixed, 32×4, ckpt block, AdamW foreach``."""
    t = record.get("techniques") or {}
    precision = t.get("precision") or t.get("precision_requested") or "?"
    micro, accumulate = t.get("micro_batch_size"), t.get("accumulate_grad_batches") or 1
    parts = [str(precision), f"{micro}×{accumulate}" if accumulate != 1 else str(micro)]
    world = t.get("world_size") or 1
    if world != 1:
        parts.append(f"{t.get('strategy')} ×{world}")
    if t.get("gradient_checkpointing") not in (None, "off"):
        parts.append(f"ckpt {t['gradient_checkpointing']}")
    if t.get("channels_last"):
        parts.append("channels_last")
    if t.get("compile"):
        parts.append("compile")
    if cpu_malloc(record) == "system":
        parts.append("system malloc")
    impl = t.get("optimizer_impl")
    if isinstance(impl, str) and "[" in impl:
        cls = impl.rsplit(".", 1)[-1].split("[")[0]
        parts.append(f"{cls} {impl.split('[', 1)[1].rstrip(']')}")
    elif t.get("optimizer"):
        parts.append(str(t["optimizer"]))
    return ", ".join(parts)


def main_table(rows: Sequence[Row]) -> str:
    ok = {r.name: r for r in rows if r.ok}
    body = []
    for row in rows:
        if not row.ok:
            continue
        v = row.values
        ref = ok.get(row.reference or "")
        rv = ref.values if ref else {}
        spread = (
            f"{v['step_time_min_ms']:.0f}–{v['step_time_max_ms']:.0f}"
            if v["step_time_min_ms"] is not None and v["step_time_max_ms"] is not None
            else "–"
        )
        body.append(
            [
                row.name,
                setup_text(row.records[0]),
                _f(v["peak_mib"], ".1f"),
                _f(_ratio(v["peak_mib"], rv.get("peak_mib")), ".2f", "×"),
                _f(v["step_time_median_ms"], ".0f"),
                spread,
                _f(_ratio(v["step_time_median_ms"], rv.get("step_time_median_ms")), ".2f", "×"),
                _f(v["samples_per_s"], ".1f"),
                _f(v["epoch_s"], ".0f"),
                _f(None if v["mfu"] is None else 100 * v["mfu"], ".1f", "%"),
                _f(v["val_acc"], ".3f"),
            ]
        )
    header = [
        "run",
        "setup",
        "peak MiB",
        "memory vs base",
        "step ms (median)",
        "step ms (min–max)",
        "time vs base",
        "samples/s",
        f"epoch s ({EPOCH_SAMPLES // 1000}k)",
        "MFU",
        "val/acc",
    ]
    return _table(header, body, "llrrrrrrrrr")


def anatomy_table(rows: Sequence[Row]) -> str:
    body = []
    for row in rows:
        if not row.ok:
            continue
        a = row.values["anatomy_mib"]
        body.append(
            [
                row.name,
                *(_f(a[k], ".1f") for k in ANATOMY_COLUMNS),
                _f(row.values["anatomy_total_mib"], ".1f"),
                _f(row.values["peak_mib"], ".1f"),
            ]
        )
    header = [
        "run",
        "parameters",
        "gradients",
        "optimizer state",
        "activations",
        "temporaries",
        "other",
        "anatomy total",
        "measured peak",
    ]
    return _table(header, body, "lrrrrrrrr")


def budget_table(budget: Sequence[BudgetRow]) -> str:
    body = []
    for b in budget:
        verdict = "yes" if b.fits else ("no" if b.measured_peak_mib is not None else b.status)
        body.append(
            [
                b.name,
                ("–" if b.from_batch is None else f"{b.from_batch}") + (" (probe)" if b.probe else ""),
                _f(b.from_peak_mib, ".1f"),
                _f(b.per_sample_mib, ".3f"),
                _f(b.fixed_mib, ".1f"),
                f"{b.predicted_batch}" if b.predicted_batch is not None else "–",
                _f(b.predicted_peak_mib, ".1f"),
                _f(b.measured_peak_mib, ".1f"),
                verdict,
                f"{b.attempts}",
                _f(b.vs_reference, ".2f", "×"),
            ]
        )
    header = [
        "run",
        "measured at batch",
        "peak there MiB",
        "MiB per sample",
        "fixed MiB",
        "largest batch",
        "predicted peak MiB",
        "confirmed peak MiB",
        "under budget",
        "confirming runs",
        "batch vs base",
    ]
    return _table(header, body, "lrrrrrrrcrr")


def failed_table(rows: Sequence[Row]) -> str:
    body = [[r.name, r.status, (r.error or "").replace("|", "\\|")] for r in rows if not r.ok]
    return _table(["run", "status", "error"], body, "lll")


def conditions(records: Sequence[dict]) -> dict[str, Any]:
    """Hardware, versions and measurement window, from the study's latest record."""
    recs = study_records(records)
    ok = [r for r in recs if r.get("status") == "ok"] or recs
    last = ok[-1] if ok else {}
    hw = last.get("hardware") or {}
    ver = last.get("versions") or {}
    runs = [r for r in ok if r["study"].get("kind", "run") == "run"]
    s = runs[-1]["study"] if runs else (last.get("study") or {})
    effective = sorted({e for e in (_get(r, "techniques.effective_batch_size") for r in runs) if isinstance(e, int)})
    models = list(dict.fromkeys(m for m in (_get(r, "techniques.model_name") for r in runs) if m))
    repeats = max((int(r["study"].get("repeats") or 1) for r in runs), default=1)
    return {
        "hardware": hw,
        "versions": ver,
        "study": s,
        "effective_batch": effective,
        "models": models,
        "repeats": repeats,
    }


def _count(n: Any, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n if n is not None else '?'} {noun}s"


def conditions_text(c: Mapping[str, Any]) -> str:
    hw, ver, s = c["hardware"], c["versions"], c["study"]
    accel = hw.get("accelerator") or "?"
    if accel == "cpu":
        device = f"CPU: {hw.get('cpu_model')}, {hw.get('cpu_cores')} cores"
    else:
        device = f"{accel.upper()}: {hw.get('num_devices') or 1}× {hw.get('device_name')}"
    mem = _num(hw.get("device_memory_mib"))
    if mem is not None:
        device += f", {mem / 1024:.0f} GiB {'RAM' if accel == 'cpu' else 'memory'}"
    versions = ", ".join(f"{k} {ver[k]}" for k in ("torch", "lightning", "python") if ver.get(k)) + (
        f", CUDA {ver['cuda']}" if accel == "cuda" and ver.get("cuda") else ""
    )
    window = (
        f"{_count(s.get('warmup_steps'), 'warm-up step')}, 1 anatomy step, "
        f"{_count(s.get('measured_steps'), 'measured step')} per run, {_count(c['repeats'], 'repeat')}"
        + (" (the median is shown)" if c["repeats"] > 1 else "")
    )
    eff = ", ".join(str(e) for e in c["effective_batch"]) or "?"
    models = ", ".join(c["models"]) or "?"
    return (
        f"- Hardware: {device}\n- Versions: {versions}\n- Models: {models}; effective batch {eff} samples per "
        f"optimizer step\n- Window: {window}; plan `{s.get('plan', '?')}`"
    )


NOTES = (
    "Peak MiB is the measured peak of tensor memory: the CUDA allocator's peak on a GPU; on a CPU, the "
    "peak of PyTorch's memory tracker over the anatomy step (process RSS is no tensor measure there). "
    "Ratios are to the model's baseline run. Step time covers one optimizer step (all its micro-batches), "
    "synchronized, warm-up and anatomy steps left out. "
    f"Epoch time is {EPOCH_SAMPLES:,} samples ÷ samples/s. MFU is model FLOPs per step ÷ (step time × the "
    "device's peak FLOP/s for the compute dtype). val/acc after a few steps only shows that every run learns "
    "alike; it is not a quality figure."
)

BUDGET_NOTES = (
    "The largest batch is predicted from the measured anatomy (activations and backward temporaries per "
    "sample × batch, plus the fixed parameters, gradients and optimizer state), then confirmed by one run at "
    "that micro-batch without accumulation (accumulation multiplies the effective batch, not what one micro-batch "
    "holds). A run that accumulates is first measured at its micro-batch without accumulation (probe), so that "
    "prediction and confirmation share one setup. A run that lands over the budget is followed by a second "
    "prediction through the two measured points."
)


def render_table_md(records: Sequence[dict], slug: str) -> str:
    """The whole ``table.md`` text for one results folder."""
    rows = build_rows(records)
    budget = build_budget_rows(records, rows)
    c = conditions(records)
    parts = [
        f"# Efficiency study: {slug}",
        "",
        conditions_text(c),
        "",
        "## Memory and speed",
        "",
        main_table(rows),
        "",
        NOTES,
        "",
        "## Memory anatomy (MiB)",
        "",
        anatomy_table(rows),
        "",
    ]
    if budget:
        gib = budget[0].budget_mib / 1024
        parts += [f"## Largest batch under a {gib:g} GiB budget", "", budget_table(budget), "", BUDGET_NOTES, ""]
    if any(not r.ok for r in rows):
        parts += ["## Runs that did not finish", "", failed_table(rows), ""]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------------
# Summary and plots
# --------------------------------------------------------------------------------------------------


def summary(records: Sequence[dict], slug: str, study_info: Mapping | None) -> dict[str, Any]:
    """A machine-readable digest of the table (for docs generators)."""
    rows = build_rows(records)
    budget = build_budget_rows(records, rows)
    ok = {r.name: r for r in rows if r.ok}
    out_rows = []
    for r in rows:
        item: dict[str, Any] = {"name": r.name, "status": r.status, "reference": r.reference, "model": r.model}
        if r.ok:
            ref = ok.get(r.reference or "")
            item["setup"] = setup_text(r.records[0])
            item["techniques"] = r.records[0].get("techniques")
            item.update(r.values)
            item["memory_vs_reference"] = _ratio(r.values["peak_mib"], ref.values["peak_mib"] if ref else None)
            item["time_vs_reference"] = _ratio(
                r.values["step_time_median_ms"], ref.values["step_time_median_ms"] if ref else None
            )
            item["run_ids"] = [x.get("run_id") for x in r.records]
        else:
            item["error"] = r.error
        out_rows.append(item)
    c = conditions(records)
    return {
        "slug": slug,
        "hardware": c["hardware"],
        "versions": c["versions"],
        "models": c["models"],
        "effective_batch": c["effective_batch"],
        "window": {
            **{k: c["study"].get(k) for k in ("plan", "warmup_steps", "measured_steps")},
            "repeats": c["repeats"],
        },
        "epoch_samples": EPOCH_SAMPLES,
        "runs": out_rows,
        "budget": [b.__dict__ for b in budget],
        "process_time_s": process_time_s(records),
        "study": dict(study_info) if study_info else None,
        "plots": [name for name in PLOTS if name != "largest_batch.png" or budget],
    }


def process_time_s(records: Sequence[dict]) -> float:
    """Sum of the run processes' wall times of the records the report uses."""
    rows = build_rows(records)
    total = sum(_num(_get(r, "study.process_wall_s")) or 0.0 for row in rows for r in row.records)
    return total + sum(b.process_wall_s for b in build_budget_rows(records, rows))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#55a868",
    "optimizer_state": "#8172b2",
    "activations": "#c44e52",
    "temporaries": "#dd8452",
    "other": "#937860",
}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    return path


def plot_all(records: Sequence[dict], out_dir: Path, title: str) -> list[Path]:
    """Write the PNG plots into ``out_dir``; returns their paths."""
    plt = _plt()
    rows = [r for r in build_rows(records) if r.ok]
    budget = build_budget_rows(records, build_rows(records))
    written: list[Path] = []
    if not rows:
        return written
    names = [r.name for r in rows]
    x = list(range(len(rows)))
    width = max(6.0, 0.8 * len(rows) + 2)

    fig, ax = plt.subplots(figsize=(width, 4.5))
    bottom = [0.0] * len(rows)
    for key in ANATOMY_COLUMNS:
        vals = [r.values["anatomy_mib"][key] or 0.0 for r in rows]
        ax.bar(x, vals, bottom=bottom, label=key.replace("_", " "), color=_COLORS[key])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, r in enumerate(rows):
        if r.values["peak_mib"] is not None:
            ax.text(i, bottom[i], f"{r.values['peak_mib']:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.set_ylabel("MiB at the step's peak")
    ax.set_title(f"Memory anatomy per run ({title})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    written.append(_save(fig, out_dir / "memory_anatomy.png"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(width, 4.0))
    med = [r.values["step_time_median_ms"] or 0.0 for r in rows]
    lo = [max(0.0, m - (r.values["step_time_min_ms"] or m)) for m, r in zip(med, rows, strict=True)]
    hi = [max(0.0, (r.values["step_time_max_ms"] or m) - m) for m, r in zip(med, rows, strict=True)]
    ax.bar(x, med, yerr=[lo, hi], capsize=4, color="#4c72b0")
    ref_time = {r.name: r.values["step_time_median_ms"] for r in rows}
    for i, r in enumerate(rows):
        ratio = _ratio(r.values["step_time_median_ms"], ref_time.get(r.reference or ""))
        if ratio is not None:
            ax.text(i, med[i] + hi[i], f"{ratio:.2f}×", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.set_ylabel("ms per optimizer step")
    ax.set_title(f"Step time per run, median and min–max ({title})")
    written.append(_save(fig, out_dir / "step_time.png"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 5.0))
    for r in rows:
        t, m = r.values["step_time_median_ms"], r.values["peak_mib"]
        if t is None or m is None:
            continue
        ref = r.name == r.reference
        ax.scatter([t], [m], s=60 if ref else 40, marker="*" if ref else "o", color="#c44e52" if ref else "#4c72b0")
        ax.annotate(r.name, (t, m), textcoords="offset points", xytext=(5, 4), fontsize=8)
    for r in rows:  # the baseline's cross-hairs: a point left of and below both lines wins on both counts
        if r.name == r.reference and r.values["step_time_median_ms"] and r.values["peak_mib"]:
            ax.axvline(r.values["step_time_median_ms"], color="#c44e52", linestyle=":", linewidth=1)
            ax.axhline(r.values["peak_mib"], color="#c44e52", linestyle=":", linewidth=1)
    times = [r.values["step_time_median_ms"] or 0.0 for r in rows]
    peaks = [r.values["peak_mib"] or 0.0 for r in rows]
    ax.set_xlim(0, max(times, default=1.0) * 1.18 or 1.0)  # from zero, so that distances read as ratios
    ax.set_ylim(0, max(peaks, default=1.0) * 1.12 or 1.0)
    ax.set_xlabel("step time, ms (median)")
    ax.set_ylabel("peak memory, MiB")
    ax.set_title(f"Memory vs time: lower left is better ({title})")
    ax.grid(alpha=0.3)
    written.append(_save(fig, out_dir / "memory_vs_time.png"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r in rows:
        points = (r.records[0].get("history") or {}).get("train/loss") or []
        pts = [(p[0], p[1]) for p in points if isinstance(p, list) and len(p) == 2 and _num(p[1]) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=r.name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train/loss")
    ax.set_title(f"Training loss ({title})")
    ax.legend(fontsize=7, ncols=2)
    ax.grid(alpha=0.3)
    written.append(_save(fig, out_dir / "loss_curves.png"))
    plt.close(fig)

    confirmed = [b for b in budget if b.predicted_batch]
    if confirmed:
        fig, ax = plt.subplots(figsize=(6.5, 0.5 * len(confirmed) + 1.8))
        y = list(range(len(confirmed)))
        colors = ["#55a868" if b.fits else "#c44e52" for b in confirmed]
        ax.barh(y, [b.predicted_batch for b in confirmed], color=colors)
        for i, b in enumerate(confirmed):
            peak = f"{b.measured_peak_mib:.0f} MiB" if b.measured_peak_mib is not None else b.status
            ax.text(b.predicted_batch, i, f" {b.predicted_batch} ({peak})", va="center", fontsize=8)
        ax.set_yticks(y, [b.name for b in confirmed])
        ax.invert_yaxis()
        ax.set_xlabel("largest micro-batch (green: confirmed under the budget)")
        ax.set_title(f"Largest batch under {confirmed[0].budget_mib / 1024:g} GiB ({title})")
        ax.margins(x=0.25)
        written.append(_save(fig, out_dir / "largest_batch.png"))
        plt.close(fig)
    return written


# --------------------------------------------------------------------------------------------------
# README section
# --------------------------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def _study_info(results_dir: Path) -> dict | None:
    path = results_dir / "study.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def readme_subsection(results_dir: Path, readme_dir: Path) -> str | None:
    """One hardware's part of the README section (``None`` if the folder holds no study records)."""
    path = results_dir / "records.jsonl"
    if not path.is_file():
        return None
    records = read_records(path)
    if not study_records(records):
        return None
    slug = results_dir.name
    rel = Path(os.path.relpath(results_dir, readme_dir)).as_posix()
    rows = build_rows(records)
    budget = build_budget_rows(records, rows)
    c = conditions(records)
    info = _study_info(results_dir) or {}
    runs = sum(len(r.records) for r in rows) + sum(b.attempts for b in budget)
    spent = _duration(process_time_s(records))
    timing = f"The runs behind these numbers took {spent} of process time in all ({runs} runs)"
    if info.get("wall_time_s") is not None and not info.get("runs_skipped"):
        timing += f"; the study that produced them took {_duration(float(info['wall_time_s']))} wall clock"
    timing += "."
    command = info.get("command") or "uv run python -m modelwright study"
    hw = c["hardware"]
    head = hw.get("device_name") if hw.get("accelerator") != "cpu" else f"{hw.get('cpu_cores')}-core CPU"
    parts = [
        f"### {head} (`{slug}`)",
        "",
        conditions_text(c),
        f"- Command: `{command}`. {timing}",
        "",
        main_table(rows),
        "",
    ]
    if budget:
        parts += [f"Largest batch under a {budget[0].budget_mib / 1024:g} GiB budget:", "", budget_table(budget), ""]
    for name, caption in PLOTS.items():
        if (results_dir / name).is_file():
            parts += [f"![{caption}]({rel}/{name})", ""]
    parts += [
        f"Anatomy per run, notes and failed runs: [{rel}/table.md]({rel}/table.md); "
        f"raw records: [{rel}/records.jsonl]({rel}/records.jsonl).",
        "",
    ]
    return "\n".join(parts)


def readme_section(results_root: Path, readme_dir: Path) -> str:
    """The text between the markers: one subsection per ``<results_root>/<slug>/``."""
    subsections = [
        text
        for d in sorted(p for p in results_root.iterdir() if p.is_dir())
        if (text := readme_subsection(d, readme_dir)) is not None
    ]
    intro = (
        "_Written by `uv run python -m modelwright report results/<hardware>` from the study's records; "
        "do not edit by hand. " + NOTES + "_"
    )
    return "\n".join([intro, "", *subsections]).rstrip() + "\n"


def update_readme(readme: Path, section: str) -> None:
    """Replace the text between the markers (or append a ``## Results`` section holding them)."""
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    block = f"{START_MARKER}\n{section}{END_MARKER}"
    start, end = text.find(START_MARKER), text.find(END_MARKER)
    if start != -1 and end != -1:
        require(start < end, f"{readme.name}: {END_MARKER} comes before {START_MARKER}")
        text = text[:start] + block + text[end + len(END_MARKER) :]
    else:
        require(start == -1 and end == -1, f"{readme.name}: only one of the results markers is present")
        text = text.rstrip("\n") + ("\n\n" if text.strip() else "") + "## Results\n\n" + block + "\n"
    tmp = readme.with_name(f".{readme.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, readme)


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------


def generate(results_dir: str | os.PathLike, readme: str | os.PathLike | None = None, plots: bool = True) -> list[Path]:
    """Write ``table.md``, ``summary.json`` and the plots into ``results_dir``; update ``readme`` if given.

    Returns:
        The paths written.
    """
    results_dir = Path(results_dir)
    path = results_dir / "records.jsonl"
    require(path.is_file(), f"{results_dir}: no records.jsonl (run `python -m modelwright study` first)")
    records = read_records(path)
    require(bool(study_records(records)), f"{path}: no study records (records with a 'study' section)")
    slug = results_dir.name
    written: list[Path] = []
    table = results_dir / "table.md"
    table.write_text(render_table_md(records, slug), encoding="utf-8")
    written.append(table)
    if plots:
        written += plot_all(records, results_dir, slug)
    digest = summary(records, slug, _study_info(results_dir))
    out = results_dir / "summary.json"
    out.write_text(json.dumps(digest, indent=2, sort_keys=False, allow_nan=False) + "\n", encoding="utf-8")
    written.append(out)
    if readme is not None:
        readme = Path(readme)
        update_readme(readme, readme_section(results_dir.parent, readme.parent))
        written.append(readme)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m modelwright report",
        description="Write table.md, summary.json and plots for a results folder; regenerate the README section.",
    )
    parser.add_argument("results_dir", help="results/<hardware-slug> holding records.jsonl")
    parser.add_argument("--readme", default="README.md", help="README to update between the results markers")
    parser.add_argument("--no-readme", action="store_true", help="leave the README alone")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    args = parser.parse_args(argv)
    try:
        written = generate(args.results_dir, readme=None if args.no_readme else args.readme, plots=not args.no_plots)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
