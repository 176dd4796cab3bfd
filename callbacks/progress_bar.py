"""A progress bar that redraws at most every ``min_interval_s`` seconds.

Lightning's ``TQDMProgressBar`` redraws the bar and its metrics after every batch (``refresh_rate: 1``), and a
redraw costs milliseconds: on the small CNN, whose steps take about 0.3 s on a 2-core CPU, it was the whole of
the Lightning loop's lead over a raw loop (``benchmarks/overhead.py --model smallcnn --epoch``). A fixed
``refresh_rate`` of N batches would leave a resnet18 step of seconds without news for N of them; a clock does not.
The last batch of each pass always redraws, so the bar ends on the true count.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lightning.pytorch.callbacks import TQDMProgressBar


class ThrottledProgressBar(TQDMProgressBar):
    """``TQDMProgressBar`` whose bars redraw at most every ``min_interval_s`` seconds (and at a pass's end).

    Args:
        min_interval_s: least time between two redraws of a bar; 0 redraws as ``refresh_rate`` alone says.
        refresh_rate: as ``TQDMProgressBar``'s: consider a redraw every this many batches.
        leave: as ``TQDMProgressBar``'s: keep the finished bar of each epoch.
    """

    def __init__(
        self, min_interval_s: float = 0.5, refresh_rate: int = 1, leave: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        if min_interval_s < 0:
            raise ValueError(f"ThrottledProgressBar.min_interval_s: must be >= 0, got {min_interval_s}")
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._last_redraw = -float("inf")
        self._last_batch: int | None = None  # batches done in the current training pass

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._last_batch = batch_idx + 1
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer, pl_module) -> None:
        # A run stopped mid-epoch (max_steps, a signal) ends on its true count, not the last throttled redraw.
        bar = self._train_progress_bar
        if bar is not None and not bar.disable and self._last_batch is not None and bar.n != self._last_batch:
            bar.n = self._last_batch
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()
        super().on_train_end(trainer, pl_module)

    def _should_update(self, current: int, total: int) -> bool:  # TQDMProgressBar's one decision point
        if not super()._should_update(current, total):
            return False
        now = self._clock()
        if current == total or now - self._last_redraw >= self.min_interval_s:
            self._last_redraw = now
            return True
        return False
