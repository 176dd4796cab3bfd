"""What the callbacks share: the :class:`Measurement` interface, scalar logging, batch helpers, quiet logs."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback


class Measurement(Callback):
    """A callback that measures part of a run. The one way callbacks learn about each other, found with isinstance.

    Both methods have defaults (nothing to add, no step disturbed); a subclass overrides what applies.
    """

    def record_sections(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, dict]:
        """What this callback adds to the run record: ``{section: {key: value}}`` (``timing``, ``memory``, ...).

        :class:`callbacks.run_record.RunRecord` merges the sections of every measurement at the end of ``fit``.
        """
        return {}

    def perturbs(self, step: int) -> bool:
        """Whether this callback disturbs optimizer step ``step`` (``global_step`` as it began) with one-off
        work (an anatomy capture, a FLOP count); the step timer leaves such steps out."""
        return False


def measurements(trainer: pl.Trainer) -> list[Measurement]:
    return [cb for cb in trainer.callbacks if isinstance(cb, Measurement)]


def log_scalars(trainer: pl.Trainer, metrics: Mapping[str, float | None]) -> None:
    """Send finite scalars to every logger at the current optimizer step (loggers write on rank 0 only)."""
    clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
    for logger in trainer.loggers if clean else ():
        logger.log_metrics(clean, step=trainer.global_step)


def log_every(trainer: pl.Trainer, own: int | None) -> int:
    """Logging interval in optimizer steps: the callback's own, else the Trainer's ``log_every_n_steps``."""
    n = own if own is not None else getattr(trainer, "log_every_n_steps", 50)
    return max(1, int(n or 1))


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor of a batch: itself, the first of a tuple or list, or a dict's first value."""
    if isinstance(batch, torch.Tensor):
        return batch
    for item in batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ():
        t = first_tensor(item)
        if t is not None:
            return t
    return None


def batch_size_of(batch: Any) -> int | None:
    """Samples in a micro-batch: the leading dimension of its first tensor."""
    t = first_tensor(batch)
    return int(t.shape[0]) if t is not None and t.ndim > 0 else None


def unwrap_net(pl_module: pl.LightningModule, attr: str = "net") -> torch.nn.Module:
    """The network inside the LightningModule (``pl_module.<attr>``), or the module itself."""
    net = getattr(pl_module, attr, None) if attr else None
    return net if isinstance(net, torch.nn.Module) else pl_module


class _DropAdverts(logging.Filter):
    PREFIXES = ("💡 Tip:", "Trainer already configured with model summary callbacks")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.PREFIXES)


def quiet_lightning() -> None:
    """Silence, by exact message, output a user cannot act on: Lightning's logging-service adverts, the
    FutureWarning torch raises at Lightning's own use of ``LeafSpec``, and the model summary's note that it sizes
    mixed-precision parameters as fp32 (they are fp32). Every other warning stays."""
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropAdverts) for f in log.filters):
        log.addFilter(_DropAdverts())
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    warnings.filterwarnings("ignore", message=r"Precision .* is not supported by the model summary")
