"""What the callbacks share: the :class:`Measurement` interface, scalar logging, batch helpers, quiet logs.
(Hooks overridden in this folder have Lightning's signatures; their annotations are not repeated.)"""

import logging
import math
import warnings
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils._pytree import tree_leaves


class Measurement(Callback):
    """A callback that measures part of a run: the one way callbacks learn about each other (isinstance)."""

    def record_sections(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, dict]:
        """What this adds to the run record, ``{section: {key: value}}``; ``RunRecord`` merges them all."""
        return {}

    def perturbs(self, step: int) -> bool:
        """Whether one-off work (an anatomy capture) disturbs optimizer step ``step``: the step timer skips it."""
        return False


def measurements(trainer: pl.Trainer) -> list[Measurement]:
    return [cb for cb in trainer.callbacks if isinstance(cb, Measurement)]


def log_scalars(trainer: pl.Trainer, metrics: Mapping[str, float | None]) -> None:
    """Send finite scalars to every logger at the current optimizer step (loggers write on rank 0 only)."""
    clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
    for logger in trainer.loggers if clean else ():
        logger.log_metrics(clean, step=trainer.global_step)


def log_every(trainer: pl.Trainer, own: int | None) -> int:  # the callback's own interval, else the Trainer's
    return max(1, int(own if own is not None else trainer.log_every_n_steps or 1))


def first_tensor(batch: Any) -> torch.Tensor | None:  # itself, or the first in its tuples, lists, dicts; not 0-d
    return next((t for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.ndim > 0), None)


def unwrap_net(pl_module: pl.LightningModule) -> torch.nn.Module:
    """The network inside the LightningModule (``pl_module.net``), or the module itself."""
    net = getattr(pl_module, "net", None)
    return net if isinstance(net, torch.nn.Module) else pl_module


def _not_an_advert(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(("💡 Tip:", "Trainer already configured with model summary callbacks"))


def quiet_lightning() -> None:
    """Silence, by exact message, output a user cannot act on: Lightning's logging-service adverts, the
    FutureWarning torch raises at Lightning's own use of ``LeafSpec``, and the model summary's note that it sizes
    mixed-precision parameters as fp32 (they are fp32). Every other warning stays."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_an_advert)  # once: a set of filters
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    warnings.filterwarnings("ignore", message=r"Precision .* is not supported by the model summary")
