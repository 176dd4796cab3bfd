"""Step timing: the one warm-up rule (:class:`Window`), the step timer (host clock or CUDA events) with the
process's CPU time beside it, and the grouping of micro-batches into optimizer steps (:class:`StepCycle`)."""

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from modelwright.measure.facts import cuda_device


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default method)."""
    return torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100).item()


def device_sync(device: torch.device | str | None) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work (CUDA, MPS, XPU); a no-op elsewhere."""
    device = torch.device(device or "cpu")
    if device.type == "mps":
        return torch.mps.synchronize
    if cuda_device(device) is not None or device.type == "xpu":
        return lambda: getattr(torch, device.type).synchronize(device)
    return lambda: None


@dataclass(frozen=True)
class Window:
    """The one warm-up rule of step time and the allocator peak: skip ``warmup_steps``, then measure
    ``measure_steps`` (``None``: every step after the warm-up)."""

    warmup_steps: int = 2
    measure_steps: int | None = None

    def __post_init__(self) -> None:
        bad_measure = self.measure_steps is not None and self.measure_steps < 1
        if self.warmup_steps < 0 or bad_measure:
            raise ValueError("warmup_steps must be >= 0 and measure_steps >= 1 or None, "
                             f"got {self.warmup_steps} and {self.measure_steps}")

    def in_window(self, step: int) -> bool:
        """Whether ``step`` (0-based, counted from the first step this run took) is measured."""
        return 0 <= step - self.warmup_steps < (self.measure_steps or math.inf)


class _Start(NamedTuple):
    """A step's start: the step clock (a CUDA event on CUDA), the process's CPU time, the host clock."""

    clock: Any
    cpu_s: float
    host_s: float


class StepTimer:
    """Durations of the optimizer steps inside a :class:`Window`; ``sync`` runs before each reading of
    ``clock``, so that queued kernels fall inside their step. Beside each measured step's duration it keeps
    the process's CPU time over it (all threads), which tells a step that had its cores from one that waited
    for them."""

    def __init__(self, warmup_steps: int = 2, measure_steps: int | None = None,
                 clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        self.window = Window(warmup_steps, measure_steps)
        self.clock = clock
        self.sync = sync or (lambda: None)
        self.cpu_clock = cpu_clock
        self.steps_seen = 0  # steps stopped, measured or not
        self.cpu_s = 0.0  # process CPU time over the measured steps
        self.host_s = 0.0  # host wall time over the measured steps
        self._durations_s: list[float] = []
        self._started: _Start | None = None  # the running step's

    def in_window(self, step_index: int | None = None) -> bool:
        """Whether step ``step_index`` (0-based; default: the next one) is in the measured window."""
        return self.window.in_window(self.steps_seen if step_index is None else step_index)

    def _now(self) -> Any:
        self.sync()
        return self.clock()

    def _add(self, t0: Any, t1: Any) -> float | None:
        self._durations_s.append(t1 - t0)
        return self._durations_s[-1]

    def start(self) -> None:
        self._started = _Start(self._now(), self.cpu_clock(), time.perf_counter())

    def stop(self, exclude: bool = False) -> float | None:
        """End the current step; its duration in seconds if it was measured and is known now, else ``None``.
        ``exclude``: a step that other work disturbed (an anatomy capture, an evaluation) is not measured."""
        if self._started is None:
            raise RuntimeError("StepTimer.stop() without start()")
        started = self._started
        self._started = None
        measured = self.in_window() and not exclude
        self.steps_seen += 1
        if not measured:
            return None
        duration = self._add(started.clock, self._now())
        self.cpu_s += self.cpu_clock() - started.cpu_s
        self.host_s += time.perf_counter() - started.host_s
        return duration

    def cancel(self) -> None:
        """Drop a step that was started but will not finish (a fit stopped mid-step)."""
        self._started = None

    @property
    def durations_s(self) -> list[float]:
        return list(self._durations_s)

    def last_s(self) -> float | None:
        durations = self.durations_s
        return durations[-1] if durations else None

    def median_s(self) -> float | None:
        return percentile(self.durations_s, 50) if self.durations_s else None

    def p90_s(self) -> float | None:
        return percentile(self.durations_s, 90) if self.durations_s else None

    def cpu_utilization(self, threads: int) -> float | None:
        """CPU time over the measured steps ÷ (their wall time × ``threads``); None before any."""
        if not self.host_s or threads < 1:
            return None
        return self.cpu_s / (self.host_s * threads)

    def summary(self, samples_per_step: int | None = None) -> dict[str, Any]:
        """The record's step-time figures; ``samples_per_step`` is the global batch."""
        durations = self.durations_s
        median = self.median_s()
        figures = {"median": median, "p90": self.p90_s(),
                   "min": min(durations, default=None), "max": max(durations, default=None)}
        out: dict[str, Any] = {"warmup_steps": self.window.warmup_steps, "measured_steps": len(durations)}
        for name, seconds in figures.items():
            out[f"step_time_{name}_ms"] = None if seconds is None else seconds * 1e3
        out["samples_per_s"] = samples_per_step / median if median and samples_per_step else None
        return out


class CudaEventTimer(StepTimer):
    """A :class:`StepTimer` on CUDA events, read as the device finishes them or when a figure is asked for, so
    the host never waits on the device inside the loop; :meth:`stop` returns None."""

    def __init__(self, warmup_steps: int = 2, measure_steps: int | None = None) -> None:
        super().__init__(warmup_steps, measure_steps)
        self._pending: list[tuple[Any, Any]] = []  # (start, end) events not read yet

    def _now(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _add(self, t0: Any, t1: Any) -> None:
        self._pending.append((t0, t1))
        self._resolve(wait=False)  # collect steps the device has finished, so few events stay pending

    def _resolve(self, wait: bool = True) -> None:
        while self._pending and (wait or self._pending[0][1].query()):
            start, end = self._pending.pop(0)
            end.synchronize()
            self._durations_s.append(start.elapsed_time(end) / 1e3)

    @property
    def durations_s(self) -> list[float]:
        self._resolve()
        return list(self._durations_s)


class StepCycle:
    """Groups micro-batches into optimizer steps by watching the step counter: a cycle closes after the
    micro-batch that moves it, so the accumulation rule (a short last cycle, manual optimization) need not be
    known."""

    def __init__(self) -> None:
        self.open = False
        self.step: int | None = None  # counter value when the current / last cycle opened
        self.micro_batches = 0  # micro-batches in the current / last cycle
        self.cycles = 0  # cycles closed so far

    def begin(self, step_counter: int) -> bool:
        """Call before each micro-batch; True if it opens a new optimizer step."""
        if not self.open:
            self.open = True
            self.step = step_counter
            self.micro_batches = 0
        self.micro_batches += 1
        return self.micro_batches == 1

    def end(self, step_counter: int) -> bool:
        """Call after each micro-batch; True if the optimizer stepped (the cycle is complete)."""
        closed = self.open and step_counter != self.step
        if closed:
            self.open = False
            self.cycles += 1
        return closed
