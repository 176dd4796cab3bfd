"""The one writer of generated text in README.md and docs/*.md: the text between ``<!-- name:start -->`` and
``<!-- name:end -->`` is replaced by what :class:`Sections` renders for ``name``; everything else is left alone.

Block sections (the marker on a line of its own) hold tables and plots; inline ones (``<!-- v:slug:run:field:start
-->0.56×<!-- ...:end -->``) put one figure of a record into a hand-written sentence. Fields of ``v:``: peak,
memory, step, time, band, verdict, mfu, activations, state (parameters + gradients + optimizer state, MiB),
share (activations ÷ peak), batch (largest batch under the budget), peak_gflops, achieved_gflops,
gflop_step.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelwright.errors import ConfigError, require
from modelwright.record import get_path, read_records
from modelwright.report import tables as t
from modelwright.report.fmt import DASH, duration, pct, ratio, sig, table
from modelwright.report.plots import PLOTS

MARKER = re.compile(r"<!-- ([\w.:/-]+):start -->(.*?)<!-- \1:end -->", re.S)
FINDINGS = ("amp", "accumulate", "checkpointing-stage", "checkpointing-block", "all", "compile", "fused",
            "contiguous", "channels_last", "system-malloc", "ddp", "fsdp2")


def write_sections(path: Path, render: Callable[[str], str | None]) -> bool:
    """Rewrite every marked section of ``path`` whose name ``render`` knows; True if the text changed.

    Raises:
        ConfigError: ``path`` holds no section markers (one line naming the file).
    """
    text = path.read_text(encoding="utf-8")
    require(MARKER.search(text) is not None, f"{path}: no <!-- name:start --> ... <!-- name:end --> markers to fill")

    def fill(m: re.Match) -> str:
        body = render(m.group(1))
        if body is None:
            return m.group(0)
        body = f"\n{body.strip()}\n" if m.group(2).startswith("\n") else body.strip()
        return f"<!-- {m.group(1)}:start -->{body}<!-- {m.group(1)}:end -->"

    new = MARKER.sub(fill, text)
    if new != text:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(new, encoding="utf-8")
        os.replace(tmp, path)
    return new != text


def _json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class Study:
    """One ``results/<slug>/`` folder: its records, rows, budget rows and provenance marks."""

    folder: Path
    records: list[dict]
    rows: list[t.Row]
    budget: list[t.BudgetRow]
    marks: dict[str, str]

    @classmethod
    def load(cls, folder: Path, allow_mixed: bool = False) -> Study:
        path = folder / "records.jsonl"
        require(path.is_file(), f"{folder}: no records.jsonl (run `python -m modelwright study` first)")
        records = read_records(path)
        require(bool(t.study_records(records)), f"{path}: no study records (records with a 'study' section)")
        rows = t.build_rows(records)
        budget = t.build_budget_rows(records, rows)
        used = [r for row in rows for r in row.records] + [r for b in budget for r in b.records]
        return cls(folder, records, rows, budget, t.check_provenance(used, str(path), allow_mixed))

    @property
    def slug(self) -> str:
        return self.folder.name

    def row(self, name: str) -> t.Row | None:
        return next((r for r in self.rows if r.name == name and r.ok), None)

    def wall_s(self) -> float:
        used = [r for row in self.rows for r in row.records] + [r for b in self.budget for r in b.records]
        return sum(t.finite(get_path(r, "study.process_wall_s")) or 0 for r in used)

    def header(self) -> str:
        """Conditions, the commands behind every row, and the runs' total wall time."""
        last = next((r for r in reversed(t.study_records(self.records)) if r.get("status") == "ok"), {})
        hw, ver, s = last.get("hardware") or {}, last.get("versions") or {}, last.get("study") or {}
        device = (f"{hw.get('cpu_model')}, {hw.get('cpu_cores')} cores" if hw.get("accelerator") == "cpu"
                  else f"{hw.get('num_devices') or 1}× {hw.get('device_name')}")
        commands = list(dict.fromkeys(get_path(r, "provenance.command") for row in self.rows for r in row.records))
        shown = [f"`{c}`" for c in commands if c]
        if None in commands:
            study_cmd = (_json(self.folder / "study.json") or {}).get("command")
            shown.append("not recorded for records made before provenance"
                         + (f" (last study invocation: `{study_cmd}`)" if study_cmd else ""))
        repeats = max((r.v["repeats"] for r in self.rows if r.ok), default=0)
        lines = [f"- Hardware: {hw.get('accelerator', '?').upper()} {device}; torch {ver.get('torch')}, "
                 f"lightning {ver.get('lightning')}, python {ver.get('python')}",
                 f"- Window: {s.get('warmup_steps')} warm-up, {s.get('measured_steps')} measured steps per run, "
                 f"up to {repeats} repeat(s) per row; plan `{s.get('plan')}`",
                 f"- Command(s): {'; '.join(shown)}; total wall time of the runs: {duration(self.wall_s())}"]
        lines += [f"- [{m}] {g}" for g, m in self.marks.items()]
        return "\n".join(lines)


