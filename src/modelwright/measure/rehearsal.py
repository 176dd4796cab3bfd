"""A step's tensor memory, operation by operation, and the peak it predicts at another batch size.

The predictor rehearses the run's own step, as its loop runs it, at two small micro-batches (2 and 4
samples by default) under PyTorch's MemTracker, and keeps the bytes of each category after every operation:
a :class:`Timeline`. The same network, techniques and loop run the same operations whatever the batch, and a
tensor's size grows linearly with it (or not at all), so each category at each operation is a line through
the two rehearsals; the predicted peak at batch ``B`` is the operation whose total is highest there
(:meth:`Rehearsal.peak`), and the largest batch under a budget solves the lines
(:meth:`Rehearsal.largest_batch`).
Nothing here is fitted to a measurement, and nothing is modelled per layer type: autocast's copies, the
recomputation of checkpointed segments, an optimizer's state and its update's temporaries, frozen parameters,
DDP's buckets and FSDP2's gathered blocks are whatever the real step allocates. What it cannot see: memory
that is not linear in the batch at some operation (a kernel's workspace rounded up, an algorithm chosen by
size), and memory outside tensors (the allocator's rounding on a GPU: ``modelwright.planner.cuda``).
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from modelwright.measure.memtracker import TRACKER_TO_CATEGORY, tracker_class, type_name
from modelwright.record import ANATOMY_CATEGORIES

MIB = 2**20
#: The categories a prediction gives: the anatomy's, less the data (not in a peak).
CATEGORIES = tuple(category for category in ANATOMY_CATEGORIES if category != "inputs")


def _bytes_by_category(snapshots: dict, device: torch.device) -> dict[str, int]:
    """MemTracker's current bytes on ``device`` (keyed as the tracker keys it: cuda:0 for cuda), by
    category."""
    snapshot = snapshots.get(device)
    if snapshot is None:
        snapshot = next((values for key, values in snapshots.items()
                         if torch.device(key).type == device.type), {})
    counted = dict.fromkeys(CATEGORIES, 0)
    for reftype, size in snapshot.items():
        category = TRACKER_TO_CATEGORY.get(type_name(reftype))
        if category in counted:
            counted[category] += int(size)
    return counted


def _timeline_tracker() -> type:
    """MemTracker (the project's, :func:`~modelwright.measure.memtracker.tracker_class`) that keeps the bytes
    of each category after every operation."""

    class TimelineTracker(tracker_class()):
        def __init__(self, device: torch.device, explicit_update: bool = False) -> None:
            super().__init__(explicit_update)
            self.device = device
            self.points: list[dict[str, int]] = []
            self.operations: list[str] = []
            # [first point, first point without it or None, [(from point, reference type), ...], bytes], in
            # order of birth
            self.tensors: list[list] = []
            self._tensor_of: dict[int, list] = {}  # id of MemTracker's record of a storage -> its entry

        def _update_snap(self, u_type: Any, winfo: Any, old_mem_consumed: Any = None,
                         old_reftype: Any = None) -> None:
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            kind = getattr(u_type, "name", str(u_type))
            entry = self._tensor_of.get(id(winfo))
            if kind == "ADD":
                entry = [len(self.points), None, [(len(self.points), type_name(winfo.reftype))],
                         winfo.mem_consumed]
                self.tensors.append(entry)
                self._tensor_of[id(winfo)] = entry
            elif entry is not None and kind == "DEL":
                entry[1] = len(self.points)
                del self._tensor_of[id(winfo)]
            elif entry is not None:  # filed anew (a temporary become a gradient), or resized
                entry[2].append((len(self.points), type_name(winfo.reftype)))
                entry[3] = winfo.mem_consumed

        def _counted(self) -> dict[str, int]:
            return _bytes_by_category(self._curr_mem_snap, self.device)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if not self.paused:
                self.points.append(self._counted())
                self.operations.append(func.__name__)
            return out

        def _refile(self, storage: Any, winfo: Any, reftype: str) -> None:
            # A storage filed anew (DDP's bucket, seen by its all-reduce) was that from its birth: so in every
            # point since, as in the tracker's peak.
            old = TRACKER_TO_CATEGORY.get(type_name(winfo.reftype))
            new = TRACKER_TO_CATEGORY.get(type_name(reftype))
            born = self.born.get(storage, self.ops)
            super()._refile(storage, winfo, reftype)
            entry = self._tensor_of.get(id(winfo))
            if entry is not None:
                entry[2] = [(entry[0], type_name(reftype))]
            if old in CATEGORIES and new in CATEGORIES:
                for point in self.points[max(0, born - 1):]:
                    point[old] -= winfo.mem_consumed
                    point[new] += winfo.mem_consumed

    return TimelineTracker


def new_timeline_tracker(device: torch.device, explicit_update: bool = False) -> Any:
    return _timeline_tracker()(torch.device(device), explicit_update)


@dataclass(frozen=True)
class Timeline:
    """One rehearsed step at ``micro_batch`` samples per micro-batch: the bytes of each category after each
    operation, and the operations' names (two rehearsals line up operation by operation)."""

    micro_batch: int
    points: tuple[Mapping[str, int], ...]
    operations: tuple[str, ...]
    # each tensor's first point, first point without it (None: alive at the end), MemTracker's types from the
    # points on which they hold, bytes
    tensors: tuple[tuple[int, int | None, tuple[tuple[int, str], ...], int], ...] = ()

    def alive_at(self, point: int) -> list[tuple[int, str, int]]:
        """The tensors alive at ``point``: their birth order, MemTracker's type then, and bytes."""
        alive = []
        for order, (born, died, kinds, size) in enumerate(self.tensors):
            if born <= point and (died is None or died > point):
                kind = [name for since, name in kinds if since <= point][-1]
                alive.append((order, kind, size))
        return alive


class RehearsalMismatch(RuntimeError):
    """The two rehearsals ran different operations: the step depends on the batch beyond its size."""


@dataclass(frozen=True)
class Line:
    """One operation's category bytes as a line in the batch: ``at_zero + per_sample × batch``; ``point``:
    the operation's index in the timelines."""

    at_zero: Mapping[str, float]
    per_sample: Mapping[str, float]
    point: int

    def at(self, batch: float) -> dict[str, float]:
        return {category: self.at_zero[category] + self.per_sample[category] * batch
                for category in CATEGORIES}

    def total_at(self, batch: float) -> float:
        return sum(self.at(batch).values())


def _lines(first: Timeline, second: Timeline) -> list[Line]:
    if first.operations != second.operations:
        raise RehearsalMismatch(f"the steps at micro-batch {first.micro_batch} and {second.micro_batch} ran "
                                f"{len(first.operations)} and {len(second.operations)} operations")
    span = second.micro_batch - first.micro_batch
    lines = []
    for point, (small, large) in enumerate(zip(first.points, second.points, strict=True)):
        slope = {category: (large[category] - small[category]) / span for category in CATEGORIES}
        start = {category: small[category] - slope[category] * first.micro_batch for category in CATEGORIES}
        lines.append(Line(start, slope, point))
    return _upper_envelope(lines)


def _upper_envelope(lines: list[Line]) -> list[Line]:
    """The lines that can be the highest for some batch from 1 on: the highest at batch 1, the steepest,
    and any in between that beats both somewhere (a few; the rest are never the peak)."""
    kept: list[Line] = []
    for line in sorted(lines, key=lambda line: (sum(line.per_sample.values()), line.total_at(1))):
        while kept and kept[-1].total_at(1) <= line.total_at(1):
            kept.pop()  # as steep or less, and no higher at batch 1: never above this one from 1 on
        kept.append(line)
    return kept


@dataclass(frozen=True)
class Rehearsal:
    """Two rehearsed steps of one config, and what they predict: :meth:`peak`, :meth:`largest_batch`."""

    timelines: tuple[Timeline, Timeline]
    lines: tuple[Line, ...]
    what: str  # how the step was rehearsed, for the prediction's record
    module_types: frozenset[str] = frozenset()  # the network's module classes (a GPU's cuBLAS workspaces)

    @classmethod
    def of(cls, timelines: Sequence[Timeline], what: str, module_types: frozenset[str] = frozenset()
           ) -> "Rehearsal":
        first, second = timelines
        return cls((first, second), tuple(_lines(first, second)), what, module_types)

    def highest(self, micro_batch: int) -> Line:
        """The operation whose total is highest at ``micro_batch``."""
        return max(self.lines, key=lambda line: line.total_at(micro_batch))

    def tensors_at_peak(self, micro_batch: int) -> list[tuple[str, float]]:
        """Each tensor alive at the predicted peak, MemTracker's type and its bytes at ``micro_batch``: the
        tensors of the two rehearsals paired by birth order, each a line in the batch."""
        point = self.highest(micro_batch).point
        first, second = self.timelines
        small = first.alive_at(point)
        large = second.alive_at(point)
        if [(order, kind) for order, kind, _ in small] != [(order, kind) for order, kind, _ in large]:
            raise RehearsalMismatch("the two rehearsals' tensors alive at the peak differ")
        span = second.micro_batch - first.micro_batch
        sized = []
        for (_, kind, size_small), (_, _, size_large) in zip(small, large, strict=True):
            per_sample = (size_large - size_small) / span
            sized.append((kind, size_small + per_sample * (micro_batch - first.micro_batch)))
        return sized

    def peak(self, micro_batch: int) -> dict[str, float]:
        """The predicted peak at ``micro_batch`` samples per micro-batch, in MiB by category and ``total``:
        the operation whose total is highest there."""
        highest = self.highest(micro_batch)
        categories = {category: max(0.0, value) / MIB for category, value in highest.at(micro_batch).items()}
        return {**categories, "total": sum(categories.values())}

    def largest_batch(self, budget_mib: float) -> int:
        """The largest micro-batch whose predicted peak fits ``budget_mib`` (0 if not even one sample)."""
        budget = budget_mib * MIB
        best = math.inf
        for line in self.lines:
            slope = sum(line.per_sample.values())
            fixed = sum(line.at_zero.values())
            if slope > 0:
                best = min(best, math.floor((budget - fixed) / slope))
            elif fixed > budget:
                return 0
        if best == math.inf:
            raise ValueError("budget_mib: the step's memory does not grow with the batch")
        return max(0, int(best))

    def json(self) -> dict[str, Any]:
        """What a prediction's record says of how it was made."""
        return {"method": "rehearsal", "what": self.what,
                "micro_batches": [timeline.micro_batch for timeline in self.timelines],
                "operations": len(self.timelines[0].operations)}


def capture(step: Callable[[Any], None], device: torch.device, modules: Sequence[torch.nn.Module],
            optimizers: Sequence[Any], inputs: Any, micro_batch: int, explicit_update: bool) -> Timeline:
    """The :class:`Timeline` of ``step(tracker)`` (one optimizer step; it calls ``tracker.reset_mod_stats()``
    between micro-batches and sets ``tracker.update_marked`` where the update begins), its ``inputs`` filed
    as the data."""
    tracker = new_timeline_tracker(device, explicit_update)
    tracker.track_external(*modules, *optimizers)
    for t in [leaf for leaf in torch.utils._pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor)]:
        tracker.register(t, "Inputs")
    with tracker:
        step(tracker)
    tensors = tuple((born, died, tuple(kinds), size) for born, died, kinds, size in tracker.tensors)
    return Timeline(micro_batch, tuple(tracker.points), tuple(tracker.operations), tensors)
