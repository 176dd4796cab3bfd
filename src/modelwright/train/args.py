"""The ``model:``, ``data:`` and (for the Accelerate loop) ``trainer:`` sections of a config as plain
dataclasses that check themselves; no Lightning.

The Accelerate loop parses the sections with them; ImageClassifier and ImageDataModule keep the typed
``__init__`` that is LightningCLI's schema and pass it through them, so a field added to one side alone fails
every run at once.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, TypeVar

from modelwright.errors import require
from modelwright.inputs import require_creatable_folder, require_file, require_folder
from modelwright.techniques import PRECISIONS, TechniqueArgs, precision

CIFAR10_FILES = (*(f"data_batch_{number}" for number in range(1, 6)), "test_batch", "batches.meta")


@dataclass
class ModelArgs(TechniqueArgs):
    """``model:``: :class:`~modelwright.train.module.ImageClassifier`'s arguments beside its ``network``: the
    techniques (:class:`~modelwright.techniques.TechniqueArgs`), then the loss and the schedule.

    Args:
        num_classes: classes of the data; null: the data module's (``num_classes``), else the network's
            output width.
        lr: peak learning rate.
        momentum: SGD's momentum (ignored by the others).
        weight_decay: decoupled for AdamW and Adafactor, L2 for SGD.
        scheduler: learning-rate schedule over the whole fit, stepped per optimizer step.
        label_smoothing: cross-entropy label smoothing.
    """

    num_classes: int | None = None
    lr: float = 2e-3
    momentum: float = 0.9
    weight_decay: float = 5e-2
    scheduler: Literal["none", "cosine", "onecycle"] = "onecycle"
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        self.check()
        require(self.num_classes is None or self.num_classes >= 2,
                f"model.num_classes: must be at least 2, got {self.num_classes}")
        for key in ("lr", "momentum", "weight_decay", "label_smoothing"):
            value = getattr(self, key)
            require(math.isfinite(value), f"model.{key}: must be a finite number, got {value}")
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
    image_size: int = 32
    channels: int = 3

    def __post_init__(self) -> None:
        require(self.dataset == "synthetic" or (self.image_size, self.channels) == (32, 3),
                "data.image_size: CIFAR-10's images are 3×32×32; image_size and channels apply to the "
                "synthetic set (an image folder: modelwright.train.data.ImageFolderDataModule)")
        for key in ("batch_size", "train_size", "val_size", "image_size", "channels"):
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


#: What an image folder's files may end in (torchvision's ImageFolder reads these).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")


def image_classes(split: Path) -> list[str]:
    """The class folders of ``split`` (``train/`` or ``val/``) of an image folder, checked: each holds
    images, and nothing but class folders lies beside them; a ConfigError naming ``data.root`` else."""
    require_folder("data.root", split)
    entries = sorted(split.iterdir())
    loose = [entry.name for entry in entries if not entry.is_dir() and not entry.name.startswith(".")]
    require(not loose, f"data.root: {split} holds files beside its class folders ({', '.join(loose[:3])}); "
            f"an image folder is {split.name}/<class>/<image>")
    classes = [entry.name for entry in entries if entry.is_dir()]
    require(bool(classes), f"data.root: {split} has no class folders; an image folder is "
            f"{split.name}/<class>/<image>")
    for name in classes:
        files = [path for path in (split / name).iterdir() if not path.name.startswith(".")]
        images = [path for path in files if path.suffix.lower() in IMAGE_SUFFIXES]
        require(bool(images), f"data.root: {split / name} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        others = [path.name for path in files if path.suffix.lower() not in IMAGE_SUFFIXES]
        require(not others, f"data.root: {split / name} holds files that are not images: "
                f"{', '.join(others[:3])}")
    return classes


@dataclass
class ImageFolderArgs:
    """``data:`` of :class:`~modelwright.train.data.ImageFolderDataModule`: torchvision's ImageFolder layout,
    ``<root>/train/<class>/*.png`` and ``<root>/val/<class>/*.png``."""

    root: str = "data/images"
    image_size: int = 32
    channels: Literal[1, 3] = 3
    batch_size: int = 32
    num_workers: int = 0
    persistent_workers: bool = False
    augment: bool = True
    mean: list[float] | None = None
    std: list[float] | None = None

    def __post_init__(self) -> None:
        for key in ("batch_size", "image_size"):
            require(getattr(self, key) >= 1, f"data.{key}: must be >= 1, got {getattr(self, key)}")
        require(self.num_workers >= 0, f"data.num_workers: must be >= 0, got {self.num_workers}")
        require(not self.persistent_workers or self.num_workers > 0,
                "data.persistent_workers: needs data.num_workers > 0")
        for key in ("mean", "std"):
            values = getattr(self, key)
            require(values is None or len(values) == self.channels,
                    f"data.{key}: one value per channel ({self.channels}), got {values}")
        require(all(value > 0 for value in self.std or [1]), f"data.std: must be positive, got {self.std}")
        require_folder("data.root", self.root)
        train = image_classes(self.root_path / "train")
        val = image_classes(self.root_path / "val")
        require(train == val, f"data.root: train/ and val/ name other classes ({', '.join(train)} vs "
                f"{', '.join(val)})")
        require(len(train) >= 2, f"data.root: {self.root_path / 'train'} has one class folder; a classifier "
                "needs two or more")

    @property
    def root_path(self) -> Path:
        return Path(self.root)


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
        # main.py fit's checks of these values run before: modelwright.train.checks.check_accelerate_run
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


def counts_batches(value: int | float) -> bool:
    """Whether Lightning reads a ``limit_*_batches`` or ``val_check_interval`` as a count of batches: an int,
    or a whole float above 1 (2.0); else it is a fraction of the epoch."""
    return isinstance(value, int) or value > 1


def limited_batches(length: int, limit: int | float | None) -> int:
    """The batches of a loader of ``length`` that Lightning's ``limit_*_batches`` (a count or a fraction)
    leaves."""
    if limit is None:
        return length
    if counts_batches(limit):
        return min(length, int(limit))
    return min(length, int(length * limit))


Args = TypeVar("Args", ModelArgs, DataArgs, ImageFolderArgs)


def from_hparams(cls: type[Args], hparams: Mapping) -> Args:
    """``cls`` from a Lightning class's saved hyperparameters (LightningCLI adds keys of its own there)."""
    return cls(**{argument.name: hparams[argument.name] for argument in fields(cls)})
