"""Device-neutral measurement: step timers, peak memory and its anatomy, FLOPs, peak FLOP/s, facts.

Nothing here imports Lightning: ``callbacks/`` and a plain training loop call the same functions.

* :class:`StepTimer` / :class:`CudaEventTimer`: per-optimizer-step durations with warm-up excluded,
  median, p90, time per epoch and samples per second.
* :func:`reset_peak_memory` / :func:`peak_memory_mib`: the CUDA allocator's peak over a window.
* :class:`MemoryAnatomy`: where the tensor memory of one step went (parameters, gradients, optimizer
  state, activations, temporaries), on any device, CPU included. It is the only place that touches
  PyTorch's private ``torch.distributed._tools.mem_tracker``.
* :func:`count_flops`, :func:`training_flops`: FLOPs with PyTorch's flop counter;
  :func:`resolve_peak_flops` picks the peak FLOP/s (table, config or a measured, cached matmul peak).
* :func:`hardware_info`, :func:`versions`: the conditions to state with every number.

Units live in names: ``_mib`` is 2**20 bytes, ``_s`` seconds, ``_ms`` milliseconds.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modelwright.record import ANATOMY_CATEGORIES

MIB = 2**20


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


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


class StepTimer:
    """Durations of optimizer steps: the first ``warmup_steps`` dropped, then at most ``measure_steps`` kept.

    Call :meth:`start` when a step begins and :meth:`stop` when it ends; both synchronize the device
    first so that queued kernels are inside the step they belong to.

    Args:
        warmup_steps: steps seen but not measured (compile and allocator warm-up fall there).
        measure_steps: steps measured after the warm-up; ``None`` measures until the end.
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
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if measure_steps is not None and measure_steps < 1:
            raise ValueError(f"measure_steps must be >= 1 or None, got {measure_steps}")
        self.warmup_steps = warmup_steps
        self.measure_steps = measure_steps
        self.clock = clock
        self.sync = sync or _noop
        self.steps_seen = 0  # steps stopped, measured or not
        self.excluded_steps = 0  # steps inside the window left out on request (e.g. an anatomy capture)
        self._durations_s: list[float] = []
        self._t0: float | None = None

    def in_window(self, step_index: int | None = None) -> bool:
        """Whether step number ``step_index`` (0-based; default: the next one) is in the measured window."""
        i = self.steps_seen if step_index is None else step_index
        if i < self.warmup_steps:
            return False
        return self.measure_steps is None or i < self.warmup_steps + self.measure_steps

    def start(self) -> None:
        self.sync()
        self._t0 = self.clock()

    def stop(self, exclude: bool = False) -> float | None:
        """End the current step; returns its duration in seconds if it was measured, else ``None``."""
        if self._t0 is None:
            raise RuntimeError("StepTimer.stop() without start()")
        self.sync()
        dt = self.clock() - self._t0
        self._t0 = None
        measured = self.in_window() and not exclude
        if self.in_window() and exclude:
            self.excluded_steps += 1
        self.steps_seen += 1
        if not measured:
            return None
        self._durations_s.append(dt)
        return dt

    def cancel(self) -> None:
        """Drop a step that was started but will not finish (a fit stopped mid-step)."""
        self._t0 = None

    @property
    def running(self) -> bool:
        return self._t0 is not None

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
        if med is None or steps_per_epoch is None:
            return None
        return steps_per_epoch * med

    def samples_per_s(self, samples_per_step: int | None) -> float | None:
        """Throughput at the median step time; ``samples_per_step`` is the effective (global) batch."""
        med = self.median_s()
        if med is None or not samples_per_step or med <= 0:
            return None
        return samples_per_step / med

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
        self._t0 = 0.0

    def stop(self, exclude: bool = False) -> float | None:
        if self._start_event is None:
            raise RuntimeError("CudaEventTimer.stop() without start()")
        measured = self.in_window() and not exclude
        if self.in_window() and exclude:
            self.excluded_steps += 1
        self.steps_seen += 1
        if measured:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._start_event, end))
        # Collect steps the device has already finished (a non-blocking query), so few events stay pending.
        while self._pending and self._pending[0][1].query():
            start, done = self._pending.pop(0)
            self._durations_s.append(start.elapsed_time(done) / 1e3)
        self._start_event = None
        self._t0 = None
        return None  # known only once the events complete; see durations_s

    def cancel(self) -> None:
        self._start_event = None
        self._t0 = None

    def _resolve(self) -> None:
        for start, end in self._pending:
            end.synchronize()
            self._durations_s.append(start.elapsed_time(end) / 1e3)
        self._pending.clear()


