"""The one module of callbacks/ that reads or calls private members of Lightning (and, through it, of torch's
GradScaler). Each function says what it relies on; ``tests/test_lightning_internals.py`` fails first when
Lightning changes them."""

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table


def validation_follows(trainer: pl.Trainer) -> bool:
    """Whether a validation runs after the current training batch: Lightning's own rule
    (``fit_loop._data_fetcher``, ``epoch_loop._should_check_val_fx``)."""
    fetcher = trainer.fit_loop._data_fetcher
    if not trainer.enable_validation or fetcher is None:
        return False
    return trainer.fit_loop.epoch_loop._should_check_val_fx(fetcher)


def every_n_train_steps(callback: ModelCheckpoint) -> int:
    """A ``ModelCheckpoint``'s ``every_n_train_steps`` (kept as ``_every_n_train_steps``)."""
    return callback._every_n_train_steps


def skips_saving(callback: ModelCheckpoint, trainer: pl.Trainer) -> bool:
    """Whether a ``ModelCheckpoint`` would save nothing now (a fast_dev_run, the sanity check, a step it
    saved already)."""
    return callback._should_skip_saving_checkpoint(trainer)


def save_checkpoint_now(callback: ModelCheckpoint, trainer: pl.Trainer) -> None:
    """What a ``ModelCheckpoint`` saves at a due step: its top-k and its ``last`` file."""
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


def grad_scale(trainer: pl.Trainer) -> torch.Tensor | None:
    """The enabled GradScaler's scale, as its device tensor ``_scale`` (``get_scale()`` stalls the host)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler._scale if scaler is not None and scaler.is_enabled() else None


def request_stop(trainer: pl.Trainer) -> None:
    """Make the fit stop as after SIGTERM: Lightning raises ``SIGTERMException`` at the end of the current
    batch (``_signal_connector.received_sigterm``)."""
    trainer._signal_connector.received_sigterm = True


def flop_counter(summary: Summary) -> Any:
    """The ``FlopCounterMode`` a Lightning model summary fills (``_flop_counter``)."""
    return summary._flop_counter


#: Lightning's model summary table as text.
format_summary_table = _format_summary_table
