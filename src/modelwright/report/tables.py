"""Rows from study records, and the markdown tables built from them. Per plan entry only the records of its latest
resolved config (``study.config_hash``) count, so a changed plan replaces a row instead of mixing old and new
measurements; their ``ok`` ones make the row (medians over repeats), an entry with none shows its last failure.
Ratios are to the model's run named ``baseline`` (or ``*-baseline``), else its first run.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from modelwright.record import get_path
from modelwright.report.fmt import DASH, finite, pct, ratio, sig, table

ANATOMY = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
#: Training-loss points averaged for the quality column (compared only at equal samples seen).
LOSS_STEPS = 3
#: airbench's "standard ResNet-18" baseline on one A100 (Keller Jordan, airbench README, 2024): 32.3 PFLOP in
#: 7 min. The scale-out table's GPU step is a record's FLOPs at that rate: an estimate, never a measurement.
PUBLISHED_A100_FLOPS_PER_S = 32.3e15 / (7 * 60)


def median(values: Sequence[Any]) -> float | None:
    return statistics.median(nums) if (nums := [v for v in map(finite, values) if v is not None]) else None


def div(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None where either is missing or ``b`` is zero (a figure that cannot be computed prints a dash)."""
    return a / b if a is not None and b else None


def provenance_group(record: Mapping) -> str:
    """Records of one commit and one definitions version share a group (and a mark where a table mixes groups)."""
    p = record.get("provenance") or {}
    return f"commit {str(p.get('commit'))[:10]}, definitions {p.get('definitions')}"


def peak_mib(record: Mapping) -> float | None:
    """The measured peak; None where the memory tracker saw eager code only (a compiled run on a CPU)."""
    if get_path(record, "techniques.compile") and get_path(record, "hardware.accelerator") == "cpu":
        return None  # MemTracker is a TorchDispatchMode: under it Dynamo falls back to eager
    return finite(get_path(record, "memory.peak_allocated_mib"))


def last_loss(record: Mapping) -> tuple[float | None, int | None]:
    """Mean training loss of the last :data:`LOSS_STEPS` logged steps, and the samples seen by the last one."""
    points = [p for p in (get_path(record, "history.train/loss") or []) if finite(p[1]) is not None]
    if len(points) < LOSS_STEPS:
        return None, None
    batch = get_path(record, "techniques.effective_batch_size")
    samples = points[-1][0] * batch if isinstance(batch, int) else None
    return statistics.fmean(p[1] for p in points[-LOSS_STEPS:]), samples


@dataclass
class Row:
    """One plan entry: the medians over its ``ok`` repeats, or its last failure."""

    name: str
    records: list[dict]
    status: str
    error: str | None = None
    reference: Row | None = None
    v: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def model(self) -> Any:
        return get_path(self.records[0], "techniques.model_name")

    def vs(self, key: str) -> float | None:
        return div(self.v.get(key), self.reference.v.get(key) if self.reference else None)

    @property
    def band(self) -> float | None:
        """Relative spread (max − min) / median of the repeats' median steps; None with fewer than 2 repeats."""
        lo, hi, mid = self.v.get("step_lo"), self.v.get("step_hi"), self.v.get("step_ms")
        return (hi - lo) / mid if self.v.get("repeats", 0) >= 2 and mid else None

    @property
    def verdict(self) -> str:
        return verdict(self.vs("step_ms"), self.reference.band if self.reference else None)


def verdict(time_ratio: float | None, band: float | None) -> str:
    """``faster``/``slower`` only outside the reference's repeat spread, else ``no measurable change``."""
    if time_ratio is None:
        return DASH
    if band is None:
        return "no verdict (1 repeat)"
    if abs(time_ratio - 1) <= band:
        return "no measurable change"
    return "faster" if time_ratio < 1 else "slower"


