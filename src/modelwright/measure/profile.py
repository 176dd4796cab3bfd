"""The saved-for-backward profile of one plain fp32 step, which ``modelwright.planner.memory`` predicts every
technique's peak from: per module in forward order, the storages autograd saved (each charged to the first
module that saved it) by dtype and kind (``batch``, ``fixed``: per-channel, ``param``, ``cast``: a weight
autocast copies to 16 bits, ``input``: the batch), MemTracker's figures at its backward peak, and its
checkpoint segments.

Version 2 writes each storage as ``{"owner", "bytes", "kind", "dtype"}`` (version 1: the list
``[owner, bytes, kind, dtype]``); ``modelwright.planner.step_profile`` reads both.
"""

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelwright.measure.memtracker import backward_peak, by_category

#: Modules whose ops autocast runs in 16 bits, so a weight they save becomes a 16-bit copy.
AUTOCAST_16BIT = ("Conv1d", "Conv2d", "Conv3d", "Linear", "NonDynamicallyQuantizableLinear",
                  "MultiheadAttention")


@dataclass
class _SegmentInput:
    storage: int | None  # the storage's pointer
    nbytes: int
    kind: str


def _kind(t: torch.Tensor, batch: int) -> str:
    """``batch`` for a tensor whose first dimension is the batch's (a multiple of it), else ``fixed``."""
    return "batch" if t.dim() >= 2 and t.shape[0] % batch == 0 else "fixed"


def _is_leaf(module: nn.Module) -> bool:
    return not any(True for _ in module.children())


class _SavedTensors:
    """Forward hooks and a saved-tensors hook that charge each storage autograd saves to the module that
    saved it first (the innermost module running), and note the input of each checkpoint segment."""

    def __init__(self, model: nn.Module, batch_size: int, inputs: Sequence[torch.Tensor],
                 segments: dict[str, list[nn.Module]]) -> None:
        self.batch_size = batch_size
        self.segments = segments
        self.names = {module: name for name, module in model.named_modules()}
        self.segment_of = {granularity: {sub: index for index, segment in enumerate(modules)
                                         for sub in segment.modules()}
                           for granularity, modules in segments.items()}
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.units: list[dict[str, Any]] = []
        self.unit_of: dict[nn.Module | None, int] = {}
        self.running: list[nn.Module] = []  # the modules whose forward is running, outermost first
        self.storages: dict[Any, dict[str, Any]] = {}  # storage key -> {"owner", "bytes", "kind", "dtype"}
        self.segment_inputs: dict[str, dict[int, _SegmentInput]] = {g: {} for g in segments}

    def unit(self, module: nn.Module | None) -> int:
        """The index of ``module``'s unit (``None``: the loss, outside every module), made on first sight."""
        if module not in self.unit_of:
            self.unit_of[module] = len(self.units)
            self.units.append({
                "name": self.names.get(module, "<loss>"),
                "type": type(module).__name__ if module is not None else "",
                "segments": {g: self.segment_of[g].get(module) for g in self.segments},
                "width": getattr(module, "out_channels", None) or getattr(module, "in_features", None),
            })
        return self.unit_of[module]

    def before_forward(self, module: nn.Module, args: Any) -> None:
        self.running.append(module)
        if _is_leaf(module):
            self.unit(module)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        for granularity, modules in self.segments.items():
            if first is None or module not in modules:
                continue
            index = modules.index(module)
            if index not in self.segment_inputs[granularity]:
                storage = first.untyped_storage()
                kind = "input" if storage.data_ptr() in self.inputs else _kind(first, self.batch_size)
                noted = _SegmentInput(storage.data_ptr(), storage.nbytes(), kind)
                self.segment_inputs[granularity][index] = noted

    def after_forward(self, *_: Any) -> None:  # returning the module would replace the output
        self.running.pop()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        owner = self.unit(self.running[-1] if self.running else None)
        if key in self.parameters:
            kind = "param"
        elif key in self.inputs:
            kind = "input"
        else:
            kind = _kind(t, self.batch_size)
        if kind == "param" and self.units[owner]["type"] in AUTOCAST_16BIT:
            kind = "cast"
            key = (key, owner)  # each module that saves a weight casts its own copy
        first_seen = key not in self.storages
        if first_seen or (isinstance(key, int) and owner < self.storages[key]["owner"]):
            self.storages[key] = {"owner": owner, "bytes": storage.nbytes(), "kind": kind,
                                  "dtype": str(t.dtype).removeprefix("torch.")}
        return t

    def segments_json(self) -> dict[str, list[dict[str, Any]]]:
        out = {}
        for granularity, modules in self.segments.items():
            out[granularity] = []
            for index, segment in enumerate(modules):
                first = self.segment_inputs[granularity].get(index, _SegmentInput(None, 0, "batch"))
                out[granularity].append({
                    "input_bytes": first.nbytes, "input_kind": first.kind,
                    "input_owner": self.storages.get(first.storage, {}).get("owner"),
                    "param_bytes": sum(p.numel() * p.element_size() for p in segment.parameters())})
        return out


def profile_step(model: nn.Module, step: Callable[[], Any], batch_size: int,
                 optimizers: Sequence[torch.optim.Optimizer] = (), inputs: Sequence[torch.Tensor] = (),
                 segments: Mapping[str, Sequence[nn.Module]] | None = None) -> dict[str, Any]:
    """Run ``step`` (forward, backward and update of ``batch_size`` samples on ``inputs``) once, the caller
    having run one before (the optimizer state exists), and return its JSON-ready profile in bytes;
    ``segments``: the checkpoint segments by granularity."""
    from torch.distributed._tools.mem_tracker import MemTracker

    if any("forward" in module.__dict__ for module in model.modules()):
        raise ValueError("profile_step: profile the model without gradient checkpointing")
    by_granularity = {granularity: list(modules) for granularity, modules in (segments or {}).items()}
    saved = _SavedTensors(model, batch_size, inputs, by_granularity)
    hooks = []
    for module in model.modules():
        hooks.append(module.register_forward_pre_hook(saved.before_forward))
        hooks.append(module.register_forward_hook(saved.after_forward))
    tracker = MemTracker()
    tracker.track_external(model, *optimizers)
    try:
        packing = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
        with warnings.catch_warnings(), tracker, packing:
            warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
            step()
    finally:
        for hook in hooks:
            hook.remove()
    device = next(model.parameters()).device
    for module, index in saved.unit_of.items():
        if module is None or not _is_leaf(module):
            continue
        at_peak = backward_peak(tracker, module, device)
        if at_peak is not None:
            kept = ("gradients", "activations", "temporaries")
            saved.units[index]["backward"] = {key: at_peak[key] for key in kept}
    peak = by_category(tracker.get_tracker_snapshot("peak"), device)
    return {
        "version": 2, "batch_size": batch_size, "units": saved.units,
        "storages": list(saved.storages.values()),
        "segments": saved.segments_json(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "largest_param_bytes": max(p.numel() * p.element_size() for p in model.parameters()),
        "peak_bytes": {k: v for k, v in peak.items() if k not in ("comm_buffers", "inputs", "other")},
    }
