"""Peak memory: the CUDA allocator's window, process RSS, and the tensor anatomy of one step.

:class:`MemoryAnatomy` is the only code that touches PyTorch's private ``torch.distributed._tools.mem_tracker``.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from modelwright.record import ANATOMY_CATEGORIES

MIB = 2**20
#: Activations still alive when a captured step ends above this are a measuring artifact, flagged in the record.
END_ACTIVATIONS_LIMIT_BYTES = MIB
# Our reference types beside MemTracker's own (whose values are "Parameter", "Activation", ...).
_INPUTS, _COMM = "Inputs", "CommBuffers"
_TRACKER_TO_OURS = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    _COMM: "comm_buffers",
    _INPUTS: "inputs",
    "Other": "other",
}
_OURS_TO_TRACKER = {v: k for k, v in _TRACKER_TO_OURS.items()}
# A storage the tracker has filed under one of these keeps its name when a collective or register() sees it.
_KEEP = {"Parameter", "Buffer", "Gradient", "Optstate"}
#: Categories not summed into ``total``: the data (an in-memory dataset can be larger than the step).
NOT_IN_TOTAL = ("inputs",)


def _cuda(device: torch.device | str | None) -> torch.device | None:
    device = torch.device(device) if device is not None else torch.device("cpu")
    return device if device.type == "cuda" and torch.cuda.is_available() else None


def reset_peak_memory(device: torch.device | str | None) -> bool:
    """Start a peak-memory window on a CUDA device; returns False (and does nothing) elsewhere."""
    device = _cuda(device)
    if device is not None:
        torch.cuda.reset_peak_memory_stats(device)
    return device is not None


def peak_memory_mib(device: torch.device | str | None) -> dict[str, float | None]:
    """The CUDA allocator's ``max_memory_allocated`` / ``max_memory_reserved`` since the last reset, in MiB.

    ``None`` for both on devices without such an allocator (CPU).
    """
    device = _cuda(device)
    if device is None:
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
    return maxrss / MIB if sys.platform == "darwin" else maxrss / 1024  # Linux reports KiB, macOS bytes


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` (or a submodule) runs through ``torch.compile``."""
    return hasattr(module, "_orig_mod") or any(
        m.__dict__.get("_compiled_call_impl") is not None for m in module.modules()
    )


class AnatomyUnavailable(RuntimeError):
    """PyTorch's memory tracker cannot be used here (import failed or its private API changed)."""


#: Why a compiled module has no anatomy (``MemoryAnatomy.caveat``).
COMPILE_NOT_MEASURED = (
    "not measured: torch.compile runs eagerly under PyTorch's memory tracker (a TorchDispatchMode), "
    "so its figures would be eager memory"
)