# --------------------------------------------------------------------------------------------------
# Peak memory
# --------------------------------------------------------------------------------------------------


def reset_peak_memory(device: torch.device | str | None) -> bool:
    """Start a peak-memory window on a CUDA device; returns False (and does nothing) elsewhere."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    torch.cuda.reset_peak_memory_stats(device)
    return True


def peak_memory_mib(device: torch.device | str | None) -> dict[str, float | None]:
    """The CUDA allocator's ``max_memory_allocated`` / ``max_memory_reserved`` since the last reset, in MiB.

    ``None`` for both on devices without such an allocator (CPU).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda" or not torch.cuda.is_available():
        return {"peak_allocated_mib": None, "peak_reserved_mib": None}
    return {
        "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MIB,
        "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / MIB,
    }


def process_rss_peak_mib() -> float | None:
    """The process's resident-set high-water mark in MiB (``getrusage``).

    This is *process RSS*, not a tensor peak: on CPU, glibc keeps freed pages, so it mixes in
    allocator slack, the Python heap and libraries. Report it only under its own label.
    """
    try:
        import resource
    except ImportError:  # Windows
        return None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return maxrss / MIB if sys.platform == "darwin" else maxrss / 1024


def _load_mem_tracker():
    """PyTorch's private memory tracker class and its category enum; ``(None, None, error)`` if gone."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    except Exception as err:  # ImportError, or the package failing to import on this build
        return None, None, err
    return MemTracker, _MemRefType, None


# MemTracker's category names (``_MemRefType`` values) → ours.
_TRACKER_TO_OURS = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other",
}


class AnatomyUnavailable(RuntimeError):
    """PyTorch's memory tracker cannot be used here (import failed or its private API changed)."""


