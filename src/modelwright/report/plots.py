"""The study's PNG plots (matplotlib's Agg renderer), from the rows of :mod:`modelwright.report.tables`."""

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modelwright.record import get_path
from modelwright.report.fmt import finite, ratio
from modelwright.report.tables import BudgetRow, Row

PLOTS = {
    "memory_anatomy.png": "Peak tensor memory per run, by what holds it",
    "step_time.png": "Step time per run (median of repeats; bars span the repeats' medians)",
    "memory_vs_time.png": "Peak memory against step time: the trade-off at a glance",
    "loss_curves.png": "Training loss of the same runs",
    "largest_batch.png": "Largest micro-batch under the memory budget",
}
COLORS = ("#4c72b0", "#55a868", "#8172b2", "#c44e52", "#dd8452", "#937860", "#da8bc3", "#8c8c8c")


def plot_all(rows: Sequence[Row], budget: Sequence[BudgetRow], out_dir: Path, title: str) -> list[Path]:
    """Write the plots of :data:`PLOTS` that have data into ``out_dir``; returns their paths."""
    from matplotlib.figure import Figure  # a bare Figure: no pyplot state, no global backend switch

    rows, written = [r for r in rows if r.ok], []
    if not rows:
        return []

    @contextlib.contextmanager
    def figure(name: str, heading: str, height: float, width: float | None = None, **labels: Any):
        ax = Figure(figsize=(width or max(6.0, 0.8 * len(rows) + 2), height)).subplots()
        if width is None:  # one bar (or stack) per run, named below it
            ax.set_xticks(range(len(rows)), [r.name for r in rows], rotation=30, ha="right")
        yield ax
        ax.set(title=f"{heading} ({title})", **labels)
        ax.figure.tight_layout()
        ax.figure.savefig(out_dir / name, dpi=110, metadata={"Software": None})  # no version stamp: same bytes
        written.append(out_dir / name)

    with figure("memory_anatomy.png", "Memory anatomy per run", 4.5, ylabel="MiB at the step's peak") as ax:
        bottom = [0.0] * len(rows)
        for key, color in zip(dict.fromkeys(k for r in rows for k in r.v["anatomy"]), COLORS, strict=False):
            vals = [r.v["anatomy"].get(key) or 0.0 for r in rows]
            ax.bar(range(len(rows)), vals, bottom=bottom, label=key.replace("_", " "), color=color)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))

    with figure("step_time.png", "Step time per run, median and spread of repeats", 4.0,
                ylabel="ms per optimizer step") as ax:
        med = [r.v["step_ms"] or 0.0 for r in rows]
        lo = [m - (r.v["step_lo"] or m) for m, r in zip(med, rows, strict=True)]
        hi = [(r.v["step_hi"] or m) - m for m, r in zip(med, rows, strict=True)]
        ax.bar(range(len(rows)), med, yerr=[lo, hi], capsize=4, color=COLORS[0])
        for i, r in enumerate(rows):
            ax.text(i, med[i] + hi[i], ratio(r.vs("step_ms")), ha="center", va="bottom", fontsize=8)

    with figure("memory_vs_time.png", "Memory vs time, lower left is better", 5.0, 6.5,
                xlabel="step time, ms (median)", ylabel="peak memory, MiB") as ax:
        points = [(r, r.v["step_ms"], r.v["peak_mib"]) for r in rows if r.v["step_ms"] and r.v["peak_mib"]]
        for r, t, m in points:
            ref = r is r.reference
            ax.scatter([t], [m], s=60 if ref else 40, marker="*" if ref else "o", color=COLORS[3 if ref else 0])
            ax.annotate(r.name, (t, m), textcoords="offset points", xytext=(5, 4), fontsize=8)
            if ref:  # a point left of and below both lines wins on both counts
                ax.axvline(t, color=COLORS[3], linestyle=":", linewidth=1)
                ax.axhline(m, color=COLORS[3], linestyle=":", linewidth=1)
        ax.set_xlim(0, max((p[1] for p in points), default=1.0) * 1.18)  # from zero: distances read as ratios
        ax.set_ylim(0, max((p[2] for p in points), default=1.0) * 1.12)
        ax.grid(alpha=0.3)

    with figure("loss_curves.png", "Training loss", 4.5, 6.5, xlabel="optimizer step", ylabel="train/loss") as ax:
        for r in rows:
            pts = [p for p in get_path(r.records[0], "history.train/loss") or [] if finite(p[1]) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=r.name)
        ax.legend(fontsize=7, ncols=2)
        ax.grid(alpha=0.3)

    if confirmed := [b for b in budget if b.batch]:
        with figure("largest_batch.png", f"Largest batch under {confirmed[0].budget_mib / 1024:g} GiB",
                    0.5 * len(confirmed) + 1.8, 6.5,
                    xlabel="largest micro-batch (green: confirmed under the budget)") as ax:
            ax.barh(range(len(confirmed)), [b.batch for b in confirmed],
                    color=[COLORS[1] if b.fits else COLORS[3] for b in confirmed])
            for i, b in enumerate(confirmed):
                peak = f"{b.measured_mib:.0f} MiB" if b.measured_mib is not None else b.status
                ax.text(b.batch, i, f" {b.batch} ({peak})", va="center", fontsize=8)
            ax.set_yticks(range(len(confirmed)), [b.name for b in confirmed])
            ax.invert_yaxis()
            ax.margins(x=0.25)
    return written
