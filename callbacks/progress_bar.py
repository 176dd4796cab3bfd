"""A throttled progress bar: Lightning's ``TQDMProgressBar`` redraws after every batch, at milliseconds a
redraw; on the small CNN that was the whole of the Lightning loop's lead over a raw loop
(``benchmarks/overhead.py --model smallcnn --epoch``). A ``refresh_rate`` of N batches would leave resnet18's
steps of seconds without news; a clock does not. (tqdm's ``mininterval`` does not apply: Lightning calls
``refresh()`` itself.)"""

import time
from collections.abc import Callable

from lightning.pytorch.callbacks import TQDMProgressBar


class ThrottledProgressBar(TQDMProgressBar):
    """``TQDMProgressBar`` whose bars redraw at most every ``min_interval_s`` seconds (0: as ``refresh_rate``
    alone says), and always at a pass's last batch; ``refresh_rate`` and ``leave`` as ``TQDMProgressBar``'s. A
    skipped redraw skips Lightning's whole batch-end update: the next one sets the bar's count absolutely."""

    def __init__(self, min_interval_s: float = 0.5, refresh_rate: int = 1, leave: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        if min_interval_s < 0:
            raise ValueError(f"ThrottledProgressBar.min_interval_s: must be >= 0, got {min_interval_s}")
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._last_redraw = -float("inf")

    def due(self, current: int, total: int | float | None) -> bool:
        """Whether the bar at batch ``current`` of ``total`` redraws now (and, if so, that it did)."""
        now = self._clock()
        if current != total and now - self._last_redraw < self.min_interval_s:
            return False
        self._last_redraw = now
        return True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.due(batch_idx + 1, self.train_progress_bar.total):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self.due(batch_idx + 1, self.val_progress_bar.total):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_train_end(self, trainer, pl_module) -> None:
        # A run stopped mid-epoch (max_steps, a signal) ends on its true count, not the last throttled redraw.
        bar = self.train_progress_bar
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if not bar.disable and bar.n != done:
            bar.n = done
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()
        super().on_train_end(trainer, pl_module)
