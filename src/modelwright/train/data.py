"""The LightningDataModule over :mod:`modelwright.train.datasets` (synthetic or CIFAR-10), resumable
mid-epoch."""

from typing import Literal

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from modelwright.train.args import DataArgs, from_hparams
from modelwright.train.datasets import image_datasets, image_loader
from modelwright.train.resume import ResumableDataLoader, ResumableRandomSampler


class ImageDataModule(LightningDataModule):
    """CIFAR-shaped 3×32×32 images with 10 classes.

    Args:
        dataset: ``synthetic`` (generated, offline, default) or ``cifar10`` (torchvision).
        data_dir: where CIFAR-10 lives (``<data_dir>/cifar-10-batches-py``) or is downloaded to.
        download: download CIFAR-10 if it is missing.
        batch_size: micro-batch size per device and step.
        num_workers: DataLoader worker processes.
        persistent_workers: keep workers alive between epochs (needs ``num_workers > 0``).
        train_size: training samples (synthetic: generated; cifar10: the first ``train_size``, capped at
            50,000).
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
        self.save_hyperparameters()
        self.args = from_hparams(DataArgs, self.hparams)  # checks the values
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def prepare_data(self) -> None:
        if self.args.dataset == "cifar10" and self.args.download:
            image_datasets(self.args, download=True)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = image_datasets(self.args)

    def train_dataloader(self) -> DataLoader:
        # Resumes mid-epoch (modelwright.train.resume) once, where load_state_dict says; RandomSampler's
        # shuffle.
        return image_loader(self.train_set, self.args, train=True, cls=ResumableDataLoader,
                            sampler=ResumableRandomSampler(self.train_set),
                            resume=lambda: vars(self).pop("_resume", None))

    # The loader's place also travels in the datamodule's state, which Lightning restores before any loader's
    # (modelwright.train.resume says why).
    def state_dict(self) -> dict:
        loader = getattr(self.trainer, "train_dataloader", None)
        if not isinstance(loader, ResumableDataLoader):
            return {}
        return {"train_loader": loader.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume = state_dict.get("train_loader")

    def val_dataloader(self) -> DataLoader:
        return image_loader(self.val_set, self.args, train=False)
