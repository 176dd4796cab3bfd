"""Time per optimizer step, synchronized, warm-up excluded: ``perf/step_time_ms``, ``perf/samples_per_s``.

YAML (``trainer.callbacks``)::

    - class_path: callbacks.step_timer.StepTimeMonitor
      init_args: {warmup_steps: 2}

A step spans all micro-batches of one optimizer step: from ``on_train_batch_start`` of the first to
``on_train_batch_end`` of the last (forward, backward, optimizer step and the hooks in between; the
first micro-batch's data loading is outside). Steps on which another callback does heavy one-off work
(an anatomy capture, the FLOP count) are left out of the statistics.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from callbacks._glue import batch_size_of, log_every, log_scalars
from modelwright.measure import CudaEventTimer, StepCycle, StepTimer, device_sync


class StepTimeMonitor(Callback):
    """Median and p90 step time, time per epoch and samples per second over a window of optimizer steps.

    Args:
        warmup_steps: first optimizer steps not measured (allocator, cuDNN and compile warm-up).
        measure_steps: steps measured after the warm-up; ``None`` measures until the end of the fit.
        log_every_n_steps: how often to log ``perf/*``; default the Trainer's ``log_every_n_steps``.
        cuda_timing: on CUDA, ``events`` (no host stall per step) or ``synchronize`` (a synchronize
            before each clock reading).
    """

    def __init__(
        self,
        warmup_steps: int = 2,
        measure_steps: int | None = None,
        log_every_n_steps: int | None = None,
        cuda_timing: Literal["events", "synchronize"] = "events",
    ) -> None:
        super().__init__()
        if warmup_steps < 0:
            raise ValueError(f"StepTimeMonitor.warmup_steps: must be >= 0, got {warmup_steps}")
        if measure_steps is not None and measure_steps < 1:
            raise ValueError(f"StepTimeMonitor.measure_steps: must be >= 1 or null, got {measure_steps}")
        if cuda_timing not in ("events", "synchronize"):
            raise ValueError(f"StepTimeMonitor.cuda_timing: {cuda_timing!r}; valid: events, synchronize")
        self.warmup_steps = warmup_steps
        self.measure_steps = measure_steps
        self.log_every_n_steps = log_every_n_steps
        self.cuda_timing = cuda_timing
        self.timer: StepTimer = StepTimer(warmup_steps, measure_steps)
        self.cycle = StepCycle()
        self.micro_batch_size: int | None = None
        self.samples_per_step: int | None = None
        self._perturbers: list[Any] = []
        self._flops: Any = None
        self._every = 1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        if device.type == "cuda" and self.cuda_timing == "events":
            self.timer = CudaEventTimer(self.warmup_steps, self.measure_steps)
        else:
            self.timer = StepTimer(self.warmup_steps, self.measure_steps, sync=device_sync(device))
        self.cycle = StepCycle()
        # Duck-typed so that callbacks need not import each other: any callback that does one-off heavy
        # work on a step says so with perturbs_step(step); one that knows the FLOPs offers mfu(seconds).
        self._perturbers = [cb for cb in trainer.callbacks if cb is not self and hasattr(cb, "perturbs_step")]
        self._flops = next((cb for cb in trainer.callbacks if callable(getattr(cb, "mfu", None))), None)
        self._every = log_every(trainer, self.log_every_n_steps)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.cycle.begin(trainer.global_step):
            if self.micro_batch_size is None:
                self.micro_batch_size = batch_size_of(batch)
                if self.micro_batch_size is not None:
                    self.samples_per_step = self.micro_batch_size * trainer.accumulate_grad_batches * trainer.world_size
            self.timer.start()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.cycle.end(trainer.global_step):
            return
        step = self.cycle.step
        exclude = any(cb.perturbs_step(step) for cb in self._perturbers)
        measured = self.timer.in_window() and not exclude
        self.timer.stop(exclude=exclude)
        if measured and trainer.global_step % self._every == 0:
            dt = self.timer.last_s()  # a CUDA event timer waits for this step here, not on every step
            log_scalars(trainer, self._step_scalars(dt))

    def _step_scalars(self, dt: float) -> dict[str, float | None]:
        scalars: dict[str, float | None] = {"perf/step_time_ms": dt * 1e3}
        if self.samples_per_step:
            scalars["perf/samples_per_s"] = self.samples_per_step / dt
        if self._flops is not None:
            scalars["perf/mfu"] = self._flops.mfu(dt)
        return scalars

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.timer.cancel()  # a fit that stopped mid-cycle
        med, p90 = self.timer.median_s(), self.timer.p90_s()
        if med is not None:
            log_scalars(
                trainer,
                {
                    "perf/step_time_median_ms": med * 1e3,
                    "perf/step_time_p90_ms": p90 * 1e3,
                    "perf/samples_per_s_median": self.timer.samples_per_s(self.samples_per_step),
                    "perf/mfu_median": self._flops.mfu(med) if self._flops is not None else None,
                },
            )

    def steps_per_epoch(self, trainer: pl.Trainer) -> int | None:
        """Optimizer steps in one training epoch (a short last cycle still steps)."""
        batches = trainer.num_training_batches
        if batches is None or not math.isfinite(batches):
            return None
        return math.ceil(batches / trainer.accumulate_grad_batches)

    def summary(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The record's ``timing`` section (without ``wall_time_s``)."""
        return self.timer.summary(self.steps_per_epoch(trainer), self.samples_per_step)
