"""Peak memory: the CUDA allocator's window, process RSS, and the tensor anatomy of one step."""

import contextlib
import resource
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from modelwright.measure.facts import MIB, cuda_device
from modelwright.measure.memtracker import CATEGORY_TO_TRACKER, by_category, tensors_in, tracker_class

#: Why a compiled module has no anatomy (``MemoryAnatomy.caveat``).
COMPILE_NOT_MEASURED = ("not measured: torch.compile runs eagerly under PyTorch's memory tracker (a "
                        "TorchDispatchMode), so its figures would be eager memory")


def reset_peak_memory(device: torch.device | str | None) -> bool:
    """Start a peak-memory window on a CUDA device; returns False (and does nothing) elsewhere."""
    device = cuda_device(device)
    if device is not None:
        torch.cuda.reset_peak_memory_stats(device)
    return device is not None


def peak_memory_mib(device: torch.device | str | None) -> dict[str, float | None]:
    """The CUDA allocator's ``max_memory_allocated`` / ``max_memory_reserved`` since the last reset; None on
    CPU."""
    device = cuda_device(device)
    if device is None:
        return {"peak_allocated_mib": None, "peak_reserved_mib": None}
    stats = torch.cuda.memory_stats(device)  # what max_memory_allocated and max_memory_reserved each read
    return {"peak_allocated_mib": stats.get("allocated_bytes.all.peak", 0) / MIB,
            "peak_reserved_mib": stats.get("reserved_bytes.all.peak", 0) / MIB}


def process_rss_peak_mib() -> float | None:
    """The process's resident-set high-water mark in MiB: not a tensor peak (glibc keeps freed pages)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / MIB if sys.platform == "darwin" else maxrss / 1024  # Linux reports KiB, macOS bytes


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule runs through ``torch.compile`` (a wrapper, or
    ``nn.Module.compile()``)."""
    wrapped = hasattr(module, "_orig_mod")
    return wrapped or any(sub.__dict__.get("_compiled_call_impl") for sub in module.modules())


class AnatomyUnavailable(RuntimeError):
    """PyTorch's memory tracker cannot be used here (import failed or its private API changed)."""


class MemoryAnatomy:
    """Where the tensor memory of a captured region (``with anatomy.capture(model, [optimizer]):``) went, by
    ``ANATOMY_CATEGORIES`` (docs/measurement.md): :attr:`peak_bytes` when ``total`` was highest,
    :attr:`end_bytes` at :meth:`stop`. Accumulation needs :meth:`next_micro_batch` between forwards; where
    forward and backward run inside ``optimizer.step(closure)``, ``explicit_optimizer_update`` counts
    optimizer state only after :meth:`optimizer_update`."""

    def __init__(self, device: torch.device | str, explicit_optimizer_update: bool = False) -> None:
        self.device = torch.device(device)
        self.explicit_optimizer_update = explicit_optimizer_update
        self._tracker: Any = None
        self._pending: list[tuple[torch.Tensor, str]] = []
        # Set by start() and stop():
        self.peak_bytes: dict[str, int] | None = None
        self.end_bytes: dict[str, int] | None = None
        self.caveat: str | None = None

    @property
    def active(self) -> bool:
        return self._tracker is not None

    def start(self, modules: nn.Module | Iterable[nn.Module], optimizers: Iterable[Any] = ()) -> None:
        modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.peak_bytes = None
        self.end_bytes = None
        self.caveat = None
        if any(is_compiled(m) for m in modules):
            self.caveat = COMPILE_NOT_MEASURED
            return
        # ModTracker warns whenever a module is re-entered by name, which DDP's wrappers do harmlessly.
        warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
        try:  # an import error on this build, or a change in the private API
            tracker = tracker_class()(self.explicit_optimizer_update)
            tracker.track_external(*modules, *(o for o in optimizers if o is not None))
            for t, reftype in self._pending:
                tracker.register(t, reftype)
            tracker.__enter__()
        except Exception as err:
            why = f"{type(err).__name__}: {err}"
            raise AnatomyUnavailable(f"PyTorch's MemTracker failed to start: {why}") from err
        self._tracker, self._pending = tracker, []

    def register(self, tensors: Any, category: str = "inputs") -> None:
        """File the storages of ``tensors`` (any nesting) under ``category``, before or during a capture (a
        storage alive at the peak moves there too); parameters, buffers, gradients, optimizer state keep
        theirs."""
        if category not in CATEGORY_TO_TRACKER:
            raise ValueError(f"unknown anatomy category {category!r}; one of {list(CATEGORY_TO_TRACKER)}")
        for t in tensors_in(tensors):
            if self._tracker is not None:
                self._tracker.register(t, CATEGORY_TO_TRACKER[category])
            else:  # registered with the tracker at start()
                self._pending.append((t, CATEGORY_TO_TRACKER[category]))

    def optimizer_update(self) -> None:
        """Mark where the optimizer's update begins (``on_before_optimizer_step``)."""
        if self._tracker is not None:
            self._tracker.update_marked = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing that runs inside (an evaluation within the captured step) is tracked, nor its modules."""
        tracker = self._tracker
        if tracker is None or tracker.paused:
            yield
            return
        tracker.pause()
        try:
            yield
        finally:
            tracker.resume()

    def next_micro_batch(self) -> None:
        """Allow the root module to run forward again in the same capture (gradient accumulation)."""
        if self._tracker is not None:
            self._tracker.reset_mod_stats()

    def stop(self) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is None and self.caveat is None:
            raise RuntimeError("MemoryAnatomy.stop() without start()")
        if tracker is None:  # not measured (compiled)
            return
        try:
            end = tracker.get_tracker_snapshot("current")
            peak = tracker.get_tracker_snapshot("peak")
        finally:
            tracker.__exit__(None, None, None)
        self.peak_bytes = by_category(peak, self.device)
        self.end_bytes = by_category(end, self.device)
        left = self.end_bytes["activations"]
        if left > MIB:
            self.caveat = (f"{left / MIB:.1f} MiB of activations alive after the step (limit 1 MiB): "
                           "tensors that outlive the step were counted as activations")

    @contextlib.contextmanager
    def capture(self, modules: nn.Module | Iterable[nn.Module],
                optimizers: Iterable[Any] = ()) -> Iterator[Any]:
        self.start(modules, optimizers)
        try:
            yield self
        finally:
            self.stop()

    def peak_mib(self) -> dict[str, float] | None:
        return None if self.peak_bytes is None else {k: v / MIB for k, v in self.peak_bytes.items()}

    def end_mib(self) -> dict[str, float] | None:
        return None if self.end_bytes is None else {k: v / MIB for k, v in self.end_bytes.items()}
