"""Lightning's model summary with the FLOPs this project measures: training FLOPs per micro-batch, per layer.

YAML (``trainer.callbacks``)::

    - class_path: callbacks.model_summary.FlopsModelSummary

Lightning's own summary counts FLOPs only by running ``example_input_array`` forward on the device, and prints
``0 Total Flops`` without one. This one counts a forward and backward of a meta-device copy of the network (nothing
runs) on a micro-batch shaped like the data, the figure the step timer divides by step time for MFU.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table
from torch.utils.flop_counter import FlopCounterMode

from callbacks._glue import first_tensor, unwrap_net
from modelwright.measure import meta_copy

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")  # printed where Lightning's summary is


class _Summary(Summary):
    def __init__(self, model: pl.LightningModule, max_depth: int, counts: dict[str, dict]) -> None:
        self._counts = counts
        super().__init__(model, max_depth)

    @property
    def total_flops(self) -> int:
        return sum(self._counts.get("Global", {}).values())

    @property
    def flop_counts(self) -> dict[str, dict[Any, int]]:
        return {name: self._counts.get(name, {}) for name in self.layer_names}


class FlopsModelSummary(ModelSummary):
    """The layer table of Lightning's ``ModelSummary``, its FLOPs column and total from a meta-device count.

    Args:
        max_depth: as ``ModelSummary``'s: layers nested deeper are not listed.
        module_attr: attribute of the LightningModule holding the network.
    """

    def __init__(self, max_depth: int = 1, module_attr: str = "net") -> None:
        super().__init__(max_depth=max_depth)
        self.module_attr = module_attr

    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Summary:
        x = _example_batch(trainer, pl_module)
        counts: dict[str, dict] = {}
        counter = FlopCounterMode(display=False, depth=self._max_depth + 1)
        try:
            net = meta_copy(unwrap_net(pl_module, self.module_attr)).train()
            with counter:
                net(x.to("meta")).float().sum().backward()
        except Exception as err:  # a sharded network (FSDP2 cannot be copied), no example: a table without FLOPs
            warnings.warn(f"FlopsModelSummary: FLOPs not counted ({type(err).__name__}: {err})", stacklevel=2)
            return _Summary(pl_module, self._max_depth, counts)
        root = type(net).__name__
        for name, ops in counter.get_flop_counts().items():
            inside = name == root or name.startswith(root + ".")
            counts[self.module_attr + name[len(root):] if inside else name] = ops
        return _Summary(pl_module, self._max_depth, counts)

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **summarize_kwargs) -> None:  # noqa: ANN001
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *summary_data)
        log.info("\n" + table.replace("Total Flops", "Training FLOPs per micro-batch (forward + backward)"))


def _example_batch(trainer: pl.Trainer, pl_module: pl.LightningModule) -> torch.Tensor | None:
    """``example_input_array``, else a micro-batch of the datamodule's first training sample (its shape is all)."""
    x = pl_module.example_input_array
    if isinstance(x, torch.Tensor):
        return x
    dm = trainer.datamodule
    train_set = getattr(dm, "train_set", None)
    batch_size = getattr(dm, "hparams", {}).get("batch_size")
    sample = first_tensor(train_set[0]) if train_set is not None and batch_size else None
    return None if sample is None else sample.expand(batch_size, *sample.shape)
