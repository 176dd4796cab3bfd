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
from typing import Any

import torch
from torch import nn

from modelwright.measure.memtracker import backward_peak, by_category

#: Modules whose ops autocast runs in 16 bits, so a weight they save becomes a 16-bit copy.
AUTOCAST_16BIT = ("Conv1d", "Conv2d", "Conv3d", "Linear", "NonDynamicallyQuantizableLinear", "MultiheadAttention")


def _kind(t: torch.Tensor, batch: int) -> str:
    return "batch" if t.dim() >= 2 and t.shape[0] % batch == 0 else "fixed"


def profile_step(model: nn.Module, step: Callable[[], Any], batch_size: int,
                 optimizers: Sequence[torch.optim.Optimizer] = (), inputs: Sequence[torch.Tensor] = (),
                 segments: Mapping[str, Sequence[nn.Module]] | None = None) -> dict[str, Any]:
    """Run ``step`` (forward, backward and update of ``batch_size`` samples on ``inputs``) once, after a
    warm-up step, and return its JSON-ready profile in bytes; ``segments``: checkpoint segments by
    granularity."""
    from torch.distributed._tools.mem_tracker import MemTracker

    names = {m: n for n, m in model.named_modules()}
    segments = {g: list(mods) for g, mods in (segments or {}).items()}
    if any("forward" in m.__dict__ for m in model.modules()):
        raise ValueError("profile_step: profile the model without gradient checkpointing")
    seg_of = {g: {sub: i for i, seg in enumerate(mods) for sub in seg.modules()} for g, mods in segments.items()}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    outside = {t.untyped_storage().data_ptr() for t in inputs}
    units: list[dict[str, Any]] = []
    unit_of: dict[nn.Module, int] = {}
    stack: list[nn.Module] = []
    storages: dict[Any, dict[str, Any]] = {}  # storage pointer -> {"owner": unit, "bytes", "kind", "dtype"}
    seg_inputs: dict[str, dict[int, list]] = {g: {} for g in segments}  # granularity -> segment -> its input

    def unit(mod: nn.Module | None) -> int:
        if mod not in unit_of:
            unit_of[mod] = len(units)
            units.append({
                "name": names.get(mod, "<loss>"),
                "type": type(mod).__name__ if mod is not None else "",
                "segments": {g: seg_of[g].get(mod) for g in segments},
                "width": getattr(mod, "out_channels", None) or getattr(mod, "in_features", None),
            })
        return unit_of[mod]

    def pre(mod: nn.Module, args: Any) -> None:
        stack.append(mod)
        if not any(True for _ in mod.children()):
            unit(mod)
        for g, mods in segments.items():
            if mod in mods and args and isinstance(args[0], torch.Tensor) and mods.index(mod) not in seg_inputs[g]:
                st = args[0].untyped_storage()
                kind = "input" if st.data_ptr() in outside else _kind(args[0], batch_size)
                seg_inputs[g][mods.index(mod)] = [st.data_ptr(), st.nbytes(), kind]

    def post(*_: Any) -> None:  # a forward hook that returned the module would replace the output
        stack.pop()

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = st.data_ptr()
        owner = unit(stack[-1] if stack else None)
        kind = "param" if key in params else "input" if key in outside else _kind(t, batch_size)
        if kind == "param" and units[owner]["type"] in AUTOCAST_16BIT:
            kind, key = "cast", (key, owner)  # each module that saves a weight casts its own copy
        if key not in storages or (isinstance(key, int) and owner < storages[key]["owner"]):
            storages[key] = {"owner": owner, "bytes": st.nbytes(), "kind": kind,
                             "dtype": str(t.dtype).removeprefix("torch.")}
        return t

    hooks = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    tracker = MemTracker()
    tracker.track_external(model, *optimizers)
    try:
        with warnings.catch_warnings(), tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
            step()
    finally:
        for h in hooks:
            h.remove()
    device = next(model.parameters()).device
    for module, index in unit_of.items():
        leaf = module is not None and not any(True for _ in module.children())
        at_peak = backward_peak(tracker, module, device) if leaf else None
        if at_peak is not None:
            units[index]["backward"] = {k: at_peak[k] for k in ("gradients", "activations", "temporaries")}
    peak = by_category(tracker.get_tracker_snapshot("peak"), device)
    return {
        "version": 2, "batch_size": batch_size, "units": units, "storages": list(storages.values()),
        "segments": {g: [{"input_bytes": inp[1], "input_kind": inp[2],
                          "input_owner": storages.get(inp[0], {}).get("owner"),
                          "param_bytes": sum(p.numel() * p.element_size() for p in seg.parameters())}
                         for i, seg in enumerate(mods) for inp in [seg_inputs[g].get(i, [None, 0, "batch"])]]
                     for g, mods in segments.items()},
        "parameters": sum(p.numel() for p in model.parameters()),
        "largest_param_bytes": max(p.numel() * p.element_size() for p in model.parameters()),
        "peak_bytes": {k: v for k, v in peak.items() if k not in ("comm_buffers", "inputs", "other")},
    }