class Sections:
    """Renders each known section for a document in ``doc_dir`` from the studies under ``results``."""

    def __init__(self, results: Path, doc_dir: Path, allow_mixed: bool = False):
        self.root, self.doc_dir = results, doc_dir
        folders = sorted(p for p in results.iterdir() if (p / "records.jsonl").is_file()) if results.is_dir() else []
        self.studies = [Study.load(f, allow_mixed) for f in folders]
        self.studies = [s for s in self.studies if s.rows]

    def rel(self, path: Path) -> str:
        return Path(os.path.relpath(path, self.doc_dir)).as_posix()

    def __call__(self, name: str) -> str | None:
        if name.startswith("v:"):
            return self.value(*name.split(":")[1:])
        method = getattr(self, f"_{name}", None)
        return method() if callable(method) else None

    def value(self, slug: str, run: str, field: str) -> str:
        study = next((s for s in self.studies if s.slug == slug), None)
        row = study.row(run) if study else None
        if row is None:
            return DASH
        a = row.v["anatomy"]
        rec = row.records[0]
        values: dict[str, Any] = {
            "peak": f"{sig(row.v['peak_mib'])} MiB", "memory": ratio(row.vs("peak_mib")),
            "step": f"{sig(row.v['step_ms'])} ms", "time": ratio(row.vs("step_ms")), "verdict": row.verdict,
            "band": t.NO_BAND if row.band is None else f"±{pct(row.band)}", "mfu": pct(row.v["mfu"]),
            "activations": f"{sig(a['activations'])} MiB",
            "state": f"{sig(sum(a[k] or 0 for k in ('parameters', 'gradients', 'optimizer_state')))} MiB",
            "share": pct((a["activations"] or 0) / row.v["peak_mib"] if row.v["peak_mib"] else None),
            "batch": str(next((b.batch for b in study.budget if b.name == run and b.fits), DASH)),
            "peak_gflops": sig((t.finite(get_path(rec, "flops.peak_flops_per_s")) or 0) / 1e9 or None),
            "gflop_step": sig((t.finite(get_path(rec, "flops.flops_per_step")) or 0) / 1e9 or None),
            "achieved_gflops": sig((t.finite(get_path(rec, "flops.achieved_flops_per_s")) or 0) / 1e9 or None),
        }
        require(field in values, f"<!-- v:{slug}:{run}:{field} -->: unknown field (one of {', '.join(values)})")
        return values[field]

    def _findings(self) -> str:
        return t.findings_table({s.slug: s.rows for s in self.studies}, FINDINGS)

    def _kernels(self) -> str:
        return t.kernel_table({s.slug: s.rows for s in self.studies})

    def _results(self) -> str:
        parts = []
        for s in self.studies:
            hw = next((r.records[0].get("hardware") or {} for r in s.rows if r.ok), {})
            kind = "CPU results" if hw.get("accelerator") == "cpu" else "GPU results"
            parts += [f"### {kind}: {hw.get('device_name')} (`{s.slug}`)", "", s.header(), "",
                      t.main_table(s.rows, s.marks), ""]
            if s.budget:
                parts += [f"Largest micro-batch under {s.budget[0].budget_mib / 1024:g} GiB:", "",
                          t.budget_table(s.budget), ""]
            parts += [f"![{cap}]({self.rel(s.folder / n)})" for n, cap in PLOTS.items() if (s.folder / n).is_file()]
            parts += ["", f"Anatomy and failed runs: [{self.rel(s.folder / 'table.md')}]"
                      f"({self.rel(s.folder / 'table.md')}).", ""]
        return "\n".join(parts) if parts else "No study results yet: run `uv run python -m modelwright study`."

    def _scaleout(self) -> str:
        s = next((s for s in self.studies if s.row("amp")), None)
        out = t.scaleout_table(s.row("amp").records[0]) if s else None
        return out or "Not generated: the planner's interface for it is not available."

    def _attention(self) -> str:
        parts = []
        for s in self.studies:
            text = t.attention_table(_json(s.folder / "attention.json"))
            if text:
                parts += [f"`{s.slug}`:", "", text, ""]
                if (s.folder / "attention.png").is_file():
                    parts += [f"![Attention: peak memory and step time against sequence length]"
                              f"({self.rel(s.folder / 'attention.png')})", ""]
        return "\n".join(parts) or "Not measured yet: run `uv run python benchmarks/attention.py`."

    def _benchmarks(self, name: str, render: Callable[[Path], str | None]) -> str:
        parts = [text for f in sorted(self.root.iterdir()) if f.is_dir() and (text := render(f))]
        return "\n\n".join(parts) or f"No {name} measurement recorded yet."

    def _mainjob(self) -> str:
        return self._benchmarks("main-job", lambda f: main_job_text(_json(f / "main_job.json")))

    def _overhead(self) -> str:
        return self._benchmarks("overhead", lambda f: overhead_text(
            _json(f / "callback_overhead.json"), _json(f / "overhead-resnet18.json"),
            _json(f / "overhead-smallcnn-epoch.json")))

    def _cpudefaults(self) -> str:
        return self._benchmarks("CPU-defaults", lambda f: cpu_defaults_text(_json(f / "cpu_defaults.json")))


