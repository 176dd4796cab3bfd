"""The ``model:`` and ``data:`` sections of a config as plain dataclasses that check themselves; no Lightning.

:class:`~modelwright.train.module.ImageClassifier` and :class:`~modelwright.train.data.ImageDataModule` keep
their typed ``__init__`` (LightningCLI's schema, documented there) and pass their hyperparameters through these
classes, so a field added to one and not the other fails every run at once. The Accelerate loop parses the same
sections with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal, TypeVar

from modelwright.errors import require
from modelwright.train.datasets import check_cifar10_dir


@dataclass
class ModelArgs:
    """``model:``: :class:`~modelwright.train.module.ImageClassifier`'s arguments."""

    model_name: Literal["resnet18", "smallcnn", "vit"] = "resnet18"
    num_classes: int = 10
    optimizer: Literal["sgd", "adamw"] = "adamw"
    lr: float = 2e-3
    momentum: float = 0.9
    weight_decay: float = 5e-2
    optimizer_impl: Literal["auto", "for-loop", "foreach", "fused"] = "auto"
    scheduler: Literal["none", "cosine", "onecycle"] = "onecycle"
    gradient_checkpointing: Literal["off", "stage", "block"] = "off"
    channels_last: bool = False
    compile: bool = False
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        require(self.num_classes >= 2, f"model.num_classes: must be at least 2, got {self.num_classes}")
        require(self.lr > 0, f"model.lr: must be positive, got {self.lr}")
        require(self.weight_decay >= 0, f"model.weight_decay: must be >= 0, got {self.weight_decay}")
        require(0 <= self.momentum < 1, f"model.momentum: must be in [0, 1), got {self.momentum}")
        require(0 <= self.label_smoothing < 1, f"model.label_smoothing: must be in [0, 1), got {self.label_smoothing}")


@dataclass
class DataArgs:
    """``data:``: :class:`~modelwright.train.data.ImageDataModule`'s arguments."""

    dataset: Literal["synthetic", "cifar10"] = "synthetic"
    data_dir: str = "data"
    download: bool = False
    batch_size: int = 128
    num_workers: int = 0
    persistent_workers: bool = False
    train_size: int = 4096
    val_size: int = 1024
    augment: bool = True
    noise: float = 6.0
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("batch_size", "train_size", "val_size"):
            require(getattr(self, key) >= 1, f"data.{key}: must be >= 1, got {getattr(self, key)}")
        require(self.num_workers >= 0, f"data.num_workers: must be >= 0, got {self.num_workers}")
        require(self.noise >= 0, f"data.noise: must be >= 0, got {self.noise}")
        require(not self.persistent_workers or self.num_workers > 0,
                "data.persistent_workers: needs data.num_workers > 0")
        if self.dataset == "cifar10" and not self.download:
            check_cifar10_dir(self.data_dir)


Args = TypeVar("Args", ModelArgs, DataArgs)


def from_hparams(cls: type[Args], hparams: Mapping) -> Args:
    """``cls`` from a Lightning class's saved hyperparameters (LightningCLI adds keys of its own there)."""
    return cls(**{f.name: hparams[f.name] for f in fields(cls)})
