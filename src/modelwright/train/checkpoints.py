"""The checkpoints a run resumes from: ``--ckpt_path last`` resolved to the latest run of the job; a
checkpoint checked to be a whole Lightning checkpoint of this model before anything loads it; a finished fit
told apart; and the arguments a resumed run may change (:data:`MAY_CHANGE_ON_RESUME`), all others compared
with the checkpoint's run."""

import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from modelwright.errors import ConfigError, require
from modelwright.train._internals import SHARDED_METADATA_FILE, fit_progress, own_hyperparameters


def _network(spec: Any) -> tuple[str, dict]:
    """A network's class path and init_args from a config's or a checkpoint's ``network``."""
    if not isinstance(spec, Mapping):
        return str(spec), {}
    return str(spec.get("class_path")), dict(spec.get("init_args") or {})

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


class LastCheckpoint(NamedTuple):
    """What ``--ckpt_path last`` takes: the run it continues (None: none) and its newest loadable checkpoint
    (None: the run wrote none, or there is no run), and the later runs passed over."""

    path: Path | None
    run: Path | None
    skipped: list[Path]


def find_last_checkpoint(log_root: Path, config: Mapping) -> LastCheckpoint:
    """The latest run (the highest ``version_N``) under ``log_root`` that wrote a loadable ``last*.ckpt``,
    with its newest one, or that is a run of this job (``config``, resolved: its saved config.yaml equal up to
    :data:`MAY_CHANGE_ON_RESUME`) and wrote none: the same job killed before its first checkpoint, which
    starts afresh in its folder. Other runs without a checkpoint (another job's killed run, a refused one) are
    passed over, and named; a requeued job is never blocked by them. As with Lightning's
    ``ckpt_path="last"``, no such run: the job starts afresh."""
    skipped = []
    for run in runs(log_root):
        candidates = [path for path in run.glob("checkpoints/last*.ckpt") if loadable(path)]
        if candidates:
            return LastCheckpoint(max(candidates, key=lambda path: path.stat().st_mtime), run, skipped)
        saved = _saved_config(run / "config.yaml")
        if saved and not _differences(_flat(saved), _flat(config)):
            return LastCheckpoint(None, run, skipped)
        skipped.append(run)
    return LastCheckpoint(None, None, skipped)


def run_of(checkpoint: Path, log_root: Path) -> Path | None:
    """The ``version_N`` folder under ``log_root`` whose ``checkpoints/`` holds ``checkpoint``, or None."""
    if checkpoint.parent.name != "checkpoints":
        return None
    run = checkpoint.resolve().parent.parent
    return run if run in {path.resolve() for path in runs(log_root)} else None


def _load(path: Path) -> Any:
    """What ``torch.load`` reads from ``path`` (memory-mapped: the tensors stay on disk), or a ConfigError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # a zip of something else, a pickle torch will not read: the user's file
        plain = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # torch's message bolds a word for terminals
        reason = " ".join(plain.split())[:200]
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
    """The checkpoint holds the config's LightningModule, and (for the project's classifier) its network
    with the same class and init_args: weights of another shape cannot load."""
    saved = own_hyperparameters(checkpoint.get("hyper_parameters"))
    saved_class = (checkpoint.get("hyper_parameters") or {}).get("_class_path")
    wanted_class = model.get("class_path")
    require(saved_class in (None, wanted_class), f"ckpt_path: {path} is a checkpoint of {saved_class}, but "
            f"model.class_path is {wanted_class}: it cannot load into it")
    wanted = model.get("init_args") or {}
    if "network" not in wanted:  # a LightningModule of the user's: Lightning checks its state_dict
        return
    require("network" in saved, f"ckpt_path: {path} was written by an earlier version of the project (no "
            "network among its hyperparameters); start the run afresh")
    saved_path, saved_args = _network(saved["network"])
    wanted_path, wanted_args = _network(wanted["network"])
    require(saved_path == wanted_path, f"ckpt_path: {path} holds {saved_path} weights, but model.network is "
            f"{wanted_path}: they cannot load into it")
    for key in sorted(saved_args.keys() | wanted_args.keys()):
        require(saved_args.get(key) == wanted_args.get(key), f"ckpt_path: {path} holds {saved_path} weights "
                f"with {key} {saved_args.get(key)!r}, but model.network.init_args.{key} is "
                f"{wanted_args.get(key)!r}: they cannot load into it")


class RunComplete(Exception):
    """The fit a checkpoint was saved in is complete under this run's limits: nothing to resume (exit 0)."""


