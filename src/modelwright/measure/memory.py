"""Peak memory: the CUDA allocator's window, process RSS, and the tensor anatomy of one step."""

import contextlib
import functools
import resource
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from modelwright.measure.facts import MIB, cuda_device
from modelwright.record import ANATOMY_CATEGORIES

# Our reference types beside MemTracker's own, whose values map in order onto ANATOMY_CATEGORIES.
_INPUTS, _COMM = "Inputs", "CommBuffers"
_TRACKER_TO_OURS = dict(zip(("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", _COMM, _INPUTS,
                             "Other"), ANATOMY_CATEGORIES, strict=True))
_OURS_TO_TRACKER = {v: k for k, v in _TRACKER_TO_OURS.items()}
# A storage the tracker has filed under one of these keeps its name when a collective or register() sees it.
_KEEP = {"Parameter", "Buffer", "Gradient", "Optstate"}
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
    """The CUDA allocator's ``max_memory_allocated`` / ``max_memory_reserved`` since the last reset; None on CPU."""
    device = cuda_device(device)
    return {f"peak_{kind}_mib": None if device is None else getattr(torch.cuda, f"max_memory_{kind}")(device) / MIB
            for kind in ("allocated", "reserved")}


def process_rss_peak_mib() -> float | None:
    """The process's resident-set high-water mark in MiB: not a tensor peak (glibc keeps freed pages)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / MIB if sys.platform == "darwin" else maxrss / 1024  # Linux reports KiB, macOS bytes


def is_compiled(module: nn.Module) -> bool:
    return hasattr(module, "_orig_mod") or any(m.__dict__.get("_compiled_call_impl") for m in module.modules())


class AnatomyUnavailable(RuntimeError):
    """PyTorch's memory tracker cannot be used here (import failed or its private API changed)."""


class MemoryAnatomy:
    """Where the tensor memory of a captured region (``with anatomy.capture(model, [optimizer]):``) went, by
    ``ANATOMY_CATEGORIES`` (docs/measurement.md): :attr:`peak_bytes` when ``total`` was highest, :attr:`end_bytes`
    at :meth:`stop`. Accumulation needs :meth:`next_micro_batch` between forwards; where forward and backward run
    inside ``optimizer.step(closure)``, ``explicit_optimizer_update`` counts optimizer state only after
    :meth:`optimizer_update`."""

    def __init__(self, device: torch.device | str, explicit_optimizer_update: bool = False) -> None:
        self.device = torch.device(device)
        self.explicit_optimizer_update = explicit_optimizer_update
        self._tracker: Any = None
        self._pending: list[tuple[torch.Tensor, str]] = []
        self.peak_bytes = self.end_bytes = self.caveat = None  # set by start() and stop()

    @property
    def active(self) -> bool:
        return self._tracker is not None

    def start(self, modules: nn.Module | Iterable[nn.Module], optimizers: Iterable[Any] = ()) -> None:
        modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.peak_bytes = self.end_bytes = self.caveat = None
        if any(is_compiled(m) for m in modules):
            self.caveat = COMPILE_NOT_MEASURED
            return
        # ModTracker warns whenever a module is re-entered by name, which DDP's wrappers do harmlessly.
        warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
        try:  # an import error on this build, or a change in the private API
            tracker = _tracker_class()(self.explicit_optimizer_update)
            tracker.track_external(*modules, *(o for o in optimizers if o is not None))
            for t, reftype in self._pending:
                tracker.register(t, reftype)
            tracker.__enter__()
        except Exception as err:
            raise AnatomyUnavailable(f"PyTorch's MemTracker failed to start: {type(err).__name__}: {err}") from err
        self._tracker, self._pending = tracker, []

    def register(self, tensors: Any, category: str = "inputs") -> None:
        """File the storages of ``tensors`` (any nesting) under ``category``, before or during a capture (a
        storage alive at the peak moves there too); parameters, buffers, gradients, optimizer state keep theirs."""
        if category not in _OURS_TO_TRACKER:
            raise ValueError(f"unknown anatomy category {category!r}; one of {list(_OURS_TO_TRACKER)}")
        for t in _tensors(tensors):
            if self._tracker is not None:
                self._tracker.register(t, _OURS_TO_TRACKER[category])
            else:  # registered with the tracker at start()
                self._pending.append((t, _OURS_TO_TRACKER[category]))

    def optimizer_update(self) -> None:
        """Mark where the optimizer's update begins (``on_before_optimizer_step``)."""
        if self._tracker is not None:
            self._tracker.update_marked = True

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
            end, peak = tracker.get_tracker_snapshot("current"), tracker.get_tracker_snapshot("peak")
        finally:
            tracker.__exit__(None, None, None)
        self.peak_bytes, self.end_bytes = _ours(peak, self.device), _ours(end, self.device)
        left = self.end_bytes["activations"]
        if left > MIB:
            self.caveat = (f"{left / MIB:.1f} MiB of activations alive after the step (limit 1 MiB): "
                           "tensors that outlive the step were counted as activations")

    @contextlib.contextmanager
    def capture(self, modules: nn.Module | Iterable[nn.Module], optimizers: Iterable[Any] = ()) -> Iterator[Any]:
        self.start(modules, optimizers)
        try:
            yield self
        finally:
            self.stop()

    def peak_mib(self) -> dict[str, float] | None:
        return None if self.peak_bytes is None else {k: v / MIB for k, v in self.peak_bytes.items()}

    def end_mib(self) -> dict[str, float] | None:
        return None if self.end_bytes is None else {k: v / MIB for k, v in self.end_bytes.items()}


