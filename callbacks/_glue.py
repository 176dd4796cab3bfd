"""Small pieces of Lightning glue shared by the measurement callbacks (not a callback itself)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch

T = TypeVar("T")


def log_scalars(trainer: pl.Trainer, metrics: Mapping[str, float | None]) -> None:
    """Send finite scalars to every logger at the current optimizer step (loggers write on rank 0 only)."""
    clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
    if not clean:
        return
    for logger in trainer.loggers:
        logger.log_metrics(clean, step=trainer.global_step)


def log_every(trainer: pl.Trainer, own: int | None) -> int:
    """Logging interval in optimizer steps: the callback's own, else the Trainer's ``log_every_n_steps``."""
    n = own if own is not None else getattr(trainer, "log_every_n_steps", 50)
    return max(1, int(n or 1))


def find_callback(trainer: pl.Trainer, cls: type[T]) -> T | None:
    """The first callback of type ``cls`` in the Trainer, or None."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, cls)), None)


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor of a batch: itself, the first of a tuple or list, or a dict's first value."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
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
