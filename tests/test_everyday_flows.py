"""What a newcomer meets first (issue 39): TensorBoard opened as the README says, and the run's memory anatomy
figure there, read at the size of a card."""

from __future__ import annotations

import re

from conftest import REPO_ROOT
from modelwright.record import read_records
from modelwright.report.run_summary import TENSORBOARD_URL, anatomy_figure

#: The room, in screen pixels, for the image in a card of TensorBoard's time-series dashboard (2.21, a window
#: 1,400 px wide, measured on headless Chromium screenshots): the figure is scaled to fit it.
CARD_WIDTH_PX, CARD_HEIGHT_PX = 336, 210


def _a_recorded_run() -> dict:
    records = read_records(REPO_ROOT / "results" / "cpu-amd-epyc-avx512-2cores" / "records.jsonl")
    return next(record for record in records if (record.get("memory") or {}).get("anatomy_mib"))


def test_the_anatomy_legend_is_readable_at_card_size():
    """Before: an 800-pixel figure with a small legend, about 5 px high once TensorBoard scaled it to a card."""
    figure = anatomy_figure(_a_recorded_run())
    figure.canvas.draw()
    scale = min(CARD_WIDTH_PX / (figure.get_figwidth() * figure.dpi),
                CARD_HEIGHT_PX / (figure.get_figheight() * figure.dpi))
    texts = [text for legend in figure.legends for text in legend.get_texts()]
    assert texts, "the figure has a legend"
    for text in texts:
        pixels = text.get_fontsize() * figure.dpi / 72 * scale
        assert pixels >= 10, f"{text.get_text()!r}: {pixels:.1f} px at card size"


def test_the_readmes_tensorboard_url_opens_on_the_runs_own_scalars():
    """Before: TensorBoard opened on Lightning's `epoch` and `lr-AdamW` cards, with train/, val/, perf/ and mem/
    collapsed below them."""
    assert "tagFilter=" in TENSORBOARD_URL
    pattern = re.compile(re.search(r"tagFilter=([^&#]+)", TENSORBOARD_URL).group(1))
    for tag in ("train/loss", "val/acc", "perf/step_time_ms", "mem/peak_allocated_mib"):
        assert pattern.search(tag), tag
    for tag in ("epoch", "lr-AdamW"):
        assert not pattern.search(tag), tag
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert f"then open {TENSORBOARD_URL}" in readme
