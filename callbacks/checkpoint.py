"""Lightning's checkpointing, made safe to kill: checkpoints a resume can continue from exactly, written atomically.

:class:`ModelCheckpoint` keeps Lightning's name and arguments, so the CLI and the study treat it as theirs, and
changes two things. A step checkpoint due on a batch that a validation follows is written after that validation:
written before it, the resumed run would skip that validation, which Lightning's loop counts as done. And a
``fast_dev_run`` saves nothing: Lightning 2.6 skips every save of one but the ``save_last`` one in ``on_train_end``,
which lands in ``./checkpoints`` (the run's dummy logger has no folder).

:class:`AtomicCheckpointIO` (``trainer.plugins`` in configs/base.yaml): Lightning writes a checkpoint to a temp file
in the system's temp folder and moves it into place, which is a copy over the old file when the two folders are on
different filesystems; a kill or a full disk during that copy leaves neither checkpoint loadable. This writes the
temp file beside the destination, fsyncs it and renames it over the old one (``modelwright.record.write_atomic``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from modelwright.record import write_atomic


class ModelCheckpoint(_LightningCheckpoint):
    """``lightning.pytorch.callbacks.ModelCheckpoint``, with the same arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._after_validation = False

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        due = self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
        if due and not self._should_skip_saving_checkpoint(trainer) and validation_follows(trainer):
            self._after_validation = True
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._after_validation and not self._should_skip_saving_checkpoint(trainer):
            self._after_validation = False
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_validation_end(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.fast_dev_run:
            super().on_train_end(trainer, pl_module)


def validation_follows(trainer: pl.Trainer) -> bool:
    """Whether Lightning validates right after the current training batch: its own rule (a private method)."""
    data_fetcher = trainer.fit_loop._data_fetcher
    return bool(trainer.enable_validation and data_fetcher is not None
                and trainer.fit_loop.epoch_loop._should_check_val_fx(data_fetcher))


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves replace the previous file only once the new one is on disk."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None or "://" in str(path):  # remote storage: Lightning's own transaction
            return super().save_checkpoint(checkpoint, path, storage_options)
        write_atomic(path, lambda f: torch.save(checkpoint, f))
