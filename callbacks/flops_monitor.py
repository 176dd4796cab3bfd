"""FLOPs of a training step and MFU: achieved FLOP/s ÷ the device's peak FLOP/s.

YAML (``trainer.callbacks``)::

    - class_path: callbacks.flops_monitor.FlopsMonitor
      init_args: {peak_flops_per_s: null}

The FLOPs are counted once, on the first micro-batch: a forward and backward of a meta-device copy of
the network (``pl_module.net``) on a batch of the same shape, under PyTorch's flop counter: model
FLOPs, without checkpointing's recomputation, nothing run on the device. One optimizer step is that
times ``accumulate_grad_batches``; the figures are per device.

The peak FLOP/s is for the run's compute dtype (bf16 for ``bf16-mixed``), from, in order: Lightning's
GPU table; ``peak_flops_per_s``; a matmul peak measured once per machine and cached in
``~/.cache/modelwright/peak_flops.json`` (``$MODELWRIGHT_CACHE_DIR``). The record says which.
The step timer (:class:`callbacks.step_timer.StepTimeMonitor`) logs ``perf/mfu`` with these figures.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.callbacks import Callback

from callbacks._glue import first_tensor, log_scalars, unwrap_net
from modelwright.measure import compute_dtype, mfu, resolve_peak_flops, training_flops


class FlopsMonitor(Callback):
    """FLOPs per optimizer step and the peak FLOP/s to measure them against.

    Args:
        peak_flops_per_s: peak FLOP/s of one device in the run's compute dtype, used where Lightning's
            table has none (a CPU, a GPU name it does not know).
        measure_peak: where neither table nor config gives a peak, measure a matmul peak (cached).
        matmul_size: side of the square matmul measured for the peak; default 2048 on CPU, 8192 on GPU.
        cache_path: file caching measured peaks; default ``<cache dir>/peak_flops.json``.
        module_attr: attribute of the LightningModule that holds the network (falls back to the
            LightningModule itself).
    """

    def __init__(
        self,
        peak_flops_per_s: float | None = None,
        measure_peak: bool = True,
        matmul_size: int | None = None,
        cache_path: str | None = None,
        module_attr: str = "net",
    ) -> None:
        super().__init__()
        if peak_flops_per_s is not None and peak_flops_per_s <= 0:
            raise ValueError(f"FlopsMonitor.peak_flops_per_s: must be positive or null, got {peak_flops_per_s}")
        self.peak_flops_per_s_config = peak_flops_per_s
        self.measure_peak = measure_peak
        self.matmul_size = matmul_size
        self.cache_path = cache_path
        self.module_attr = module_attr
        self.flops_per_micro_batch: int | None = None
        self.flops_per_step: int | None = None
        self.peak_flops_per_s: float | None = None
        self.peak_flops_source: str | None = None
        self.dtype: torch.dtype = torch.float32
        self._counted_at: int | None = None
        self._tried = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        self.dtype = compute_dtype(trainer.precision)
        try:
            table = get_available_flops(device, self.dtype)
        except Exception:  # an accelerator the table code does not handle
            table = None
        needs_measuring = not table and not self.peak_flops_per_s_config and self.measure_peak
        if needs_measuring and trainer.world_size > 1:
            # One process per machine measures (the others would share its cores), the rest read its cache.
            if trainer.local_rank == 0:
                self._resolve(device, table)
            trainer.strategy.barrier("modelwright-peak-flops")
            if trainer.local_rank != 0:
                self._resolve(device, table)
        else:
            self._resolve(device, table)

    def _resolve(self, device: torch.device, table: float | None) -> None:
        try:
            self.peak_flops_per_s, self.peak_flops_source = resolve_peak_flops(
                device,
                self.dtype,
                table_value=table,
                config_value=self.peak_flops_per_s_config,
                measure=self.measure_peak,
                cache_path=self.cache_path,
                matmul_size=self.matmul_size,
            )
        except Exception as err:  # MFU is a nicety; it must not stop a run
            warnings.warn(f"FlopsMonitor: no peak FLOP/s ({type(err).__name__}: {err})", stacklevel=2)
            self.peak_flops_per_s, self.peak_flops_source = None, None

    def perturbs_step(self, step: int) -> bool:
        """The step on which the FLOPs were counted (a few hundred ms on the host)."""
        return self._counted_at is not None and step == self._counted_at

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._tried:
            return
        self._tried = True
        self._counted_at = trainer.global_step
        x = first_tensor(batch)
        if x is None:
            warnings.warn("FlopsMonitor: the batch holds no tensor; FLOPs not counted", stacklevel=2)
            return
        try:
            self.flops_per_micro_batch = training_flops(unwrap_net(pl_module, self.module_attr), x)
        except Exception as err:
            warnings.warn(f"FlopsMonitor: FLOPs not counted ({type(err).__name__}: {err})", stacklevel=2)
            return
        self.flops_per_step = self.flops_per_micro_batch * trainer.accumulate_grad_batches
        log_scalars(
            trainer,
            {"perf/flops_per_step": self.flops_per_step, "perf/peak_flops_per_s": self.peak_flops_per_s},
        )

    def mfu(self, step_time_s: float | None) -> float | None:
        """Model FLOPs utilisation of one device at ``step_time_s`` per optimizer step."""
        return mfu(self.flops_per_step, step_time_s, self.peak_flops_per_s)

    def summary(self, step_time_s: float | None) -> dict[str, Any]:
        """The record's ``flops`` section at ``step_time_s`` (the median step time)."""
        achieved = self.flops_per_step / step_time_s if self.flops_per_step and step_time_s else None
        return {
            "flops_per_step": self.flops_per_step,
            "flops_per_micro_batch": self.flops_per_micro_batch,
            "achieved_flops_per_s": achieved,
            "peak_flops_per_s": self.peak_flops_per_s,
            "peak_flops_source": self.peak_flops_source,
            "peak_flops_dtype": str(self.dtype).removeprefix("torch."),
            "mfu": self.mfu(step_time_s),
        }
