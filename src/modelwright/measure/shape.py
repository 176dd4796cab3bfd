"""What tensor and pipeline parallelism could split of a network, read off one forward on the meta device (no
memory, no compute): its blocks, its narrowest layer, the largest activation crossing a block boundary."""

from collections.abc import Sequence

import torch
from torch import nn

from modelwright.measure.flops import meta_copy


def _width(module: nn.Module) -> int | None:
    return getattr(module, "out_channels", None) or getattr(module, "out_features", None)


def network_shape(network: nn.Module, blocks: Sequence[nn.Module], input_shape: Sequence[int]) -> dict:
    """``num_layers`` (the blocks a pipeline can cut between), ``min_width`` (the narrowest layer's channels
    or features, the most tensor parallelism can split it) and ``boundary_bytes_per_sample`` (the largest fp32
    input of a block, per sample: what crosses a pipeline cut), for one input of ``input_shape``."""
    widths = [width for module in network.modules() if (width := _width(module))]
    names = {id(module): name for name, module in network.named_modules()}
    copy = meta_copy(network)
    by_name = dict(copy.named_modules())
    inputs: list[int] = []

    def note(module: nn.Module, args: tuple) -> None:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is not None:
            inputs.append(first.numel() * 4)

    hooks = [by_name[names[id(block)]].register_forward_pre_hook(note)
             for block in blocks if id(block) in names]
    try:
        with torch.no_grad():
            copy.eval()(torch.empty(1, *input_shape, device="meta"))
    finally:
        for hook in hooks:
            hook.remove()
    return {"num_layers": len(blocks) or None, "min_width": min(widths, default=None),
            "boundary_bytes_per_sample": float(max(inputs, default=0))}
