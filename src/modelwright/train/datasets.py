"""Datasets and loaders without Lightning: synthetic CIFAR-shaped images (default, offline), real CIFAR-10, or
an image folder of one's own.

The synthetic set is learnable: each class has a smooth random prototype image; a sample is its class's
prototype, shifted a few pixels, scaled in contrast and buried in Gaussian noise. A CNN separates the
classes within a few dozen steps, so ``val/acc`` rises well above chance (10%) in a short run, and the
same seed always gives the same tensors on every rank and every machine.
"""

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from modelwright.errors import ConfigError, one_line
from modelwright.train.args import DataArgs, ImageFolderArgs

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def synthetic_images(count: int, num_classes: int = 10, seed: int = 0, noise: float = 6.0,
                     image_size: int = 32, channels: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` images (float32, N×C×H×W, roughly zero-mean unit-variance) and their labels.

    The class prototypes depend on ``num_classes``, ``image_size`` and ``channels`` only (fixed seed), so a
    training and a
    validation set drawn with different ``seed`` share classes.
    """
    proto_gen = torch.Generator().manual_seed(1234)
    coarse = torch.randn(num_classes, channels, 4, 4, generator=proto_gen)
    size = (image_size, image_size)
    protos = functional.interpolate(coarse, size=size, mode="bicubic", align_corners=False)
    protos = (protos - protos.mean(dim=(1, 2, 3), keepdim=True)) / protos.std(dim=(1, 2, 3), keepdim=True)

    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(num_classes, (count,), generator=gen)
    contrast = torch.empty(count, 1, 1, 1).uniform_(0.6, 1.4, generator=gen)
    shifts = torch.randint(-3, 4, (count, 2), generator=gen)
    images = protos[labels] * contrast
    for dy in range(-3, 4):  # shift by rolling, grouped by offset so it stays vectorised
        for dx in range(-3, 4):
            idx = ((shifts[:, 0] == dy) & (shifts[:, 1] == dx)).nonzero().flatten()
            if len(idx):
                images[idx] = images[idx].roll(shifts=(dy, dx), dims=(2, 3))
    images += noise * torch.randn(images.shape, generator=gen)
    return images.contiguous(), labels


def image_datasets(args: DataArgs, download: bool = False) -> tuple[Dataset, Dataset]:
    """The training and validation sets ``args`` describe (``download``: fetch CIFAR-10 first if it is
    missing)."""
    if args.dataset == "synthetic":
        shape = {"image_size": args.image_size, "channels": args.channels, "noise": args.noise}
        train = TensorDataset(*synthetic_images(args.train_size, seed=args.seed, **shape))
        val = TensorDataset(*synthetic_images(args.val_size, seed=args.seed + 1, **shape))
        return train, val
    from torchvision import transforms
    from torchvision.datasets import CIFAR10

    normalize = [transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    augment = []
    if args.augment:
        augment = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    train = CIFAR10(args.data_dir, train=True, transform=UnhookedTransforms(augment + normalize),
                    download=download)
    val = CIFAR10(args.data_dir, train=False, transform=UnhookedTransforms(normalize), download=download)
    train_subset = Subset(train, range(min(args.train_size, len(train))))
    val_subset = Subset(val, range(min(args.val_size, len(val))))
    return train_subset, val_subset


def download_cifar10(args: DataArgs) -> None:
    """CIFAR-10 into ``args.data_dir`` unless it is there; a ``cifar-10-python.tar.gz`` already there is
    checked and extracted, with no network. A download that fails is one line naming ``data.download``, and
    leaves no folder it made."""
    made = not Path(args.data_dir).exists()
    try:
        image_datasets(args, download=True)
    except (OSError, RuntimeError) as err:  # no network (URLError), a corrupt download
        if made:
            shutil.rmtree(args.data_dir, ignore_errors=True)
        raise ConfigError(f"data.download: CIFAR-10 could not be downloaded ({one_line(err)}); without a "
                          f"network, put cifar-10-python.tar.gz (www.cs.toronto.edu/~kriz/cifar.html) in "
                          f"data.data_dir {args.data_dir}") from None


class UnhookedTransforms:
    """torchvision's transforms in order, each called by its ``forward`` where it is an ``nn.Module``
    (RandomCrop, Normalize, ...): the global module hooks of PyTorch's memory tracker would otherwise see the
    next batch's transforms, loaded inside the tracked step, as modules of the network called twice."""

    def __init__(self, steps: list[Any]) -> None:
        self.steps = steps

    def __call__(self, image: Any) -> Any:
        for step in self.steps:
            image = step.forward(image) if isinstance(step, nn.Module) else step(image)
        return image


#: ImageNet's channel statistics (torchvision's pretrained weights expect them); a grey image's: 0.5.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _rgb(image: Any) -> Any:
    return image.convert("RGB")


def folder_transforms(args: ImageFolderArgs, train: bool) -> Any:
    """Resized to ``image_size`` square (grey for one channel), randomly flipped and cropped with 1/8
    padding when training with ``augment``, as tensors normalised by ``mean`` and ``std`` (ImageNet's for
    RGB, 0.5 for grey, unless given)."""
    from torchvision import transforms

    grey = args.channels == 1
    mean = args.mean or ([0.5] if grey else list(IMAGENET_MEAN))
    std = args.std or ([0.5] if grey else list(IMAGENET_STD))
    steps = [transforms.Resize((args.image_size, args.image_size))]
    if grey:
        steps.append(transforms.Grayscale(1))
    else:
        steps.append(transforms.Lambda(_rgb))
    if train and args.augment:
        padding = max(1, args.image_size // 8)
        steps += [transforms.RandomCrop(args.image_size, padding=padding), transforms.RandomHorizontalFlip()]
    steps += [transforms.ToTensor(), transforms.Normalize(mean, std)]
    return UnhookedTransforms(steps)


def image_folder_datasets(args: ImageFolderArgs) -> tuple[Dataset, Dataset]:
    """``<root>/train`` and ``<root>/val`` as torchvision ``ImageFolder`` datasets."""
    from torchvision.datasets import ImageFolder

    root = Path(args.root)
    train = ImageFolder(str(root / "train"), transform=folder_transforms(args, train=True))
    val = ImageFolder(str(root / "val"), transform=folder_transforms(args, train=False))
    return train, val


def image_loader(dataset: Dataset, args: DataArgs | ImageFolderArgs, train: bool, cls: type = DataLoader,
                 **extra: Any) -> DataLoader:
    """A loader over ``dataset``; for training shuffled (unless ``extra`` brings a sampler), partial batch
    dropped.

    An evaluation loader has a generator of its own: each pass over a DataLoader draws a seed from its
    generator, by default the global RNG, so a validation would shift the next training shuffle, and a resumed
    run that skips or repeats one would shuffle differently from the uninterrupted run.
    """
    if train and "sampler" not in extra:
        extra["shuffle"] = True
    if not train:
        extra.setdefault("generator", torch.Generator().manual_seed(0))
    return cls(
        dataset, batch_size=args.batch_size, num_workers=args.num_workers,
        persistent_workers=args.persistent_workers, pin_memory=torch.cuda.is_available(),
        drop_last=train, **extra,
    )