class MemoryAnatomy:
    """Where the tensor memory of a captured region went, on any device.

    Every tensor storage created inside the region is filed under one of ``record.ANATOMY_CATEGORIES``:
    activations in forward, temporaries in backward, optimizer state in ``optimizer.step``; parameters,
    buffers, their gradients and existing optimizer state are registered at :meth:`start`. Two rules
    keep the step's own memory apart from what merely passes through it:

    * ``inputs``: outside every module's forward and outside backward and the optimizer's update, an op
      whose tensors are all inputs or untracked (indexing a dataset, collating, moving a batch to the
      device) makes inputs, not activations; :meth:`register` files tensors there explicitly. Inputs are
      reported but not summed into ``total`` (an in-memory dataset is not the step's memory).
    * ``comm_buffers``: tensors handed to an all-reduce (DDP's gradient buckets).

    Views, each a dict of the categories plus ``total``, in bytes: :attr:`peak_bytes` at the moment
    ``total`` was highest, :attr:`end_bytes` when :meth:`stop` is called. A module run through
    ``torch.compile`` is not measured (:attr:`caveat` says why) rather than measured as eager code.

    Usage::

        anatomy = MemoryAnatomy(device="cpu")
        with anatomy.capture(model, optimizer):
            loss = model(x).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()
        anatomy.peak_mib()["activations"]

    Calling the same root module again inside one capture (gradient accumulation) needs
    :meth:`next_micro_batch` between the calls. Forward and backward may run inside
    ``optimizer.step(closure)`` (Lightning does this); with ``explicit_optimizer_update`` optimizer
    state is counted only after :meth:`optimizer_update` (call it where the update begins, e.g.
    Lightning's ``on_before_optimizer_step``), so the loss computed in the closure is not counted as such.

    Args:
        device: the device whose memory to report; default: the one with the largest peak.
        explicit_optimizer_update: see above.
    """

    def __init__(self, device: torch.device | str | None = None, explicit_optimizer_update: bool = False) -> None:
        self.device = torch.device(device) if device is not None else None
        self.explicit_optimizer_update = explicit_optimizer_update
        self._tracker = None
        self._pending: list[tuple[torch.Tensor, str]] = []
        self.peak_bytes: dict[str, int] | None = None
        self.end_bytes: dict[str, int] | None = None
        self.caveat: str | None = None

    @property
    def active(self) -> bool:
        return self._tracker is not None

    def start(self, modules: nn.Module | Iterable[nn.Module], optimizers: Iterable[Any] = ()) -> None:
        """Begin tracking; ``modules`` and ``optimizers`` are registered as parameters / optimizer state."""
        modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.peak_bytes = self.end_bytes = self.caveat = None
        if any(is_compiled(m) for m in modules):
            self.caveat = COMPILE_NOT_MEASURED
            return
        try:
            from torch.distributed._tools.mem_tracker import MemTracker
        except Exception as err:  # ImportError, or the package failing to import on this build
            raise AnatomyUnavailable(f"torch.distributed._tools.mem_tracker is unavailable: {err}") from err
        # ModTracker warns whenever a module is re-entered by name, which DDP's wrappers do harmlessly.
        warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
        try:
            tracker = _tracker_class(MemTracker)(self.explicit_optimizer_update)
            tracker.track_external(*modules, *(o for o in optimizers if o is not None))
            for t, reftype in self._pending:
                tracker.register(t, reftype)
            tracker.__enter__()
        except Exception as err:
            raise AnatomyUnavailable(f"MemTracker failed to start: {type(err).__name__}: {err}") from err
        self._tracker, self._pending = tracker, []

    def register(self, tensors: Any, category: str = "inputs") -> None:
        """File the storages of ``tensors`` (any nesting of tensors) under ``category``, before or during a capture.

        A storage the tracker already knows as parameters, buffers, gradients or optimizer state keeps
        that name. Registered during a capture, a storage alive at the peak moves there too.
        """
        if category not in _OURS_TO_TRACKER:
            raise ValueError(f"unknown anatomy category {category!r}; one of {list(_OURS_TO_TRACKER)}")
        for t in _tensors(tensors):
            if self._tracker is not None:
                self._tracker.register(t, _OURS_TO_TRACKER[category])
            else:
                self._pending.append((t, _OURS_TO_TRACKER[category]))

    def optimizer_update(self) -> None:
        """Mark that the optimizer's update begins now (with ``explicit_optimizer_update``)."""
        if self._tracker is not None:
            self._tracker.update_marked = True

    def next_micro_batch(self) -> None:
        """Allow the root module to run forward again in the same capture (gradient accumulation)."""
        if self._tracker is not None:
            self._tracker.reset_mod_stats()

    def stop(self) -> dict[str, float] | None:
        """End tracking; returns :meth:`peak_mib` (``None`` when not measured)."""
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            if self.caveat is not None:
                return None
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
        self.peak_bytes, self.end_bytes = _ours(peak, device), _ours(end, device)
        left = self.end_bytes["activations"]
        if left > END_ACTIVATIONS_LIMIT_BYTES:
            self.caveat = (
                f"{left / MIB:.1f} MiB of activations alive after the step (limit 1 MiB): "
                "tensors that outlive the step were counted as activations"
            )
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

    def peak_mib(self) -> dict[str, float] | None:
        return _mib_dict(self.peak_bytes)

    def end_mib(self) -> dict[str, float] | None:
        return _mib_dict(self.end_bytes)


def _ours(snapshots: dict, device: torch.device) -> dict[str, int]:
    snap: dict = {}
    for dev, s in snapshots.items():
        d = torch.device(dev)
        if d.type == device.type and (device.index is None or d.index in (None, device.index)):
            snap = s
            break
    out = dict.fromkeys(ANATOMY_CATEGORIES, 0)
    for key, value in snap.items():
        name = _TRACKER_TO_OURS.get(getattr(key, "value", key))
        if name is not None:
            out[name] += int(value)
    out["total"] = sum(v for k, v in out.items() if k not in NOT_IN_TOTAL)
    return out


