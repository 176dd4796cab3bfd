"""Step time over a window of optimizer steps, throughput, FLOPs and MFU: ``perf/*`` (docs/measurement.md)."""

import contextlib
import math
import warnings
from typing import Literal

import torch
from lightning.fabric.utilities.throughput import get_available_flops

from callbacks._glue import Measurement, first_tensor, log_every, log_scalars, measurements, unwrap_net
from modelwright import measure


class StepTimeMonitor(Measurement):
    """A step spans all micro-batches of one optimizer step; steps another :class:`~callbacks._glue.Measurement`
    disturbs are left out. Lightning's ``ThroughputMonitor`` gives running means only; the record needs a window's
    median and p90. FLOPs are model FLOPs (no recomputation), counted before the first step is timed. MFU's peak is
    ``peak_flops_per_s`` if set, else :func:`modelwright.measure.hardware_peak`, else Lightning's GPU table.

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
        self.timer = measure.StepTimer(warmup_steps, measure_steps)  # checks the window
        self.warmup_steps, self.measure_steps, self.log_every_n_steps = warmup_steps, measure_steps, log_every_n_steps
        self.cuda_timing, self.peak_flops_per_s_config = cuda_timing, peak_flops_per_s
        self.cycle, self.dtype, self._every = measure.StepCycle(), torch.float32, 1
        self.samples_per_step = self.flops_per_micro_batch = self.flops_per_step = None
        self.peak: tuple[float | None, str | None, str | None] = (None, None, None)  # FLOP/s, source, method
        self._meta_net: torch.nn.Module | None = None

    def setup(self, trainer, pl_module, stage) -> None:
        # FLOPs are counted on a meta copy of the network made before the strategy shards it: FSDP2's sharded modules
        # cannot be copied. Checkpointing, compile and memory format applied later change no model FLOP.
        with contextlib.suppress(Exception):  # else counted on the network itself, when the first step starts
            self._meta_net = measure.meta_copy(unwrap_net(pl_module))

    def on_train_start(self, trainer, pl_module) -> None:
        device = pl_module.device
        if device.type == "cuda" and self.cuda_timing == "events":
            self.timer = measure.CudaEventTimer(self.warmup_steps, self.measure_steps)
        else:
            self.timer = measure.StepTimer(self.warmup_steps, self.measure_steps, sync=measure.device_sync(device))
        self.cycle, self._every = measure.StepCycle(), log_every(trainer, self.log_every_n_steps)
        self.dtype = measure.compute_dtype(trainer.precision)
        if self.peak_flops_per_s_config:
            self.peak = (float(self.peak_flops_per_s_config), "config", "StepTimeMonitor.peak_flops_per_s")
            return
        # The record and loggers are rank 0's: the other processes need no peak (nor measure the CPU clock beside it).
        if not trainer.is_global_zero:
            return
        try:
            self.peak = measure.hardware_peak(device, self.dtype)
            if not self.peak.flops_per_s and (table := get_available_flops(device, self.dtype)):
                self.peak = (float(table), "lightning-table", "Lightning's get_available_flops")
        except Exception as err:  # MFU is a nicety; it must not stop a run
            warnings.warn(f"StepTimeMonitor: no peak FLOP/s ({type(err).__name__}: {err})", stacklevel=2)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.cycle.begin(trainer.global_step):
            return
        if self.samples_per_step is None and (x := first_tensor(batch)) is not None:  # before the clock starts
            self.samples_per_step = len(x) * trainer.accumulate_grad_batches * trainer.world_size
            net = self._meta_net if self._meta_net is not None else unwrap_net(pl_module)
            try:
                self.flops_per_micro_batch = measure.training_flops(net, x)
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
