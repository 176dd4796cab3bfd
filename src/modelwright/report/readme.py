"""The one writer of generated text in README.md and docs/*.md: the text between ``<!-- name:start -->`` and
``<!-- name:end -->`` becomes what :class:`Sections` renders for ``name``; the rest, and sections of names it does not
know, are left alone. Block sections (the marker on a line of its own) hold tables and plots; inline ones (``<!--
v:slug:run:field:start -->0.56×<!-- ...:end -->``) put one figure of a record into a hand-written sentence.
"""

import contextlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

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
        if (body := render(m.group(1))) is None:
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


def _where(result: Mapping) -> str:
    hw, v = result.get("hardware") or {}, result.get("versions") or {}
    device = (f"{hw.get('cpu_model')}, {hw.get('cpu_cores')} cores" if hw.get("accelerator") == "cpu"
              else f"{hw.get('num_devices') or 1}× {hw.get('device_name')}")
    return f"{device}; torch {v.get('torch')}, lightning {v.get('lightning')}"


class Study:
    """One ``results/<slug>/`` folder: its records, rows, budget rows, provenance marks and the runs' wall time."""

    def __init__(self, folder: Path, allow_mixed: bool = False, slug: str | None = None):
        path, self.folder, self.slug = folder / "records.jsonl", folder, slug or folder.name
        require(path.is_file(), f"{folder}: no records.jsonl (run `python -m modelwright study` first)")
        records = read_records(path)
        self.rows = t.build_rows(records)
        self.budget = t.build_budget_rows(records, self.rows)
        self.runs = [r for row in self.rows for r in row.records]
        used = self.runs + [r for b in self.budget for r in b.records]
        require(bool(used), f"{path}: no study records (records with a 'study' section)")
        groups = list(dict.fromkeys(map(t.provenance_group, used)))
        require(len(groups) < 2 or allow_mixed, f"{path}: records of {len(groups)} commits/definitions "
                f"({'; '.join(groups)}); rerun them, or pass --allow_mixed true to mark them")
        self.marks = {g: chr(ord("a") + i) for i, g in enumerate(groups)} if len(groups) > 1 else {}
        self.wall_s = sum(finite(get_path(r, "study.process_wall_s")) or 0 for r in used)
        self.ok_rows = {r.name: r for r in self.rows if r.ok}

    def header(self) -> str:
        """Conditions, the commands behind every row, and the runs' total wall time."""
        last = next((r for r in reversed(self.runs) if r.get("status") == "ok"), {})
        commands = dict.fromkeys(f"`{get_path(r, 'provenance.command')}`" for r in self.runs)
        plans = dict.fromkeys(f"`{get_path(r, 'study.plan')}`" for r in self.runs)
        steps = {row.name: get_path(row.records[-1], "study.measured_steps") for row in self.rows}
        usual = max(steps.values(), key=list(steps.values()).count, default=get_path(last, "study.measured_steps"))
        others = "".join(f"; {k} for {', '.join(n for n in steps if steps[n] == k)}"
                         for k in dict.fromkeys(steps.values()) if k != usual)
        repeats = max((r.v["repeats"] for r in self.rows if r.ok), default=0)
        return "\n".join([f"- Hardware: {get_path(last, 'hardware.accelerator', '?').upper()} {_where(last)}, "
                          f"python {get_path(last, 'versions.python')}",
                          f"- Window: {get_path(last, 'study.warmup_steps')} warm-up, {usual} measured steps per run"
                          f"{others}, up to {repeats} repeat(s) per row; plan(s) {', '.join(plans)}",
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
        self.studies = [s for f in folders if (s := Study(f, allow_mixed, f.relative_to(results).as_posix())).rows]
        self.top = [s for s in self.studies if "/" not in s.slug]

    def rel(self, path: Path) -> str:
        return Path(os.path.relpath(path, self.doc_dir)).as_posix()

    def __call__(self, name: str) -> str | None:
        """The text of section ``name``; None for a name this writer does not know (its text is left alone)."""
        if name.startswith("v:"):
            require(name.count(":") == 3, f"<!-- {name}:start -->: an inline figure is v:<slug>:<run>:<field>")
            return self.value(*name.split(":")[1:])
        render = {"predictions": lambda: t.prediction_table(self.studies) or "No run of a study was predicted yet.",
                  "results": self.results, "scaleout": self.scaleout, "attention": self.attention,
                  "mainjob": lambda: self.benchmark("main-job", main_job_text, "main_job.json"),
                  "overhead": lambda: self.benchmark("overhead", overhead_text, "callback_overhead.json",
                                                     "overhead-resnet18.json", "overhead-smallcnn-epoch.json"),
                  "cpudefaults": lambda: self.benchmark("CPU-defaults", cpu_defaults_text, "cpu_defaults.json")}
        return render[name]() if name in render else None

    def value(self, slug: str, run: str, field: str) -> str:
        """One figure (a key of ``values``) of run ``run`` in ``results/<slug>/``; a dash without that run."""
        study = next((s for s in self.studies if s.slug == slug), None)
        if (row := study and study.ok_rows.get(run)) is None:
            return DASH
        a, peak = row.v["anatomy"], row.v["peak_mib"]
        gflops = {f: sig(t.div(finite(get_path(row.records[0], f"flops.{key}")), 1e9)) for f, key in
                  (("peak_gflops", "peak_flops_per_s"), ("gflop_step", "flops_per_step"),
                   ("achieved_gflops", "achieved_flops_per_s"))}
        values = {"peak": f"{sig(peak)} MiB", "memory": ratio(row.vs("peak_mib")), "time": ratio(row.vs("step_ms")),
                  "step": f"{sig(row.v['step_ms'])} ms", "verdict": row.verdict, "mfu": pct(row.v["mfu"]),
                  "band": "none with 1 repeat" if row.band is None else f"±{pct(row.band)}",
                  "activations": f"{sig(a['activations'])} MiB", "share": pct(t.div(a["activations"] or 0, peak)),
                  "state": f"{sig(sum(a[k] or 0 for k in ('parameters', 'gradients', 'optimizer_state')))} MiB",
                  "batch": str(next((b.batch for b in study.budget if b.name == run and b.fits), DASH)), **gflops}
        require(field in values, f"<!-- v:{slug}:{run}:{field} -->: unknown field (one of {', '.join(values)})")
        return values[field]

    def results(self) -> str:
        parts = []
        for s in self.top:
            hw = next((r.records[0].get("hardware") or {} for r in s.rows if r.ok), {})
            parts += [f"### {'CPU' if hw.get('accelerator') == 'cpu' else 'GPU'} results: {hw.get('device_name')} "
                      f"(`{s.slug}`)", "", s.header(), "", t.main_table(s.rows, s.marks), ""]
            parts += [f"Largest micro-batch under {s.budget[0].budget_mib / 1024:g} GiB:", "",
                      t.budget_table(s.budget), ""] if s.budget else []
            parts += [f"![{cap}]({self.rel(s.folder / n)})" for n, cap in PLOTS.items() if (s.folder / n).is_file()]
            table_md = self.rel(s.folder / "table.md")
            parts += ["", f"Anatomy and failed runs: [{table_md}]({table_md}).", ""]
        return "\n".join(parts) if parts else "No study results yet: run `uv run python -m modelwright study`."

    def scaleout(self) -> str:
        row = next((s.ok_rows["baseline"] for s in self.top if "baseline" in s.ok_rows), None)
        out = row and t.scaleout_table(row.records[0])
        return out or "Not generated: no `baseline` run recorded with what the planner needs."

    def attention(self) -> str:
        parts = []
        for s in self.top:
            if text := t.attention_table(_json(s.folder / "attention.json")):
                png = s.folder / "attention.png"
                image = f"\n\n![Attention: peak memory and step time against sequence length]({self.rel(png)})"
                parts.append(f"`{s.slug}`:\n\n{text}" + (image if png.is_file() else ""))
        return "\n\n".join(parts) or "Not measured yet: run `uv run python benchmarks/attention.py`."

    def benchmark(self, what: str, render: Callable[..., str], *files: str) -> str:
        """``render`` over the benchmark ``files`` (read as JSON, None where absent) of each results folder with any."""
        found = {f.name: [_json(f / name) for name in files] for f in sorted(self.root.iterdir()) if f.is_dir()}
        parts = [f"`{folder}`:\n\n{render(*data)}" for folder, data in found.items() if any(data)]
        return "\n\n".join(parts) or f"No {what} measurement recorded yet."


def main_job_text(r: Mapping) -> str:
    return table(["command", "wall time, start to exit", "final val/acc", "precision", "machine"],
                 [[f"`{r['command']}`", duration(r["process_wall_time_s"]), sig(r["val_acc"]), r["precision"],
                   _where(r)]])


def overhead_text(callback: Mapping | None, *loops: Mapping | None) -> str:
    def spread(values: list, what: str) -> str:
        return f"{ratio(min(values, default=None))}–{ratio(max(values, default=None))} ({len(values)} {what})"

    rows = [["measurement callbacks, hooks timed directly",
             f"{sig((callback.get('hooks_ms_per_step') or {}).get('median'), 2)} ms per step",
             pct(callback.get("hooks_fraction_of_step"), 2), DASH, f"`{callback['command']}`"],
            ["measurement callbacks on ÷ off, paired runs", ratio(callback["ratio_on_off"], 3), DASH,
             spread(callback.get("pair_ratios") or [], "pairs"), f"`{callback['command']}`"]] if callback else []
    for result in filter(None, loops):
        e, what = ("epoch_", "time per epoch") if result.get("mode") == "epoch" else ("", "median step")
        rows += [[f"{name} ÷ raw PyTorch loop, {result['settings']['model']}, {what}", ratio(s[f"{e}ratio_to_raw"], 3),
                  DASH, spread(s.get(f"repeat_{e}ratios_to_raw") or [], "repeats"), f"`{result['command']}`"]
                 for name, s in result["loops"].items() if name != "raw"]
    header = ["what", "figure", "share of a step", "spread", "command"]
    return f"{_where(callback or next(filter(None, loops)))}:\n\n" + table(header, rows, "lrrrl")


def cpu_defaults_text(result: Mapping) -> str:
    body = [[g["group"], o["option"].split("=", 1)[1] + (" **(default)**" if o["default"] else ""),
             f"{sig(o['median_step_ms'])} ms", ratio(o["ratio_to_reference"]), pct(o.get("mfu")),
             sig(o.get("minor_faults_per_step"))] for g in result["groups"] for o in g["options"]]
    kernel = result.get("peak_flops_source") == "measured-matmul"  # a file made before MFU used the hardware peak
    mfu, peak = ("% of kernel peak", "the best measured kernel") if kernel else ("MFU", "the fp32 peak")
    header = ["setting", "option", "median step", "vs first option", mfu, "minor page faults per step"]
    return (f"`{result['command']}` ({result['settings']['rounds']} rounds; {_where(result)}; {mfu} of {peak}, "
            f"{sig(result['peak_flops_per_s'] / 1e9)} GFLOP/s):\n\n" + table(header, body, "llrrrr"))


def update(docs: list[Path], results: Path, allow_mixed: bool = False) -> list[Path]:
    """Fill the sections of each document; returns those that changed."""
    return [doc for doc in docs if write_sections(doc, Sections(results, doc.parent.resolve(), allow_mixed))]
