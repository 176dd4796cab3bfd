"""The study's report: records → ``table.md``, ``summary.json`` and plots per results folder, and the
generated sections of README.md and docs/*.md (:mod:`.readme`); the same records always give the same text.

To run: ``uv run python -m modelwright report`` (every ``results/<hardware>/``; the study runs it at its end).
"""

import dataclasses
import json
from pathlib import Path

from modelwright import REPO_ROOT, repo_path
from modelwright.errors import require
from modelwright.fmt import table
from modelwright.record import write_text_atomic
from modelwright.report import predictions, tables
from modelwright.report.plots import PLOTS, plot_all
from modelwright.report.readme import ResultsFolder, update
from modelwright.study_rows import CONFIDENCE, Row

NOTES = ("Peak MiB: the CUDA allocator's peak on a GPU; on a CPU the peak of PyTorch's memory tracker "
         "over one step (it sees eager code only: compiled runs are not measured). Step ms: the median over "
         "repeats of each repeat's median optimizer step; min–max: the repeats' medians. The interval: a "
         "95% bootstrap over the pairs of a row's repeat and its baseline's of the same round (the same "
         "plan, run in turn); a row is faster or slower only where it leaves out 1.0. MFU and samples/s: at "
         "the median step. Time per epoch: one full configured epoch (its steps, data loading and "
         "validations), measured in a run of its own; cost: that time, or 1,000 samples at the median step's "
         "samples/s, at the listed price below. Train loss: the mean of the last logged steps, shown where a "
         "run has seen as many samples as the baseline. An artifact in the anatomy: activations still held "
         "after the step.")


PREDICTION_NOTE = ("Each run's peak, by category, as predicted and written to predictions.jsonl before the "
                   "run started; each line's `from` says how (today: `rehearsal`, its step rehearsed at two "
                   "small micro-batches; earlier studies: the replay of one profiled baseline step).")


def render_table_md(folder: ResultsFolder) -> str:
    parts = [f"# Efficiency study: {folder.slug}", folder.header(), "## Memory and speed",
             tables.main_table(folder.rows, folder.marks), NOTES, *tables.price_notes(folder.rows),
             "## Memory anatomy (MiB)", tables.anatomy_table(folder.rows)]
    epochs = tables.epoch_table(folder.rows)
    if epochs:
        parts += ["## Time per epoch", epochs]
    if folder.budget:
        budget_gib = folder.budget[0].budget_mib / 1024
        parts += [f"## Largest batch under {budget_gib:g} GiB", tables.budget_table(folder.budget)]
    predicted = predictions.prediction_table([folder])
    if predicted:
        parts += ["## Predicted before each run", PREDICTION_NOTE, predicted]
    failed = [[row.name, row.status, row.error or ""] for row in folder.rows if not row.ok]
    if failed:
        parts += ["## Runs that did not finish", table(["run", "status", "error"], failed, "lll")]
    return "\n\n".join(parts) + "\n"


def row_summary(row: Row) -> dict:
    """One row of ``summary.json``: its figures and ratios, or its error."""
    summary = {"name": row.name, "status": row.status, "model": row.model,
               "reference": row.reference and row.reference.name}
    if not row.ok:
        return summary | {"error": row.error}
    return summary | dataclasses.asdict(row.figures) | {
        "setup": tables.setup_text(row.records[0]), "memory_vs_reference": row.vs("peak_mib"),
        "time_vs_reference": row.vs("step_ms"), "verdict": row.verdict,
        "time_interval": row.interval and {"low": row.interval.low, "high": row.interval.high,
                                           "pairs": row.interval.pairs, "confidence": CONFIDENCE},
        "run_ids": [record.get("run_id") for record in row.records], "epoch": epoch_summary(row),
        "cost_usd": cost_summary(row)}


def epoch_summary(row: Row) -> dict | None:
    epoch = row.epoch
    if epoch is None:
        return None
    return {"time_s": epoch.time_s, "steps": epoch.steps, "validation_s": epoch.validation_s,
            "validations": epoch.validations, "validation_share": epoch.validation_share,
            "run_id": epoch.record.get("run_id")}


def cost_summary(row: Row) -> dict | None:
    """The row's estimated cost, with the price and its source."""
    cost = tables.row_cost(row)
    if cost is None:
        return None
    return {"per_epoch": cost.per_epoch, "per_1000_samples": cost.per_1000_samples,
            "usd_per_hour": cost.price.usd_per_hour, "priced_as": cost.price.what,
            "source": cost.price.source, "estimate": True}


def summary(folder: ResultsFolder) -> dict:
    """A machine-readable digest of the table."""
    budget = [{key: value for key, value in row.__dict__.items() if key != "records"} | {"fits": row.fits}
              for row in folder.budget]
    return {"slug": folder.slug, "runs": [row_summary(row) for row in folder.rows], "budget": budget,
            "process_time_s": folder.wall_s, "provenance_groups": folder.marks,
            "plots": [name for name in PLOTS if (folder.folder / name).is_file()]}


def generate(results_dir: str | Path, readme: str | Path | None = None, plots: bool = True,
             allow_mixed: bool = False) -> list[Path]:
    """Write ``table.md``, ``summary.json`` and the plots into ``results_dir``, and ``readme``'s sections if
    given."""
    folder = ResultsFolder(Path(results_dir), allow_mixed)
    table_md = write_text_atomic(folder.folder / "table.md", render_table_md(folder))
    pngs = plot_all(folder.rows, folder.budget, folder.folder, folder.slug) if plots else []
    digest = json.dumps(summary(folder), indent=2, allow_nan=False) + "\n"  # after the plots: it lists them
    written = [table_md, write_text_atomic(folder.folder / "summary.json", digest), *pngs]
    if readme is not None:
        written += update([Path(readme)], folder.folder.parent, allow_mixed)
    return written


def report(results: Path | None = None, readme: Path = Path("README.md"), docs: bool = True,
           plots: bool = True, allow_mixed: bool = False) -> int:
    """Rebuild every results folder's table, summary and plots, then the generated sections of the documents.

    Args:
        results: the folder holding ``<hardware>/records.jsonl`` folders (default: the project's ``results``).
        readme: the README whose marked sections to fill.
        docs: also fill the marked sections of ``docs/*.md`` beside the README.
        plots: write the PNG plots.
        allow_mixed: put records of different commits or definitions in one table, marked, instead of
            refusing.
    """
    results = Path(results) if results is not None else REPO_ROOT / "results"
    # A study's folder, or one a study wrote inside another (``--results results/extra``); not a check of a
    # few runs kept beside a study (records without a study.json).
    studies = [path.parent for path in results.glob("*/*/study.json")]
    folders = sorted(path for path in [*results.glob("*"), *studies] if (path / "records.jsonl").is_file())
    require(bool(folders),
            f"{results}: no <hardware>/records.jsonl (run `python -m modelwright study` first)")
    written = [path for folder in folders for path in generate(folder, plots=plots, allow_mixed=allow_mixed)]
    readme = repo_path(readme)
    documents = sorted((readme.parent / "docs").glob("*.md")) if docs else []
    marked = [doc for doc in documents if ":start -->" in doc.read_text("utf-8")]
    written += update([readme, *marked], results, allow_mixed)
    print("\n".join(map(str, written)))
    return 0
