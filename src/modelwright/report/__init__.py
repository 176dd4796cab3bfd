"""The study's report: records → ``table.md``, ``summary.json`` and plots per results folder, and the generated
sections of README.md and docs/*.md (:mod:`.readme`); the same records always give the same text. To run: ``uv run
python -m modelwright report`` (every ``results/<hardware>/``; the study runs it at its end).
"""

import json
from pathlib import Path

from modelwright import REPO_ROOT
from modelwright.errors import require
from modelwright.record import write_text_atomic
from modelwright.report import tables
from modelwright.report.fmt import table
from modelwright.report.plots import PLOTS, plot_all
from modelwright.report.readme import Study, update

NOTES = ("Peak MiB: the CUDA allocator's peak on a GPU; on a CPU the peak of PyTorch's memory tracker over one step "
         "(it sees eager code only: compiled runs are not measured). Step ms: the median over repeats of each repeat's "
         "median optimizer step; a row is faster or slower only when its ratio leaves the baseline's min–max of those "
         "medians. Train loss: the mean of the last logged steps, shown where a run has seen as many samples as the "
         "baseline. An artifact in the anatomy: activations still held after the step.")


def render_table_md(study: Study) -> str:
    parts = [f"# Efficiency study: {study.slug}", study.header(), "## Memory and speed",
             tables.main_table(study.rows, study.marks), NOTES, "## Memory anatomy (MiB)",
             tables.anatomy_table(study.rows)]
    if budget := study.budget:
        parts += [f"## Largest batch under {budget[0].budget_mib / 1024:g} GiB", tables.budget_table(budget)]
    if failed := [[r.name, r.status, r.error or ""] for r in study.rows if not r.ok]:
        parts += ["## Runs that did not finish", table(["run", "status", "error"], failed, "lll")]
    return "\n\n".join(parts) + "\n"


def summary(study: Study) -> dict:
    """A machine-readable digest of the table."""
    runs = [{"name": r.name, "status": r.status, "model": r.model, "reference": r.reference and r.reference.name}
            | (dict(r.v, setup=tables.setup_text(r.records[0]), memory_vs_reference=r.vs("peak_mib"),
                    time_vs_reference=r.vs("step_ms"), verdict=r.verdict,
                    run_ids=[x.get("run_id") for x in r.records]) if r.ok else {"error": r.error})
            for r in study.rows]
    budget = [{k: v for k, v in b.__dict__.items() if k != "records"} | {"fits": b.fits} for b in study.budget]
    return {"slug": study.slug, "runs": runs, "budget": budget, "process_time_s": study.wall_s,
            "provenance_groups": study.marks, "plots": [n for n in PLOTS if (study.folder / n).is_file()]}


def generate(results_dir: str | Path, readme: str | Path | None = None, plots: bool = True,
             allow_mixed: bool = False) -> list[Path]:
    """Write ``table.md``, ``summary.json`` and the plots into ``results_dir``, and ``readme``'s sections if given."""
    study = Study(Path(results_dir), allow_mixed)
    table_md = write_text_atomic(study.folder / "table.md", render_table_md(study))
    pngs = plot_all(study.rows, study.budget, study.folder, study.slug) if plots else []
    digest = json.dumps(summary(study), indent=2, allow_nan=False) + "\n"  # after the plots: it lists them
    out = [table_md, write_text_atomic(study.folder / "summary.json", digest), *pngs]
    return out + (update([Path(readme)], study.folder.parent, allow_mixed) if readme is not None else [])


def report(results: Path | None = None, readme: Path = Path("README.md"), docs: bool = True, plots: bool = True,
           allow_mixed: bool = False) -> int:
    """Rebuild every results folder's table, summary and plots, then the generated sections of the documents.

    Args:
        results: the folder holding ``<hardware>/records.jsonl`` folders (default: the project's ``results``).
        readme: the README whose marked sections to fill.
        docs: also fill the marked sections of ``docs/*.md`` beside the README.
        plots: write the PNG plots.
        allow_mixed: put records of different commits or definitions in one table, marked, instead of refusing.
    """
    results = Path(results) if results is not None else REPO_ROOT / "results"
    folders = sorted(p for p in results.glob("*") if (p / "records.jsonl").is_file())
    require(bool(folders), f"{results}: no <hardware>/records.jsonl (run `python -m modelwright study` first)")
    written = [p for f in folders for p in generate(f, plots=plots, allow_mixed=allow_mixed)]
    readme = Path(readme) if Path(readme).is_absolute() or Path(readme).exists() else REPO_ROOT / readme
    documents = sorted((readme.parent / "docs").glob("*.md")) if docs else []
    written += update([readme, *(d for d in documents if ":start -->" in d.read_text("utf-8"))], results, allow_mixed)
    print("\n".join(map(str, written)))
    return 0
