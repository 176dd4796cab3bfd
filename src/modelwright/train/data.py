"""The LightningDataModules of the project, resumable mid-epoch: CIFAR-shaped images (synthetic or CIFAR-10)
and an image folder of one's own. Any other LightningDataModule is given by class path
(``data: {class_path: ..., init_args: ...}``)."""

from typing import Literal

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from modelwright.train.args import DataArgs, ImageFolderArgs, from_hparams, image_classes
from modelwright.train.datasets import download_cifar10, image_datasets, image_folder_datasets, image_loader
from modelwright.train.resume import ResumableDataLoader, ResumableRandomSampler


class _ResumableImages(LightningDataModule):
    """What both data modules share: a training loader that resumes mid-epoch where a checkpoint left it,
    a validation loader, and the number of classes (``num_classes``) the model reads."""

    args: DataArgs | ImageFolderArgs
    num_classes: int

    def __init__(self) -> None:
        super().__init__()
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

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

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """One image's shape, channels first."""
        return (self.args.channels, self.args.image_size, self.args.image_size)


class ImageDataModule(_ResumableImages):
    """CIFAR-shaped images with 10 classes: generated (offline, the default) or CIFAR-10's.

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
        image_size: synthetic only: side of the square images.
        channels: synthetic only: channels of the images.
    """

    num_classes = 10

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
        image_size: int = 32,
        channels: int = 3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.args = from_hparams(DataArgs, self.hparams)  # checks the values
        self.prepared = False

    def prepare_data(self) -> None:
        """CIFAR-10 downloaded, once (the CLI calls this before the fit makes a run folder, then the fit)."""
        if self.args.dataset == "cifar10" and self.args.download and not self.prepared:
            download_cifar10(self.args)
        self.prepared = True

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = image_datasets(self.args)


class ImageFolderDataModule(_ResumableImages):
    """Images of one's own in torchvision's ImageFolder layout: ``<root>/train/<class>/*.png`` and
    ``<root>/val/<class>/*.png`` (jpg, bmp, webp and tif too), the same classes in both.

    Args:
        root: the folder holding ``train/`` and ``val/``.
        image_size: side of the square images the network sees (each image is resized to it).
        channels: 3 (RGB) or 1 (grey).
        batch_size: micro-batch size per device and step.
        num_workers: DataLoader worker processes.
        persistent_workers: keep workers alive between epochs (needs ``num_workers > 0``).
        augment: training images randomly cropped (1/8 padding) and flipped horizontally.
        mean: per-channel mean to normalise by (default ImageNet's for RGB, 0.5 for grey).
        std: per-channel standard deviation to normalise by (default ImageNet's for RGB, 0.5 for grey).
    """

    def __init__(
        self,
        root: str = "data/images",
        image_size: int = 32,
        channels: Literal[1, 3] = 3,
        batch_size: int = 32,
        num_workers: int = 0,
        persistent_workers: bool = False,
        augment: bool = True,
        mean: list[float] | None = None,
        std: list[float] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.args = from_hparams(ImageFolderArgs, self.hparams)  # checks the values and the folder
        self.classes = image_classes(self.args.root_path / "train")
        self.num_classes = len(self.classes)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = image_folder_datasets(self.args)
