"""Step timing: the one warm-up/window rule, host and CUDA-event step timers, and micro-batch grouping."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _noop() -> None:
    return None


def device_sync(device: torch.device | str | None) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work: ``torch.cuda.synchronize`` on CUDA, else no-op."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps" and hasattr(torch, "mps"):
        return torch.mps.synchronize
    if device.type == "xpu" and hasattr(torch, "xpu"):
        return lambda: torch.xpu.synchronize(device)
    return _noop


@dataclass(frozen=True)
class Window:
    """The measured optimizer steps: the first ``warmup_steps`` are left out, then ``measure_steps`` count.

    Every measurement (step time, allocator peak) uses this one rule, so their windows agree.

    Args:
        warmup_steps: steps seen but not measured (compile, allocator and cuDNN warm-up fall there).
        measure_steps: steps measured after the warm-up; ``None`` measures until the end.
    """

    warmup_steps: int = 2
    measure_steps: int | None = None

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.measure_steps is not None and self.measure_steps < 1:
            raise ValueError(f"measure_steps must be >= 1 or None, got {self.measure_steps}")

    def in_window(self, step: int) -> bool:
        """Whether step number ``step`` (0-based, counted from the first step this run took) is measured."""
        if step < self.warmup_steps:
            return False
        return self.measure_steps is None or step < self.warmup_steps + self.measure_steps


class StepTimer:
    """Durations of optimizer steps inside a :class:`Window`.

    Call :meth:`start` when a step begins and :meth:`stop` when it ends; both synchronize the device
    first so that queued kernels are inside the step they belong to.

    Args:
        warmup_steps, measure_steps: the :class:`Window`.
        clock: a monotonic clock in seconds.
        sync: waits for the device; see :func:`device_sync`.
    """

    def __init__(
        self,
        warmup_steps: int = 2,
        measure_steps: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        sync: Callable[[], None] | None = None,
    ) -> None:
        self.window = Window(warmup_steps, measure_steps)
        self.warmup_steps, self.measure_steps = warmup_steps, measure_steps
        self.clock = clock
        self.sync = sync or _noop
        self.steps_seen = 0  # steps stopped, measured or not
        self.excluded_steps = 0  # steps inside the window left out on request (e.g. an anatomy capture)
        self._durations_s: list[float] = []
        self._t0: float | None = None

    def in_window(self, step_index: int | None = None) -> bool:
        """Whether step ``step_index`` (0-based; default: the next one) is in the measured window."""
        return self.window.in_window(self.steps_seen if step_index is None else step_index)

    def start(self) -> None:
        self.sync()
        self._t0 = self.clock()

    def _count(self, exclude: bool) -> bool:
        """Count one finished step; whether it is measured."""
        inside = self.in_window()
        self.excluded_steps += inside and exclude
        self.steps_seen += 1
        return inside and not exclude

    def stop(self, exclude: bool = False) -> float | None:
        """End the current step; returns its duration in seconds if it was measured, else ``None``."""
        if self._t0 is None:
            raise RuntimeError("StepTimer.stop() without start()")
        self.sync()
        dt = self.clock() - self._t0
        self._t0 = None
        if not self._count(exclude):
            return None
        self._durations_s.append(dt)
        return dt

    def cancel(self) -> None:
        """Drop a step that was started but will not finish (a fit stopped mid-step)."""
        self._t0 = None

    def _resolve(self) -> None:
        """Turn pending measurements into durations (nothing to do for a host clock)."""

    @property
    def durations_s(self) -> list[float]:
        """Measured step durations in seconds, in order."""
        self._resolve()
        return list(self._durations_s)

    def last_s(self) -> float | None:
        """The latest measured step's duration in seconds."""
        self._resolve()
        return self._durations_s[-1] if self._durations_s else None

    @property
    def measured_steps(self) -> int:
        return len(self.durations_s)

    def median_s(self) -> float | None:
        d = self.durations_s
        return percentile(d, 50) if d else None

    def p90_s(self) -> float | None:
        d = self.durations_s
        return percentile(d, 90) if d else None

    def epoch_time_s(self, steps_per_epoch: int | None) -> float | None:
        """Time per epoch predicted as ``steps_per_epoch`` × median step time."""
        med = self.median_s()
        return None if med is None or steps_per_epoch is None else steps_per_epoch * med

    def samples_per_s(self, samples_per_step: int | None) -> float | None:
        """Throughput at the median step time; ``samples_per_step`` is the effective (global) batch."""
        med = self.median_s()
        return None if med is None or not samples_per_step or med <= 0 else samples_per_step / med

    def summary(self, steps_per_epoch: int | None = None, samples_per_step: int | None = None) -> dict[str, Any]:
        """The record's ``timing`` figures (without ``wall_time_s``)."""
        d = self.durations_s

        def ms(x: float | None) -> float | None:
            return None if x is None else x * 1e3

        return {
            "warmup_steps": self.warmup_steps,
            "measured_steps": len(d),
            "step_time_median_ms": ms(self.median_s()),
            "step_time_p90_ms": ms(self.p90_s()),
            "step_time_min_ms": ms(min(d)) if d else None,
            "step_time_max_ms": ms(max(d)) if d else None,
            "steps_per_epoch": steps_per_epoch,
            "epoch_time_s": self.epoch_time_s(steps_per_epoch),
            "samples_per_s": self.samples_per_s(samples_per_step),
        }


