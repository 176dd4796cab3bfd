"""The CNN of an earlier module, as its author wrote it: nothing in it knows about this project."""

import torch
from torch import nn


def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    convolution = nn.Conv2d(c_in, c_out, 3, padding=1)
    return nn.Sequential(convolution, nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2))


class EarlierCNN(nn.Module):
    """Three convolution blocks and a linear head, for small grey or colour images."""

    def __init__(self, num_classes: int = 4, in_channels: int = 1, width: int = 32) -> None:
        super().__init__()
        self.block1 = conv_block(in_channels, width)
        self.block2 = conv_block(width, 2 * width)
        self.block3 = conv_block(2 * width, 4 * width)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block3(self.block2(self.block1(x))))
