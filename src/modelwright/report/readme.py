"""The one writer of generated text in README.md and docs/*.md: the text between ``<!-- name:start -->`` and
``<!-- name:end -->`` becomes what :class:`Sections` renders for ``name``; the rest, and sections of names it does not
know, are left alone. Block sections (the marker on a line of its own) hold tables and plots; inline ones (``<!--
v:slug:run:field:start -->0.56×<!-- ...:end -->``) put one figure of a record into a hand-written sentence.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from modelwright.errors import require
from modelwright.record import get_path, read_record, read_records, write_text_atomic
from modelwright.report import tables as t
from modelwright.report.fmt import DASH, duration, finite, pct, ratio, sig, table
from modelwright.report.plots import PLOTS

MARKER = re.compile(r"<!-- ([\w.:/-]+):start -->(.*?)<!-- \1:end -->", re.S)


def write_sections(path: Path, render: Callable[[str], str | None]) -> bool:
    """Rewrite every marked section of ``path`` whose name ``render`` knows; True if the text changed."""
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
        write_text_atomic(path, new)
    return new != text


def _json(path: Path) -> dict | None:
    # A benchmark that has not run, or a torn file, leaves its section saying so instead of failing the report.
    with contextlib.suppress(OSError, ValueError):
        return read_record(path, validate=False)
    return None


class Study:
    """One ``results/<slug>/`` folder: its records, rows, budget rows, provenance marks and the runs' wall time."""

    def __init__(self, folder: Path, allow_mixed: bool = False, slug: str | None = None):
        path, self.folder, self.slug = folder / "records.jsonl", folder, slug or folder.name
        require(path.is_file(), f"{folder}: no records.jsonl (run `python -m modelwright study` first)")
        records = read_records(path)
        self.rows = t.build_rows(records)
        self.budget = t.build_budget_rows(records, self.rows)
        used = [r for row in self.rows for r in row.records] + [r for b in self.budget for r in b.records]
        require(bool(used), f"{path}: no study records (records with a 'study' section)")
        groups = list(dict.fromkeys(map(t.provenance_group, used)))
        require(len(groups) < 2 or allow_mixed, f"{path}: records of {len(groups)} commits/definitions "
                f"({'; '.join(groups)}); rerun them, or pass --allow_mixed true to mark them")
        self.marks = {g: chr(ord("a") + i) for i, g in enumerate(groups)} if len(groups) > 1 else {}
        self.wall_s = sum(finite(get_path(r, "study.process_wall_s")) or 0 for r in used)

    def row(self, name: str) -> t.Row | None:
        return next((r for r in self.rows if r.name == name and r.ok), None)

    def header(self) -> str:
        """Conditions, the commands behind every row, and the runs' total wall time."""
        last = next((r for row in reversed(self.rows) for r in reversed(row.records) if r.get("status") == "ok"), {})
        hw, ver, s = last.get("hardware") or {}, last.get("versions") or {}, last.get("study") or {}
        device = (f"{hw.get('cpu_model')}, {hw.get('cpu_cores')} cores" if hw.get("accelerator") == "cpu"
                  else f"{hw.get('num_devices') or 1}× {hw.get('device_name')}")
        commands = dict.fromkeys(f"`{get_path(r, 'provenance.command')}`" for row in self.rows for r in row.records)
        plans = dict.fromkeys(f"`{get_path(r, 'study.plan')}`" for row in self.rows for r in row.records)
        steps: dict[Any, list[str]] = {}
        for row in self.rows:
            steps.setdefault(get_path(row.records[-1], "study.measured_steps"), []).append(row.name)
        usual = max(steps, key=lambda k: len(steps[k]), default=s.get("measured_steps"))
        others = "".join(f"; {k} for {', '.join(names)}" for k, names in steps.items() if k != usual)
        repeats = max((r.v["repeats"] for r in self.rows if r.ok), default=0)
        return "\n".join([f"- Hardware: {hw.get('accelerator', '?').upper()} {device}; torch {ver.get('torch')}, "
                          f"lightning {ver.get('lightning')}, python {ver.get('python')}",
                          f"- Window: {s.get('warmup_steps')} warm-up, {usual} measured steps per run{others}, up to "
                          f"{repeats} repeat(s) per row; plan(s) {', '.join(plans)}",
                          f"- Command(s): {'; '.join(commands)}; total wall time of the runs: {duration(self.wall_s)}",
                          *(f"- [{m}] {g}" for g, m in self.marks.items()),
                          *([] if self.marks else [f"- Records: {t.provenance_group(last)}"])])


