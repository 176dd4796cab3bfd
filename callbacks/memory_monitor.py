"""Peak memory over a window of optimizer steps, and where it went on one step: ``mem/*`` (docs/measurement.md)."""

import warnings
from typing import Any

import torch

from callbacks._glue import Measurement, log_every, log_scalars
from modelwright import measure


class MemoryMonitor(Measurement):
    """On CUDA the allocator's peaks are reset when the window opens. On one step
    :class:`modelwright.measure.MemoryAnatomy` splits the tensors into categories at the step's peak; the capture spans
    its accumulation cycle and slows it, so the step timer leaves it out. On CPU, with no allocator peak,
    ``peak_allocated_mib`` is the capture's peak total.

    Args:
        warmup_steps: optimizer steps before the window opens.
        measure_steps: steps in the window; ``None``: until the end of the fit.
        anatomy: capture the anatomy of one step.
        anatomy_step: the optimizer step (``global_step`` as it starts) to capture; default the first after warm-up.
        log_every_n_steps: how often to log the running peaks; default the Trainer's.
    """

    def __init__(self, warmup_steps: int = 2, measure_steps: int | None = None, anatomy: bool = True,
                 anatomy_step: int | None = None, log_every_n_steps: int | None = None) -> None:
        super().__init__()
        self.window = measure.Window(warmup_steps, measure_steps)  # checks itself
        if anatomy_step is not None and anatomy_step < 0:
            raise ValueError(f"MemoryMonitor.anatomy_step: must be >= 0 or null, got {anatomy_step}")
        self.anatomy, self.anatomy_step, self.log_every_n_steps = anatomy, anatomy_step, log_every_n_steps
        self.cycle, self.device, self._every = measure.StepCycle(), torch.device("cpu"), 1
        # What the window and the captured step measured (MiB; the anatomy by category), for the record.
        self.peak_allocated_mib = self.peak_reserved_mib = self.anatomy_mib = self.anatomy_end_mib = None
        self.captured_step = self.anatomy_caveat = self._capture_at = None
        self._tracker: measure.MemoryAnatomy | None = None

    def perturbs(self, step: int) -> bool:
        return self.anatomy and step == self._capture_at

    def on_train_start(self, trainer, pl_module) -> None:
        self.device, self.cycle = pl_module.device, measure.StepCycle()
        self._every = log_every(trainer, self.log_every_n_steps)
        first = trainer.global_step  # not 0 when resuming from a checkpoint
        self._capture_at = first + self.window.warmup_steps if self.anatomy_step is None else self.anatomy_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.cycle.begin(trainer.global_step):
            if self._tracker is not None:  # a later micro-batch of the captured step
                self._tracker.next_micro_batch()
                self._tracker.register(batch, "inputs")
            return
        if self.cycle.cycles == self.window.warmup_steps:  # the step that begins now opens the window
            measure.reset_peak_memory(self.device)
        if not self.anatomy or self.captured_step is not None or trainer.global_step != self._capture_at:
            return
        tracker = measure.MemoryAnatomy(self.device, explicit_optimizer_update=True)
        # An in-memory dataset (TensorDataset) is data, not activations, whenever the capture touches it.
        dataset = getattr(getattr(trainer, "train_dataloader", None), "dataset", None)
        tracker.register([getattr(dataset, "tensors", ()), batch], "inputs")
        try:
            tracker.start(pl_module, trainer.optimizers)
        except measure.AnatomyUnavailable as err:
            warnings.warn(f"MemoryMonitor: no memory anatomy on this run: {err}", stacklevel=2)
            self.anatomy = False
            return
        if tracker.active:
            self._tracker = tracker
        else:  # not measured (a compiled network)
            self.anatomy, self.anatomy_caveat = False, tracker.caveat
            warnings.warn(f"MemoryMonitor: memory anatomy {tracker.caveat}", stacklevel=2)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Lightning runs forward and backward inside optimizer.step(closure); the update starts here.
        if self._tracker is not None:
            self._tracker.optimizer_update()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.cycle.end(trainer.global_step):
            return
        scalars: dict[str, float | None] = {}
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.stop()
            self.captured_step, self.anatomy_caveat = self.cycle.step, tracker.caveat
            self.anatomy_mib, self.anatomy_end_mib = tracker.peak_mib(), tracker.end_mib()
            if self.anatomy_mib is not None:  # the categories go to TensorBoard as one figure, by RunRecord
                scalars["mem/anatomy_total_mib"] = self.anatomy_mib["total"]
                if self.device.type != "cuda":
                    self.peak_allocated_mib = self.anatomy_mib["total"]
        peaks = measure.peak_memory_mib(self.device) if self.window.in_window(self.cycle.cycles - 1) else {}
        if peaks.get("peak_allocated_mib") is not None:  # CUDA
            self.peak_allocated_mib, self.peak_reserved_mib = peaks["peak_allocated_mib"], peaks["peak_reserved_mib"]
        if scalars or trainer.global_step % self._every == 0:
            log_scalars(trainer, {**scalars, "mem/peak_allocated_mib": self.peak_allocated_mib,
                                  "mem/peak_reserved_mib": self.peak_reserved_mib,
                                  "mem/process_rss_peak_mib": measure.process_rss_peak_mib()})

    def on_train_end(self, *_: Any) -> None:
        # Leaves no tracker (dispatch mode, hooks) behind when a fit ends inside the captured step.
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.stop()

    on_exception = on_train_end

    def record_sections(self, trainer, pl_module) -> dict[str, dict]:
        source = "cuda-allocator" if self.device.type == "cuda" else "mem-tracker"
        return {"memory": {
            "peak_allocated_mib": self.peak_allocated_mib, "peak_reserved_mib": self.peak_reserved_mib,
            "peak_source": source if self.peak_allocated_mib is not None else None,
            "anatomy_step": self.captured_step, "anatomy_caveat": self.anatomy_caveat,
            "anatomy_mib": self.anatomy_mib, "anatomy_end_mib": self.anatomy_end_mib,
            "rss_peak_mib": measure.process_rss_peak_mib(), "window_warmup_steps": self.window.warmup_steps,
        }}
