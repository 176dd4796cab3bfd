"""Data: deterministic synthetic CIFAR-shaped images (default, offline) or real CIFAR-10 through torchvision.

The synthetic set is learnable: each class has a smooth random prototype image; a sample is its class's
prototype, shifted a few pixels, scaled in contrast and buried in Gaussian noise. A CNN separates the
classes within a few dozen steps, so ``val/acc`` rises well above chance (10%) in a short run, and the
same seed always gives the same tensors on every rank and every machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from modelwright.errors import ConfigError, require
from modelwright.train.resume import ResumableDataLoader, ResumableRandomSampler, TrainLoaderResume

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")
CIFAR10_FOLDER = "cifar-10-batches-py"


def synthetic_images(
    n: int, num_classes: int = 10, seed: int = 0, noise: float = 6.0, image_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images (float32, N×3×H×W, roughly zero-mean unit-variance) and their labels.

    The class prototypes depend on ``num_classes`` and ``image_size`` only (fixed seed), so a training and a
    validation set drawn with different ``seed`` share classes.
    """
    proto_gen = torch.Generator().manual_seed(1234)
    coarse = torch.randn(num_classes, 3, 4, 4, generator=proto_gen)
    protos = F.interpolate(coarse, size=(image_size, image_size), mode="bicubic", align_corners=False)
    protos = (protos - protos.mean(dim=(1, 2, 3), keepdim=True)) / protos.std(dim=(1, 2, 3), keepdim=True)

    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(num_classes, (n,), generator=gen)
    contrast = torch.empty(n, 1, 1, 1).uniform_(0.6, 1.4, generator=gen)
    shifts = torch.randint(-3, 4, (n, 2), generator=gen)
    images = protos[labels] * contrast
    for dy in range(-3, 4):  # shift by rolling, grouped by offset so it stays vectorised
        for dx in range(-3, 4):
            idx = ((shifts[:, 0] == dy) & (shifts[:, 1] == dx)).nonzero().flatten()
            if len(idx):
                images[idx] = images[idx].roll(shifts=(dy, dx), dims=(2, 3))
    images += noise * torch.randn(images.shape, generator=gen)
    return images.contiguous(), labels


def check_cifar10_dir(data_dir: str | Path) -> None:
    """Raise a one-line :class:`ConfigError` unless ``data_dir`` holds CIFAR-10's python-format batches."""
    folder = Path(data_dir) / CIFAR10_FOLDER
    missing = [name for name in CIFAR10_FILES if not (folder / name).is_file()]
    if missing:
        raise ConfigError(
            f"data.data_dir: no CIFAR-10 files in {folder} (missing {', '.join(missing)}); "
            "set data.download: true or point data.data_dir at an extracted cifar-10-python.tar.gz"
        )


class ImageDataModule(pl.LightningDataModule):
    """CIFAR-shaped 3×32×32 images with 10 classes.

    Args:
        dataset: ``synthetic`` (generated, offline, default) or ``cifar10`` (torchvision).
        data_dir: where CIFAR-10 lives (``<data_dir>/cifar-10-batches-py``) or is downloaded to.
        download: download CIFAR-10 if it is missing.
        batch_size: micro-batch size per device and step.
        num_workers: DataLoader worker processes.
        persistent_workers: keep workers alive between epochs (needs ``num_workers > 0``).
        train_size: training samples (synthetic: generated; cifar10: the first ``train_size``, capped at 50,000).
        val_size: validation samples (synthetic: generated; cifar10: the first ``val_size`` test images).
        augment: CIFAR-10 only: random crop with 4-pixel padding and horizontal flip.
        noise: synthetic only: standard deviation of the noise over the unit-variance class prototypes.
        seed: synthetic only: seed of the training set (validation uses ``seed + 1``).
    """

    def __init__(
        self,
        dataset: Literal["synthetic", "cifar10"] = "synthetic",
        data_dir: str = "data",
        download: bool = False,
        batch_size: int = 128,
        num_workers: int = 0,
        persistent_workers: bool = False,
        train_size: int = 4096,
        val_size: int = 1024,
        augment: bool = True,
        noise: float = 6.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        require(batch_size >= 1, f"data.batch_size: must be >= 1, got {batch_size}")
        require(train_size >= 1, f"data.train_size: must be >= 1, got {train_size}")
        require(val_size >= 1, f"data.val_size: must be >= 1, got {val_size}")
        require(num_workers >= 0, f"data.num_workers: must be >= 0, got {num_workers}")
        require(noise >= 0, f"data.noise: must be >= 0, got {noise}")
        require(not persistent_workers or num_workers > 0, "data.persistent_workers: needs data.num_workers > 0")
        if dataset == "cifar10" and not download:
            check_cifar10_dir(data_dir)
        self.save_hyperparameters()
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self._resume = TrainLoaderResume()  # the training loader's place in its epoch, across a resume

    def prepare_data(self) -> None:
        if self.hparams.dataset == "cifar10" and self.hparams.download:
            from torchvision.datasets import CIFAR10

            CIFAR10(self.hparams.data_dir, train=True, download=True)
            CIFAR10(self.hparams.data_dir, train=False, download=True)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        if hp.dataset == "synthetic":
            self.train_set = TensorDataset(*synthetic_images(hp.train_size, seed=hp.seed, noise=hp.noise))
            self.val_set = TensorDataset(*synthetic_images(hp.val_size, seed=hp.seed + 1, noise=hp.noise))
            return
        from torchvision import transforms as T
        from torchvision.datasets import CIFAR10

        normalize = [T.ToTensor(), T.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
        augment = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()] if hp.augment else []
        train = CIFAR10(hp.data_dir, train=True, transform=T.Compose(augment + normalize))
        val = CIFAR10(hp.data_dir, train=False, transform=T.Compose(normalize))
        self.train_set = Subset(train, range(min(hp.train_size, len(train))))
        self.val_set = Subset(val, range(min(hp.val_size, len(val))))

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        hp = self.hparams
        # The training loader resumes mid-epoch (modelwright.train.resume); its shuffle is RandomSampler's.
        extra = {"sampler": ResumableRandomSampler(dataset), "resume": self._resume.take} if shuffle else {}
        return (ResumableDataLoader if shuffle else DataLoader)(
            dataset,
            batch_size=hp.batch_size,
            num_workers=hp.num_workers,
            persistent_workers=hp.persistent_workers,
            pin_memory=torch.cuda.is_available(),
            drop_last=shuffle,
            **extra,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def state_dict(self) -> dict:
        return TrainLoaderResume.state_dict(self.trainer)

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume.load_state_dict(state_dict)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
