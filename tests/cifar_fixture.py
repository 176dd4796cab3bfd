"""A tiny CIFAR-10 in its real on-disk format (cifar-10-batches-py: pickled dicts of uint8 rows)."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import numpy as np

LABEL_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def write_tiny_cifar10(root: Path, per_batch: int = 8, seed: int = 0) -> dict[str, str]:
    """Write five training batches, a test batch and batches.meta under ``root``; return each file's md5."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        batch = {
            "batch_label": f"{name} of a tiny CIFAR-10",
            "labels": [int(x) for x in rng.integers(0, 10, per_batch)],
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "filenames": [f"{name}_{i}.png" for i in range(per_batch)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": LABEL_NAMES, "num_cases_per_batch": per_batch, "num_vis": 3072}, f, protocol=2)
    return {p.name: _md5(p) for p in folder.iterdir()}


def trust_fixture(monkeypatch, md5s: dict[str, str]) -> None:
    """Make torchvision's integrity check accept the fixture's checksums (it knows the real files' md5s)."""
    from torchvision.datasets import CIFAR10

    monkeypatch.setattr(CIFAR10, "train_list", [[f"data_batch_{i}", md5s[f"data_batch_{i}"]] for i in range(1, 6)])
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", md5s["test_batch"]]])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": md5s["batches.meta"]})