class CudaEventTimer(StepTimer):
    """A :class:`StepTimer` that times CUDA steps with events instead of a synchronize per step.

    Events are recorded on the current stream and read lazily (when a figure is asked for), so the host
    never waits on the device inside the training loop.
    """

    def __init__(self, warmup_steps: int = 2, measure_steps: int | None = None) -> None:
        super().__init__(warmup_steps, measure_steps)
        self._start_event: torch.cuda.Event | None = None
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> None:
        self._start_event = torch.cuda.Event(enable_timing=True)
        self._start_event.record()

    def stop(self, exclude: bool = False) -> float | None:
        if self._start_event is None:
            raise RuntimeError("CudaEventTimer.stop() without start()")
        if self._count(exclude):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._start_event, end))
        # Collect steps the device has already finished (a non-blocking query), so few events stay pending.
        while self._pending and self._pending[0][1].query():
            start, done = self._pending.pop(0)
            self._durations_s.append(start.elapsed_time(done) / 1e3)
        self._start_event = None
        return None  # known only once the events complete; see durations_s

    def cancel(self) -> None:
        self._start_event = None

    def _resolve(self) -> None:
        for start, end in self._pending:
            end.synchronize()
            self._durations_s.append(start.elapsed_time(end) / 1e3)
        self._pending.clear()


class StepCycle:
    """Groups micro-batches into optimizer steps by watching the optimizer-step counter.

    A cycle opens at the first micro-batch after the previous one closed and closes at the first
    micro-batch after which the counter has moved. This needs no knowledge of the accumulation rule
    (``batch_idx % k``, a short last batch of an epoch, manual optimization all work the same way).
    """

    def __init__(self) -> None:
        self.open = False
        self.step: int | None = None  # counter value when the current / last cycle opened
        self.micro_batches = 0  # micro-batches in the current / last cycle
        self.cycles = 0  # cycles closed so far

    def begin(self, step_counter: int) -> bool:
        """Call before each micro-batch; True if it opens a new optimizer step."""
        if self.open:
            self.micro_batches += 1
            return False
        self.open, self.step, self.micro_batches = True, step_counter, 1
        return True

    def end(self, step_counter: int) -> bool:
        """Call after each micro-batch; True if the optimizer stepped (the cycle is complete)."""
        if not self.open or step_counter == self.step:
            return False
        self.open = False
        self.cycles += 1
        return True
