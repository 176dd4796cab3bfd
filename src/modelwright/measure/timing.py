"""Step timing: the one warm-up/window rule, the step timer (host clock or CUDA events), micro-batch grouping."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from modelwright.measure.facts import as_device, cuda_device


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def _noop() -> None:
    return None


def device_sync(device: torch.device | str | None) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work (CUDA, MPS, XPU); a no-op elsewhere."""
    device = as_device(device)
    if cuda_device(device) is not None:
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps" and hasattr(torch, "mps"):
        return torch.mps.synchronize
    if device.type == "xpu" and hasattr(torch, "xpu"):
        return lambda: torch.xpu.synchronize(device)
    return _noop


@dataclass(frozen=True)
class Window:
    """The measured optimizer steps: the first ``warmup_steps`` are left out, then ``measure_steps`` count
    (``None``: until the end). Step time and the allocator peak both use this one rule."""

    warmup_steps: int = 2
    measure_steps: int | None = None

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.measure_steps is not None and self.measure_steps < 1:
            raise ValueError(f"measure_steps must be >= 1 or None, got {self.measure_steps}")

    def in_window(self, step: int) -> bool:
        """Whether step ``step`` (0-based, counted from the first step this run took) is measured."""
        end = None if self.measure_steps is None else self.warmup_steps + self.measure_steps
        return step >= self.warmup_steps and (end is None or step < end)


class StepTimer:
    """Durations of the optimizer steps inside a :class:`Window`: :meth:`start` when a step begins, :meth:`stop`
    when it ends.

    With a host clock the device is synchronized before each reading, so queued kernels fall inside their
    step. With ``cuda_events`` CUDA events are recorded instead and read lazily (when a figure is asked for, or
    as the device finishes them), so the host never waits on the device inside the loop.

    Args:
        warmup_steps, measure_steps: the :class:`Window`.
        clock: a monotonic clock in seconds.
        sync: waits for the device; see :func:`device_sync`.
        cuda_events: time with CUDA events instead of ``clock`` and ``sync``.
    """

    def __init__(self, warmup_steps: int = 2, measure_steps: int | None = None,
                 clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None,
                 cuda_events: bool = False) -> None:
        self.window = Window(warmup_steps, measure_steps)
        self.clock, self.sync, self.cuda_events = clock, sync or _noop, cuda_events
        self.steps_seen = 0  # steps stopped, measured or not
        self.excluded_steps = 0  # steps inside the window left out on request (e.g. an anatomy capture)
        self._durations_s: list[float] = []
        self._pending: list[tuple[Any, Any]] = []  # CUDA (start, end) events not read yet
        self._t0: Any = None

    def in_window(self, step_index: int | None = None) -> bool:
        """Whether step ``step_index`` (0-based; default: the next one) is in the measured window."""
        return self.window.in_window(self.steps_seen if step_index is None else step_index)

    def _now(self) -> Any:
        if self.cuda_events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        self.sync()
        return self.clock()

    def start(self) -> None:
        self._t0 = self._now()

    def stop(self, exclude: bool = False) -> float | None:
        """End the current step; its duration in seconds if it was measured on the host clock, else ``None``."""
        if self._t0 is None:
            raise RuntimeError("StepTimer.stop() without start()")
        t0, self._t0 = self._t0, None
        measured = self.in_window() and not exclude
        self.excluded_steps += self.in_window() and exclude
        self.steps_seen += 1
        if self.cuda_events:
            if measured:
                self._pending.append((t0, self._now()))
            self._resolve(wait=False)  # collect steps the device has finished, so few events stay pending
            return None
        dt = self._now() - t0
        if measured:
            self._durations_s.append(dt)
        return dt if measured else None

    def cancel(self) -> None:
        """Drop a step that was started but will not finish (a fit stopped mid-step)."""
        self._t0 = None

    def _resolve(self, wait: bool = True) -> None:
        while self._pending and (wait or self._pending[0][1].query()):
            start, end = self._pending.pop(0)
            end.synchronize()
            self._durations_s.append(start.elapsed_time(end) / 1e3)

    @property
    def durations_s(self) -> list[float]:
        """Measured step durations in seconds, in order."""
        self._resolve()
        return list(self._durations_s)

    def last_s(self) -> float | None:
        d = self.durations_s
        return d[-1] if d else None

    def median_s(self) -> float | None:
        d = self.durations_s
        return percentile(d, 50) if d else None

    def p90_s(self) -> float | None:
        d = self.durations_s
        return percentile(d, 90) if d else None

    def summary(self, steps_per_epoch: int | None = None, samples_per_step: int | None = None) -> dict[str, Any]:
        """The record's ``timing`` figures (without ``wall_time_s``); ``samples_per_step`` is the global batch."""
        d, med = self.durations_s, self.median_s()

        def ms(x: float | None) -> float | None:
            return None if x is None else x * 1e3

        return {
            "warmup_steps": self.window.warmup_steps,
            "measured_steps": len(d),
            "step_time_median_ms": ms(med),
            "step_time_p90_ms": ms(self.p90_s()),
            "step_time_min_ms": ms(min(d)) if d else None,
            "step_time_max_ms": ms(max(d)) if d else None,
            "steps_per_epoch": steps_per_epoch,
            "epoch_time_s": None if med is None or steps_per_epoch is None else steps_per_epoch * med,
            "samples_per_s": samples_per_step / med if med and samples_per_step else None,
        }


class CudaEventTimer(StepTimer):
    """A :class:`StepTimer` with ``cuda_events``."""

    def __init__(self, warmup_steps: int = 2, measure_steps: int | None = None) -> None:
        super().__init__(warmup_steps, measure_steps, cuda_events=True)


class StepCycle:
    """Groups micro-batches into optimizer steps by watching the optimizer-step counter.

    A cycle opens at the first micro-batch after the previous one closed and closes after the first micro-batch
    that moves the counter, so the accumulation rule (``batch_idx % k``, a short last batch of an epoch, manual
    optimization) need not be known.
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
