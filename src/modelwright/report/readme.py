"""The one writer of generated text in README.md and docs/*.md: the text between ``<!-- name:start -->`` and
``<!-- name:end -->`` becomes what :class:`Sections` renders for ``name``; the rest, and sections of names it
does not know, are left alone. Block sections (the markers on lines of their own) hold tables and plots.

A hand-written sentence takes one figure of a study's row between short markers, best on a line of its own:
``<!-- v accumulate.memory -->0.45×<!-- /v -->`` is the ``memory`` figure of run ``accumulate`` in the study
named by the last ``<!-- figures: SLUG -->`` line above it (``<!-- v SLUG:run.field -->`` names another).
"""

import contextlib
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import modelwright.report.predictions as predictions
import modelwright.report.tables as tables
from modelwright import planner
from modelwright.errors import require
from modelwright.fmt import DASH, duration, finite, pct, ratio, sig, table, usd
from modelwright.planner.memory import MIB, state_bytes_per_rank
from modelwright.record import get_path, read_record, read_records, write_text_atomic
from modelwright.report.plots import PLOTS
from modelwright.study_rows import Row, build_budget_rows, build_rows, div, plan_of, provenance_group

MARKER = re.compile(r"<!-- ([\w.:/-]+):start -->(.*?)<!-- \1:end -->", re.S)
#: The study that the inline figures after it come from, and one inline figure.
FIGURES = re.compile(r"<!-- figures: (?P<slug>[\w./-]+) -->"
                     r"|<!-- v (?P<name>[\w./:-]+) -->(?P<old>.*?)<!-- /v -->")


def write_sections(path: Path, render: Callable[[str], str | None]) -> bool:
    """Rewrite every marked section of ``path`` whose name ``render`` knows; True if the text changed."""
    text = path.read_text(encoding="utf-8")
    require(MARKER.search(text) is not None or FIGURES.search(text) is not None,
            f"{path}: no <!-- name:start --> ... <!-- name:end --> markers to fill")

    def fill(match: re.Match) -> str:
        name, old_body = match.group(1), match.group(2)
        body = render(name)
        if body is None or _less_complete(path, name, old_body, body):
            return match.group(0)
        body = f"\n{body.strip()}\n" if old_body.startswith("\n") else body.strip()
        return f"<!-- {name}:start -->{body}<!-- {name}:end -->"

    new = fill_figures(MARKER.sub(fill, text), path, render)
    if new != text:
        write_text_atomic(path, new)
    return new != text


def _less_complete(path: Path, name: str, old: str, new: str) -> bool:
    """Whether ``new`` lacks table rows that ``old`` has (by first cell, as often): a section is not rewritten
    from a study with fewer runs than the one it shows (a scratch study of two runs), and says so. A section
    emptied by hand takes any."""
    def first_cells(text: str) -> Counter:
        return Counter(re.findall(r"^\| ([^|\n]+?) \|", text, re.M))

    missing = list(first_cells(old) - first_cells(new))
    if missing:
        print(f"{path.name}: {name} kept: the new text lacks {', '.join(missing)} (empty the section to fill "
              "it from this study)", file=sys.stderr)
    return bool(missing)


def figure_markers(text: str, path: Path) -> Iterator[tuple[re.Match, str]]:
    """Each inline figure of ``text`` with its full name, ``v:<slug>:<run>:<field>``: the slug the figure's
    own or the last ``figures:`` line's. A figure before any such line is an error naming the file."""
    slug = None
    for match in FIGURES.finditer(text):
        if match.group("slug"):
            slug = match.group("slug")
            continue
        name = match.group("name")
        figure_slug, _, figure = name.rpartition(":") if ":" in name else (slug, "", name)
        require(figure_slug is not None,
                f"{path}: <!-- v {name} --> before any <!-- figures: SLUG --> line")
        run, dot, field = figure.rpartition(".")
        require(bool(dot and run), f"{path}: <!-- v {name} -->: an inline figure is run.field")
        yield match, f"v:{figure_slug}:{run}:{field}"


