"""Plain ``nn.Module`` networks for 32×32 images, built by name, and their checkpoint segments.

Granularities: ``stage`` (layers sharing a resolution: resnet18's ``layer1``..``layer4``) and ``block``
(the residual / conv / transformer blocks inside). A segment's ``forward`` is replaced on the instance, so
parameter names and ``state_dict`` keys stay the same.
"""

from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint
from torchvision.models import resnet18 as tv_resnet18
from torchvision.models.vision_transformer import VisionTransformer

from modelwright.errors import require


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's resnet18 with the usual 32×32 stem: a 3×3 stride-1 conv and no max-pool."""
    model = tv_resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class ConvBlock(nn.Sequential):
    """conv3×3 → BatchNorm → ReLU, optionally followed by a 2×2 max-pool."""

    def __init__(self, c_in: int, c_out: int, pool: bool) -> None:
        conv = nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False)
        layers = [conv, nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
        if pool:
            layers.append(nn.MaxPool2d(2))
        super().__init__(*layers)


class SmallCNN(nn.Module):
    """Six conv layers in three stages (32→16→8→4 pixels), global pooling and a linear head."""

    def __init__(self, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()
        stages = []
        for c_in, c_stage in ((3, width), (2 * width, 2 * width), (4 * width, 4 * width)):
            # a conv at the stage's width, then one to twice that and a pool
            stages.append(nn.Sequential(ConvBlock(c_in, c_stage, pool=False),
                                        ConvBlock(c_stage, 2 * c_stage, pool=True)))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(x))


def small_vit(num_classes: int = 10) -> VisionTransformer:
    """torchvision's VisionTransformer for 32×32 inputs: patch 4 (64 tokens), 6 blocks, width 192; its
    attention (``nn.MultiheadAttention`` with ``need_weights=False``) runs through
    ``F.scaled_dot_product_attention``."""
    return VisionTransformer(image_size=32, patch_size=4, num_layers=6, num_heads=6, hidden_dim=192,
                             mlp_dim=768, num_classes=num_classes)


BUILDERS = {"resnet18": resnet18_cifar, "smallcnn": SmallCNN, "vit": small_vit}
MODEL_NAMES = tuple(BUILDERS)


def build_model(name: str, num_classes: int = 10) -> nn.Module:
    """Build a network by name (one of :data:`MODEL_NAMES`)."""
    require(name in BUILDERS, f"model.model_name: unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}")
    return BUILDERS[name](num_classes)


def checkpoint_segments(model: nn.Module, granularity: str) -> list[nn.Module]:
    """The modules that ``granularity`` recomputes in backward (empty for ``off``)."""
    if granularity == "off":
        return []
    if isinstance(model, VisionTransformer):
        segments = {"block": list(model.encoder.layers)}
    elif isinstance(model, SmallCNN):
        blocks = [block for stage in model.stages for block in stage]
        segments = {"stage": list(model.stages), "block": blocks}
    else:  # torchvision's ResNet
        stages = [model.layer1, model.layer2, model.layer3, model.layer4]
        segments = {"stage": stages, "block": [block for stage in stages for block in stage]}
    require(granularity in segments, f"model.gradient_checkpointing: {type(model).__name__} has no "
            f"{granularity!r} segments; valid: off, {', '.join(segments)}")
    return segments[granularity]


@contextmanager
def _batchnorm_stats_frozen(module: nn.Module):
    """Keep BatchNorm running statistics as they are while a segment is recomputed.

    Without this, every checkpointed BatchNorm would fold the same batch into its running statistics twice
    (once in forward, once in the recomputation), and evaluation would differ from a run without
    checkpointing.
    """
    norms = [norm for norm in module.modules()
             if isinstance(norm, _BatchNorm) and norm.training and norm.track_running_stats]
    saved = [(norm.momentum, norm.num_batches_tracked.clone()) for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:
        for norm, (momentum, tracked) in zip(norms, saved, strict=True):
            norm.momentum = momentum
            norm.num_batches_tracked.copy_(tracked)


class _CheckpointedForward:
    """A module's original forward, recomputed in backward instead of keeping its activations."""

    def __init__(self, forward) -> None:
        self.forward = forward

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        contexts = nullcontext(), _batchnorm_stats_frozen(self.forward.__self__)
        return checkpoint(self.forward, *args, use_reentrant=False, context_fn=lambda: contexts, **kwargs)


def apply_gradient_checkpointing(model: nn.Module, granularity: str) -> list[nn.Module]:
    """Recompute ``granularity``'s segments of ``model`` in backward (``use_reentrant=False``); returns
    them."""
    segments = checkpoint_segments(model, granularity)
    for module in segments:
        if not isinstance(module.forward, _CheckpointedForward):
            module.forward = _CheckpointedForward(module.forward)
    return segments


def checkpointed_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that :func:`apply_gradient_checkpointing` wrapped, in module order."""
    return [module for module in model.modules()
            if isinstance(module.__dict__.get("forward"), _CheckpointedForward)]
