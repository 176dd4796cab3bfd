"""Step timing: the one warm-up/window rule, the step timer (host clock or CUDA events), micro-batch grouping."""

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
    """The one warm-up rule of step time and the allocator peak: skip ``warmup_steps``, measure ``measure_steps``."""

    warmup_steps: int = 2
    measure_steps: int | None = None

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or (self.measure_steps is not None and self.measure_steps < 1):
            raise ValueError(f"warmup_steps must be >= 0 and measure_steps >= 1 or None, got {self.warmup_steps} "
                             f"and {self.measure_steps}")

    def in_window(self, step: int) -> bool:  # step: 0-based, from the first step this run took
        return 0 <= step - self.warmup_steps < (self.measure_steps or math.inf)


class StepTimer:
    """Durations of the optimizer steps inside a :class:`Window`, ``sync`` run before each reading of ``clock`` so
    that queued kernels fall inside their step."""

    def __init__(self, warmup_steps: int = 2, measure_steps: int | None = None,
                 clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None) -> None:
        self.window = Window(warmup_steps, measure_steps)
        self.clock, self.sync = clock, sync or (lambda: None)
        self.steps_seen, self._t0 = 0, None  # steps stopped, measured or not; the running step's start
        self._durations_s: list[float] = []

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
        self._t0 = self._now()

    def stop(self, exclude: bool = False) -> float | None:
        """End the current step; its duration in seconds if it was measured and is known now, else ``None``."""
        if self._t0 is None:
            raise RuntimeError("StepTimer.stop() without start()")
        t0, self._t0, measured = self._t0, None, self.in_window() and not exclude
        self.steps_seen += 1
        return self._add(t0, self._now()) if measured else None

    def cancel(self) -> None:
        """Drop a step that was started but will not finish (a fit stopped mid-step)."""
        self._t0 = None

    @property
    def durations_s(self) -> list[float]:
        return list(self._durations_s)

    def last_s(self) -> float | None:
        return self.durations_s[-1] if self.durations_s else None

    def median_s(self) -> float | None:
        return percentile(self.durations_s, 50) if self.durations_s else None

    def p90_s(self) -> float | None:
        return percentile(self.durations_s, 90) if self.durations_s else None

    def summary(self, steps_per_epoch: int | None = None, samples_per_step: int | None = None) -> dict[str, Any]:
        """The record's ``timing`` figures (without ``wall_time_s``); ``samples_per_step`` is the global batch."""
        d, med = self.durations_s, self.median_s()
        figures = {"median": med, "p90": self.p90_s(), "min": min(d, default=None), "max": max(d, default=None)}
        return {
            "warmup_steps": self.window.warmup_steps,
            "measured_steps": len(d),
            **{f"step_time_{k}_ms": None if v is None else v * 1e3 for k, v in figures.items()},
            "steps_per_epoch": steps_per_epoch,
            "epoch_time_s": None if med is None or steps_per_epoch is None else steps_per_epoch * med,
            "samples_per_s": samples_per_step / med if med and samples_per_step else None,
        }


class CudaEventTimer(StepTimer):
    """A :class:`StepTimer` on CUDA events, read as the device finishes them or when a figure is asked for, so the
    host never waits on the device inside the loop; :meth:`stop` returns None."""

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
    """Groups micro-batches into optimizer steps by watching the step counter: a cycle closes after the micro-batch
    that moves it, so the accumulation rule (a short last cycle, manual optimization) need not be known."""

    def __init__(self) -> None:
        self.open = False
        self.step: int | None = None  # counter value when the current / last cycle opened
        self.micro_batches = 0  # micro-batches in the current / last cycle
        self.cycles = 0  # cycles closed so far

    def begin(self, step_counter: int) -> bool:
        """Call before each micro-batch; True if it opens a new optimizer step."""
        if not self.open:
            self.open, self.step, self.micro_batches = True, step_counter, 0
        self.micro_batches += 1
        return self.micro_batches == 1

    def end(self, step_counter: int) -> bool:
        """Call after each micro-batch; True if the optimizer stepped (the cycle is complete)."""
        closed = self.open and step_counter != self.step
        if closed:
            self.open, self.cycles = False, self.cycles + 1
        return closed