def _values(ok: list[dict]) -> dict[str, Any]:
    def med(path: str) -> float | None:
        return median([get_path(r, path) for r in ok])

    steps = [s for s in (finite(get_path(r, "timing.step_time_median_ms")) for r in ok) if s is not None]
    losses = [last_loss(r) for r in ok]
    # Categories a newer instrument adds (communication buffers, say) get columns of their own.
    keys = list(dict.fromkeys([*ANATOMY, *(k for r in ok for k in get_path(r, "memory.anatomy_mib") or {})]))
    anatomy = {k: med(f"memory.anatomy_mib.{k}") for k in keys if k not in ("buffers", "total")}
    anatomy["other"] = (anatomy["other"] or 0.0) + (med("memory.anatomy_mib.buffers") or 0.0)
    return {"peak_mib": median([peak_mib(r) for r in ok]), "anatomy": anatomy,
            "end_activations": max(finite(get_path(r, "memory.anatomy_end_mib.activations")) or 0 for r in ok),
            "step_ms": median(steps), "step_lo": min(steps, default=None), "step_hi": max(steps, default=None),
            "repeats": len(steps), "samples_per_s": med("timing.samples_per_s"), "mfu": med("flops.mfu"),
            "loss": median([x[0] for x in losses]), "loss_samples": losses[0][1]}


def _by_name(records: Sequence[dict], kind: str) -> dict[str, list[dict]]:
    """The records a study wrote of ``kind`` (``run`` or ``budget``) per plan entry, in the order they were written."""
    out: dict[str, list[dict]] = {}
    for r in records:
        if isinstance(s := r.get("study"), Mapping) and isinstance(s.get("name"), str) and s.get("kind") == kind:
            out.setdefault(s["name"], []).append(r)
    return out


def build_rows(records: Sequence[dict]) -> list[Row]:
    """The table's rows in plan order, each with its reference row set."""
    rows, plans = [], {}
    for name, group in _by_name(records, "run").items():
        last = group[-1]
        plans.setdefault(last["study"].get("plan"), len(plans))  # plans in the order they were first run
        ok = [r for r in group if r["study"].get("config_hash") == last["study"].get("config_hash")
              and r.get("status") == "ok"]
        rows.append(Row(name, ok, "ok", v=_values(ok)) if ok
                    else Row(name, [last], str(last.get("status")), error=last.get("error")))
    rows.sort(key=lambda r: (plans[r.records[-1]["study"].get("plan")], r.records[-1]["study"].get("index", 0), r.name))
    ranked = sorted((r for r in rows if r.ok), key=lambda r: not re.fullmatch(r"(.*[-_])?baseline", r.name))
    refs = {row.model: row for row in reversed(ranked)}  # the first per model wins: its baseline, else its first run
    for row in rows:
        row.reference = refs.get(row.model)
    return rows


def setup_text(record: Mapping) -> str:
    """The run's techniques in a few words: ``bf16-mixed, 32×4, ckpt block, AdamW foreach``."""
    t = record.get("techniques") or {}
    micro, acc, impl = t.get("micro_batch_size"), t.get("accumulate_grad_batches") or 1, t.get("optimizer_impl")
    parts = [str(t.get("precision") or "?"), f"{micro}×{acc}" if acc != 1 else str(micro)]
    parts += [f"{t.get('strategy')} ×{t['world_size']}"] if (t.get("world_size") or 1) != 1 else []
    parts += [f"ckpt {t['gradient_checkpointing']}"] if t.get("gradient_checkpointing") not in (None, "off") else []
    parts += [k for k in ("channels_last", "compile") if t.get(k)]
    parts += ["system malloc"] if get_path(record, "config.cpu_malloc") == "system" else []
    if isinstance(impl, str) and "[" in impl:
        parts.append(f"{impl.rsplit('.', 1)[-1].split('[')[0]} {impl.split('[', 1)[1].rstrip(']')}")
    return ", ".join(parts)