def fill_figures(text: str, path: Path, render: Callable[[str], str | None]) -> str:
    """``text`` with each inline figure rendered (:func:`figure_markers`)."""
    parts = []
    position = 0
    for match, full_name in figure_markers(text, path):
        value = render(full_name)
        old = match.group("old")
        kept = value is None or (value == DASH and old not in (DASH, "", "?"))
        if value is not None and kept:
            print(f"{path.name}: {full_name} kept: this study has no such figure", file=sys.stderr)
        body = old if kept else value
        parts.append(text[position:match.start()])
        parts.append(f"<!-- v {match.group('name')} -->{body}<!-- /v -->")
        position = match.end()
    parts.append(text[position:])
    return "".join(parts)


def read_json(path: Path) -> dict | None:
    """A benchmark's JSON result; None for one that has not run or a torn file (its section then says so)."""
    with contextlib.suppress(OSError, ValueError):
        return read_record(path, validate=False)
    return None


def machine_text(result: Mapping) -> str:
    """The machine and versions a result names: ``AMD EPYC, 2 cores; torch 2.15.0, lightning 2.6.6``."""
    hardware = result.get("hardware") or {}
    versions = result.get("versions") or {}
    if hardware.get("accelerator") == "cpu":
        device = f"{hardware.get('cpu_model')}, {hardware.get('cpu_cores')} cores"
    else:
        device = f"{hardware.get('num_devices') or 1}× {hardware.get('device_name')}"
    return f"{device}; torch {versions.get('torch')}, lightning {versions.get('lightning')}"


class ResultsFolder:
    """One ``results/<slug>/`` folder: its records, rows, budget rows, provenance marks and the runs' wall
    time."""

    def __init__(self, folder: Path, allow_mixed: bool = False, slug: str | None = None):
        path = folder / "records.jsonl"
        self.folder = folder
        self.slug = slug or folder.name
        require(path.is_file(), f"{folder}: no records.jsonl (run `python -m modelwright study` first)")
        records = read_records(path)
        self.rows = build_rows(records)
        self.budget = build_budget_rows(records, self.rows)
        epochs = [row.epoch.record for row in self.rows if row.epoch]
        self.runs = [record for row in self.rows for record in row.records] + epochs
        used = self.runs + [record for row in self.budget for record in row.records]
        require(bool(used), f"{path}: no study records (records with a 'study' section)")
        groups = list(dict.fromkeys(map(provenance_group, used)))
        require(len(groups) < 2 or allow_mixed, f"{path}: records of {len(groups)} commits/definitions "
                f"({'; '.join(groups)}); rerun them, or pass --allow_mixed true to mark them")
        self.marks = {group: chr(ord("a") + i) for i, group in enumerate(groups)} if len(groups) > 1 else {}
        self.wall_s = sum(finite(get_path(record, "study.process_wall_s")) or 0 for record in used)
        self.plan_wall_s: dict[str, float] = {}
        for record in used:  # what each plan's runs took, the budget phase included
            plan = str(get_path(record, "study.plan"))
            wall_s = finite(get_path(record, "study.process_wall_s")) or 0
            self.plan_wall_s[plan] = self.plan_wall_s.get(plan, 0) + wall_s
        self.ok_rows = {row.name: row for row in self.rows if row.ok}

    def window_text(self, last: Mapping) -> str:
        """Warm-up, measured steps (and the rows that measured another number), repeats and plans."""
        plans = dict.fromkeys(f"`{get_path(record, 'study.plan')}`" for record in self.runs)
        steps = {row.name: get_path(row.records[-1], "study.measured_steps") for row in self.rows}
        counts = list(steps.values())
        usual = max(counts, key=counts.count, default=get_path(last, "study.measured_steps"))
        others = "".join(f"; {count} for {', '.join(name for name in steps if steps[name] == count)}"
                         for count in dict.fromkeys(counts) if count != usual)
        repeats = max((row.figures.repeats for row in self.rows if row.ok), default=0)
        warmup = get_path(last, "study.warmup_steps")
        return (f"- Window: {warmup} warm-up, {usual} measured steps per run{others}, up to {repeats} "
                f"repeat(s) per row; plan(s) {', '.join(plans)}")

    def plan_wall_text(self) -> str:
        """`` (`plan_default.yaml` 27 min, ...)`` where the runs came from more than one plan."""
        if len(self.plan_wall_s) < 2:
            return ""
        parts = [f"`{Path(plan).name}` {duration(wall_s)}" for plan, wall_s in self.plan_wall_s.items()]
        return f" ({', '.join(parts)})"

    def header(self) -> str:
        """Conditions, the commands behind every row, and the runs' total wall time."""
        last = next((record for record in reversed(self.runs) if record.get("status") == "ok"), {})
        commands = dict.fromkeys(f"`{get_path(record, 'provenance.command')}`" for record in self.runs)
        accelerator = get_path(last, "hardware.accelerator", "?").upper()
        python = get_path(last, "versions.python")
        lines = [f"- Hardware: {accelerator} {machine_text(last)}, python {python}",
                 self.window_text(last),
                 f"- Command(s): {'; '.join(commands)}; total wall time of the runs: {duration(self.wall_s)}"
                 + self.plan_wall_text()]
        lines += [f"- [{mark}] {group}" for group, mark in self.marks.items()]
        if not self.marks:
            lines.append(f"- Records: {provenance_group(last)}")
        return "\n".join(lines)