class Sections:
    """Renders each known section for a document in ``doc_dir`` from the studies under ``results``."""

    def __init__(self, results: Path, doc_dir: Path, allow_mixed: bool = False):
        self.root, self.doc_dir = results, doc_dir
        # A folder inside a study's folder (a check of a few runs beside it) gives figures and predictions, not a
        # results section of its own: its slug is its path, e.g. cpu-amd-epyc-avx2-2cores/bf16-check.
        folders = sorted(f.parent for f in [*results.glob("*/records.jsonl"), *results.glob("*/*/records.jsonl")])
        studies = (Study(f, allow_mixed, f.relative_to(results).as_posix()) for f in folders)
        self.studies = [s for s in studies if s.rows]
        self.top = [s for s in self.studies if "/" not in s.slug]

    def rel(self, path: Path) -> str:
        return Path(os.path.relpath(path, self.doc_dir)).as_posix()

    def __call__(self, name: str) -> str | None:
        """The text of section ``name``; None for a name this writer does not know (its text is left alone)."""
        if name.startswith("v:"):
            require(name.count(":") == 3, f"<!-- {name}:start -->: an inline figure is v:<slug>:<run>:<field>")
            return self.value(*name.split(":")[1:])
        rows = {s.slug: s.rows for s in self.studies}
        render = {"predictions": lambda: t.prediction_table(rows) or "No run of a study was predicted yet.",
                  "results": self.results, "scaleout": self.scaleout, "attention": self.attention,
                  "mainjob": lambda: self.benchmark("main-job", main_job_text, "main_job.json"),
                  "overhead": lambda: self.benchmark("overhead", overhead_text, "callback_overhead.json",
                                                     "overhead-resnet18.json", "overhead-smallcnn-epoch.json"),
                  "cpudefaults": lambda: self.benchmark("CPU-defaults", cpu_defaults_text, "cpu_defaults.json")}
        return render[name]() if name in render else None

    def value(self, slug: str, run: str, field: str) -> str:
        """One figure (a key of ``values``) of run ``run`` in ``results/<slug>/``; a dash without that run."""
        study = next((s for s in self.studies if s.slug == slug), None)
        row = study.row(run) if study else None
        if row is None:
            return DASH
        a, peak = row.v["anatomy"], row.v["peak_mib"]
        gflops = {f: sig(t.div(finite(get_path(row.records[0], f"flops.{key}")), 1e9)) for f, key in
                  (("peak_gflops", "peak_flops_per_s"), ("gflop_step", "flops_per_step"),
                   ("achieved_gflops", "achieved_flops_per_s"))}
        values = {
            "peak": f"{sig(peak)} MiB", "memory": ratio(row.vs("peak_mib")), "step": f"{sig(row.v['step_ms'])} ms",
            "time": ratio(row.vs("step_ms")), "verdict": row.verdict,
            "band": "none with 1 repeat" if row.band is None else f"±{pct(row.band)}", "mfu": pct(row.v["mfu"]),
            "activations": f"{sig(a['activations'])} MiB",
            "state": f"{sig(sum(a[k] or 0 for k in ('parameters', 'gradients', 'optimizer_state')))} MiB",
            "share": pct(t.div(a["activations"] or 0, peak)),
            "batch": str(next((b.batch for b in study.budget if b.name == run and b.fits), DASH)), **gflops}
        require(field in values, f"<!-- v:{slug}:{run}:{field} -->: unknown field (one of {', '.join(values)})")
        return values[field]

    def results(self) -> str:
        parts = []
        for s in self.top:
            hw = next((r.records[0].get("hardware") or {} for r in s.rows if r.ok), {})
            kind = "CPU results" if hw.get("accelerator") == "cpu" else "GPU results"
            parts += [f"### {kind}: {hw.get('device_name')} (`{s.slug}`)", "", s.header(), "",
                      t.main_table(s.rows, s.marks), ""]
            if s.budget:
                parts += [f"Largest micro-batch under {s.budget[0].budget_mib / 1024:g} GiB:", "",
                          t.budget_table(s.budget), ""]
            parts += [f"![{cap}]({self.rel(s.folder / n)})" for n, cap in PLOTS.items() if (s.folder / n).is_file()]
            table_md = self.rel(s.folder / "table.md")
            parts += ["", f"Anatomy and failed runs: [{table_md}]({table_md}).", ""]
        return "\n".join(parts) if parts else "No study results yet: run `uv run python -m modelwright study`."

    def scaleout(self) -> str:
        s = next((s for s in self.top if s.row("baseline")), None)
        out = t.scaleout_table(s.row("baseline").records[0]) if s else None
        return out or "Not generated: no `baseline` run recorded with what the planner needs."

    def attention(self) -> str:
        parts = []
        for s in self.top:
            if text := t.attention_table(_json(s.folder / "attention.json")):
                parts += [f"`{s.slug}`:", "", text, ""]
                if (s.folder / "attention.png").is_file():
                    parts += [f"![Attention: peak memory and step time against sequence length]"
                              f"({self.rel(s.folder / 'attention.png')})", ""]
        return "\n".join(parts) or "Not measured yet: run `uv run python benchmarks/attention.py`."

    def benchmark(self, what: str, render: Callable[..., str | None], *files: str) -> str:
        """``render`` over each results folder's benchmark ``files`` (read as JSON, None where absent)."""
        folders = sorted(f for f in self.root.iterdir() if f.is_dir())
        parts = [f"`{f.name}`:\n\n{text}" for f in folders if (text := render(*(_json(f / name) for name in files)))]
        return "\n\n".join(parts) or f"No {what} measurement recorded yet."


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
    def spread(values: list, what: str) -> str:
        return f"{ratio(min(values, default=None))}–{ratio(max(values, default=None))} ({len(values)} {what})"

    rows = []
    if callback:
        cmd = f"`{callback['command']}`"
        rows += [["measurement callbacks, hooks timed directly",
                  f"{sig((callback.get('hooks_ms_per_step') or {}).get('median'), 2)} ms per step",
                  pct(callback.get("hooks_fraction_of_step"), 2), DASH, cmd],
                 ["measurement callbacks on ÷ off, paired runs", ratio(callback["ratio_on_off"], 3), DASH,
                  spread(callback.get("pair_ratios") or [], "pairs"), cmd]]
    for result in filter(None, loops):
        epoch = result.get("mode") == "epoch"
        rows += [[f"{name} ÷ raw PyTorch loop, {result['settings']['model']}, "
                  f"{'time per epoch' if epoch else 'median step'}",
                  ratio(s["epoch_ratio_to_raw" if epoch else "ratio_to_raw"], 3), DASH,
                  spread(s.get("repeat_epoch_ratios_to_raw" if epoch else "repeat_ratios_to_raw") or [], "repeats"),
                  f"`{result['command']}`"] for name, s in result["loops"].items() if name != "raw"]
    if not rows:
        return None
    header = ["what", "figure", "share of a step", "spread", "command"]
    return f"{_where(callback or next(filter(None, loops)))}:\n\n" + table(header, rows, "lrrrl")


def cpu_defaults_text(result: Mapping | None) -> str | None:
    if not result:
        return None
    body = [[g["group"], o["option"].split("=", 1)[1] + (" **(default)**" if o["default"] else ""),
             f"{sig(o['median_step_ms'])} ms", ratio(o["ratio_to_reference"]), pct(o.get("mfu")),
             sig(o.get("minor_faults_per_step"))] for g in result["groups"] for o in g["options"]]
    kernel = result.get("peak_flops_source") == "measured-matmul"  # a file made before MFU used the hardware peak
    mfu, peak = ("% of kernel peak", "the best measured kernel") if kernel else ("MFU", "the fp32 peak")
    return (f"`{result['command']}` ({result['settings']['rounds']} rounds; {_where(result)}; {mfu} of {peak}, "
            f"{sig(result['peak_flops_per_s'] / 1e9)} GFLOP/s):\n\n"
            + table(["setting", "option", "median step", "vs first option", mfu, "minor page faults per step"], body,
                    "llrrrr"))


def update(docs: list[Path], results: Path, allow_mixed: bool = False) -> list[Path]:
    """Fill the sections of each document; returns those that changed."""
    return [doc for doc in docs if write_sections(doc, Sections(results, doc.parent.resolve(), allow_mixed))]