def main_table(rows: Sequence[Row], marks: Mapping[str, str] | None = None) -> str:
    body = []
    for r in (r for r in rows if r.ok):
        ref_samples = r.reference.v["loss_samples"] if r.reference else None
        loss = r.v["loss"] if r.v["loss_samples"] is not None and r.v["loss_samples"] == ref_samples else None
        peak = "not measured" if r.v["peak_mib"] is None else sig(r.v["peak_mib"])  # an ok run without: compiled
        letters = sorted({(marks or {}).get(provenance_group(x)) for x in r.records} - {None})
        spread = (f"{sig(r.v['step_lo'])}–{sig(r.v['step_hi'])} ({r.v['repeats']})" if r.band is not None
                  else f"{DASH} (1 repeat)")
        body.append([r.name + (f" [{','.join(letters)}]" if letters else ""), setup_text(r.records[0]), peak,
                     ratio(r.vs("peak_mib")), sig(r.v["step_ms"]), spread, ratio(r.vs("step_ms")), r.verdict,
                     sig(r.v["samples_per_s"]), pct(r.v["mfu"]), sig(loss)])
    header = ["run", "setup", "peak MiB", "memory vs base", "step ms (median of repeats)",
              "repeat medians min–max (n)", "time vs base", "verdict", "samples/s", "MFU",
              f"train loss, last {LOSS_STEPS} steps"]
    return table(header, body, "llrrrrrlrrr")


def anatomy_table(rows: Sequence[Row]) -> str:
    ok = [r for r in rows if r.ok]
    keys = list(dict.fromkeys(k for r in ok for k in r.v["anatomy"]))
    body = [[r.name, *(sig(r.v["anatomy"].get(k)) for k in keys), sig(r.v["peak_mib"]),
             sig(r.v["end_activations"]) + (" (artifact)" if r.v["end_activations"] > 1 else "")] for r in ok]
    return table(["run", *(k.replace("_", " ") for k in keys), "peak", "activations left after the step"], body)


@dataclass
class BudgetRow:
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


def build_budget_rows(records: Sequence[dict], rows: Sequence[Row]) -> list[BudgetRow]:
    """Per budget run, its latest series of attempts (from attempt 1) and where it ended, in plan order."""
    out = []
    for name, recs in _by_name(records, "budget").items():
        over = [r for r in recs if r["study"].get("role") == "over"]
        confirm = [r for r in recs if r["study"].get("role") != "over"]
        starts = [i for i, r in enumerate(confirm) if r["study"].get("attempt") == 1]
        if not starts:
            continue
        series = confirm[starts[-1]:]
        s, last = series[-1]["study"], series[-1]
        b = BudgetRow(name, float(s["budget_mib"]), s.get("predicted_batch"), finite(s.get("predicted_peak_mib")),
                      peak_mib(last) if last.get("status") == "ok" else None, str(last.get("status")), len(series),
                      sum(finite(get_path(r, "study.process_wall_s")) or 0 for r in series), series)
        if over and over[-1]["study"].get("confirmed_batch") == b.batch:
            b.over_batch = get_path(over[-1], "techniques.micro_batch_size")
            b.over_mib = peak_mib(over[-1]) if over[-1].get("status") == "ok" else None
        out.append(b)
    out.sort(key=lambda b: b.records[-1]["study"].get("index", 0))
    refs = {r.name: r.reference.name for r in rows if r.reference}
    fitted = {b.name: b.batch for b in out if b.fits}
    for b in out:
        b.vs_reference = div(b.batch, fitted.get(refs.get(b.name))) if b.fits else None
    return out


def budget_table(budget: Sequence[BudgetRow]) -> str:
    def over(b: BudgetRow) -> str:
        exceeds = "yes" if b.over_mib is not None and b.over_mib > b.budget_mib else "no"
        return "not run" if b.over_batch is None else f"{exceeds}: batch {b.over_batch}, {sig(b.over_mib)} MiB"

    body = [[b.name, DASH if b.batch is None else b.batch, sig(b.predicted_mib), sig(b.measured_mib),
             "yes" if b.fits else ("no" if b.measured_mib is not None else b.status), b.attempts,
             ratio(b.vs_reference), over(b)] for b in budget]
    header = ["run", "largest batch", "predicted peak MiB", "confirmed peak MiB", "under budget", "confirming runs",
              "batch vs base", "a few % more exceeds it"]
    return table(header, body, "lrrrcrrl")