def state_figures(row: Row) -> dict[str, str]:
    """The model state a row measured at its peak beside the planner's bytes per parameter, and ZeRO-1's
    optimizer state per GPU at 8 GPUs (``v:<slug>:<run>:<field>``)."""
    anatomy = row.figures.anatomy
    mib = {"parameters": anatomy["parameters"], "gradients": anatomy["gradients"],
           "optimizer": anatomy["optimizer_state"], "optimizer_zero1_8": None, "state_planned": None}
    per_parameter = None
    with contextlib.suppress(KeyError):  # a record without what the planner needs: dashes
        spec = planner.spec_from_record(row.records[0])
        zero1 = state_bytes_per_rank(spec.num_params, spec.state, "zero1", 8)["optimizer_state"]
        mib.update(optimizer_zero1_8=zero1 / MIB, state_planned=spec.state.total * spec.num_params / MIB)
        per_parameter = spec.state.total
    return {**{field: sig(value, suffix=" MiB") for field, value in mib.items()},
            "bytes_per_parameter": DASH if per_parameter is None else f"{per_parameter:g} B"}


def loss_figures(row: Row) -> dict[str, str]:
    """The row's training loss: the mean of its last steps, its last step's (and how many steps that is), and
    whether its loss curve is bit for bit its reference's."""
    history = get_path(row.records[0], "history.train/loss") or []
    reference = get_path(row.reference.records[0], "history.train/loss") if row.reference else None
    last_step, last_loss = history[-1] if history else (None, None)
    return {"loss": sig(row.figures.loss), "last_loss": sig(last_loss),
            "loss_steps": DASH if last_step is None else str(last_step + 1),
            "loss_match": "bit-identical" if history and history == reference else "not identical"}


