"""The ``model:``, ``data:`` and (for the Accelerate loop) ``trainer:`` sections of a config as plain
dataclasses that check themselves; no Lightning.

The Accelerate loop parses the sections with them; ImageClassifier and ImageDataModule keep the typed
``__init__`` that is LightningCLI's schema and pass it through them, so a field added to one side alone fails
every run at once.
"""

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal, TypeVar

from modelwright.errors import require
from modelwright.inputs import require_creatable_folder, require_file, require_folder
from modelwright.precision import PRECISIONS, precision

CIFAR10_FILES = (*(f"data_batch_{number}" for number in range(1, 6)), "test_batch", "batches.meta")


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
        require(0 <= self.label_smoothing < 1,
                f"model.label_smoothing: must be in [0, 1), got {self.label_smoothing}")


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
        if self.dataset == "cifar10":
            self._check_cifar10()

    def _check_cifar10(self) -> None:
        """CIFAR-10's python-format batches are there, readable and whole (torchvision's MD5s), or may be
        downloaded into a folder that exists or can be made."""
        if self.download:
            require_creatable_folder("data.data_dir", self.data_dir)
            return
        require_folder("data.data_dir", self.data_dir)
        folder = Path(self.data_dir) / "cifar-10-batches-py"
        missing = [name for name in CIFAR10_FILES if not (folder / name).is_file()]
        require(not missing, f"data.data_dir: no CIFAR-10 files in {folder} (missing {', '.join(missing)}); "
                "set data.download: true or point data.data_dir at an extracted cifar-10-python.tar.gz")
        from torchvision.datasets import CIFAR10
        from torchvision.datasets.utils import check_integrity

        checksums = [*CIFAR10.train_list, *CIFAR10.test_list, [CIFAR10.meta["filename"], CIFAR10.meta["md5"]]]
        for name, md5 in checksums:
            path = require_file("data.data_dir", folder / name)
            require(check_integrity(str(path), md5), f"data.data_dir: {path} is not CIFAR-10's (its MD5 "
                    "differs: a corrupt or partial file); remove the folder and set data.download: true")


@dataclass
class TrainerArgs:
    """``trainer:``: the keys the loop applies; then Lightning's plumbing (devices: the launcher decides;
    logger: only its ``init_args.name``; callbacks, plugins, checkpoints, progress bar), accepted and
    ignored."""

    precision: str | int = "32-true"
    accumulate_grad_batches: int = 1
    max_epochs: int | None = None
    max_steps: int = -1
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    check_val_every_n_epoch: int = 1
    val_check_interval: int | float = 1.0
    log_every_n_steps: int = 50
    gradient_clip_val: float | None = None
    strategy: str | dict = "auto"
    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = "auto"
    devices: int | str | list = "auto"
    num_nodes: int = 1
    logger: bool | dict | None = None
    callbacks: list | dict | None = field(default_factory=list)
    plugins: list | dict | None = None
    enable_checkpointing: bool | None = None
    enable_progress_bar: bool | None = None
    enable_model_summary: bool | None = None
    num_sanity_val_steps: int | None = None

    def __post_init__(self) -> None:
        mixed = [entry.name for entry in PRECISIONS.values() if entry.accelerate is not None]
        require(precision(self.precision).accelerate is not None,
                f"trainer.precision: {self.precision!r} is not run by the accelerate loop; "
                f"valid here: {', '.join(mixed)}")
        strategy = self.strategy
        if not isinstance(strategy, str):
            strategy = str(strategy.get("class_path"))
        require(strategy in ("auto", "ddp") or strategy.endswith(".DDPStrategy"),
                f"trainer.strategy: {strategy} is not run by the accelerate loop (data parallel only); "
                "use main.py fit")
        from modelwright.train.checks import check_trainer  # the checks main.py fit makes, one module below

        check_trainer(asdict(self))


def limited_batches(length: int, limit: int | float | None) -> int:
    """The batches of a loader of ``length`` that Lightning's ``limit_*_batches`` (a count or a fraction)
    leaves."""
    if limit is None:
        return length
    if isinstance(limit, int):
        return min(length, limit)
    return min(length, int(length * limit))


Args = TypeVar("Args", ModelArgs, DataArgs)


def from_hparams(cls: type[Args], hparams: Mapping) -> Args:
    """``cls`` from a Lightning class's saved hyperparameters (LightningCLI adds keys of its own there)."""
    return cls(**{argument.name: hparams[argument.name] for argument in fields(cls)})
