"""The checkpoints a run resumes from: ``--ckpt_path last`` resolved to the latest run's newest one, and a
checkpoint checked to be a whole Lightning checkpoint of this model before anything loads it."""

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from modelwright.errors import ConfigError, require
from modelwright.train._internals import SHARDED_METADATA_FILE, own_hyperparameters

#: The model arguments that fix the network's shapes: a checkpoint with others cannot be loaded at all.
ARCHITECTURE_KEYS = ("model_name", "num_classes")


def runs(log_root: Path) -> list[Path]:
    """The ``version_N`` folders under ``log_root``, the highest N first."""
    found = [path for path in log_root.glob("version_*")
             if path.is_dir() and path.name.removeprefix("version_").isdigit()]
    found.sort(key=lambda path: int(path.name.removeprefix("version_")), reverse=True)
    return found


def loadable(path: Path) -> bool:
    """A checkpoint folder, or a file that is a whole zip archive (a write cut short or a full disk leaves one
    not)."""
    try:
        return path.is_dir() or (path.stat().st_size > 0 and zipfile.is_zipfile(path))
    except OSError:
        return False


def find_last_checkpoint(log_root: Path) -> Path | None:
    """The newest loadable ``last*.ckpt`` of the latest run (the highest ``version_N``) under ``log_root``.

    Never an older run's without saying so: when the latest run has none, the error names the newest older
    one. ``None`` when no run has one: as with Lightning's ``ckpt_path="last"``, a relaunched job may start
    afresh.
    """
    found_runs = runs(log_root)
    for run in found_runs:
        candidates = [path for path in run.glob("checkpoints/last*.ckpt") if loadable(path)]
        if not candidates:
            continue
        newest = max(candidates, key=lambda path: path.stat().st_mtime)
        latest = found_runs[0]
        require(run == latest, f"ckpt_path: 'last', but the latest run {latest} has no loadable checkpoint; "
                f"the newest older one is {newest} (pass it as --ckpt_path to resume that run)")
        return newest
    return None


def _load(path: Path) -> Any:
    """What ``torch.load`` reads from ``path`` (memory-mapped: the tensors stay on disk), or a ConfigError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # a zip of something else, a pickle torch will not read: the user's file
        reason = " ".join(str(err).split())[:200]
        message = f"ckpt_path: {path} is not a PyTorch checkpoint ({type(err).__name__}: {reason})"
        raise ConfigError(message) from None


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint at ``path`` without loading its tensors, once it is known to be a whole, readable
    Lightning checkpoint (a file, or a sharded checkpoint's folder); else a ConfigError naming the path."""
    path = Path(path)
    require(path.exists(), f"ckpt_path: no checkpoint at {path}")
    if path.is_dir():
        metadata = path / SHARDED_METADATA_FILE
        require(metadata.is_file(), f"ckpt_path: {path} is a folder but no sharded Lightning checkpoint (no "
                f"{SHARDED_METADATA_FILE} in it)")
        path = metadata
    require(loadable(path), f"ckpt_path: {path} is not a PyTorch checkpoint (truncated or corrupted?)")
    checkpoint = _load(path)
    lightning = isinstance(checkpoint, Mapping) and "pytorch-lightning_version" in checkpoint
    require(lightning, f"ckpt_path: {path} is a PyTorch file but not a Lightning checkpoint (a plain "
            "state_dict?); resume from a run's checkpoints/last*.ckpt")
    return dict(checkpoint)


def check_architecture(checkpoint: Mapping, model: Mapping, path: str | Path) -> None:
    """The checkpoint holds this project's network with the shapes the config asks for, by name."""
    saved = own_hyperparameters(checkpoint.get("hyper_parameters"))
    require("model_name" in saved, f"ckpt_path: {path} is not a checkpoint of this project's ImageClassifier "
            "(no model_name among its hyperparameters)")
    name = saved["model_name"]
    require(name == model["model_name"], f"ckpt_path: {path} holds {name} weights, but model.model_name is "
            f"{model['model_name']!r}: they cannot load into it")
    for key in ARCHITECTURE_KEYS:
        require(saved.get(key) == model[key], f"ckpt_path: {path} holds {name} weights with {key} "
                f"{saved.get(key)!r}, but model.{key} is {model[key]!r}: they cannot load into it")
