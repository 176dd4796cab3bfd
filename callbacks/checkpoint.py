"""Lightning's checkpointing, made safe to kill: checkpoints a resume can continue from exactly, written
atomically.

:class:`ModelCheckpoint` defers a step checkpoint due on a batch that a validation follows until after that
validation (saved before it, a resumed run skips it: Lightning counts it done), and saves nothing on a
``fast_dev_run``. :class:`AtomicCheckpointIO`: Lightning moves a checkpoint from the system's temp folder, a
copy across filesystems that a kill leaves half-done; this writes beside the destination, fsyncs and
renames."""

import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from callbacks import _lightning
from modelwright.record import write_atomic


class ModelCheckpoint(_LightningCheckpoint):
    """``lightning.pytorch.callbacks.ModelCheckpoint``, with the same arguments."""

    _after_validation = False

    def setup(self, trainer, pl_module, stage) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            super().setup(trainer, pl_module, stage)
        for warning in caught:
            # A resumed fit goes on in its run's folder: its own last*.ckpt there are no other run's files.
            if "exists and is not empty" in str(warning.message) and _only_last_checkpoints(self.dirpath):
                continue
            warnings.warn(warning.message, stacklevel=2)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        every = _lightning.every_n_train_steps(self)
        due = every >= 1 and trainer.global_step % every == 0
        if due and not _lightning.skips_saving(self, trainer) and _lightning.validation_follows(trainer):
            self._after_validation = True
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._after_validation and not _lightning.skips_saving(self, trainer):
            self._after_validation = False
            _lightning.save_checkpoint_now(self, trainer)
        super().on_validation_end(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if not trainer.fast_dev_run:
            super().on_train_end(trainer, pl_module)


def _only_last_checkpoints(folder: str) -> bool:
    return all(path.match("last*.ckpt") for path in Path(folder).iterdir())


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves replace the previous file only once the new one is on disk."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None or "://" in str(path):  # remote storage: Lightning's own transaction
            return super().save_checkpoint(checkpoint, path, storage_options)
        write_atomic(path, lambda f: torch.save(checkpoint, f))