def _where(result: Mapping) -> str:
    hw, v = result.get("hardware") or {}, result.get("versions") or {}
    cores = f", {hw.get('cpu_cores')} cores" if hw.get("accelerator") == "cpu" else ""
    device = hw.get("device_name") or hw.get("cpu_model")
    return f"{device}{cores}; torch {v.get('torch')}, lightning {v.get('lightning')}"


def main_job_text(r: Mapping | None) -> str | None:
    if not r:
        return None
    return table(["command", "wall time, start to exit", "final val/acc", "precision", "machine"],
                 [[f"`{r['command']}`", duration(r["process_wall_time_s"]), sig(r["val_acc"]), r["precision"],
                   _where(r)]])


def overhead_text(callback: Mapping | None, *loops: Mapping | None) -> str | None:
    rows = []
    if callback:
        hooks = callback.get("hooks_ms_per_step") or {}
        pairs = callback.get("pair_ratios") or []
        rows.append(["measurement callbacks, hooks timed directly", f"{sig(hooks.get('median'), 2)} ms per step",
                     pct(callback.get("hooks_fraction_of_step"), 2), DASH, f"`{callback['command']}`"])
        rows.append(["measurement callbacks on ÷ off, paired runs", ratio(callback["ratio_on_off"], 3),
                     DASH, f"{ratio(min(pairs, default=None))}–{ratio(max(pairs, default=None))} ({len(pairs)} pairs)",
                     f"`{callback['command']}`"])
    for result in filter(None, loops):
        epoch = result.get("mode") == "epoch"
        for name, s in result["loops"].items():
            if name == "raw":
                continue
            reps = s.get("repeat_epoch_ratios_to_raw" if epoch else "repeat_ratios_to_raw") or []
            rows.append([f"{name} ÷ raw PyTorch loop, {result['settings']['model']}, "
                         f"{'time per epoch' if epoch else 'median step'}",
                         ratio(s["epoch_ratio_to_raw" if epoch else "ratio_to_raw"], 3), DASH,
                         f"{ratio(min(reps, default=None))}–{ratio(max(reps, default=None))} ({len(reps)} repeats)",
                         f"`{result['command']}`"])
    if not rows:
        return None
    where = _where(callback or next(filter(None, loops)))
    return f"{where}:\n\n" + table(["what", "figure", "share of a step", "spread", "command"], rows, "lrrrl")


def cpu_defaults_text(result: Mapping | None) -> str | None:
    if not result:
        return None
    body = [[g["group"], o["option"].split("=", 1)[1] + (" **(default)**" if o["default"] else ""),
             f"{sig(o['median_step_ms'])} ms", ratio(o["ratio_to_reference"]), pct(o.get("mfu")),
             sig(o.get("minor_faults_per_step"))] for g in result["groups"] for o in g["options"]]
    return (f"`{result['command']}` ({result['settings']['rounds']} rounds; {_where(result)}; the MFU column "
            f"divides by the best measured kernel, {sig(result['peak_flops_per_s'] / 1e9)} GFLOP/s):\n\n"
            + table(["setting", "option", "median step", "vs first option", "% of kernel peak",
                     "minor page faults per step"], body, "llrrrr"))


def update(docs: list[Path], results: Path, allow_mixed: bool = False) -> list[Path]:
    """Fill the sections of each document; returns those that changed."""
    changed = []
    for doc in docs:
        if write_sections(doc, Sections(results, doc.parent.resolve(), allow_mixed)):
            changed.append(doc)
    return changed


__all__ = ["ConfigError", "Sections", "Study", "update", "write_sections"]
