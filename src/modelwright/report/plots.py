"""The study's PNG plots (matplotlib's Agg renderer), from the rows of :mod:`modelwright.study_rows`."""

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from modelwright.fmt import finite, ratio
from modelwright.record import get_path
from modelwright.study_rows import BudgetRow, Row

PLOTS = {
    "memory_anatomy.png": "Peak tensor memory per run, by what holds it",
    "step_time.png": "Step time per run (median of repeats; bars span the repeats' medians)",
    "memory_vs_time.png": "Peak memory against step time: the trade-off at a glance",
    "loss_curves.png": "Training loss of the same runs",
    "largest_batch.png": "Largest micro-batch under the memory budget",
}
COLORS = ("#4c72b0", "#55a868", "#8172b2", "#c44e52", "#dd8452", "#937860", "#da8bc3", "#8c8c8c")


class PlotWriter:
    """Figures of one study's ``ok`` rows, each saved as a PNG in ``out_dir`` under the study's ``title``."""

    def __init__(self, rows: Sequence[Row], out_dir: Path, title: str) -> None:
        self.rows = rows
        self.out_dir = out_dir
        self.title = title
        self.written: list[Path] = []

    @contextlib.contextmanager
    def figure(self, name: str, heading: str, height: float, width: float | None = None,
               **labels: Any) -> Iterator[Any]:
        """The axes of one figure; without ``width``, one bar (or stack) per run, named below it."""
        from matplotlib.figure import Figure  # a bare Figure: no pyplot state, no global backend switch

        axes = Figure(figsize=(width or max(6.0, 0.8 * len(self.rows) + 2), height)).subplots()
        if width is None:
            axes.set_xticks(range(len(self.rows)), [row.name for row in self.rows], rotation=30, ha="right")
        yield axes
        axes.set(title=f"{heading} ({self.title})", **labels)
        axes.figure.tight_layout()
        axes.figure.savefig(self.out_dir / name, dpi=110, metadata={"Software": None})  # no version stamp
        self.written.append(self.out_dir / name)


def plot_anatomy(plots: PlotWriter) -> None:
    rows = plots.rows
    with plots.figure("memory_anatomy.png", "Memory anatomy per run", 4.5,
                      ylabel="MiB at the step's peak") as axes:
        bottom = [0.0] * len(rows)
        categories = dict.fromkeys(key for row in rows for key in row.figures.anatomy)
        for category, color in zip(categories, COLORS, strict=False):
            heights = [row.figures.anatomy.get(category) or 0.0 for row in rows]
            axes.bar(range(len(rows)), heights, bottom=bottom, label=category.replace("_", " "), color=color)
            bottom = [below + height for below, height in zip(bottom, heights, strict=True)]
        axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_step_time(plots: PlotWriter) -> None:
    rows = plots.rows
    with plots.figure("step_time.png", "Step time per run, median and spread of repeats", 4.0,
                      ylabel="ms per optimizer step") as axes:
        medians = [row.figures.step_ms or 0.0 for row in rows]
        below = [mid - (row.figures.step_lo or mid) for mid, row in zip(medians, rows, strict=True)]
        above = [(row.figures.step_hi or mid) - mid for mid, row in zip(medians, rows, strict=True)]
        axes.bar(range(len(rows)), medians, yerr=[below, above], capsize=4, color=COLORS[0])
        for i, row in enumerate(rows):
            axes.text(i, medians[i] + above[i], ratio(row.vs("step_ms")), ha="center", va="bottom",
                      fontsize=8)


def plot_memory_vs_time(plots: PlotWriter) -> None:
    points = [row for row in plots.rows if row.figures.step_ms and row.figures.peak_mib]
    with plots.figure("memory_vs_time.png", "Memory vs time, lower left is better", 5.0, 6.5,
                      xlabel="step time, ms (median)", ylabel="peak memory, MiB") as axes:
        for row in points:
            step, peak = row.figures.step_ms, row.figures.peak_mib
            is_reference = row is row.reference
            axes.scatter([step], [peak], s=60 if is_reference else 40, marker="*" if is_reference else "o",
                         color=COLORS[3 if is_reference else 0])
            axes.annotate(row.name, (step, peak), textcoords="offset points", xytext=(5, 4), fontsize=8)
            if is_reference:  # a point left of and below both lines wins on both counts
                axes.axvline(step, color=COLORS[3], linestyle=":", linewidth=1)
                axes.axhline(peak, color=COLORS[3], linestyle=":", linewidth=1)
        # From zero: distances read as ratios.
        axes.set_xlim(0, max((row.figures.step_ms for row in points), default=1.0) * 1.18)
        axes.set_ylim(0, max((row.figures.peak_mib for row in points), default=1.0) * 1.12)
        axes.grid(alpha=0.3)


def plot_losses(plots: PlotWriter) -> None:
    with plots.figure("loss_curves.png", "Training loss", 4.5, 6.5, xlabel="optimizer step",
                      ylabel="train/loss") as axes:
        for row in plots.rows:
            history = get_path(row.records[0], "history.train/loss") or []
            points = [point for point in history if finite(point[1]) is not None]
            if points:
                steps = [point[0] for point in points]
                axes.plot(steps, [point[1] for point in points], marker=".", label=row.name)
        axes.legend(fontsize=7, ncols=2)
        axes.grid(alpha=0.3)


def plot_largest_batch(plots: PlotWriter, confirmed: Sequence[BudgetRow]) -> None:
    with plots.figure("largest_batch.png", f"Largest batch under {confirmed[0].budget_mib / 1024:g} GiB",
                      0.5 * len(confirmed) + 1.8, 6.5,
                      xlabel="largest micro-batch (green: confirmed under the budget)") as axes:
        axes.barh(range(len(confirmed)), [row.batch for row in confirmed],
                  color=[COLORS[1] if row.fits else COLORS[3] for row in confirmed])
        for i, row in enumerate(confirmed):
            peak = f"{row.measured_mib:.0f} MiB" if row.measured_mib is not None else row.status
            axes.text(row.batch, i, f" {row.batch} ({peak})", va="center", fontsize=8)
        axes.set_yticks(range(len(confirmed)), [row.name for row in confirmed])
        axes.invert_yaxis()
        axes.margins(x=0.25)


def plot_all(rows: Sequence[Row], budget: Sequence[BudgetRow], out_dir: Path, title: str) -> list[Path]:
    """Write the plots of :data:`PLOTS` that have data into ``out_dir``; returns their paths."""
    ok = [row for row in rows if row.ok]
    if not ok:
        return []
    plots = PlotWriter(ok, out_dir, title)
    plot_anatomy(plots)
    plot_step_time(plots)
    plot_memory_vs_time(plots)
    plot_losses(plots)
    confirmed = [row for row in budget if row.batch]
    if confirmed:
        plot_largest_batch(plots, confirmed)
    return plots.written
