"""The checks a training config passes before any work, shared by ``main.py fit`` and the Accelerate loop
(they read the same YAML): values that break training, runs that would train nothing, a multi-node launch that
has no peers to wait for. Each refusal is one :class:`ConfigError` naming the keys; no Lightning here."""

import math
import os
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from modelwright.errors import require
from modelwright.inputs import require_creatable_folder
from modelwright.train.args import IMAGE_SUFFIXES, DataArgs, ImageFolderArgs, TrainerArgs, limited_batches

#: CIFAR-10's training images: a larger ``data.train_size`` takes them all.
CIFAR10_TRAIN_IMAGES = 50_000
#: Environment variables of the launchers that start a multi-node job and tell each process where its peers
#: meet: torchrun, SLURM, LSF; or a hand launch's NODE_RANK beside MASTER_ADDR.
_LAUNCHER_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "LSB_JOBID")
#: The smallest value of each key that still trains (None: the key may be unset; num_sanity_val_steps
#: -1: every validation batch).
_LOWEST = (("accumulate_grad_batches", 1), ("check_val_every_n_epoch", 1), ("log_every_n_steps", 1),
           ("gradient_clip_val", 0), ("min_epochs", 0), ("num_nodes", 1), ("num_sanity_val_steps", -1))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_lowest(trainer: Mapping) -> None:
    """Values Lightning's Trainer accepts but that break training (a negative clip flips the gradients)."""
    for key, low in _LOWEST:
        value = trainer.get(key)
        require(value is None or value >= low, f"trainer.{key}: must be >= {low}, got {value}")


def _check_length(trainer: Mapping) -> None:
    """How long to train: not zero, not forever."""
    max_epochs = trainer.get("max_epochs")
    max_steps = trainer.get("max_steps", -1)
    if max_epochs is not None:
        require(max_epochs != 0, "trainer.max_epochs: 0 trains nothing; at least 1, or -1 (no limit) beside "
                "trainer.max_steps")
        require(max_epochs >= -1, f"trainer.max_epochs: must be >= 1 or -1 (no limit), got {max_epochs}")
    require(max_steps != 0, "trainer.max_steps: 0 trains nothing; at least 1, or -1 (no limit)")
    require(max_steps >= -1, f"trainer.max_steps: must be >= 1 or -1 (no limit), got {max_steps}")
    endless = max_epochs == -1 and max_steps == -1 and trainer.get("max_time") is None
    require(not endless, "trainer.max_epochs: -1 with trainer.max_steps -1 never ends; set one of them")
    limit = trainer.get("limit_train_batches")
    require(limit is None or limit != 0, f"trainer.limit_train_batches: {limit} trains nothing")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_batches(key: str, value: Any, zero_allowed: bool) -> None:
    """A count of batches, or a float: a fraction of them up to 1 (or a whole number, as Lightning reads it);
    ``zero_allowed`` where 0 means none, else it must be more."""
    if not _is_number(value):
        return  # unset, or a time ("00:12:00:00", a dict) for val_check_interval; types are the parser's
    if zero_allowed:
        require(value >= 0, f"trainer.{key}: must be >= 0, got {value}")
    else:
        require(value > 0, f"trainer.{key}: must be positive, got {value}")
    if isinstance(value, float):
        whole = value.is_integer()
        require(value <= 1 or whole, f"trainer.{key}: {value} is neither a fraction up to 1 nor a whole "
                "number of batches")


def _names_devices(devices: Any) -> bool:
    """A count >= 1, -1 (all), 'auto', or device indices (a list, or a string of comma-separated ones)."""
    if isinstance(devices, list):
        return bool(devices) and all(_is_count(index) and index >= 0 for index in devices)
    if not isinstance(devices, str):
        return _is_count(devices) and (devices >= 1 or devices == -1)
    text = devices.strip()
    if text in ("auto", "-1"):
        return True
    parts = [part.strip() for part in text.rstrip(",").split(",")]
    if not all(part.isdigit() for part in parts):
        return False
    return "," in text or int(parts[0]) >= 1  # "2" is a count, "0," an index


def _check_devices(devices: Any) -> None:
    valid = "a count >= 1, -1 (all), 'auto' or a list of device indices"
    named = devices is None or _names_devices(devices)
    require(named, f"trainer.devices: {devices!r} names no device; {valid}")


def check_finite(key: str, values: Any) -> None:
    """Every float under ``values`` (a config's section as plain mappings and lists) is a number: YAML's
    ``.inf`` and ``.nan``, or ``1e999`` on the command line, pass every comparison a bound makes (inf > 0) or
    none (nan), and a run would train on them. A section's own ``init_args`` are named as their keys
    (``model.lr``), a class's nested in it in full (``model.network.init_args.width``)."""
    if isinstance(values, float):
        require(math.isfinite(values), f"{key}: must be a finite number, got {values}")
    elif isinstance(values, Mapping):
        nested = values.get("init_args") if "." not in key and "class_path" in values else None
        for name, value in (nested or values).items():
            check_finite(f"{key}.{name}", value)
    elif isinstance(values, list):
        for index, value in enumerate(values):
            check_finite(f"{key}[{index}]", value)


