"""The command line: LightningCLI over :class:`ImageClassifier` and :class:`ImageDataModule`.

To run: ``uv run main.py fit --config configs/amp.yaml`` (``configs/base.yaml`` is always loaded first). Added
to a plain LightningCLI: ``--ckpt_path last`` resolution, a log line for a precision the Trainer changed
(``16-mixed`` runs as ``bf16-mixed`` on CPU), and the user's errors as one line on stderr with exit status 2
(``MODELWRIGHT_DEBUG=1`` shows the traceback). :func:`resolved_config` is the config a run would see, by the
same parser, without running anything.
"""

import argparse
import errno
import inspect
import logging
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Literal

import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_only

from modelwright import CONFIGS_DIR, resolve_config_args
from modelwright.errors import ConfigError, one_line, require
from modelwright.train.data import ImageDataModule
from modelwright.train.module import ImageClassifier
from modelwright.train.runtime import set_cpu_malloc

BASE_CONFIG = CONFIGS_DIR / "base.yaml"
log = logging.getLogger("modelwright")
say = rank_zero_only(log.warning)

#: Lightning's flag that refuses a callback of its kind in the list, and the kind (base.yaml lists some).
_FLAGGED_CALLBACKS = (("enable_checkpointing", "ModelCheckpoint"), ("enable_progress_bar", "ProgressBar"),
                      ("enable_model_summary", "ModelSummary"))


def _runs(log_root: Path) -> list[Path]:
    """The ``version_N`` folders under ``log_root``, the highest N first."""
    runs = [path for path in log_root.glob("version_*")
            if path.is_dir() and path.name.removeprefix("version_").isdigit()]
    runs.sort(key=lambda path: int(path.name.removeprefix("version_")), reverse=True)
    return runs


def find_last_checkpoint(log_root: Path) -> Path | None:
    """The newest loadable ``last*.ckpt`` of the latest run (the highest ``version_N``) under ``log_root``.

    Never an older run's without saying so: when the latest run has none, the error names the newest older
    one. ``None`` when no run has one: as with Lightning's ``ckpt_path="last"``, a relaunched job may start
    afresh.
    """
    runs = _runs(log_root)
    for run in runs:
        loadable = [path for path in run.glob("checkpoints/last*.ckpt") if _loadable(path)]
        if not loadable:
            continue
        newest = max(loadable, key=lambda path: path.stat().st_mtime)
        require(run == runs[0], f"ckpt_path: 'last', but the latest run {runs[0]} has no loadable "
                f"checkpoint; the newest older one is {newest} (pass it as --ckpt_path to resume that run)")
        return newest
    return None


def _loadable(path: Path) -> bool:
    """A checkpoint folder, or a file that is a whole zip archive (a write cut short or a full disk leaves one
    not)."""
    try:
        return path.is_dir() or (path.stat().st_size > 0 and zipfile.is_zipfile(path))
    except OSError:
        return False


def _check_trainer(trainer) -> None:
    """Refuse values Lightning's Trainer accepts but that break training (a negative clip flips the
    gradients)."""
    lowest = (("accumulate_grad_batches", 1), ("check_val_every_n_epoch", 1), ("log_every_n_steps", 1),
              ("gradient_clip_val", 0), ("min_epochs", 0))
    for key, low in lowest:
        value = trainer.get(key)
        require(value is None or value >= low, f"trainer.{key}: must be >= {low}, got {value}")
    interval = trainer.get("val_check_interval")
    # also a time: "00:12:00:00", a dict
    positive = not isinstance(interval, (int, float)) or interval > 0
    require(positive, f"trainer.val_check_interval: must be positive, got {interval}")


