"""What the callbacks share: scalar logging, the network inside the LightningModule, quiet logs.
(Hooks overridden in this folder have Lightning's signatures; their annotations are not repeated.)"""

import logging
import math
import warnings
from collections.abc import Mapping

import lightning.pytorch as pl
import torch


def log_scalars(trainer: pl.Trainer, metrics: Mapping[str, float | None], step: int) -> None:
    """Send finite scalars to every logger at ``step`` (loggers write on rank 0 only)."""
    clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
    for logger in trainer.loggers if clean else ():
        logger.log_metrics(clean, step=step)


def log_every(trainer: pl.Trainer, own: int | None) -> int:
    """The callback's own logging interval, else the Trainer's ``log_every_n_steps``."""
    return max(1, int(own if own is not None else trainer.log_every_n_steps or 1))


def unwrap_net(pl_module: pl.LightningModule) -> torch.nn.Module:
    """The network inside the LightningModule (``pl_module.net``), or the module itself."""
    net = getattr(pl_module, "net", None)
    return net if isinstance(net, torch.nn.Module) else pl_module


def _not_an_advert(record: logging.LogRecord) -> bool:
    adverts = ("💡 Tip:", "Trainer already configured with model summary callbacks")
    return not str(record.msg).startswith(adverts)


def quiet_lightning() -> None:
    """Silence, by exact message, output a user cannot act on: Lightning's logging-service adverts, the
    FutureWarning torch raises at Lightning's own use of ``LeafSpec``, and the model summary's note that it
    sizes mixed-precision parameters as fp32 (they are fp32). Every other warning stays."""
    # addFilter keeps a set: calling this again adds nothing.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_an_advert)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    warnings.filterwarnings("ignore", message=r"Precision .* is not supported by the model summary")
