"""Lightning's ``ModelCheckpoint`` less one write: a ``fast_dev_run`` saves nothing, ``last.ckpt`` included.

Lightning 2.6 skips every save of a ``fast_dev_run`` but the ``save_last`` one in ``on_train_end``, which lands in
``./checkpoints`` (the run's dummy logger has no folder). The class keeps Lightning's name, so the CLI and the study
treat it as theirs.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningCheckpoint


class ModelCheckpoint(_LightningCheckpoint):
    """``lightning.pytorch.callbacks.ModelCheckpoint``, with the same arguments."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.fast_dev_run:
            super().on_train_end(trainer, pl_module)
