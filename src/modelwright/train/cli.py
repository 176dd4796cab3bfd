"""The command line: LightningCLI over :class:`ImageClassifier` and :class:`ImageDataModule`.

To run: ``uv run main.py fit --config configs/amp.yaml`` (``configs/base.yaml`` is always loaded first). Added to a
plain LightningCLI: ``--ckpt_path last`` resolution, a log line for a precision the Trainer changed (``16-mixed``
runs as ``bf16-mixed`` on CPU), and the user's errors as one line on stderr with exit status 2
(``MODELWRIGHT_DEBUG=1`` shows the traceback).
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
_say = rank_zero_only(log.warning)


def find_last_checkpoint(log_root: Path) -> Path | None:
    """The newest loadable ``last*.ckpt`` of the latest run (the highest ``version_N``) under ``log_root``.

    Never an older run's without saying so: when the latest run has none, the error names the newest older one.
    ``None`` when no run has one: as with Lightning's ``ckpt_path="last"``, a relaunched job may start afresh.
    """
    runs = [p for p in log_root.glob("version_*") if p.is_dir() and p.name.removeprefix("version_").isdigit()]
    runs.sort(key=lambda p: int(p.name.removeprefix("version_")), reverse=True)
    for run in runs:
        found = sorted((c for c in run.glob("checkpoints/last*.ckpt") if _loadable(c)), key=lambda c: c.stat().st_mtime)
        if found:
            require(run == runs[0], f"ckpt_path: 'last', but the latest run {runs[0]} has no loadable checkpoint; the "
                    f"newest older one is {found[-1]} (pass it as --ckpt_path to resume that run)")
            return found[-1]
    return None


def _loadable(path: Path) -> bool:
    """A checkpoint folder, or a file that is a whole zip archive (a write cut short or a full disk leaves one not)."""
    try:
        return path.is_dir() or (path.stat().st_size > 0 and zipfile.is_zipfile(path))
    except OSError:
        return False


def _check_trainer(trainer) -> None:
    """Refuse values Lightning's Trainer accepts but that break training (a negative clip flips the gradients)."""
    for key, low in (("accumulate_grad_batches", 1), ("check_val_every_n_epoch", 1), ("log_every_n_steps", 1),
                     ("gradient_clip_val", 0), ("min_epochs", 0)):
        value = trainer.get(key)
        require(value is None or value >= low, f"trainer.{key}: must be >= {low}, got {value}")
    interval = trainer.get("val_check_interval")
    positive = not isinstance(interval, (int, float)) or interval > 0  # also a time: "00:12:00:00", a dict
    require(positive, f"trainer.val_check_interval: must be positive, got {interval}")
    # Lightning refuses enable_checkpointing/enable_progress_bar/enable_model_summary: false beside a callback of
    # that kind, with a traceback; base.yaml lists such callbacks, so the flag drops them instead.
    callbacks = trainer.get("callbacks") or []
    for flag, kind in (("enable_checkpointing", "ModelCheckpoint"), ("enable_progress_bar", "ProgressBar"),
                       ("enable_model_summary", "ModelSummary")):
        kept = [cb for cb in callbacks if not str(getattr(cb, "class_path", cb)).endswith(kind)]
        if trainer.get(flag) is False and len(kept) != len(callbacks):
            _say(f"trainer.{flag}: false; {len(callbacks) - len(kept)} {kind} callback(s) of the config dropped")
            callbacks = trainer["callbacks"] = kept


