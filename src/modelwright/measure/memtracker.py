"""The one module that touches private members of PyTorch's ``MemTracker`` (``torch.distributed._tools``).

:func:`tracker_class` extends it with what the anatomy needs: two categories of our own (the data, and buffers
handed to an all-reduce), optimizer state counted only from the update itself when forward and backward run
inside ``optimizer.step(closure)``, a peak that the data does not move, and a pause for evaluations inside a
captured step; and it tracks networks with frozen parameters (MemTracker would hook their gradients).
``tests/test_memtracker.py`` fails first when the private members this relies on change.
"""

import sys
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from modelwright.record import ANATOMY_CATEGORIES

try:  # private modules of torch: without them (another build) there is no anatomy, and the run goes on
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.weak import WeakIdKeyDictionary

    _IMPORT_ERROR: ImportError | None = None
except ImportError as err:
    MemTracker = object
    _IMPORT_ERROR = err

#: Our reference types beside MemTracker's own.
INPUTS = "Inputs"
COMM_BUFFERS = "CommBuffers"
#: MemTracker's reference types (and ours), in the order of ``ANATOMY_CATEGORIES``.
TRACKER_TYPES = ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", COMM_BUFFERS, INPUTS,
                 "Other")
TRACKER_TO_CATEGORY = dict(zip(TRACKER_TYPES, ANATOMY_CATEGORIES, strict=True))
CATEGORY_TO_TRACKER = {category: name for name, category in TRACKER_TO_CATEGORY.items()}
# A storage the tracker has filed under one of these keeps its name when a collective or register() sees it.
_KEEP = {"Parameter", "Buffer", "Gradient", "Optstate"}


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors anywhere in ``tree`` (tuples, lists, dicts)."""
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def type_name(reftype: Any) -> Any:
    """A reference type's name: MemTracker's enum members carry it as ``value``, ours are strings."""
    return getattr(reftype, "value", reftype)


def by_category(snapshots: dict, device: torch.device) -> dict[str, int]:
    """One device's snapshot (``{device: {reference type: bytes}}``) in ``ANATOMY_CATEGORIES``, plus ``total``
    (every category but the data)."""
    snapshot = {}
    for snapshot_device, values in snapshots.items():
        snapshot_device = torch.device(snapshot_device)
        same_index = device.index is None or snapshot_device.index in (None, device.index)
        if snapshot_device.type == device.type and same_index:
            snapshot = values
            break
    out = dict.fromkeys(ANATOMY_CATEGORIES, 0)
    for reftype, size in snapshot.items():
        category = TRACKER_TO_CATEGORY.get(type_name(reftype))
        if category is not None:
            out[category] += int(size)
    out["total"] = sum(size for category, size in out.items() if category != "inputs")
    return out


def tracker_class() -> type:
    """The extended ``MemTracker`` class; raises the import error of a build without torch's private tools."""
    if _IMPORT_ERROR is not None:
        raise _IMPORT_ERROR
    return CategoryTracker


class _NoHook:
    """What stands for a frozen parameter's gradient hooks: it has none to remove."""

    def remove(self) -> None:
        pass