def inline_figures(row: Row, folder: ResultsFolder) -> dict[str, str]:
    """Every figure a sentence can take from ``row`` (``v:<slug>:<run>:<field>``), by field."""
    figures = row.figures
    anatomy = figures.anatomy
    peak = figures.peak_mib
    # The step, MFU and FLOP rates are all the median step's (study_rows.Figures): one statistic.
    flops = {"peak_gflops": sig(div(figures.peak_flops_per_s, 1e9)),
             "gflop_step": sig(div(figures.flops_per_step, 1e9)),
             "achieved_gflops": sig(div(figures.achieved_flops_per_s, 1e9))}
    state = sum(anatomy[key] or 0 for key in ("parameters", "gradients", "optimizer_state"))
    batch = next((budget.batch for budget in folder.budget if budget.name == row.name and budget.fits), DASH)
    cost = tables.row_cost(row)
    time_ratio = row.vs("step_ms")
    return {"peak": f"{sig(peak)} MiB", "memory": ratio(row.vs("peak_mib")), "time": ratio(time_ratio),
            "time_change": pct(time_ratio - 1, signed=True) if time_ratio else DASH,
            "step": f"{sig(figures.step_ms)} ms", "verdict": row.verdict, "mfu": pct(figures.mfu),
            "band": "none with 1 repeat" if row.band is None else row.band.text(),
            "interval": tables.interval_text(row),
            "paired_apart": duration(row.interval.apart_s) if row.interval else DASH,
            "plan_wall": duration(folder.plan_wall_s.get(str(plan_of(row)))),
            "activations": f"{sig(anatomy['activations'])} MiB",
            "share": pct(div(anatomy["activations"] or 0, peak)),
            "state": f"{sig(state)} MiB", "batch": str(batch), "epoch": tables.epoch_text(row),
            "epoch_cost": usd(cost.per_epoch) if cost and cost.per_epoch is not None else DASH, **flops,
            **state_figures(row), **loss_figures(row)}


def _is_job(folder: Path) -> bool:
    """Whether ``folder`` holds the study of a user's job (its study.json names the job's files)."""
    summary = folder / "study.json"
    if not summary.is_file():
        return False
    return bool(json.loads(summary.read_text(encoding="utf-8")).get("job"))