def completed(checkpoint: Mapping, trainer: Mapping) -> str | None:
    """How far past this run's ``max_epochs`` or ``max_steps`` the checkpoint's fit got, if it did (then
    resuming trains nothing); None if it is short of both. As Lightning, an unset ``max_epochs`` is 1000 when
    ``max_steps`` is -1 and there is no ``max_time``."""
    epochs, steps = fit_progress(checkpoint)
    max_steps = trainer.get("max_steps", -1)
    max_epochs = trainer.get("max_epochs")
    if max_epochs is None:
        unlimited = max_steps == -1 and trainer.get("max_time") is None
        max_epochs = 1000 if unlimited else -1
    if max_steps != -1 and steps >= max_steps:
        return f"step {steps} of trainer.max_steps {max_steps}"
    if max_epochs != -1 and epochs >= max_epochs:
        return f"epoch {epochs} of trainer.max_epochs {max_epochs}, step {steps}"
    return None


#: The arguments a resumed run may change from the checkpoint's run: how long to train; what is validated,
#: logged and checkpointed, and where; and the process (a new seed per launch: the checkpoint restores the
#: RNG states and the samplers' seeds; malloc; loader workers; where the data lives). Any other difference
#: changes what is computed, and is refused unless ``--allow_resume_changes true`` is given.
MAY_CHANGE_ON_RESUME = (
    "trainer.max_epochs", "trainer.max_steps", "trainer.min_epochs", "trainer.min_steps", "trainer.max_time",
    "trainer.val_check_interval", "trainer.check_val_every_n_epoch", "trainer.limit_val_batches",
    "trainer.num_sanity_val_steps", "trainer.log_every_n_steps", "trainer.logger", "trainer.callbacks",
    "trainer.plugins", "trainer.enable_checkpointing", "trainer.enable_progress_bar",
    "trainer.enable_model_summary", "trainer.default_root_dir", "trainer.profiler",
    "seed_everything", "cpu_malloc", "ckpt_path", "allow_resume_changes",
    "data.num_workers", "data.persistent_workers", "data.data_dir", "data.download",
)


def _flat(config: Mapping) -> dict[str, Any]:
    """``config``'s top-level values and its sections' keys as ``section.key`` (a section's ``init_args``
    read as its keys); a key's value whole."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and key in ("trainer", "model", "data"):
            # a section given by class path: its init_args by name, beside the class
            arguments = value.get("init_args") if isinstance(value.get("init_args"), Mapping) else value
            flat.update({f"{key}.{name}": item for name, item in arguments.items()})
            if arguments is not value:
                flat[f"{key}.class_path"] = value.get("class_path")
        else:
            flat[key] = value
    return flat


#: The checkpoint's key for its run's resolved config (train.cli.SaveConfigCallback puts it there): a
#: checkpoint copied out of its run folder is compared with the arguments it was trained under all the same.
CONFIG_KEY = "modelwright_config"


def _saved_config(saved: Path) -> dict:
    """The resolved config LightningCLI saved in a run's folder (``version_N/config.yaml``), or an empty one
    where there is none."""
    import yaml

    if not saved.is_file():
        return {}
    try:
        data = yaml.safe_load(saved.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):  # unreadable, not text, not YAML: no config
        return {}
    return data if isinstance(data, dict) else {}


def resume_differences(checkpoint: Mapping, config: Mapping, path: str | Path) -> list[str]:
    """Each argument of ``config`` (the run about to resume, resolved) that differs from the checkpoint's
    run and may not change on resume, as ``key: before -> now``. The model's and data's come from the
    checkpoint's hyperparameters, the rest from the config the checkpoint holds (:data:`CONFIG_KEY`), else
    from the one its run saved beside it."""
    saved = checkpoint.get(CONFIG_KEY)
    if not isinstance(saved, Mapping):  # written before the checkpoint held it
        saved = _saved_config(Path(path).parent.parent / "config.yaml")
    before = _flat(saved)
    for section, stored_as in (("model", "hyper_parameters"), ("data", "datamodule_hyper_parameters")):
        hyperparameters = own_hyperparameters(checkpoint.get(stored_as))
        before.update({f"{section}.{key}": value for key, value in hyperparameters.items()})
    return _differences(before, _flat(config))


def _differences(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """Each key of both flat configs that differs and may not change on resume, as ``key: before -> now``."""
    differences = []
    for key in sorted(before.keys() & now.keys()):
        if key not in MAY_CHANGE_ON_RESUME and before[key] != now[key]:
            differences.append(f"{key}: {before[key]!r} -> {now[key]!r}")
    return differences
