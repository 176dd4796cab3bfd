"""The study's report: records → ``table.md``, ``summary.json`` and plots per results folder, and the generated
sections of README.md and docs/*.md.

To run: ``uv run python -m modelwright report`` (every ``results/<hardware>/``; the study runs it at its end).

The same records always give the same text. Tables come from :mod:`.tables`, plots from :mod:`.plots`, and
:mod:`.readme` is the one writer into documents: only between ``<!-- name:start -->`` / ``<!-- name:end -->``.
"""

from __future__ import annotations

import json
from pathlib import Path

from modelwright import REPO_ROOT
from modelwright.errors import require
from modelwright.report import tables
from modelwright.report.plots import PLOTS, plot_all
from modelwright.report.readme import Study, update

__all__ = ["PLOTS", "generate", "render_table_md", "report", "summary"]

NOTES = (
    "Peak MiB: the CUDA allocator's peak on a GPU; on a CPU the peak of PyTorch's memory tracker over one step "
    "(compiled code on a CPU is not measured: the tracker sees eager code). Step ms: the median over repeats of each "
    "repeat's median optimizer step; the spread is the min–max of those repeat medians. A row is called faster or "
    "slower only when its ratio leaves the baseline's own repeat spread. Train loss: the mean over the last logged "
    "steps, shown only where a run has seen as many samples as the baseline. An artifact in the anatomy: "
    "activations still held after the step (data the tracker counted)."
)


def render_table_md(study: Study) -> str:
    """The whole ``table.md`` of one results folder."""
    parts = [f"# Efficiency study: {study.slug}", "", study.header(), "", "## Memory and speed", "",
             tables.main_table(study.rows, study.marks), "", NOTES, "", "## Memory anatomy (MiB)", "",
             tables.anatomy_table(study.rows), ""]
    if study.budget:
        parts += [f"## Largest batch under {study.budget[0].budget_mib / 1024:g} GiB", "",
                  tables.budget_table(study.budget), ""]
    if any(not r.ok for r in study.rows):
        parts += ["## Runs that did not finish", "", tables.failed_table(study.rows), ""]
    return "\n".join(parts)


def summary(study: Study) -> dict:
    """A machine-readable digest of the table."""
    runs = [{"name": r.name, "status": r.status, "model": r.model,
             "reference": r.reference.name if r.reference else None}
            | (dict(r.v, setup=tables.setup_text(r.records[0]), memory_vs_reference=r.vs("peak_mib"),
                    time_vs_reference=r.vs("step_ms"), verdict=r.verdict,
                    run_ids=[x.get("run_id") for x in r.records]) if r.ok else {"error": r.error})
            for r in study.rows]
    budget = [{k: v for k, v in b.__dict__.items() if k != "records"} | {"fits": b.fits} for b in study.budget]
    return {"slug": study.slug, "runs": runs, "budget": budget, "process_time_s": study.wall_s,
            "provenance_groups": study.marks, "plots": [n for n in PLOTS if (study.folder / n).is_file()]}


def generate(results_dir: str | Path, readme: str | Path | None = None, plots: bool = True,
             allow_mixed: bool = False) -> list[Path]:
    """Write ``table.md``, ``summary.json`` and the plots into ``results_dir``; fill ``readme``'s sections if given.

    Returns:
        The paths written.
    """
    study = Study.load(Path(results_dir), allow_mixed)
    out = [study.folder / "table.md", study.folder / "summary.json"]
    out[0].write_text(render_table_md(study), encoding="utf-8")
    if plots:
        out += plot_all(study.rows, study.budget, study.folder, study.slug)
    out[1].write_text(json.dumps(summary(study), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    if readme is not None:
        out += update([Path(readme)], study.folder.parent, allow_mixed)
    return out


def report(results: Path | None = None, readme: Path = Path("README.md"), docs: bool = True, plots: bool = True,
           allow_mixed: bool = False) -> int:
    """Rebuild every results folder's table, summary and plots, then the generated sections of the documents.

    Args:
        results: the folder holding ``<hardware>/records.jsonl`` folders (default: the project's ``results``).
        readme: the README whose marked sections to fill.
        docs: also fill the marked sections of ``docs/*.md`` beside the README.
        plots: write the PNG plots.
        allow_mixed: put records of different commits or definitions in one table, marked, instead of refusing.

    Returns:
        0 on success (a user error raises ConfigError: one line, exit status 2).
    """
    results = Path(results) if results is not None else REPO_ROOT / "results"
    folders = sorted(p for p in results.glob("*") if (p / "records.jsonl").is_file())
    require(bool(folders), f"{results}: no <hardware>/records.jsonl (run `python -m modelwright study` first)")
    written = [p for f in folders for p in generate(f, plots=plots, allow_mixed=allow_mixed)]
    readme = Path(readme) if Path(readme).is_absolute() or Path(readme).exists() else REPO_ROOT / readme
    documents = [readme]
    if docs:
        documents += [d for d in sorted((readme.parent / "docs").glob("*.md")) if ":start -->" in d.read_text("utf-8")]
    written += update(documents, results, allow_mixed)
    for path in written:
        print(path)
    return 0