class ModelwrightCLI(LightningCLI):
    """LightningCLI with the project's defaults, input checks, ``last`` resolution and precision report."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--cpu_malloc", type=Literal["retain", "system"], default="retain",
            help="glibc malloc: retain freed memory for the next step (fewer page faults) or leave it as it is.",
        )

    @property
    def run_config(self):
        """The subcommand's config (``fit``, ...), or the whole config with ``run=False``."""
        sub = self.config.get("subcommand")
        return self.config[sub] if sub else self.config

    def before_instantiate_classes(self) -> None:  # not when parsing: --print_config changes nothing
        set_cpu_malloc(self.run_config["cpu_malloc"])

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        cfg = self.run_config
        _check_trainer(cfg["trainer"])
        logger = cfg["trainer"].get("logger")
        init_args = logger.get("init_args") if hasattr(logger, "get") else None
        if init_args is not None and init_args.get("save_dir"):
            save_dir = Path(init_args["save_dir"])
            existing = next(p for p in (save_dir, *save_dir.parents) if p.exists())  # "." or "/" at the latest
            key = "trainer.logger.init_args.save_dir"
            require(existing.is_dir(), f"{key}: cannot create {init_args['save_dir']}: {existing} is not a folder")
            require(os.access(existing, os.W_OK | os.X_OK), f"{key}: cannot write in {existing}")
        if cfg.get("ckpt_path") == "last" and init_args is not None:
            root = Path(init_args["save_dir"]) / (init_args.get("name") or "")
            found = find_last_checkpoint(root)
            if found is None:
                _say(f"ckpt_path: 'last', but no run under {root} has a checkpoint; starting from the beginning")
            cfg["ckpt_path"] = None if found is None else str(found)
        if ckpt := cfg.get("ckpt_path"):
            require(Path(ckpt).exists(), f"ckpt_path: no checkpoint at {ckpt}")
            require(_loadable(Path(ckpt)), f"ckpt_path: {ckpt} is not a PyTorch checkpoint (truncated or corrupted?)")

    def instantiate_trainer(self, **kwargs):
        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError, TypeError) as err:
            # Named as ``trainer.<key>``: the Trainer argument Lightning's message mentions first.
            text = " ".join(str(err).split())
            names = [n for n in inspect.signature(Trainer.__init__).parameters if n != "self"]
            found = [(m.start(), n) for n in names if (m := re.search(rf"\b{n}\b", text))]
            if "FSDP" in text:
                text += "; on a CPU, FSDP2 runs: configs/fsdp2.yaml"
            raise ConfigError(f"trainer.{min(found)[1]}: {text}" if found else f"trainer: {text}") from None

    def after_instantiate_classes(self) -> None:
        requested, actual = str(self.run_config["trainer"].get("precision")), str(self.trainer.precision)
        if requested != actual:
            _say(f"precision: requested {requested}, running {actual} on {type(self.trainer.accelerator).__name__}; "
                 f"the run is recorded as {actual}")


def cli_main(args: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0, 2 for a configuration error, 1 for a diverged run or a full disk)."""
    try:
        argv = sys.argv[1:] if args is None else list(args)
        # Lightning's --optimizer/--lr_scheduler would replace the model's own optimizer and schedule.
        generic = [flag for flag in (a.split("=", 1)[0] for a in argv) if flag in ("--optimizer", "--lr_scheduler")]
        if generic:
            raise ConfigError(f"{generic[0][2:]}: not used here; choose the optimizer with --model.optimizer (sgd, "
                              "adamw) and --model.optimizer_impl, the schedule with --model.scheduler (none, cosine, "
                              "onecycle)")
        argv = resolve_config_args(argv)
        if args is None:  # LightningCLI warns when given args beside a non-empty sys.argv
            sys.argv[1:], argv = argv, None
        subcommand = {"default_config_files": [str(BASE_CONFIG)], "exit_on_error": False}
        ModelwrightCLI(
            ImageClassifier,
            ImageDataModule,
            parser_kwargs={"exit_on_error": False, "fit": subcommand, "validate": subcommand, "test": subcommand},
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,  # the model builds its own: one way to choose an optimizer
            args=argv,
        )
    # FloatingPointError: callbacks.fault_tolerance.NonFiniteLossError, the run diverged. A full disk or quota: the
    # run's record says so too, where it could be written.
    except (ConfigError, argparse.ArgumentError, FloatingPointError, OSError) as err:
        if os.environ.get("MODELWRIGHT_DEBUG") == "1" or (
            isinstance(err, OSError) and err.errno not in (errno.ENOSPC, errno.EDQUOT)
        ):
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2 if isinstance(err, (ConfigError, argparse.ArgumentError)) else 1
    return 0