class MemoryAnatomy:
    """Where the tensor memory of a captured region went, on any device.

    Wraps ``torch.distributed._tools.mem_tracker.MemTracker`` (a private PyTorch API): every tensor
    storage created inside the region is attributed to one category (activations in forward,
    temporaries in backward, optimizer state in ``optimizer.step``); parameters, buffers, their
    gradients and existing optimizer state are registered at :meth:`start`. Tensors created before
    :meth:`start` that are none of those (e.g. the input batch) are not counted.

    Three views, each a dict of ``record.ANATOMY_CATEGORIES`` plus ``total``, in bytes:

    * :attr:`peak_bytes`: the breakdown at the moment the total was highest (it sums to the total);
    * :attr:`category_max_bytes`: each category's own maximum over the region (these peak at
      different moments, so they do not sum to the peak);
    * :attr:`end_bytes`: what is alive when :meth:`stop` is called.

    Usage::

        anatomy = MemoryAnatomy(device="cpu")
        with anatomy.capture(model, optimizer):
            loss = model(x).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()
        anatomy.peak_mib()["activations"]

    Calling the same root module again inside one capture (gradient accumulation) needs
    :meth:`next_micro_batch` between the calls.

    Forward and backward may run inside ``optimizer.step(closure)`` (Lightning does this): tensors
    made inside a module's forward or in backward are activations and temporaries even then. With
    ``explicit_optimizer_update``, optimizer state is counted only after :meth:`optimizer_update`
    (call it where the update begins, e.g. Lightning's ``on_before_optimizer_step``), so that the
    loss computed in the closure is not counted as optimizer state either.

    Args:
        device: the device whose memory to report; default: the one with the largest peak.
        explicit_optimizer_update: see above.
    """

    def __init__(self, device: torch.device | str | None = None, explicit_optimizer_update: bool = False) -> None:
        self.device = torch.device(device) if device is not None else None
        self.explicit_optimizer_update = explicit_optimizer_update
        self._tracker = None
        self.peak_bytes: dict[str, int] | None = None
        self.end_bytes: dict[str, int] | None = None
        self.category_max_bytes: dict[str, int] | None = None

    @staticmethod
    def available() -> bool:
        """Whether PyTorch's tracker can be imported on this build."""
        return _load_mem_tracker()[0] is not None

    @property
    def active(self) -> bool:
        return self._tracker is not None

    def start(self, modules: nn.Module | Iterable[nn.Module], optimizers: Iterable[Any] = ()) -> None:
        """Begin tracking; ``modules`` and ``optimizers`` are registered as parameters / optimizer state."""
        tracker_cls, _, err = _load_mem_tracker()
        if tracker_cls is None:
            raise AnatomyUnavailable(f"torch.distributed._tools.mem_tracker is unavailable: {err}")
        modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        optimizers = [o for o in optimizers if o is not None]
        # ModTracker warns whenever a module is re-entered by name, which DDP's wrappers do harmlessly.
        warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
        try:
            tracker = _tracker_class(tracker_cls)(self.explicit_optimizer_update)
            tracker.track_external(*modules, *optimizers)
            tracker.__enter__()
        except Exception as err:
            raise AnatomyUnavailable(f"MemTracker failed to start: {type(err).__name__}: {err}") from err
        self._tracker = tracker
        self.peak_bytes = self.end_bytes = self.category_max_bytes = None

    def optimizer_update(self) -> None:
        """Mark that the optimizer's update begins now (with ``explicit_optimizer_update``)."""
        if self._tracker is not None:
            self._tracker.update_marked = True

    def next_micro_batch(self) -> None:
        """Allow the root module to run forward again in the same capture (gradient accumulation)."""
        if self._tracker is not None:
            self._tracker.reset_mod_stats()

    def stop(self) -> dict[str, float]:
        """End tracking; returns :meth:`peak_mib`."""
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            raise RuntimeError("MemoryAnatomy.stop() without start()")
        try:
            end = tracker.get_tracker_snapshot("current")
            peak = tracker.get_tracker_snapshot("peak")
        finally:
            tracker.__exit__(None, None, None)
        device = self.device
        if device is None:
            totals = {d: s.get("Total", 0) for d, s in peak.items()}
            device = max(totals, key=totals.get) if totals else torch.device("cpu")
        self.peak_bytes = self._ours(peak, device)
        self.end_bytes = self._ours(end, device)
        self.category_max_bytes = self._ours(tracker.category_max, device)
        # Categories peak at different moments: the total of this view is the real peak, not their sum.
        self.category_max_bytes["total"] = self.peak_bytes["total"]
        return self.peak_mib()

    def capture(self, modules: nn.Module | Iterable[nn.Module], optimizers: Iterable[Any] = ()):
        """Context manager around :meth:`start` / :meth:`stop`."""
        anatomy = self

        class _Ctx:
            def __enter__(self) -> MemoryAnatomy:
                anatomy.start(modules, optimizers)
                return anatomy

            def __exit__(self, *exc: Any) -> None:
                anatomy.stop()

        return _Ctx()

    @staticmethod
    def _ours(snapshots: dict, device: torch.device) -> dict[str, int]:
        snap = _device_entry(snapshots, device)
        out = dict.fromkeys(ANATOMY_CATEGORIES, 0)
        for key, value in snap.items():
            name = getattr(key, "value", key)
            if name in _TRACKER_TO_OURS:
                out[_TRACKER_TO_OURS[name]] += int(value)
        out["total"] = sum(out[k] for k in ANATOMY_CATEGORIES)
        return out

    def peak_mib(self) -> dict[str, float] | None:
        return _mib_dict(self.peak_bytes)

    def end_mib(self) -> dict[str, float] | None:
        return _mib_dict(self.end_bytes)

    def category_max_mib(self) -> dict[str, float] | None:
        return _mib_dict(self.category_max_bytes)