def _drop_flagged_callbacks(trainer) -> None:
    """Lightning refuses ``enable_checkpointing: false`` (progress bar, model summary) beside a callback of
    that kind, with a traceback; base.yaml lists such callbacks, so the flag drops them instead, and says
    so."""
    callbacks = trainer.get("callbacks") or []
    for flag, kind in _FLAGGED_CALLBACKS:
        if trainer.get(flag) is not False:
            continue
        kept = [callback for callback in callbacks
                if not str(getattr(callback, "class_path", callback)).endswith(kind)]
        if len(kept) != len(callbacks):
            dropped = len(callbacks) - len(kept)
            say(f"trainer.{flag}: false; {dropped} {kind} callback(s) of the config dropped")
            callbacks = trainer["callbacks"] = kept


def _check_log_dir(logger_args) -> None:
    save_dir = Path(logger_args["save_dir"])
    # the nearest folder that exists: "." or "/" at the latest
    existing = next(path for path in (save_dir, *save_dir.parents) if path.exists())
    key = "trainer.logger.init_args.save_dir"
    require(existing.is_dir(), f"{key}: cannot create {save_dir}: {existing} is not a folder")
    require(os.access(existing, os.W_OK | os.X_OK), f"{key}: cannot write in {existing}")


def _resolve_last(config, logger_args) -> None:
    """``ckpt_path: last`` becomes the latest run's newest checkpoint, or None (a fresh start) if no run has
    one."""
    root = Path(logger_args["save_dir"]) / (logger_args.get("name") or "")
    found = find_last_checkpoint(root)
    if found is None:
        say(f"ckpt_path: 'last', but no run under {root} has a checkpoint; starting from the beginning")
        config["ckpt_path"] = None
    else:
        config["ckpt_path"] = str(found)


def _trainer_error(err: Exception) -> ConfigError:
    """Lightning's refusal of a Trainer argument, named as ``trainer.<key>``: the argument its message
    mentions first."""
    text = " ".join(str(err).split())
    names = [name for name in inspect.signature(Trainer.__init__).parameters if name != "self"]
    mentioned = []
    for name in names:
        match = re.search(rf"\b{name}\b", text)
        if match:
            mentioned.append((match.start(), name))
    if "FSDP" in text:
        text += "; on a CPU, FSDP2 runs: configs/fsdp2.yaml"
    if not mentioned:
        return ConfigError(f"trainer: {text}")
    return ConfigError(f"trainer.{min(mentioned)[1]}: {text}")


def _cli_kwargs() -> dict:
    """How the project builds its LightningCLI, for a run and for :func:`resolved_config` alike (fresh each
    time: LightningCLI writes into its parser arguments)."""
    subcommand = {"default_config_files": [str(BASE_CONFIG)], "exit_on_error": False}
    return {
        "model_class": ImageClassifier,
        "datamodule_class": ImageDataModule,
        "parser_kwargs": {"exit_on_error": False, "fit": subcommand, "validate": subcommand,
                          "test": subcommand},
        "save_config_kwargs": {"overwrite": True},
        "auto_configure_optimizers": False,  # the model builds its own: one way to choose an optimizer
    }