def _mib_dict(d: dict[str, int] | None) -> dict[str, float] | None:
    return None if d is None else {k: v / MIB for k, v in d.items()}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


_TRACKER_CLASSES: dict[type, type] = {}


def _tracker_class(base: type) -> type:
    """``MemTracker`` plus inputs and communication buffers, closure-aware optimizer state, and a peak without inputs.

    Relies on private members of PyTorch's tracker (``_WINFO``, ``_curr_mem_snap``, ``_peak_mem_snap``,
    ``_ref_class``, ``_track``, ``_in_opt``, ``_mod_tracker``, ``_update_and_maybe_create_winfos``);
    ``tests/test_measure.py`` breaks first if they change.
    """
    if base in _TRACKER_CLASSES:
        return _TRACKER_CLASSES[base]
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.utils.weak import WeakIdKeyDictionary

    class _Tracker(base):  # type: ignore[misc, valid-type]
        def __init__(self, explicit_update: bool = False) -> None:
            super().__init__()
            self._ref_class = (*self._ref_class, _INPUTS, _COMM)  # only iterated, to key each device's snapshot
            self.explicit_update, self.update_marked = explicit_update, False
            self.as_inputs = False
            self.ops = 0  # dispatch count: orders births against the peak
            self.born = WeakIdKeyDictionary()  # storage -> dispatch count when first tracked
            self.peak_at: dict[Any, int] = {}
            self.peak_counted: dict[Any, int] = {}

        def _track(self, reftype: Any, t: torch.Tensor) -> None:
            for st in get_untyped_storages(t):
                if st not in self._WINFO:
                    self.born[st] = self.ops
            super()._track(_INPUTS if self.as_inputs else reftype, t)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # The peak of the step's own memory: inputs (a dataset first touched mid-step) do not move it.
            for dev, snap in self._curr_mem_snap.items():
                counted = snap["Total"] - snap.get(_INPUTS, 0)
                if counted > self.peak_counted.get(dev, -1):
                    self.peak_counted[dev], self.peak_at[dev] = counted, self.ops
                    self._peak_mem_snap[dev] = dict(snap)

        def _known_as(self, st: Any) -> str | None:
            winfo = self._WINFO.get(st, (None, None))[0]
            return None if winfo is None else getattr(winfo.reftype, "value", winfo.reftype)

        def register(self, t: torch.Tensor, reftype: str) -> None:
            for st in get_untyped_storages(t):
                winfo = self._WINFO.get(st, (None, None))[0]
                if winfo is None:
                    self.born[st] = self.ops
                    self._update_and_maybe_create_winfos(t, reftype)
                elif getattr(winfo.reftype, "value", winfo.reftype) not in _KEEP and winfo.reftype != reftype:
                    old, size = winfo.reftype, winfo.mem_consumed
                    winfo.reftype = reftype
                    current = self._curr_mem_snap[winfo.device]
                    current[old] -= size
                    current[reftype] = current.get(reftype, 0) + size
                    peak = self._peak_mem_snap.get(winfo.device)
                    # Alive now and tracked by the peak's moment: it was in the peak under its old name.
                    if peak is not None and self.born.get(st, -1) <= self.peak_at.get(winfo.device, -1):
                        peak[old] -= size
                        peak[reftype] = peak.get(reftype, 0) + size

        def _only_inputs(self, args: Any, kwargs: Any) -> bool:
            tensors = _tensors((args, kwargs))
            return bool(tensors) and all(
                self._known_as(st) in (None, _INPUTS) for t in tensors for st in get_untyped_storages(t)
            )

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.ops += 1
            mods = self._mod_tracker
            outside = not mods.is_bw and mods.parents == {"Global"}
            # Inside optimizer.step(): only work outside every module's forward and outside backward is the
            # update itself (a closure runs forward and backward inside step()).
            update = self._in_opt and outside and (self.update_marked or not self.explicit_update)
            if not self._in_opt:
                self.update_marked = False
            self.as_inputs = outside and not update and self._only_inputs(args, kwargs)
            in_opt, self._in_opt = self._in_opt, update
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._in_opt, self.as_inputs = in_opt, False
            if func.namespace in ("c10d", "_c10d_functional") and "all_reduce" in func.__name__.replace(
                "allreduce", "all_reduce"
            ):
                for t in _tensors((args, kwargs)):
                    self.register(t, _COMM)
            return out

    _TRACKER_CLASSES[base] = _Tracker
    return _Tracker