def _ours(snapshots: dict, device: torch.device) -> dict[str, int]:
    """One device's tracker snapshot in our categories, plus ``total`` (all but inputs)."""
    snap = next((s for dev, s in snapshots.items() if torch.device(dev).type == device.type
                 and (device.index is None or torch.device(dev).index in (None, device.index))), {})
    out = dict.fromkeys(ANATOMY_CATEGORIES, 0)
    for key, value in snap.items():
        if (name := _TRACKER_TO_OURS.get(_name(key))) is not None:
            out[name] += int(value)
    out["total"] = sum(v for k, v in out.items() if k != "inputs")
    return out


def _name(reftype: Any) -> Any:
    return getattr(reftype, "value", reftype)  # MemTracker's enum, or one of our strings


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


@functools.cache
def _tracker_class() -> type:
    """``MemTracker`` plus inputs and communication buffers, closure-aware optimizer state, a peak without inputs.
    It relies on private members of PyTorch's tracker: ``tests/test_measure.py`` breaks first if they change."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.weak import WeakIdKeyDictionary

    class _Tracker(MemTracker):
        def __init__(self, explicit_update: bool = False) -> None:
            super().__init__()
            self._ref_class = (*self._ref_class, _INPUTS, _COMM)  # only iterated, to key each device's snapshot
            self.explicit_update, self.update_marked, self.as_inputs = explicit_update, False, False
            self.ops = 0  # dispatch count: orders births against the peak
            self.born = WeakIdKeyDictionary()  # storage -> dispatch count when first tracked
            self.peak_of: dict[Any, tuple[int, int]] = {}  # device -> (bytes counted, dispatch count) at its peak

        def _track(self, reftype: Any, t: torch.Tensor) -> None:
            for st in get_untyped_storages(t):
                if st not in self._WINFO:
                    self.born[st] = self.ops
            super()._track(_INPUTS if self.as_inputs else reftype, t)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # The peak of the step's own memory: inputs (a dataset first touched mid-step) do not move it.
            for dev, snap in self._curr_mem_snap.items():
                counted = snap["Total"] - snap.get(_INPUTS, 0)
                if counted > self.peak_of.get(dev, (-1, -1))[0]:
                    self.peak_of[dev], self._peak_mem_snap[dev] = (counted, self.ops), dict(snap)

        def _winfo(self, st: Any) -> Any:
            return self._WINFO.get(st, (None, None))[0]

        def _only_inputs(self, tensors: list[torch.Tensor]) -> bool:
            return bool(tensors) and all(self._winfo(st) is None or _name(self._winfo(st).reftype) == _INPUTS
                                         for t in tensors for st in get_untyped_storages(t))

        def register(self, t: torch.Tensor, reftype: str) -> None:
            for st in get_untyped_storages(t):
                winfo = self._winfo(st)
                if winfo is None:
                    self.born[st] = self.ops
                    self._update_and_maybe_create_winfos(t, reftype)
                elif _name(winfo.reftype) not in _KEEP and winfo.reftype != reftype:
                    old, size = winfo.reftype, winfo.mem_consumed
                    winfo.reftype = reftype
                    snaps = [self._curr_mem_snap[winfo.device]]
                    # Alive now and tracked by the peak's moment: it was in the peak under its old name.
                    if winfo.device in self._peak_mem_snap and \
                            self.born.get(st, -1) <= self.peak_of.get(winfo.device, (-1, -1))[1]:
                        snaps.append(self._peak_mem_snap[winfo.device])
                    for snap in snaps:
                        snap[old] -= size
                        snap[reftype] = snap.get(reftype, 0) + size

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.ops += 1
            mods = self._mod_tracker
            outside = not mods.is_bw and mods.parents == {"Global"}
            # Inside optimizer.step(), only work outside every forward and backward is the update itself (a
            # closure runs forward and backward inside step()).
            update = self._in_opt and outside and (self.update_marked or not self.explicit_update)
            if not self._in_opt:
                self.update_marked = False
            self.as_inputs = outside and not update and self._only_inputs(_tensors((args, kwargs)))
            in_opt, self._in_opt = self._in_opt, update
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._in_opt, self.as_inputs = in_opt, False
            if func.namespace in ("c10d", "_c10d_functional") and \
                    "all_reduce" in func.__name__.replace("allreduce", "all_reduce"):
                for t in _tensors((args, kwargs)):
                    self.register(t, _COMM)
            return out

    return _Tracker
