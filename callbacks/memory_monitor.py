"""Peak memory over a window of optimizer steps, and where it went on one step: ``mem/*``.

YAML (``trainer.callbacks``)::

    - class_path: callbacks.memory_monitor.MemoryMonitor
      init_args: {warmup_steps: 2, anatomy: true}

* CUDA: the allocator's peak statistics are reset when the window opens (after ``warmup_steps``);
  ``mem/peak_allocated_mib`` and ``mem/peak_reserved_mib`` are the peaks since then.
* Any device: on one optimizer step (``anatomy_step``, default the first after the warm-up) every
  tensor is attributed by :class:`modelwright.measure.MemoryAnatomy` to parameters, gradients,
  optimizer state, activations, temporaries, communication buffers or inputs (the dataset and the
  batches, registered so that micro-batches fetched inside the capture are not activations);
  the breakdown at that step's peak goes to the record and to TensorBoard as one figure and table
  (``mem/anatomy_total_mib`` is its total). The capture spans the whole accumulation
  cycle and slows that step down, so the step timer leaves it out. On CPU, where there is no allocator
  peak, ``peak_allocated_mib`` is the capture's peak total. A compiled network has no anatomy (the
  tracker would see eager code); ``anatomy_caveat`` says so, or flags activations left after the step.
* ``mem/process_rss_peak_mib`` is the process's resident-set high-water mark: not a tensor peak
  (glibc keeps freed pages), logged under its own name only.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from callbacks._glue import Measurement, log_every, log_scalars
from modelwright.measure import (
    AnatomyUnavailable,
    MemoryAnatomy,
    StepCycle,
    Window,
    peak_memory_mib,
    process_rss_peak_mib,
    reset_peak_memory,
)


class MemoryMonitor(Measurement):
    """Peak allocator memory over a window, and the tensor anatomy of one step.

    Args:
        warmup_steps: optimizer steps before the window opens.
        measure_steps: steps in the window; ``None``: until the end of the fit.
        anatomy: capture the anatomy of one step.
        anatomy_step: the optimizer step (``global_step`` when it starts) to capture; default the
            first step after the warm-up.
        log_every_n_steps: how often to log the running peaks; default the Trainer's.
    """

    def __init__(
        self,
        warmup_steps: int = 2,
        measure_steps: int | None = None,
        anatomy: bool = True,
        anatomy_step: int | None = None,
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__()
        try:
            self.window = Window(warmup_steps, measure_steps)
        except ValueError as err:
            raise ValueError(f"MemoryMonitor.{err}") from None
        if anatomy_step is not None and anatomy_step < 0:
            raise ValueError(f"MemoryMonitor.anatomy_step: must be >= 0 or null, got {anatomy_step}")
        self.warmup_steps = warmup_steps
        self.measure_steps = measure_steps
        self.anatomy = anatomy
        self.anatomy_step = anatomy_step
        self.log_every_n_steps = log_every_n_steps
        self.cycle = StepCycle()
        self.device = torch.device("cpu")
        self.peak_allocated_mib: float | None = None
        self.peak_reserved_mib: float | None = None
        self.anatomy_mib: dict[str, float] | None = None
        self.anatomy_end_mib: dict[str, float] | None = None
        self.captured_step: int | None = None
        self.anatomy_caveat: str | None = None
        self._capture_at: int | None = None
        self._tracker: MemoryAnatomy | None = None
        self._every = 1

    # -- the window ------------------------------------------------------------------------------

    def perturbs(self, step: int) -> bool:
        """Whether this callback slows optimizer step ``step`` down (the anatomy capture)."""
        return self.anatomy and self._capture_at is not None and step == self._capture_at

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.device = pl_module.device
        self.cycle = StepCycle()
        self._every = log_every(trainer, self.log_every_n_steps)
        first = trainer.global_step  # not 0 when resuming from a checkpoint
        self._capture_at = self.anatomy_step if self.anatomy_step is not None else first + self.warmup_steps

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.cycle.begin(trainer.global_step):
            if self._tracker is not None:  # a later micro-batch of the captured step
                self._tracker.next_micro_batch()
                self._tracker.register(batch, "inputs")
            return
        index = self.cycle.cycles  # 0-based index of the step that begins now
        if index == self.warmup_steps:
            reset_peak_memory(self.device)
        if self.anatomy and self.captured_step is None and trainer.global_step == self._capture_at:
            self._start_capture(trainer, pl_module, batch)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.cycle.end(trainer.global_step):
            return
        index = self.cycle.cycles - 1
        scalars: dict[str, float | None] = {}
        if self._tracker is not None:
            self._stop_capture()
            scalars.update(self._anatomy_scalars())
        if self.window.in_window(index):
            peaks = peak_memory_mib(self.device)
            if peaks["peak_allocated_mib"] is not None:
                self.peak_allocated_mib = peaks["peak_allocated_mib"]
                self.peak_reserved_mib = peaks["peak_reserved_mib"]
        if scalars or trainer.global_step % self._every == 0:
            scalars["mem/peak_allocated_mib"] = self.peak_allocated_mib
            scalars["mem/peak_reserved_mib"] = self.peak_reserved_mib
            scalars["mem/process_rss_peak_mib"] = process_rss_peak_mib()
            log_scalars(trainer, scalars)

    # -- the anatomy -----------------------------------------------------------------------------

    def _start_capture(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        tracker = MemoryAnatomy(self.device, explicit_optimizer_update=True)
        # An in-memory dataset (TensorDataset) is data, not activations, whenever the capture touches it.
        dataset = getattr(getattr(trainer, "train_dataloader", None), "dataset", None)
        tracker.register([getattr(dataset, "tensors", ()), batch], "inputs")
        try:
            tracker.start(pl_module, trainer.optimizers)
        except AnatomyUnavailable as err:
            warnings.warn(f"MemoryMonitor: no memory anatomy on this run: {err}", stacklevel=2)
            self.anatomy = False
            return
        if not tracker.active:  # not measured (a compiled network)
            self.anatomy, self.anatomy_caveat = False, tracker.caveat
            warnings.warn(f"MemoryMonitor: memory anatomy {tracker.caveat}", stacklevel=2)
            return
        self._tracker = tracker

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Lightning runs forward and backward inside optimizer.step(closure); the update starts here.
        if self._tracker is not None:
            self._tracker.optimizer_update()

    def _stop_capture(self) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return
        tracker.stop()
        self.captured_step = self.cycle.step
        self.anatomy_mib = tracker.peak_mib()
        self.anatomy_end_mib = tracker.end_mib()
        self.anatomy_caveat = tracker.caveat
        if self.device.type != "cuda" and self.anatomy_mib is not None:
            self.peak_allocated_mib = self.anatomy_mib["total"]

    def _anatomy_scalars(self) -> dict[str, float | None]:
        # The categories go to TensorBoard as one figure and table (callbacks/_summary.py), not as single dots.
        return {} if self.anatomy_mib is None else {"mem/anatomy_total_mib": self.anatomy_mib["total"]}

    def _abandon_capture(self) -> None:
        # Leaves no tracker (dispatch mode, hooks) behind when a fit ends inside the captured step.
        if self._tracker is not None:
            try:
                self._tracker.stop()
            finally:
                self._tracker = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._abandon_capture()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._abandon_capture()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._abandon_capture()

    # -- the record ------------------------------------------------------------------------------

    def record_sections(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, dict]:
        return {"memory": self.summary()}

    def summary(self) -> dict[str, Any]:
        """The record's ``memory`` figures this callback knows."""
        return {
            "peak_allocated_mib": self.peak_allocated_mib,
            "peak_reserved_mib": self.peak_reserved_mib,
            "anatomy_step": self.captured_step,
            "anatomy_mib": self.anatomy_mib,
            "anatomy_end_mib": self.anatomy_end_mib,
            "rss_peak_mib": process_rss_peak_mib(),
            "peak_source": (
                "cuda-allocator"
                if self.device.type == "cuda" and self.peak_allocated_mib is not None
                else "mem-tracker"
                if self.peak_allocated_mib is not None
                else None
            ),
            "window_warmup_steps": self.warmup_steps,
            "anatomy_caveat": self.anatomy_caveat,
        }
