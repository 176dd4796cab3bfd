"""Datasets and loaders without Lightning: synthetic CIFAR-shaped images (default, offline) or real CIFAR-10.

The synthetic set is learnable: each class has a smooth random prototype image; a sample is its class's
prototype, shifted a few pixels, scaled in contrast and buried in Gaussian noise. A CNN separates the
classes within a few dozen steps, so ``val/acc`` rises well above chance (10%) in a short run, and the
same seed always gives the same tensors on every rank and every machine.
"""

from typing import Any

import torch
from torch.nn import functional
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from modelwright.train.args import DataArgs

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def synthetic_images(count: int, num_classes: int = 10, seed: int = 0, noise: float = 6.0,
                     image_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` images (float32, N×3×H×W, roughly zero-mean unit-variance) and their labels.

    The class prototypes depend on ``num_classes`` and ``image_size`` only (fixed seed), so a training and a
    validation set drawn with different ``seed`` share classes.
    """
    proto_gen = torch.Generator().manual_seed(1234)
    coarse = torch.randn(num_classes, 3, 4, 4, generator=proto_gen)
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
        train = TensorDataset(*synthetic_images(args.train_size, seed=args.seed, noise=args.noise))
        val = TensorDataset(*synthetic_images(args.val_size, seed=args.seed + 1, noise=args.noise))
        return train, val
    from torchvision import transforms
    from torchvision.datasets import CIFAR10

    normalize = [transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    augment = []
    if args.augment:
        augment = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    train = CIFAR10(args.data_dir, train=True, transform=transforms.Compose(augment + normalize),
                    download=download)
    val = CIFAR10(args.data_dir, train=False, transform=transforms.Compose(normalize), download=download)
    train_subset = Subset(train, range(min(args.train_size, len(train))))
    val_subset = Subset(val, range(min(args.val_size, len(val))))
    return train_subset, val_subset


def image_loader(dataset: Dataset, args: DataArgs, train: bool, cls: type = DataLoader,
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