class ModelwrightCLI(LightningCLI):
    """LightningCLI with the project's defaults, input checks, ``last`` resolution and precision report."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--cpu_malloc", type=Literal["retain", "system"], default="retain",
            help="glibc malloc: retain freed memory for the next step (fewer page faults) or leave it as it "
                 "is.",
        )

    @property
    def run_config(self):
        """The subcommand's config (``fit``, ...), or the whole config with ``run=False``."""
        subcommand = self.config.get("subcommand")
        if subcommand:
            return self.config[subcommand]
        return self.config

    def parse_arguments(self, parser, args) -> None:
        # LightningCLI's own, less its warning that ``args`` were given beside a non-empty ``sys.argv``: the
        # project always gives them (cli_main takes them from sys.argv).
        self.config = parser.parse_args(args)
        config = self.run_config
        _check_trainer(config["trainer"])
        logger = config["trainer"].get("logger")
        logger_args = logger.get("init_args") if hasattr(logger, "get") else None
        if logger_args is not None and logger_args.get("save_dir"):
            _check_log_dir(logger_args)
        if config.get("ckpt_path") == "last" and logger_args is not None:
            _resolve_last(config, logger_args)
        checkpoint = config.get("ckpt_path")
        if checkpoint:
            require(Path(checkpoint).exists(), f"ckpt_path: no checkpoint at {checkpoint}")
            require(_loadable(Path(checkpoint)),
                    f"ckpt_path: {checkpoint} is not a PyTorch checkpoint (truncated or corrupted?)")

    def before_instantiate_classes(self) -> None:  # not when parsing: --print_config changes nothing
        set_cpu_malloc(self.run_config["cpu_malloc"])
        _drop_flagged_callbacks(self.run_config["trainer"])

    def instantiate_trainer(self, **kwargs):
        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError, TypeError) as err:
            raise _trainer_error(err) from None

    def after_instantiate_classes(self) -> None:
        requested = str(self.run_config["trainer"].get("precision"))
        actual = str(self.trainer.precision)
        if requested != actual:
            accelerator = type(self.trainer.accelerator).__name__
            say(f"precision: requested {requested}, running {actual} on {accelerator}; the run is recorded "
                f"as {actual}")


class _Parsed(Exception):
    """How :class:`_ParseOnly` stops LightningCLI once the config is parsed (it carries the config)."""

    def __init__(self, config: dict) -> None:
        super().__init__("parsed")
        self.config = config


class _ParseOnly(ModelwrightCLI):
    """ModelwrightCLI that stops once the arguments are parsed and checked: nothing seeded, built or run."""

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        dumped = yaml.safe_load(parser.dump(self.config, skip_unset=False))
        raise _Parsed(dumped[self.config["subcommand"]])


def resolved_config(args: list[str]) -> dict:
    """The config ``main.py ARGS`` would run (what ``--print_config`` shows), parsed and checked by the
    project's LightningCLI in this process; a refusal is its one-line :class:`ConfigError`."""
    try:
        _ParseOnly(**_cli_kwargs(), args=resolve_config_args(args))
    except _Parsed as parsed:
        return parsed.config
    except argparse.ArgumentError as err:
        raise ConfigError(one_line(err)) from None
    raise AssertionError("_ParseOnly returned without a config")


def _generic_optimizer_flag(argv: list[str]) -> None:
    """Lightning's --optimizer/--lr_scheduler would replace the model's own optimizer and schedule."""
    flags = [arg.split("=", 1)[0] for arg in argv]
    generic = [flag for flag in flags if flag in ("--optimizer", "--lr_scheduler")]
    if generic:
        raise ConfigError(f"{generic[0][2:]}: not used here; choose the optimizer with --model.optimizer "
                          "(sgd, adamw) and --model.optimizer_impl, the schedule with --model.scheduler "
                          "(none, cosine, onecycle)")


def _exit_status(err: Exception) -> int | None:
    """The exit status of an error that is the user's to fix (2) or a run's known end (1: diverged, a full
    disk), said in one line; None for a bug, which keeps its traceback."""
    if isinstance(err, (ConfigError, argparse.ArgumentError)):
        return 2
    # FloatingPointError: callbacks.fault_tolerance.NonFiniteLossError, the run diverged. A full disk or
    # quota: the run's record says so too, where it could be written.
    if isinstance(err, FloatingPointError):
        return 1
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return 1
    return None


def cli_main(args: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0, 2 for a configuration error, 1 for a diverged run or a
    full disk)."""
    argv = sys.argv[1:] if args is None else list(args)
    try:
        _generic_optimizer_flag(argv)
        ModelwrightCLI(**_cli_kwargs(), args=resolve_config_args(argv))
    except Exception as err:
        status = _exit_status(err)
        if status is None or os.environ.get("MODELWRIGHT_DEBUG") == "1":
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return status
    return 0