class CategoryTracker(MemTracker):
    """``MemTracker`` with the data and all-reduce buffers as categories, closure-aware optimizer state, a
    peak the data does not move, and a pause (module docstring)."""

    def __init__(self, explicit_update: bool = False) -> None:
        super().__init__()
        self._ref_class = (*self._ref_class, INPUTS, COMM_BUFFERS)  # only iterated, to key each snapshot
        self.explicit_update = explicit_update
        self.update_marked = False  # the optimizer's update has begun (explicit_update)
        self.as_inputs = False  # the current op only reads the data: its outputs are data too
        self.paused = False
        self.ops = 0  # dispatch count: orders births against the peak
        self.born = WeakIdKeyDictionary()  # storage -> dispatch count when first tracked
        # device -> (bytes counted, dispatch count) at its peak
        self.peak_of: dict[Any, tuple[int, int]] = {}

    # A torchmetrics metric hashes by its state, which changes as it updates; the tracker's modules are keyed
    # in weak dictionaries by hash, and Python shares a weak reference (with its hash, computed once) between
    # callers: a metric updated between two captures in one process is then lost to the second. While
    # tracking, a metric hashes as any module does, by identity.
    def __enter__(self) -> Any:
        self._metric_hash = _identity_hash_for_metrics()
        try:
            return super().__enter__()
        except BaseException:
            _restore_metric_hash(self._metric_hash)
            raise

    def __exit__(self, *args: Any) -> Any:
        try:
            return super().__exit__(*args)
        finally:
            _restore_metric_hash(self._metric_hash)

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> Any:
        # MemTracker hooks every parameter's gradient, which a frozen one (requires_grad false) refuses: it is
        # marked as hooked already, with nothing to remove.
        for parameter in module.parameters():
            if not parameter.requires_grad:
                self._param_to_grad_hook_handles.setdefault(parameter, (_NoHook(), _NoHook()))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        for storage in get_untyped_storages(t):
            if storage not in self._WINFO:
                self.born[storage] = self.ops
        super()._track(INPUTS if self.as_inputs else reftype, t)

    def _update_peak_stats(self, peak_state: Any) -> None:
        # The peak of the step's own memory: the data (a dataset first touched mid-step) does not move it.
        for device, snapshot in self._curr_mem_snap.items():
            counted = snapshot["Total"] - snapshot.get(INPUTS, 0)
            if counted > self.peak_of.get(device, (-1, -1))[0]:
                self.peak_of[device] = (counted, self.ops)
                self._peak_mem_snap[device] = dict(snapshot)

    # Paused (an evaluation inside the captured step): no module hooks and no op is tracked. An evaluation
    # calls the root module again, which MemTracker refuses within one capture, and its gradient-free
    # forwards would queue module exits for the next backward that ModTracker then finds out of order.
    def pause(self) -> None:
        self.paused = True
        self._mod_tracker.__exit__(None, None, None)

    def resume(self) -> None:
        self._mod_tracker.__enter__()
        self.paused = False

    def _winfo(self, storage: Any) -> Any:
        return self._WINFO.get(storage, (None, None))[0]

    def _only_inputs(self, tensors: list[torch.Tensor]) -> bool:
        storages = [storage for t in tensors for storage in get_untyped_storages(t)]
        return bool(storages) and all(self._is_input(storage) for storage in storages)

    def _is_input(self, storage: Any) -> bool:
        winfo = self._winfo(storage)
        return winfo is None or type_name(winfo.reftype) == INPUTS

    def register(self, t: torch.Tensor, reftype: str) -> None:
        for storage in get_untyped_storages(t):
            winfo = self._winfo(storage)
            if winfo is None:
                self.born[storage] = self.ops
                self._update_and_maybe_create_winfos(t, reftype)
            elif type_name(winfo.reftype) not in _KEEP and winfo.reftype != reftype:
                self._refile(storage, winfo, reftype)

    def _refile(self, storage: Any, winfo: Any, reftype: str) -> None:
        old = winfo.reftype
        size = winfo.mem_consumed
        winfo.reftype = reftype
        snapshots = [self._curr_mem_snap[winfo.device]]
        # Alive now and tracked by the peak's moment: it was in the peak under its old name.
        peak_op = self.peak_of.get(winfo.device, (-1, -1))[1]
        if winfo.device in self._peak_mem_snap and self.born.get(storage, -1) <= peak_op:
            snapshots.append(self._peak_mem_snap[winfo.device])
        for snapshot in snapshots:
            snapshot[old] -= size
            snapshot[reftype] = snapshot.get(reftype, 0) + size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if self.paused:
            return func(*args, **(kwargs or {}))
        self.ops += 1
        modules = self._mod_tracker
        outside_modules = not modules.is_bw and modules.parents == {"Global"}
        # Inside optimizer.step(), only work outside every forward and backward is the update itself (a
        # closure runs forward and backward inside step()).
        update = self._in_opt and outside_modules and (self.update_marked or not self.explicit_update)
        if not self._in_opt:
            self.update_marked = False
        self.as_inputs = outside_modules and not update and self._only_inputs(tensors_in((args, kwargs)))
        in_optimizer = self._in_opt
        self._in_opt = update
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._in_opt = in_optimizer
            self.as_inputs = False
        if _is_all_reduce(func):
            for t in tensors_in((args, kwargs)):
                self.register(t, COMM_BUFFERS)
        return out


def _identity_hash_for_metrics() -> Any:
    """Make torchmetrics' ``Metric`` hash by identity; returns what to restore (None without torchmetrics)."""
    metric = getattr(sys.modules.get("torchmetrics"), "Metric", None)
    if metric is None:
        return None
    previous = metric.__dict__.get("__hash__")
    metric.__hash__ = nn.Module.__hash__
    return metric, previous


def _restore_metric_hash(saved: Any) -> None:
    if saved is None:
        return
    metric, previous = saved
    if previous is None:
        del metric.__hash__
    else:
        metric.__hash__ = previous


def _is_all_reduce(func: Any) -> bool:
    return func.namespace in ("c10d", "_c10d_functional") and "all_reduce" in func.__name__.replace(
        "allreduce", "all_reduce")