class Sections:
    """Renders each known section for a document in ``doc_dir`` from the studies under ``results``."""

    def __init__(self, results: Path, doc_dir: Path, allow_mixed: bool = False):
        self.root = results
        self.doc_dir = doc_dir
        # A folder inside a study's folder (a check of a few runs beside it) gives figures and predictions,
        # not a results section of its own: its slug is its path, e.g. cpu-amd-epyc-avx2-2cores/bf16-check.
        found = [*results.glob("*/records.jsonl"), *results.glob("*/*/records.jsonl")]
        folders = [ResultsFolder(path.parent, allow_mixed, path.parent.relative_to(results).as_posix())
                   for path in sorted(found, key=lambda path: path.parent)]
        self.studies = [folder for folder in folders if folder.rows]
        self.top = [folder for folder in self.studies if "/" not in folder.slug]

    def rel(self, path: Path) -> str:
        return Path(os.path.relpath(path, self.doc_dir)).as_posix()

    def __call__(self, name: str) -> str | None:
        """The text of section ``name``; None for a name this writer does not know (its text is left
        alone)."""
        if name.startswith("results:"):
            return self.results(name.removeprefix("results:"))
        if name.startswith("techniques:"):
            return self.techniques(name.removeprefix("techniques:"))
        if name.startswith("v:"):
            require(name.count(":") == 3,
                    f"<!-- {name}:start -->: an inline figure is v:<slug>:<run>:<field>")
            return self.value(*name.split(":")[1:])
        if name.startswith("predictions:"):
            return self.predictions(name.removeprefix("predictions:"))
        if name.startswith("cost:"):
            return self.cost(name.removeprefix("cost:"))
        render = {
            "predictions": self.predictions,
            "results": self.results,
            "scaleout": self.scaleout,
            "attention": self.attention,
            "mainjob": lambda: self.benchmark("main-job", main_job_text, "main_job.json"),
            "overhead": lambda: self.benchmark("overhead", overhead_text, "callback_overhead.json",
                                               "overhead-resnet18.json", "overhead-smallcnn-epoch.json"),
            "cpudefaults": lambda: self.benchmark("CPU-defaults", cpu_defaults_text, "cpu_defaults.json"),
        }
        return render[name]() if name in render else None

    def study(self, slug: str, section: str) -> ResultsFolder:
        """The study ``results/<slug>/`` that the section ``<section>:<slug>`` names."""
        folder = next((folder for folder in self.studies if folder.slug == slug), None)
        require(folder is not None, f"<!-- {section}:{slug}:start -->: no study results/{slug}/")
        return folder

    def techniques(self, slug: str) -> str:
        """The one-table summary of a study's runs against its baseline."""
        folder = self.study(slug, "techniques")
        return tables.technique_summary(folder.rows, folder.budget)

    def predictions(self, slug: str | None = None) -> str:
        """The project's own studies' predictions (``predictions:<slug>``: one study's, its check folders
        included); a user's job (``study --config``) has them in its table.md."""
        own = [folder for folder in self.studies if not _is_job(folder.folder)
               and slug in (None, folder.slug.split("/")[0])]
        require(bool(own) or slug is None, f"<!-- predictions:{slug}:start -->: no study results/{slug}/")
        return predictions.prediction_table(own) or "No run of a study was predicted yet."

    def cost(self, slug: str) -> str:
        """The worked cost example from the study's baseline (``cost:<slug>``)."""
        baseline = self.study(slug, "cost").ok_rows.get("baseline")
        text = tables.cost_table(baseline) if baseline else None
        return text or "Not generated: no `baseline` run recorded with a whole epoch and its FLOPs."

    def value(self, slug: str, run: str, field: str) -> str:
        """One figure (a key of :func:`inline_figures`) of run ``run`` in ``results/<slug>/``; a dash without
        it."""
        folder = next((folder for folder in self.studies if folder.slug == slug), None)
        row = folder.ok_rows.get(run) if folder else None
        if row is None:
            return DASH
        values = inline_figures(row, folder)
        require(field in values,
                f"<!-- v:{slug}:{run}:{field} -->: unknown field (one of {', '.join(values)})")
        return values[field]

    def results_of(self, folder: ResultsFolder) -> list[str]:
        """One study's results section: heading, conditions, the table, the budget table and the plots."""
        hardware = next((row.records[0].get("hardware") or {} for row in folder.rows if row.ok), {})
        kind = "CPU" if hardware.get("accelerator") == "cpu" else "GPU"
        parts = [f"### {kind} results: {hardware.get('device_name')} (`{folder.slug}`)", "", folder.header(),
                 "", tables.main_table(folder.rows, folder.marks), ""]
        parts += [*tables.price_notes(folder.rows), ""]
        if folder.budget:
            parts += [f"Largest micro-batch under {folder.budget[0].budget_mib / 1024:g} GiB:", "",
                      tables.budget_table(folder.budget), ""]
        parts += [f"![{caption}]({self.rel(folder.folder / name)})" for name, caption in PLOTS.items()
                  if (folder.folder / name).is_file()]
        table_md = self.rel(folder.folder / "table.md")
        return [*parts, "", f"Anatomy and failed runs: [{table_md}]({table_md}).", ""]

    def results(self, slug: str | None = None) -> str:
        """Every study's results section, or (``results:<slug>``) one study's."""
        folders = [folder for folder in self.top if slug in (None, folder.slug)]
        require(slug is None or bool(folders), f"<!-- results:{slug}:start -->: no study results/{slug}/")
        parts = [line for folder in folders for line in self.results_of(folder)]
        if not parts:
            return "No study results yet: run `uv run python -m modelwright study`."
        return "\n".join(parts)

    def scaleout(self) -> str:
        row = next((folder.ok_rows["baseline"] for folder in self.top if "baseline" in folder.ok_rows), None)
        text = tables.scaleout_table(row.records[0]) if row else None
        return text or "Not generated: no `baseline` run recorded with what the planner needs."

    def attention(self) -> str:
        parts = []
        for folder in self.top:
            text = tables.attention_table(read_json(folder.folder / "attention.json"))
            if not text:
                continue
            png = folder.folder / "attention.png"
            image = f"\n\n![Attention: peak memory and step time against sequence length]({self.rel(png)})"
            parts.append(f"`{folder.slug}`:\n\n{text}" + (image if png.is_file() else ""))
        return "\n\n".join(parts) or "Not measured yet: run `uv run python benchmarks/attention.py`."

    def benchmark(self, what: str, render: Callable[..., str], *files: str) -> str:
        """``render`` over the benchmark ``files`` (read as JSON, None where absent) of each results folder
        with any."""
        found = {folder.name: [read_json(folder / name) for name in files]
                 for folder in sorted(self.root.iterdir()) if folder.is_dir()}
        parts = [f"`{folder}`:\n\n{render(*data)}" for folder, data in found.items() if any(data)]
        return "\n\n".join(parts) or f"No {what} measurement recorded yet."


