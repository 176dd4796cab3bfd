"""The step probe: the one object that watches a training loop's optimizer steps, for both loops.

It owns the step cycle (the micro-batches of one optimizer step), the warm-up window, the step timer, the
memory anatomy of one step (paused while an evaluation runs inside it), the allocator's peaks, FLOPs and MFU,
the time of whole epochs and the divergence check; :meth:`StepProbe.sections` gives the record's ``timing``,
``flops``, ``memory``, ``techniques`` and ``faults``. A loop calls it around each micro-batch::

    probe.prepare(network)                      # before a strategy shards it: FLOPs count on a meta copy
    probe.start(device=..., precision=..., modules=[...], optimizers=[...], ...)
    for each micro-batch:
        probe.before_micro_batch(step, batch)   # step: the optimizer steps taken so far
        ... forward: probe.observe_loss(loss, epoch, batch_idx) ... backward ...
        probe.before_update(optimizer)          # only before the optimizer's update
        ... optimizer step ...
        reading = probe.after_micro_batch(step) # the steps taken now; a StepReading when a step closed
        with probe.evaluating(): ...            # an evaluation, inside a step or between steps
    probe.stop()

The Lightning callback ``callbacks.run_monitor.RunMonitor`` forwards its hooks to it; the Accelerate loop
calls it in its body. Nothing here imports Lightning.
"""

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from modelwright.measure.divergence import LossWatch, Reduce
from modelwright.measure.facts import channels_last_applied, optimizer_impl
from modelwright.measure.flops import PeakFlops, compute_dtype, hardware_peak, meta_copy, mfu, training_flops
from modelwright.measure.memory import (
    AnatomyUnavailable,
    MemoryAnatomy,
    is_compiled,
    peak_memory_mib,
    process_rss_peak_mib,
    reset_peak_memory,
)
from modelwright.measure.timing import CudaEventTimer, StepCycle, StepTimer, Window, device_sync


class StepReading(NamedTuple):
    """What one closed optimizer step gives the loggers: ``step`` is its 0-based index (the step Lightning
    logs it at), ``scalars`` the ``perf/*`` and ``mem/*`` values known now (an unmeasured step has no
    ``perf/*``)."""

    step: int
    scalars: dict[str, float]


@dataclass
class _RunningEpoch:
    start: float
    steps: int = 0
    evaluation_s: float = 0.0
    evaluations: int = 0


@dataclass
class EpochTime:
    """One whole training epoch, its data loading and the evaluations inside it."""

    seconds: float
    steps: int
    evaluation_s: float
    evaluations: int


def first_tensor(batch: Any) -> torch.Tensor | None:
    """``batch`` itself, or the first tensor of more than zero dimensions in its tuples, lists and dicts."""
    tensors = (leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.ndim > 0)
    return next(tensors, None)


def _identity(value: torch.Tensor) -> torch.Tensor:
    return value


def _mirror_trainable(live: nn.Module, copy: nn.Module) -> None:
    """The copy's parameters trainable where the live network's are: freezing, applied after the copy was
    made, removes the frozen weights' gradient FLOPs from the count."""
    copied = dict(copy.named_parameters())
    for name, param in live.named_parameters():  # the live module may hold the network (``net.conv1.weight``)
        parts = name.split(".")
        for start in range(len(parts)):
            twin = copied.get(".".join(parts[start:]))
            if twin is not None:
                twin.requires_grad_(param.requires_grad)
                break


