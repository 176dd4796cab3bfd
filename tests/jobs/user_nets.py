"""Networks the project does not ship, as a user would write them in a file of their own: a plain CNN on
grey images, a transformer over image patches, a recurrent model over image rows. The predictor was not
written against any of them."""

import torch
from torch import nn


class ThreeLayerCNN(nn.Module):
    """An earlier module's CNN: three convolutions, pooling, dropout, a linear head."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class PatchTransformer(nn.Module):
    """Patches embedded by a strided convolution, PyTorch's own TransformerEncoder, a mean-pooled head."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 64, layers: int = 2,
                 patch: int = 4) -> None:
        super().__init__()
        self.embed = nn.Conv2d(in_channels, width, patch, patch)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.encoder(tokens)).mean(1))


class RowLSTM(nn.Module):
    """Each image row a time step of a two-layer LSTM; the last step's state classified."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32,
                 hidden: int = 64) -> None:
        super().__init__()
        self.lstm = nn.LSTM(in_channels * image_size, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.permute(0, 2, 1, 3).flatten(2)  # batch × rows × (channels · columns)
        out, _ = self.lstm(rows)
        return self.head(out[:, -1])