def prediction_table(studies: Sequence[Any], tolerance: float = 0.05) -> str | None:
    """Per run of the studies recorded with a prediction, the peak predicted before it ran beside the measured one."""
    body = []
    for study in studies:
        for r in (r for r in study.rows if r.ok and r.v["peak_mib"] is not None):
            pred = next((get_path(x, "prediction.predicted_mib.total") for x in r.records if x.get("prediction")), None)
            if finite(pred) is not None:
                err = pred / r.v["peak_mib"] - 1
                body.append([r.name, study.slug, sig(pred), sig(r.v["peak_mib"]), pct(err, signed=True),
                             "within" if abs(err) <= tolerance else "misses"])
    header = ["run", "machine", "predicted peak MiB", "measured peak MiB (median)", "error", f"within {pct(tolerance)}"]
    return table(header, body, "llrrrl") if body else None


def attention_table(result: Mapping | None) -> str | None:
    """Per sequence length, each implementation's peak MiB and median step ms (``benchmarks/attention.py``'s
    ``results`` of ``{"impl", "seq", "status", "peak_mib", "median_ms"}``); None when there is no result."""
    results = [r for r in (result or {}).get("results") or [] if isinstance(r, Mapping)]
    impls, seqs = list(dict.fromkeys(r.get("impl") for r in results)), sorted({r.get("seq") for r in results})
    cells = {(r.get("impl"), r.get("seq")): r for r in results}

    def cell(impl: str, seq: Any, key: str) -> str:
        r = cells.get((impl, seq), {"status": DASH})
        return sig(r.get(key)) if r.get("status") == "ok" else str(r.get("status"))

    body = [[q, *(cell(i, q, "peak_mib") for i in impls), *(cell(i, q, "median_ms") for i in impls)] for q in seqs]
    header = ["sequence length", *(f"{i} peak MiB" for i in impls), *(f"{i} step ms" for i in impls)]
    return table(header, body) if results else None


def scaleout_table(record: Mapping, devices: Sequence[int] = (1, 8, 512)) -> str | None:
    """Data parallelism of this record's job at ``devices`` GPUs, by the planner, from an estimated GPU step
    (:data:`PUBLISHED_A100_FLOPS_PER_S`); None where the record lacks its FLOPs or what the planner needs."""
    from modelwright import planner  # here: the package's formatters should not pull in the planner

    flops = finite(get_path(record, "flops.flops_per_step"))
    if not flops:
        return None
    try:
        spec = dataclasses.replace(planner.spec_from_record(record),
                                   step_time_ms=1e3 * flops / PUBLISHED_A100_FLOPS_PER_S)
    except KeyError as err:
        print(f"report: no scale-out table ({err})", file=sys.stderr)
        return None
    a = planner.Assumptions()
    preds = [planner.predict_step(spec, "dp", n, a) for n in devices]
    one = preds[0].samples_per_s
    body = [[n, f"{p.samples_per_step:,}", sig(p.comm_bytes / 2**20), f"{sig(p.comm_s * 1e3, 2)} ms (estimate)",
             f"{sig(p.step_s * 1e3, 2)} ms (estimate)", f"{pct(p.samples_per_s / (n * one))} (estimate)"]
            for n, p in zip(devices, preds, strict=True)]
    knobs = (f"{a.device}, {a.bandwidth(1):g} GB/s per GPU inside a node of {a.gpus_per_node}, "
             f"{a.bandwidth(a.gpus_per_node + 1):g} GB/s between nodes; overlap_fraction = {a.overlap_fraction}")
    return table(["GPUs", "global batch", "gradient MiB sent per GPU per step", "communication per step",
                  "step time", "scaling efficiency"], body) + f"\n\nPlanner assumptions: {knobs}."
