"""Step time over a window of optimizer steps, throughput, FLOPs and MFU: ``perf/*`` (docs/measurement.md).

A step spans all micro-batches of one optimizer step; steps another :class:`~callbacks._glue.Measurement` disturbs
are left out. Lightning's ``ThroughputMonitor`` gives running means only; the record needs a window's median and p90.
FLOPs are model FLOPs (no recomputation), counted before the first step is timed. MFU's peak is ``peak_flops_per_s``
if set, else :func:`modelwright.measure.hardware_peak`, else Lightning's GPU table.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal

import torch
from lightning.fabric.utilities.throughput import get_available_flops

from callbacks._glue import Measurement, batch_size_of, first_tensor, log_every, log_scalars, measurements, unwrap_net
from modelwright import measure


class StepTimeMonitor(Measurement):
    """Median and p90 step time, samples per second, FLOPs per step and MFU over a window of optimizer steps.

    Args:
        warmup_steps: first optimizer steps not measured (allocator, cuDNN and compile warm-up).
        measure_steps: steps measured after the warm-up; ``None`` measures until the end of the fit.
        log_every_n_steps: how often to log ``perf/*``; default the Trainer's ``log_every_n_steps``.
        cuda_timing: on CUDA, ``events`` (no host stall per step) or ``synchronize`` (before each clock reading).
        peak_flops_per_s: peak FLOP/s of one device in the run's compute dtype; ``None``: the hardware's.
    """

    def __init__(self, warmup_steps: int = 2, measure_steps: int | None = None, log_every_n_steps: int | None = None,
                 cuda_timing: Literal["events", "synchronize"] = "events",
                 peak_flops_per_s: float | None = None) -> None:
        super().__init__()
        if peak_flops_per_s is not None and peak_flops_per_s <= 0:
            raise ValueError(f"StepTimeMonitor.peak_flops_per_s: must be positive or null, got {peak_flops_per_s}")
        try:
            self.timer = measure.StepTimer(warmup_steps, measure_steps)
        except ValueError as err:
            raise ValueError(f"StepTimeMonitor: {err}") from None
        self.warmup_steps, self.measure_steps, self.log_every_n_steps = warmup_steps, measure_steps, log_every_n_steps
        self.cuda_timing, self.peak_flops_per_s_config = cuda_timing, peak_flops_per_s
        self.cycle, self.dtype, self._every = measure.StepCycle(), torch.float32, 1
        self.samples_per_step = self.flops_per_micro_batch = self.flops_per_step = None
        self.peak: tuple[float | None, str | None, str | None] = (None, None, None)  # FLOP/s, source, method
        self._meta_net: torch.nn.Module | None = None

    def setup(self, trainer, pl_module, stage) -> None:
        # FLOPs are counted on a meta copy of the network made before the strategy shards it: FSDP2's sharded modules
        # cannot be copied. Checkpointing, compile and memory format applied later change no model FLOP.
        try:
            self._meta_net = measure.meta_copy(unwrap_net(pl_module))
        except Exception:
            self._meta_net = None

    def on_train_start(self, trainer, pl_module) -> None:
        device = pl_module.device
        if device.type == "cuda" and self.cuda_timing == "events":
            self.timer = measure.CudaEventTimer(self.warmup_steps, self.measure_steps)
        else:
            self.timer = measure.StepTimer(self.warmup_steps, self.measure_steps, sync=measure.device_sync(device))
        self.cycle, self._every = measure.StepCycle(), log_every(trainer, self.log_every_n_steps)
        self.dtype = measure.compute_dtype(trainer.precision)
        # One process per machine may measure the CPU clock (cached); the others would share its cores: they wait.
        if trainer.local_rank > 0:
            trainer.strategy.barrier("modelwright-peak-flops")
        self.peak = self._peak(device)
        if trainer.local_rank == 0 and trainer.world_size > 1:
            trainer.strategy.barrier("modelwright-peak-flops")

    def _peak(self, device: torch.device) -> tuple[float | None, str | None, str | None]:
        if self.peak_flops_per_s_config:
            return float(self.peak_flops_per_s_config), "config", "StepTimeMonitor.peak_flops_per_s"
        try:
            peak = measure.hardware_peak(device, self.dtype)
            table = None if peak.flops_per_s else get_available_flops(device, self.dtype)
        except Exception as err:  # MFU is a nicety; it must not stop a run
            warnings.warn(f"StepTimeMonitor: no peak FLOP/s ({type(err).__name__}: {err})", stacklevel=2)
            return None, None, None
        if table:
            return float(table), "lightning-table", "Lightning's get_available_flops"
        return peak.flops_per_s, peak.source, peak.method

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.cycle.begin(trainer.global_step):
            return
        if self.samples_per_step is None and (micro := batch_size_of(batch)) is not None:  # before the clock starts
            self.samples_per_step = micro * trainer.accumulate_grad_batches * trainer.world_size
            net = self._meta_net if self._meta_net is not None else unwrap_net(pl_module)
            try:
                self.flops_per_micro_batch = measure.training_flops(net, first_tensor(batch))
                self.flops_per_step = self.flops_per_micro_batch * trainer.accumulate_grad_batches
            except Exception as err:
                warnings.warn(f"StepTimeMonitor: FLOPs not counted ({type(err).__name__}: {err})", stacklevel=2)
            log_scalars(trainer, {"perf/flops_per_step": self.flops_per_step, "perf/peak_flops_per_s": self.peak[0]})
        self.timer.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.cycle.end(trainer.global_step):
            return
        exclude = any(m.perturbs(self.cycle.step) for m in measurements(trainer))
        measured = self.timer.in_window() and not exclude
        self.timer.stop(exclude=exclude)
        if measured and trainer.global_step % self._every == 0:
            log_scalars(trainer, self._scalars(self.timer.last_s(), ""))  # a CUDA event timer waits for this step

    def _scalars(self, dt: float | None, suffix: str) -> dict[str, float | None]:
        return {
            f"perf/step_time{suffix}_ms": dt * 1e3 if dt else None,
            f"perf/samples_per_s{suffix}": self.samples_per_step / dt if dt and self.samples_per_step else None,
            f"perf/mfu{suffix}": measure.mfu(self.flops_per_step, dt, self.peak[0]),
        }

    def on_train_end(self, trainer, pl_module) -> None:
        self.timer.cancel()  # a fit that stopped mid-cycle
        if (med := self.timer.median_s()) is not None:
            log_scalars(trainer, {**self._scalars(med, "_median"), "perf/step_time_p90_ms": self.timer.p90_s() * 1e3})

    def record_sections(self, trainer, pl_module) -> dict[str, dict]:
        batches = trainer.num_training_batches
        per_epoch = math.ceil(batches / trainer.accumulate_grad_batches) if math.isfinite(batches or math.inf) else None
        med = self.timer.median_s()
        flops, source, method = self.peak
        return {
            "timing": self.timer.summary(per_epoch, self.samples_per_step),
            "flops": {
                "flops_per_step": self.flops_per_step, "flops_per_micro_batch": self.flops_per_micro_batch,
                "achieved_flops_per_s": self.flops_per_step / med if self.flops_per_step and med else None,
                "peak_flops_per_s": flops, "peak_flops_source": source, "peak_flops_method": method,
                "peak_flops_dtype": str(self.dtype).removeprefix("torch."),
                "mfu": measure.mfu(self.flops_per_step, med, flops),
            },
        }
