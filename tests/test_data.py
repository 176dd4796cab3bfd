"""Data: the synthetic set is deterministic and learnable; CIFAR-10 loads from its real on-disk format."""

from __future__ import annotations

import hashlib
import pickle

import pytest
import torch

from cifar_fixture import trust_fixture, write_tiny_cifar10
from conftest import fit_args
from modelwright.errors import ConfigError
from modelwright.record import get_path, read_record
from modelwright.train.cli import cli_main
from modelwright.train.data import ImageDataModule
from modelwright.train.datasets import synthetic_images


def test_synthetic_is_deterministic_and_cifar_shaped():
    x1, y1 = synthetic_images(64, seed=3)
    x2, y2 = synthetic_images(64, seed=3)
    assert x1.shape == (64, 3, 32, 32) and x1.dtype == torch.float32
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, synthetic_images(64, seed=4)[0])
    assert set(y1.tolist()) <= set(range(10)) and len(set(y1.tolist())) >= 8


def test_synthetic_classes_are_separable():
    # A nearest-class-mean classifier on training images must beat chance (10%) by far on held-out ones.
    x, y = synthetic_images(2000, seed=0)
    xv, yv = synthetic_images(500, seed=1)
    means = torch.stack([x[y == c].mean(0).flatten() for c in range(10)])
    pred = torch.cdist(xv.flatten(1), means).argmin(1)
    accuracy = (pred == yv).float().mean().item()
    assert accuracy > 0.5, accuracy


def test_datamodule_sizes_and_batches():
    dm = ImageDataModule(batch_size=16, train_size=40, val_size=24)
    dm.setup("fit")
    train = list(dm.train_dataloader())
    assert len(train) == 2, "the last partial training batch is dropped"
    assert sum(len(b[0]) for b in dm.val_dataloader()) == 24


def test_cifar10_from_real_file_format(tmp_path, monkeypatch):
    trust_fixture(monkeypatch, write_tiny_cifar10(tmp_path, per_batch=8))
    dm = ImageDataModule(dataset="cifar10", data_dir=str(tmp_path), batch_size=4, train_size=100, val_size=5)
    dm.setup("fit")
    assert len(dm.train_set) == 40, "five batches of 8, capped by train_size"
    assert len(dm.val_set) == 5
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32
    assert -3 < x.min() < 0 < x.max() < 3, "normalized with CIFAR-10's mean and std"
    assert 0 <= int(y.min()) and int(y.max()) < 10


def test_cifar10_trains_through_the_cli_on_the_files(tmp_path, monkeypatch):
    md5s = write_tiny_cifar10(tmp_path / "data", per_batch=8)
    trust_fixture(monkeypatch, md5s)
    args = fit_args(tmp_path / "logs", "--data.dataset", "cifar10", "--data.data_dir", str(tmp_path / "data"),
                    "--model.network", "SmallCNN", "--trainer.max_epochs", "1", "--data.train_size", "1000")
    assert cli_main(args) == 0
    (path,) = (tmp_path / "logs").glob("*/version_0/record.json")
    record = read_record(path)
    # The files hold 5 × 8 training images: 40 of the 1,000 asked for, 5 steps of 8 (synthetic data: 125).
    assert get_path(record["config"], "data.dataset") == "cifar10" and record["timing"]["steps_per_epoch"] == 5
    data = ImageDataModule(dataset="cifar10", data_dir=str(tmp_path / "data"), train_size=1000)
    data.setup()
    with open(tmp_path / "data" / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        first = pickle.load(f, encoding="latin1")
    image, label = data.train_set.dataset.data[0], data.train_set.dataset.targets[0]
    assert (image == first["data"][0].reshape(3, 32, 32).transpose(1, 2, 0)).all() and label == first["labels"][0]


def test_cifar10_missing_files_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="data.data_dir"):
        ImageDataModule(dataset="cifar10", data_dir=str(tmp_path))


@pytest.mark.parametrize("train", [True, False])
def test_image_transforms_stay_out_of_the_memory_trackers_module_hooks(tmp_path, train):
    """The next batch loads inside the tracked step (num_workers 0): torchvision's transforms are modules, and
    MemTracker's global hooks refused the second call of one ("multiple iterative calls")."""
    from PIL import Image

    from modelwright.train.args import ImageFolderArgs
    from modelwright.train.datasets import folder_transforms

    for split in ("train", "val"):
        for name in ("a", "b"):
            (tmp_path / split / name).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(tmp_path / split / name / "0.png")
    transform = folder_transforms(ImageFolderArgs(root=str(tmp_path), image_size=8), train=train)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: seen.append(module))
    try:
        out = transform(Image.new("RGB", (12, 12)))
    finally:
        handle.remove()
    assert out.shape == (3, 8, 8) and seen == []


def test_a_cifar10_download_without_network_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capfd):
    """Issue 39. Before: a chained traceback ending in URLError, a version folder holding a failed record, an
    empty data folder."""
    import urllib.error
    import urllib.request

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    data = tmp_path / "data"
    args = fit_args(tmp_path / "logs", "--data.dataset", "cifar10", "--data.data_dir", str(data),
                    "--data.download", "true", "--model.network", "SmallCNN")
    assert cli_main(args) == 2
    (line,) = capfd.readouterr().err.strip().splitlines()
    assert line.startswith("error: data.download: CIFAR-10 could not be downloaded (")
    assert "Temporary failure in name resolution" in line and "cifar-10-python.tar.gz" in line
    assert not data.exists(), "the folder the download made is gone"
    assert not list((tmp_path / "logs").glob("*/version_*")), "no run folder"


def test_a_downloaded_cifar10_archive_in_data_dir_needs_no_network(tmp_path, monkeypatch):
    """The README's offline way: cifar-10-python.tar.gz put in data.data_dir, then --data.download true."""
    import tarfile
    import urllib.request

    from torchvision.datasets import CIFAR10

    md5s = write_tiny_cifar10(tmp_path / "made", per_batch=8)
    trust_fixture(monkeypatch, md5s)
    archive = tmp_path / "data" / "cifar-10-python.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "made" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    monkeypatch.setattr(CIFAR10, "tgz_md5", hashlib.md5(archive.read_bytes()).hexdigest())
    monkeypatch.setattr(urllib.request, "urlopen", None)  # no network: any use of it fails
    data = ImageDataModule(dataset="cifar10", data_dir=str(archive.parent), download=True, train_size=100)
    data.prepare_data()
    data.setup()
    assert len(data.train_set) == 40