def main_job_text(result: Mapping) -> str:
    header = ["command", "wall time, start to exit", "time per epoch", "median step", "data", "final val/acc",
              "precision", "machine"]
    step = result.get("step_time_median_ms")
    row = [f"`{result['command']}`", duration(result["process_wall_time_s"]),
           duration(result.get("epoch_time_s")),
           sig(step, suffix=" ms"), result.get("data", "synthetic"), sig(result["val_acc"]),
           result["precision"], machine_text(result)]
    return table(header, [row])


def spread_text(values: list, what: str) -> str:
    return f"{ratio(min(values, default=None))}–{ratio(max(values, default=None))} ({len(values)} {what})"


def callback_overhead_rows(callback: Mapping) -> list[list]:
    hooks_ms = (callback.get("hooks_ms_per_step") or {}).get("median")
    command = f"`{callback['command']}`"
    return [["measurement callbacks, hooks timed directly", f"{sig(hooks_ms, 2)} ms per step",
             pct(callback.get("hooks_fraction_of_step"), 2), DASH, command],
            ["measurement callbacks on ÷ off, paired runs", ratio(callback["ratio_on_off"], 3), DASH,
             spread_text(callback.get("pair_ratios") or [], "pairs"), command]]


def loop_overhead_rows(result: Mapping) -> list[list]:
    if result.get("mode") == "epoch":
        prefix, what = "epoch_", "time per epoch"
    else:
        prefix, what = "", "median step"
    rows = []
    for name, loop in result["loops"].items():
        if name == "raw":
            continue
        rows.append([f"{name} ÷ raw PyTorch loop, {result['settings']['model']}, {what}",
                     ratio(loop[f"{prefix}ratio_to_raw"], 3), DASH,
                     spread_text(loop.get(f"repeat_{prefix}ratios_to_raw") or [], "repeats"),
                     f"`{result['command']}`"])
    return rows


def overhead_text(callback: Mapping | None, *loops: Mapping | None) -> str:
    loops = [result for result in loops if result]
    rows = callback_overhead_rows(callback) if callback else []
    for result in loops:
        rows += loop_overhead_rows(result)
    header = ["what", "figure", "share of a step", "spread", "command"]
    return f"{machine_text(callback or loops[0])}:\n\n" + table(header, rows, "lrrrl")


def cpu_defaults_text(result: Mapping) -> str:
    body = []
    for group in result["groups"]:
        for option in group["options"]:
            value = option["option"].split("=", 1)[1] + (" **(default)**" if option["default"] else "")
            body.append([group["group"], value, f"{sig(option['median_step_ms'])} ms",
                         ratio(option["ratio_to_reference"]), pct(option.get("mfu")),
                         sig(option.get("minor_faults_per_step"))])
    # A file made before MFU used the hardware peak divides by a measured kernel.
    if result.get("peak_flops_source") == "measured-matmul":
        mfu, peak = "% of kernel peak", "the best measured kernel"
    else:
        mfu, peak = "MFU", "the fp32 peak"
    header = ["setting", "option", "median step", "vs first option", mfu, "minor page faults per step"]
    rounds = result["settings"]["rounds"]
    peak_gflops = sig(result["peak_flops_per_s"] / 1e9)
    return (f"`{result['command']}` ({rounds} rounds; {machine_text(result)}; {mfu} of {peak}, {peak_gflops} "
            f"GFLOP/s):\n\n" + table(header, body, "llrrrr"))


def update(docs: list[Path], results: Path, allow_mixed: bool = False) -> list[Path]:
    """Fill the sections of each document; returns those that changed. The records are read once, for all."""
    if not docs:
        return []
    sections = Sections(results, docs[0].parent.resolve(), allow_mixed)
    changed = []
    for doc in docs:
        sections.doc_dir = doc.parent.resolve()  # what links are relative to
        if write_sections(doc, sections):
            changed.append(doc)
    return changed