def check_trainer(trainer: Mapping) -> None:
    """The ``trainer:`` values of either loop that break training or train nothing, before any work."""
    _check_lowest(trainer)
    _check_length(trainer)
    _check_batches("val_check_interval", trainer.get("val_check_interval"), zero_allowed=False)
    _check_batches("limit_train_batches", trainer.get("limit_train_batches"), zero_allowed=True)
    _check_batches("limit_val_batches", trainer.get("limit_val_batches"), zero_allowed=True)
    _check_devices(trainer.get("devices"))


def check_launch(num_nodes: int, environ: Mapping[str, str] = os.environ) -> None:
    """More than one machine needs a launcher that tells each process where its peers meet: without one, the
    first process would wait for the others until the process group's timeout (30 min by default)."""
    if num_nodes is None or num_nodes <= 1:
        return
    launched = any(name in environ for name in _LAUNCHER_VARIABLES)
    by_hand = "NODE_RANK" in environ and "MASTER_ADDR" in environ
    require(launched or by_hand, f"trainer.num_nodes: {num_nodes} machines, but no multi-node launcher "
            "started this process (torchrun, SLURM's srun) and NODE_RANK and MASTER_ADDR are not set: it "
            "would wait for machines that never come; docs/distributed.md shows the launch")


def training_samples(data: DataArgs | ImageFolderArgs) -> tuple[int, str]:
    """The samples of one training epoch, and the key that sets them."""
    if isinstance(data, ImageFolderArgs):
        folder = data.root_path / "train"
        images = [path for path in folder.rglob("*") if path.suffix.lower() in IMAGE_SUFFIXES]
        return len(images), f"data.root ({folder})"
    samples = data.train_size
    if data.dataset == "cifar10":
        samples = min(samples, CIFAR10_TRAIN_IMAGES)
    return samples, "data.train_size"


def epoch_batches(data: DataArgs | ImageFolderArgs, world_size: int, loop: str) -> int:
    """Training batches of one epoch per process: the last partial batch is dropped. Lightning's
    DistributedSampler gives each process ``ceil(samples / processes)`` samples; Accelerate deals whole
    batches round-robin, repeating the first ones so that every process has as many."""
    samples, _ = training_samples(data)
    if loop == "accelerate":
        return math.ceil((samples // data.batch_size) / world_size)
    return math.ceil(samples / world_size) // data.batch_size


def check_run(trainer: Mapping, data: DataArgs | ImageFolderArgs, world_size: int, loop: str) -> None:
    """A run that would train nothing, or whose validation interval its epoch never reaches, refused naming
    the keys that make it so (``loop``: ``lightning`` or ``accelerate``)."""
    batches = epoch_batches(data, world_size, loop)
    samples, key = training_samples(data)
    per_process = f" per process of {world_size}" if world_size > 1 else ""
    require(batches > 0, f"{key}: {samples} samples make no whole batch of data.batch_size "
            f"{data.batch_size}{per_process} (a partial batch is dropped): the run would train nothing")
    limit = trainer.get("limit_train_batches")
    limited = limited_batches(batches, limit)
    require(limited > 0, f"trainer.limit_train_batches: {limit} of an epoch's {batches} batches leaves none: "
            "the run would train nothing")
    interval = trainer.get("val_check_interval")
    validates = trainer.get("check_val_every_n_epoch") is not None and trainer.get("limit_val_batches") != 0
    if _is_number(interval) and validates:  # a count (5.0 is 5 batches); a fraction <= 1 fits
        require(interval <= limited, f"trainer.val_check_interval: {interval} batches, but an epoch has "
                f"{limited} ({samples} samples, data.batch_size {data.batch_size}{per_process}); at most "
                f"{limited}, a fraction, or check_val_every_n_epoch: null")


def check_accelerate_run(data: DataArgs | ImageFolderArgs | None, trainer: TrainerArgs, out: str) -> None:
    """The Accelerate loop's arguments, before any work: what ``main.py fit`` checks, for the processes its
    launcher started (``WORLD_SIZE``), and the output folder."""
    settings = asdict(trainer)
    check_trainer(settings)
    check_launch(trainer.num_nodes)
    require_creatable_folder("out", out)
    if data is not None:  # a data module of the user's: its own loaders say
        check_run(settings, data, int(os.environ.get("WORLD_SIZE", "1")), loop="accelerate")