class StepProbe:
    """Measures the optimizer steps of one training run (module docstring: how a loop calls it).

    Args:
        warmup_steps: first optimizer steps not measured (allocator, cuDNN and compile warm-up).
        measure_steps: steps measured after the warm-up; ``None``: until the end.
        anatomy: capture where the memory of one step goes (PyTorch's MemTracker); that step is not timed.
        anatomy_step: the optimizer step (0-based, as the loop counts) to capture; default: the first after
            the warm-up.
        cuda_timing: on CUDA, ``events`` (no host stall per step) or ``synchronize`` (before each clock
            reading).
        peak_flops_per_s: peak FLOP/s of one device in the run's compute dtype; ``None``: the hardware's.
        on_nonfinite: ``stop`` or ``skip`` a step whose loss is not finite (:class:`~.divergence.LossWatch`).
        max_skipped_steps: with ``skip``, stop once more than this many steps were skipped; ``None``: never.
    """

    def __init__(self, warmup_steps: int = 2, measure_steps: int | None = None, anatomy: bool = True,
                 anatomy_step: int | None = None, cuda_timing: Literal["events", "synchronize"] = "events",
                 peak_flops_per_s: float | None = None, on_nonfinite: Literal["stop", "skip"] = "stop",
                 max_skipped_steps: int | None = None) -> None:
        self.window = Window(warmup_steps, measure_steps)  # checks itself
        if anatomy_step is not None and anatomy_step < 0:
            raise ValueError(f"anatomy_step: must be >= 0 or null, got {anatomy_step}")
        if peak_flops_per_s is not None and peak_flops_per_s <= 0:
            raise ValueError(f"peak_flops_per_s: must be positive or null, got {peak_flops_per_s}")
        if cuda_timing not in ("events", "synchronize"):
            raise ValueError(f"cuda_timing: {cuda_timing!r}; valid: events, synchronize")
        self.anatomy = anatomy
        self.anatomy_step = anatomy_step
        self.cuda_timing = cuda_timing
        self.peak_flops_per_s = peak_flops_per_s
        self.watch = LossWatch(on_nonfinite, max_skipped_steps)
        self._meta_network: nn.Module | None = None
        self._reset()

    def _reset(self) -> None:
        """The state of one run, set again by :meth:`start`."""
        self.timer = StepTimer(self.window.warmup_steps, self.window.measure_steps)
        self.cycle = StepCycle()
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.peak = PeakFlops(None, None, None)
        self.modules: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.micro_batches_per_step = 1
        self.world_size = 1
        self.reduce: Reduce = _identity
        self.grad_scale: Callable[[], torch.Tensor | None] = lambda: None
        self.data: Any = ()
        self.capture_at: int | None = None
        self.micro_batch_size: int | None = None
        self.flops_per_micro_batch: int | None = None
        self.peak_allocated_mib: float | None = None
        self.peak_reserved_mib: float | None = None
        self.captured_step: int | None = None
        self.anatomy_mib: dict[str, float] | None = None
        self.anatomy_end_mib: dict[str, float] | None = None
        self.anatomy_caveat: str | None = None
        self.last_epoch: EpochTime | None = None
        self._capture: MemoryAnatomy | None = None
        self._evaluated_in_step = False
        self._epoch: _RunningEpoch | None = None
        self._cpu_start = time.process_time()
        self._wall_start = time.perf_counter()

    # --- set-up ---------------------------------------------------------------------------------------------

    def prepare(self, network: nn.Module) -> None:
        """Copy ``network`` to the meta device for counting FLOPs, before a strategy shards it (FSDP2's
        sharded modules cannot be copied). Checkpointing, compile and memory format applied later change no
        model FLOP."""
        try:
            self._meta_network = meta_copy(network)
        except Exception:  # counted on the modules given to start() instead
            self._meta_network = None

    def start(self, *, device: torch.device | str, precision: str | int | None, modules: Sequence[nn.Module],
              optimizers: Sequence[torch.optim.Optimizer], micro_batches_per_step: int = 1,
              world_size: int = 1,
              first_step: int = 0, main_process: bool = True, reduce: Reduce | None = None,
              grad_scale: Callable[[], torch.Tensor | None] | None = None, data: Any = (),
              fallback_peak: Callable[[torch.device, torch.dtype], float | None] | None = None) -> None:
        """Before the first step. ``modules`` and ``optimizers`` are what the anatomy tracks (the first module
        is the network, or holds it); ``first_step`` is the step counter now (not 0 when resuming); only the
        ``main_process`` looks up the peak FLOP/s; ``reduce`` sums a tensor over the ranks; ``grad_scale``
        reads a GradScaler's scale; ``data``: tensors that are the data wherever the capture meets them (a
        dataset's)."""
        self._reset()
        self.device = torch.device(device)
        self.dtype = compute_dtype(precision)
        self.modules = list(modules)
        self.optimizers = list(optimizers)
        self.micro_batches_per_step = micro_batches_per_step
        self.world_size = world_size
        self.reduce = reduce or _identity
        self.grad_scale = grad_scale or (lambda: None)
        self.data = data
        self.timer = self._new_timer()
        if self.anatomy_step is not None:
            self.capture_at = self.anatomy_step
        else:
            self.capture_at = first_step + self.window.warmup_steps
        self.peak = self._peak_flops(main_process, fallback_peak)

    def _new_timer(self) -> StepTimer:
        warmup, measured = self.window.warmup_steps, self.window.measure_steps
        if self.device.type == "cuda" and self.cuda_timing == "events" and torch.cuda.is_available():
            return CudaEventTimer(warmup, measured)
        return StepTimer(warmup, measured, sync=device_sync(self.device))

    def _peak_flops(self, main_process: bool, fallback: Callable | None) -> PeakFlops:
        if self.peak_flops_per_s:
            return PeakFlops(float(self.peak_flops_per_s), "config", "peak_flops_per_s as configured")
        if not main_process:  # the record is the main process's: the others need no peak (nor the CPU clock)
            return PeakFlops(None, None, None)
        try:
            peak = hardware_peak(self.device, self.dtype)
            table = fallback(self.device, self.dtype) if fallback and not peak.flops_per_s else None
            if table:
                return PeakFlops(float(table), "lightning-table", "Lightning's get_available_flops")
            return peak
        except Exception as err:  # MFU is a nicety; it must not stop a run
            warnings.warn(f"StepProbe: no peak FLOP/s ({type(err).__name__}: {err})", stacklevel=2)
            return PeakFlops(None, None, None)

    # --- the step cycle -------------------------------------------------------------------------------------

    def before_micro_batch(self, step: int, batch: Any) -> None:
        """Before each training micro-batch; ``step``: the optimizer steps taken so far."""
        if not self.cycle.begin(step):
            if self._capture is not None:  # a later micro-batch of the captured step
                self._capture.next_micro_batch()
                self._capture.register(batch, "inputs")
            return
        self._evaluated_in_step = False
        if self.flops_per_micro_batch is None and self.micro_batch_size is None:
            self._count_flops(batch)  # before the clock starts
        if self.cycle.cycles == self.window.warmup_steps:  # the step that begins now opens the window
            reset_peak_memory(self.device)
        if self.anatomy and self.captured_step is None and step == self.capture_at:
            self._begin_capture(batch)
        self.watch.step_begins(self.modules[0])
        self.timer.start()

    def observe_loss(self, loss: torch.Tensor, epoch: int, batch_idx: int) -> None:
        """A training micro-batch's loss, before its backward: the divergence check's input."""
        self.watch.observe(loss, self.cycle.step or 0, epoch, batch_idx)

    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Just before the optimizer's update: the anatomy counts optimizer state from here; a step with a
        non-finite loss is dropped here under ``on_nonfinite: skip``."""
        if self._capture is not None:
            self._capture.optimizer_update()
        self.watch.before_update(optimizer, self.modules[0], self.reduce, self.grad_scale())

    def after_micro_batch(self, step: int, log_every: int = 1) -> StepReading | None:
        """After each training micro-batch; ``step``: the optimizer steps taken now. A :class:`StepReading`
        when this micro-batch closed an optimizer step, with scalars on every ``log_every``-th step (0-based
        index + 1 a multiple, as Lightning logs); raises :class:`~.divergence.NonFiniteLossError` under
        ``on_nonfinite: stop``."""
        closed = self.cycle.end(step)
        self.watch.after_micro_batch(self.reduce, self.grad_scale())
        if not closed:
            return None
        disturbed = self._capture is not None or self._evaluated_in_step
        measured = self.timer.in_window() and not disturbed
        self.timer.stop(exclude=disturbed)
        logged = (self.cycle.step + 1) % log_every == 0  # reading a CUDA step's time waits for the device
        scalars = self._step_scalars(self.timer.last_s()) if measured and logged else {}
        if self._capture is not None:
            self._end_capture()
        self._update_peaks()
        if logged:
            scalars.update(self._memory_scalars())
        if self._epoch is not None:
            self._epoch.steps += 1
        return StepReading(self.cycle.step, scalars)

    def _step_scalars(self, seconds: float | None) -> dict[str, float]:
        if not seconds:
            return {}
        scalars = {"perf/step_time_ms": seconds * 1e3}
        if self.samples_per_step:
            scalars["perf/samples_per_s"] = self.samples_per_step / seconds
        utilization = mfu(self.flops_per_step, seconds, self.peak.flops_per_s)
        if utilization is not None:
            scalars["perf/mfu"] = utilization
        return scalars

    def _update_peaks(self) -> None:
        """The allocator's peaks as the window's steps close (CUDA; None on a CPU)."""
        if self.window.in_window(self.cycle.cycles - 1):
            peaks = peak_memory_mib(self.device)
            if peaks["peak_allocated_mib"] is not None:
                self.peak_allocated_mib = peaks["peak_allocated_mib"]
                self.peak_reserved_mib = peaks["peak_reserved_mib"]

    def _memory_scalars(self) -> dict[str, float]:
        scalars = {"mem/process_rss_peak_mib": process_rss_peak_mib()}
        if self.peak_allocated_mib is not None:
            scalars["mem/peak_allocated_mib"] = self.peak_allocated_mib
        if self.peak_reserved_mib is not None:
            scalars["mem/peak_reserved_mib"] = self.peak_reserved_mib
        return scalars

    # --- FLOPs ----------------------------------------------------------------------------------------------

    @property
    def samples_per_step(self) -> int | None:
        """The global batch: micro-batch × micro-batches per step × processes."""
        if self.micro_batch_size is None:
            return None
        return self.micro_batch_size * self.micro_batches_per_step * self.world_size

    @property
    def flops_per_step(self) -> int | None:
        """Model FLOPs of one optimizer step on one device."""
        if self.flops_per_micro_batch is None:
            return None
        return self.flops_per_micro_batch * self.micro_batches_per_step

    def _count_flops(self, batch: Any) -> None:
        example = first_tensor(batch)
        if example is None:
            return
        self.micro_batch_size = len(example)
        network = self._meta_network if self._meta_network is not None else self.modules[0]
        if network is self._meta_network:
            _mirror_trainable(self.modules[0], network)
        try:
            self.flops_per_micro_batch = training_flops(network, example)
        except Exception as err:
            warnings.warn(f"StepProbe: FLOPs not counted ({type(err).__name__}: {err})", stacklevel=2)

    # --- the memory anatomy ---------------------------------------------------------------------------------

    def _begin_capture(self, batch: Any) -> None:
        capture = MemoryAnatomy(self.device, explicit_optimizer_update=True)
        # An in-memory dataset (TensorDataset) is data, not activations, whenever the capture touches it.
        capture.register([self.data, batch], "inputs")
        try:
            capture.start(self.modules, self.optimizers)
        except AnatomyUnavailable as err:
            warnings.warn(f"StepProbe: no memory anatomy on this run: {err}", stacklevel=2)
            self.anatomy = False
            return
        if capture.active:
            self._capture = capture
            return
        self.anatomy = False  # not measured: a compiled network
        self.anatomy_caveat = capture.caveat
        warnings.warn(f"StepProbe: memory anatomy {capture.caveat}", stacklevel=2)

    def _end_capture(self) -> None:
        capture = self._capture
        self._capture = None
        capture.stop()
        self.captured_step = self.cycle.step
        self.anatomy_caveat = capture.caveat
        self.anatomy_mib = capture.peak_mib()
        self.anatomy_end_mib = capture.end_mib()
        if self.anatomy_mib is not None and self.device.type != "cuda":
            self.peak_allocated_mib = self.anatomy_mib["total"]  # no allocator peak on a CPU: the tracker's

    # --- evaluations and epochs -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Around an evaluation: the anatomy capture pauses (an evaluation never enters it), a step it falls
        inside is not timed, and its time counts toward the epoch's evaluation time."""
        if self.cycle.open:
            self._evaluated_in_step = True
        started = time.perf_counter()
        paused = self._capture.paused() if self._capture is not None else contextlib.nullcontext()
        try:
            with paused:
                yield
        finally:
            if self._epoch is not None:
                self._epoch.evaluation_s += time.perf_counter() - started
                self._epoch.evaluations += 1

    def epoch_begins(self) -> None:
        self._epoch = _RunningEpoch(time.perf_counter())

    def epoch_ends(self, expected_steps: int | None) -> None:
        """At the end of a training epoch, its evaluations included; it counts as whole when this process ran
        ``expected_steps`` optimizer steps in it (not when a resume began it midway, nor when max_steps ended
        it)."""
        epoch = self._epoch
        self._epoch = None
        if epoch is not None and expected_steps is not None and epoch.steps == expected_steps:
            seconds = time.perf_counter() - epoch.start
            self.last_epoch = EpochTime(seconds, epoch.steps, epoch.evaluation_s, epoch.evaluations)

    def stop(self) -> None:
        """At the end of the run, also of one that failed mid-step: no capture (a dispatch mode, hooks) stays
        active."""
        self.timer.cancel()
        capture = self._capture
        self._capture = None
        if capture is not None:
            capture.stop()

    # --- the record -----------------------------------------------------------------------------------------

    def sections(self, steps_per_epoch: int | None = None) -> dict[str, dict]:
        """The record's ``timing``, ``flops``, ``memory``, ``techniques`` (what the run showed; a loop adds
        what its config says) and ``faults`` sections."""
        return {"timing": self._timing(steps_per_epoch), "flops": self._flops(), "memory": self._memory(),
                "techniques": self._techniques(), "faults": self.watch.section()}

    def _timing(self, steps_per_epoch: int | None) -> dict[str, Any]:
        timing = self.timer.summary(self.samples_per_step)
        timing["steps_per_epoch"] = steps_per_epoch
        epoch = self.last_epoch
        timing["epoch_time_s"] = epoch.seconds if epoch else None
        timing["epoch_steps"] = epoch.steps if epoch else None
        timing["epoch_validation_s"] = epoch.evaluation_s if epoch else None
        timing["epoch_validations"] = epoch.evaluations if epoch else None
        timing["wall_time_s"] = time.perf_counter() - self._wall_start
        timing["cpu_time_s"] = time.process_time() - self._cpu_start
        timing["step_cpu_utilization"] = self.timer.cpu_utilization(torch.get_num_threads())
        return timing

    def _flops(self) -> dict[str, Any]:
        median_s = self.timer.median_s()
        per_step = self.flops_per_step
        return {
            "flops_per_step": per_step,
            "flops_per_micro_batch": self.flops_per_micro_batch,
            "achieved_flops_per_s": per_step / median_s if per_step and median_s else None,
            "peak_flops_per_s": self.peak.flops_per_s,
            "peak_flops_source": self.peak.source,
            "peak_flops_method": self.peak.method,
            "peak_flops_dtype": str(self.dtype).removeprefix("torch."),
            "mfu": mfu(per_step, median_s, self.peak.flops_per_s),
        }

    def _memory(self) -> dict[str, Any]:
        if self.peak_allocated_mib is None:
            source = None
        elif self.device.type == "cuda":
            source = "cuda-allocator"
        else:
            source = "mem-tracker"
        network = self.modules[0] if self.modules else None
        return {
            "peak_allocated_mib": self.peak_allocated_mib,
            "peak_reserved_mib": self.peak_reserved_mib,
            "peak_source": source,
            "anatomy_step": self.captured_step,
            "anatomy_caveat": self.anatomy_caveat,
            "anatomy_mib": self.anatomy_mib,
            "anatomy_end_mib": self.anatomy_end_mib,
            "rss_peak_mib": process_rss_peak_mib(),
            "window_warmup_steps": self.window.warmup_steps,
            "model_parameters": sum(p.numel() for p in network.parameters()) if network is not None else None,
        }

    def _techniques(self) -> dict[str, Any]:
        network = self.modules[0] if self.modules else None
        return {
            "micro_batch_size": self.micro_batch_size,
            "accumulate_grad_batches": self.micro_batches_per_step,
            "world_size": self.world_size,
            "effective_batch_size": self.samples_per_step,
            "channels_last": channels_last_applied(network) if network is not None else None,
            "compile": is_compiled(network) if network is not None else None,
            "optimizer_impl": optimizer_impl(self.optimizers[0]) if self.optimizers else None,
        }