_TRACKER_CLASSES: dict[type, type] = {}


def _tracker_class(base: type) -> type:
    """``MemTracker`` plus two things it lacks: per-category maxima, and closure-aware optimizer state.

    Relies on private members of PyTorch's tracker (``_update_peak_stats``, ``_curr_mem_snap``,
    ``_in_opt``, ``_mod_tracker``); ``tests/test_measure.py`` breaks first if they change.
    """
    if base in _TRACKER_CLASSES:
        return _TRACKER_CLASSES[base]

    class _Tracker(base):  # type: ignore[misc, valid-type]
        def __init__(self, explicit_update: bool = False) -> None:
            super().__init__()
            self.category_max: dict[Any, dict[Any, int]] = {}
            self.explicit_update = explicit_update
            self.update_marked = False

        def _update_peak_stats(self, peak_state: Any) -> None:
            super()._update_peak_stats(peak_state)
            for dev, snap in self._curr_mem_snap.items():
                seen = self.category_max.setdefault(dev, {})
                for key, value in snap.items():
                    if value > seen.get(key, 0):
                        seen[key] = value

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if not self._in_opt:
                self.update_marked = False
                return super().__torch_dispatch__(func, types, args, kwargs)
            # Inside optimizer.step(): only work outside every module's forward and outside backward is
            # the update itself (a closure runs forward and backward inside step()).
            mods = self._mod_tracker
            if not mods.is_bw and mods.parents == {"Global"} and (self.update_marked or not self.explicit_update):
                return super().__torch_dispatch__(func, types, args, kwargs)
            self._in_opt = False
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._in_opt = True

    _TRACKER_CLASSES[base] = _Tracker
    return _Tracker


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` (or a submodule) runs through ``torch.compile``.

    A memory anatomy of such a module misses the tensors made inside compiled graphs: they are
    allocated by generated kernels that PyTorch's tracker does not see.
    """
    return hasattr(module, "_orig_mod") or any(
        m.__dict__.get("_compiled_call_impl") is not None for m in module.modules()
    )


def _device_entry(snapshots: dict, device: torch.device) -> dict:
    for dev, snap in snapshots.items():
        d = torch.device(dev)
        if d.type == device.type and (device.index is None or d.index in (None, device.index)):
            return snap
    return {}


def _mib_dict(d: dict[str, int] | None) -> dict[str, float] | None:
    return None if d is None else {k: v / MIB for k, v in d.items()}


# --------------------------------------------------------------------------------------------------
# FLOPs and peak FLOP/s
# --------------------------------------------------------------------------------------------------


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of everything ``fn`` runs, counted by ``torch.utils.flop_counter.FlopCounterMode``.

    The counter knows matmuls, convolutions and attention (the ops that dominate); elementwise ops,
    norms and the optimizer count as zero.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with parameters and buffers on the meta device (no memory, no compute).

    Forwards replaced on instances (gradient-checkpointing wrappers) are dropped in the copy, so FLOPs
    counted on it are model FLOPs, without recomputation. A ``torch.compile`` wrapper is looked through.
    """
    module = getattr(module, "_orig_mod", module)
    memo: dict[int, Any] = {}
    for sub in module.modules():  # nn.Module.compile() keeps its compiled call on the instance
        impl = sub.__dict__.get("_compiled_call_impl")
        if impl is not None:
            memo[id(impl)] = None
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    copied = copy.deepcopy(module, memo)
    for sub in copied.modules():
        sub.__dict__.pop("forward", None)
    return copied


def training_flops(
    module: nn.Module,
    example_input: torch.Tensor,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> int:
    """FLOPs of one forward and backward of ``module`` on a batch shaped like ``example_input``.

    Counted on a :func:`meta_copy` (nothing runs on the device); the loss (``loss_fn``, default a
    sum of the output) is negligible next to the network. Multiply by the micro-batches per
    optimizer step for a step's FLOPs.
    """
    model = meta_copy(module)
    model.train()
    x = example_input.detach().to("meta")
    loss_fn = loss_fn or (lambda out: out.float().sum())
    return count_flops(lambda: loss_fn(model(x)).backward())


#: ``precision`` strings (Lightning's) → the dtype matmuls run in.
_PRECISION_DTYPES = {
    "bf16": torch.bfloat16,
    "16": torch.float16,
    "64": torch.float64,
    "32": torch.float32,
}


def compute_dtype(precision: str | int | None) -> torch.dtype:
    """The dtype a run's matmuls use: ``"bf16-mixed"`` → bfloat16, ``"16-mixed"`` → float16, else float32."""
    p = str(precision or "32").lower()
    for prefix in ("bf16", "64", "16", "32"):
        if p.startswith(prefix):
            return _PRECISION_DTYPES[prefix]
    if p.startswith("transformer-engine"):
        return torch.bfloat16
    return torch.float32


def device_name(device: torch.device | str | None) -> str:
    """A human name for ``device``: the GPU's name, or the CPU model."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return cpu_model()
    return device.type


def default_cache_dir() -> Path:
    """``$MODELWRIGHT_CACHE_DIR``, else ``~/.cache/modelwright``."""
    env = os.environ.get("MODELWRIGHT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "modelwright"


def default_matmul_size(device: torch.device | str) -> int:
    """Side of the square matmul that measures a device's peak: 8192 on a GPU, 2048 on a CPU."""
    return 2048 if torch.device(device).type == "cpu" else 8192


def _gemm_kernels(
    device: torch.device, dtype: torch.dtype, n: int, gen: torch.Generator
) -> dict[str, tuple[Callable, int]]:
    """The dense products whose best throughput is the device's peak: ``{name: (run, FLOPs per run)}``.

    ``torch.matmul`` of two ``n``×``n`` matrices everywhere. On a CPU also two convolutions in channels_last, which
    go to oneDNN rather than the BLAS library: a 1×1 convolution computing the same product (``n`` pixels, ``n``
    channels in and out) and a 3×3 convolution of ``n // 4`` channels over ``n`` pixels, the shape of a ResNet
    stage. On some CPUs the BLAS sgemm is the slower kernel (seen on an AMD EPYC: 136 GFLOP/s against 209 for
    oneDNN in fp32), and a peak that a network's convolutions exceed is not a peak.
    """
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    kernels: dict[str, tuple[Callable, int]] = {"matmul": (lambda: torch.matmul(a, b), 2 * n**3)}
    if device.type == "cpu" and n % 128 == 0:
        cl = torch.channels_last
        x = torch.randn(1, n, 32, n // 32, dtype=dtype, generator=gen).to(memory_format=cl)
        w1 = torch.randn(n, n, 1, 1, dtype=dtype, generator=gen).to(memory_format=cl)
        c = n // 4
        x3 = torch.randn(1, c, 32, n // 32, dtype=dtype, generator=gen).to(memory_format=cl)
        w3 = torch.randn(c, c, 3, 3, dtype=dtype, generator=gen).to(memory_format=cl)
        kernels["conv1x1"] = (lambda: torch.nn.functional.conv2d(x, w1), 2 * n**3)
        kernels["conv3x3"] = (lambda: torch.nn.functional.conv2d(x3, w3, padding=1), 2 * n * c * 9 * c)
    return kernels


def measure_matmul_peak(
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    n: int | None = None,
    repeats: int = 10,
    budget_s: float = 3.0,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The best FLOP/s of the dense products of :func:`_gemm_kernels` in ``dtype`` on ``device``.

    Each kernel gets one warm-up call, then is timed until ``repeats`` calls or ``budget_s`` seconds; the best
    call of any kernel wins.
    """
    device = torch.device(device)
    n = n or default_matmul_size(device)
    sync = device_sync(device)
    # A private generator: measuring the peak must not move the global RNG (and so the run's shuffle).
    gen = torch.Generator(device=device).manual_seed(0)
    best = 0.0
    for kernel, flops in _gemm_kernels(device, dtype, n, gen).values():
        kernel()
        sync()
        spent = 0.0
        for _ in range(repeats):
            t0 = clock()
            kernel()
            sync()
            dt = clock() - t0
            best = max(best, flops / dt)
            spent += dt
            if spent > budget_s:
                break
    return best


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def peak_cache_key(device: torch.device | str, dtype: torch.dtype, n: int | None = None) -> str:
    """The key of a measured matmul peak in the cache file (see :func:`cached_matmul_peak`)."""
    n = n or default_matmul_size(device)
    key = f"{device_name(device)}|{_dtype_name(dtype)}|n={n}"
    if torch.device(device).type == "cpu":
        key += f"|threads={torch.get_num_threads()}|kernels=matmul+conv1x1+conv3x3"
    return key


def cached_matmul_peak(
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    cache_path: str | Path | None = None,
    n: int | None = None,
) -> float:
    """:func:`measure_matmul_peak`, measured once per machine: cached in a JSON file.

    The key is ``"<device name>|<dtype>|n=<n>"``, and for a CPU also ``|threads=<torch threads>``
    (DDP on CPU gives each process a share of the cores, so its peak is that share's). The default
    file is ``<cache dir>/peak_flops.json`` (see :func:`default_cache_dir`).
    """
    path = Path(cache_path) if cache_path is not None else default_cache_dir() / "peak_flops.json"
    key = peak_cache_key(device, dtype, n)
    cache: dict[str, Any] = {}
    if path.is_file():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
    entry = cache.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("flops_per_s"), (int, float)):
        return float(entry["flops_per_s"])
    value = measure_matmul_peak(device, dtype, n=n)
    cache[key] = {"flops_per_s": value, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".peak_flops.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as err:  # a read-only home should not stop a run
        warnings.warn(f"could not cache the matmul peak in {path}: {err}", stacklevel=2)
    return value


def resolve_peak_flops(
    device: torch.device | str,
    dtype: torch.dtype,
    table_value: float | None = None,
    config_value: float | None = None,
    measure: bool = True,
    cache_path: str | Path | None = None,
    matmul_size: int | None = None,
) -> tuple[float | None, str | None]:
    """The peak FLOP/s to divide by, and where it came from.

    In order: ``table_value`` (a vendor table, e.g. Lightning's) → ``"lightning-table"``;
    ``config_value`` → ``"config"``; a measured matmul peak in ``dtype``, cached per machine →
    ``"measured-matmul"``; else ``(None, None)``.

    On a CPU a reduced-precision matmul can be slower than the float32 one (AVX512-BF16 without AMX: seen at
    135 against 238 GFLOP/s) while oneDNN's bf16 convolutions are not; the machine's peak is then the faster
    of the two, so a bf16 run's MFU is taken against ``max(bf16, fp32)`` and never exceeds what fp32 could reach.
    """
    if table_value:
        return float(table_value), "lightning-table"
    if config_value:
        return float(config_value), "config"
    if measure:
        peak = cached_matmul_peak(device, dtype, cache_path=cache_path, n=matmul_size)
        if torch.device(device).type == "cpu" and dtype != torch.float32:
            peak = max(peak, cached_matmul_peak(device, torch.float32, cache_path=cache_path, n=matmul_size))
        return peak, "measured-matmul"
    return None, None


def mfu(flops_per_step: float | None, step_time_s: float | None, peak_flops_per_s: float | None) -> float | None:
    """Model FLOPs utilisation: (FLOPs per step ÷ step time) ÷ peak FLOP/s."""
    if not flops_per_step or not step_time_s or not peak_flops_per_s:
        return None
    return flops_per_step / step_time_s / peak_flops_per_s


# --------------------------------------------------------------------------------------------------
# Facts: hardware and versions
# --------------------------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memtotal_mib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def hardware_info(device: torch.device | str | None = None, num_devices: int | None = None) -> dict[str, Any]:
    """The record's ``hardware`` section for ``device`` (default: CUDA if present, else CPU).

    ``device_memory_mib`` is the GPU's total memory, or the machine's RAM for a CPU run.
    ``cpu_cores`` counts logical CPUs; ``cpu_cores_available`` those this process may run on.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    info: dict[str, Any] = {
        "accelerator": device.type,
        "device_name": device_name(device),
        "device_memory_mib": None,
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "num_devices": num_devices if num_devices is not None else 1,
        "host_memory_mib": _memtotal_mib(),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        info["device_memory_mib"] = torch.cuda.get_device_properties(device).total_memory / MIB
    elif device.type == "cpu":
        info["device_memory_mib"] = info["host_memory_mib"]
    return info


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """The record's ``versions`` section; ``cuda`` is the CUDA version torch was built with (or None)."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": _dist_version("lightning"),
        "torchvision": _dist_version("torchvision"),
        "accelerate": _dist_version("accelerate"),
        "cuda": torch.version.cuda,
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None,
    }


# --------------------------------------------------------------------------------------------------
# Techniques as applied, and how a run ended
# --------------------------------------------------------------------------------------------------


def optimizer_impl(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer class that ran and its kernel: ``torch.optim.AdamW[foreach]`` / ``[for-loop]`` / ``[fused]``."""
    cls = type(optimizer)
    exported = getattr(torch.optim, cls.__name__, None) is cls
    name = f"torch.optim.{cls.__name__}" if exported else f"{cls.__module__}.{cls.__qualname__}"
    defaults = optimizer.defaults
    if defaults.get("fused"):
        return f"{name}[fused]"
    foreach = defaults.get("foreach")
    if foreach is None:
        # PyTorch's default: foreach when every parameter is on a GPU, else the per-tensor for-loop.
        params = [p for group in optimizer.param_groups for p in group["params"]]
        foreach = bool(params) and all(p.device.type == "cuda" for p in params)
    return f"{name}[{'foreach' if foreach else 'for-loop'}]"


def channels_last_applied(module: nn.Module) -> bool | None:
    """Whether the first spatial conv weight is in channels_last format; None if none or unreadable (sharded)."""
    for p in module.parameters():
        if p.ndim == 4 and p.shape[2:] != (1, 1):
            try:
                return p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
            except Exception:
                return None
    return None


def error_status(exception: BaseException) -> str:
    """The record status of a run that raised ``exception``: ``interrupted``, ``oom`` or ``failed``."""
    if isinstance(exception, (KeyboardInterrupt, SystemExit)):  # Ctrl-C; SIGTERM (Lightning's SIGTERMException)
        return "interrupted"
    text = str(exception).lower()
    if isinstance(exception, (torch.OutOfMemoryError, MemoryError)) or any(
        phrase in text
        for phrase in ("out of memory", "can't allocate memory")  # CUDA; CPU allocator
    ):
        return "oom"
    return "failed"


def one_line_error(exception: BaseException) -> str:
    """``Type: first line of the message``, at most 500 characters, for the record's ``error``."""
    text = str(exception).strip().splitlines()
    return f"{type(exception).__name__}: {text[0] if text else ''}"[:500].rstrip(": ")
