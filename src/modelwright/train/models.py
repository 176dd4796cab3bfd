"""The project's own networks: plain ``nn.Module`` classes like any a user brings by class path.

``model.network: ResNet18`` (or ``SmallCNN``, ``SmallViT``; a class path and ``init_args`` for any other
network). Each declares its ``checkpoint_policies``: the named sets of modules gradient checkpointing may
recompute (:mod:`modelwright.techniques`): ``stage`` (layers sharing a resolution) and ``block`` (the
residual, conv or transformer blocks inside).
"""

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet
from torchvision.models.vision_transformer import VisionTransformer

#: The names the study's ``--model`` flag and the records use for the built-in networks.
SHORT_NAMES = {"resnet18": "ResNet18", "smallcnn": "SmallCNN", "vit": "SmallViT"}


class ResNet18(ResNet):
    """torchvision's resnet18 with the usual stem for small images: a 3×3 stride-1 conv and no max-pool.

    Args:
        num_classes: output logits.
        in_channels: channels of the input images (3: RGB, 1: grey).
    """

    checkpoint_policies = {"stage": ("layer1", "layer2", "layer3", "layer4"), "block": ("BasicBlock",)}

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
        # Drawn after torchvision's own layers, as torchvision's resnet18 builder
        # and a replaced stem draw them.
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.maxpool = nn.Identity()


class ConvBlock(nn.Sequential):
    """conv3×3 → BatchNorm → ReLU, optionally followed by a 2×2 max-pool."""

    def __init__(self, c_in: int, c_out: int, pool: bool) -> None:
        conv = nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False)
        layers = [conv, nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
        if pool:
            layers.append(nn.MaxPool2d(2))
        super().__init__(*layers)


class SmallCNN(nn.Module):
    """Six conv layers in three stages (each halves the resolution), global pooling and a linear head.

    Args:
        num_classes: output logits.
        width: channels of the first conv; each stage doubles them twice.
        in_channels: channels of the input images.
    """

    checkpoint_policies = {"stage": ("stages.0", "stages.1", "stages.2"), "block": ("ConvBlock",)}

    def __init__(self, num_classes: int = 10, width: int = 32, in_channels: int = 3) -> None:
        super().__init__()
        stages = []
        for c_in, c_stage in ((in_channels, width), (2 * width, 2 * width), (4 * width, 4 * width)):
            # a conv at the stage's width, then one to twice that and a pool
            stages.append(nn.Sequential(ConvBlock(c_in, c_stage, pool=False),
                                        ConvBlock(c_stage, 2 * c_stage, pool=True)))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(x))


class SmallViT(VisionTransformer):
    """torchvision's VisionTransformer for small images: patch 4 (64 tokens at 32×32), 6 blocks, width 192;
    its attention (``nn.MultiheadAttention``, ``need_weights=False``) runs through
    ``F.scaled_dot_product_attention``.

    Args:
        num_classes: output logits.
        image_size: side of the square input images.
        patch_size: side of the square patches (tokens).
        num_layers: transformer blocks.
    """

    checkpoint_policies = {"block": ("EncoderBlock",)}

    def __init__(self, num_classes: int = 10, image_size: int = 32, patch_size: int = 4,
                 num_layers: int = 6) -> None:
        super().__init__(image_size=image_size, patch_size=patch_size, num_layers=num_layers, num_heads=6,
                         hidden_dim=192, mlp_dim=768, num_classes=num_classes)
