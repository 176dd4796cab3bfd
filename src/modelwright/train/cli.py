"""The command line: LightningCLI over :class:`ImageClassifier` and :class:`ImageDataModule`.

To run: ``uv run main.py fit --config configs/amp.yaml`` (``configs/base.yaml`` is always loaded first).

What this adds to a plain LightningCLI, and why:

* ``configs/base.yaml`` is the default config of every subcommand, so experiment files hold only deltas.
* ``--ckpt_path last`` finds the newest ``last.ckpt`` of the experiment (each config file names its runs
  with ``trainer.logger.init_args.name``: ``lightning_logs/amp/version_0``).
* A precision the Trainer changed (``16-mixed`` becomes ``bf16-mixed`` on CPU) is said in a log line.
* Errors that are the user's to fix are one line on stderr and exit status 2; ``MODELWRIGHT_DEBUG=1``
  shows the traceback.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_only

from modelwright import CONFIGS_DIR, resolve_config_args
from modelwright.errors import ConfigError, one_line, require
from modelwright.train.data import ImageDataModule
from modelwright.train.module import ImageClassifier
from modelwright.train.runtime import set_cpu_malloc

BASE_CONFIG = CONFIGS_DIR / "base.yaml"
log = logging.getLogger("modelwright")


def _logger_init_args(trainer_cfg) -> dict | None:
    logger = trainer_cfg.get("logger")
    if logger is None or isinstance(logger, bool) or "init_args" not in logger:
        return None
    return logger["init_args"]


def find_last_checkpoint(log_root: Path) -> Path | None:
    """The newest loadable ``last*.ckpt`` of the latest run (the highest ``version_N``) under ``log_root``.

    Never an older run's without saying so: when the latest run has none (killed before its first checkpoint), the
    error names the newest older candidate, to be passed explicitly. ``None`` when no run has one: as with
    Lightning's own ``ckpt_path="last"``, a job relaunched with ``--ckpt_path last`` may start before any checkpoint.
    """
    def number(folder: Path) -> int:
        tail = folder.name.removeprefix("version_")
        return int(tail) if tail.isdigit() else -1

    runs = sorted((p for p in log_root.glob("version_*") if p.is_dir()), key=number, reverse=True)
    for i, run in enumerate(runs):
        found = sorted((c for c in run.glob("checkpoints/last*.ckpt") if _loadable(c)), key=lambda c: c.stat().st_mtime)
        if found and i == 0:
            return found[-1]
        if found:
            raise ConfigError(
                f"ckpt_path: 'last', but the latest run {runs[0]} has no loadable checkpoint; the newest older one is "
                f"{found[-1]} (pass it as --ckpt_path to resume that run)"
            )
    return None


def _loadable(path: Path) -> bool:
    """A checkpoint file that is a whole zip archive (a write cut short or a full disk leaves one that is not)."""
    try:
        return path.is_dir() or (path.stat().st_size > 0 and zipfile.is_zipfile(path))
    except OSError:
        return False


def check_no_generic_optimizer(argv: list[str]) -> None:
    """Lightning's ``--optimizer``/``--lr_scheduler`` would replace the model's own optimizer and schedule."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in ("--optimizer", "--lr_scheduler"):
            raise ConfigError(
                f"{flag.lstrip('-')}: not used here; choose the optimizer with --model.optimizer (sgd, adamw) and "
                "--model.optimizer_impl, the schedule with --model.scheduler (none, cosine, onecycle)"
            )


def trainer_error(err: BaseException) -> str:
    """Lightning's refusal of a Trainer value as ``trainer.<key>: problem`` (the key the message names first)."""
    import inspect

    from lightning.pytorch import Trainer

    text = " ".join(str(err).split())
    names = [n for n in inspect.signature(Trainer.__init__).parameters if n != "self"]
    found = [(m.start(), n) for n in names if (m := re.search(rf"\b{n}\b", text))]
    key = f"trainer.{min(found)[1]}" if found else "trainer"
    return f"{key}: {text}"


def check_writable_dir(path: Path, key: str) -> None:
    """Raise unless ``path`` is, or can be created as, a folder this process may write in."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}: cannot create {path}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot write in {existing}")


def check_checkpoint(path: Path) -> None:
    """Raise unless ``path`` is a PyTorch checkpoint file (a zip archive) or a distributed-checkpoint folder."""
    if path.is_dir():
        return
    if not path.is_file():
        raise ConfigError(f"ckpt_path: no checkpoint at {path}")
    if not _loadable(path):
        raise ConfigError(f"ckpt_path: {path} is not a PyTorch checkpoint (truncated or corrupted?)")


def _check_trainer_values(trainer_cfg) -> None:
    """Values Lightning's Trainer accepts but that break training or say nothing sensible."""
    clip = trainer_cfg.get("gradient_clip_val")
    require(clip is None or clip >= 0, f"trainer.gradient_clip_val: must be >= 0 or null, got {clip}")
    for key in ("check_val_every_n_epoch", "log_every_n_steps", "val_check_interval"):
        value = trainer_cfg.get(key)
        require(value is None or value > 0, f"trainer.{key}: must be positive or null, got {value}")
    low = trainer_cfg.get("min_epochs")
    require(low is None or low >= 0, f"trainer.min_epochs: must be >= 0 or null, got {low}")


def _check_strategy(trainer_cfg) -> None:
    """Lightning's FSDPStrategy raises a ValueError deep inside on CPU: say what to use instead."""
    name = _class_path(trainer_cfg.get("strategy"))
    if not (name.startswith("fsdp") or name.endswith("FSDPStrategy")):
        return
    accelerator = str(trainer_cfg.get("accelerator"))
    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
        raise ConfigError(
            f"trainer.strategy: {name} needs CUDA GPUs; on CPU use configs/fsdp2.yaml "
            "(FSDP2 through ModelParallelStrategy), which shards the same way"
        )


def add_cpu_malloc_argument(parser) -> None:
    """The top-level ``cpu_malloc`` key (``retain`` or ``system``; :func:`modelwright.train.runtime.set_cpu_malloc`)."""
    parser.add_argument(
        "--cpu_malloc", type=Literal["retain", "system"], default="retain",
        help="glibc malloc: retain freed memory for the next step (fewer page faults) or leave it as it is.",
    )


def _drop_disabled_callbacks(trainer_cfg) -> None:
    """``enable_checkpointing: false`` / ``enable_progress_bar: false`` drop the config's callbacks of that kind.

    Lightning refuses either flag beside a callback of its kind, with a traceback; base.yaml lists ModelCheckpoint
    and progress-bar callbacks, so without this a user could not switch them off with the one flag made for it.
    """
    callbacks = trainer_cfg.get("callbacks") or []
    kinds = {"enable_checkpointing": "ModelCheckpoint", "enable_progress_bar": "ProgressBar",
             "enable_model_summary": "ModelSummary"}
    for flag, kind in kinds.items():
        kept = [cb for cb in callbacks if not _class_path(cb).endswith(kind)]
        if trainer_cfg.get(flag) is False and len(kept) != len(callbacks):
            _say(f"trainer.{flag}: false; {len(callbacks) - len(kept)} {kind} callback(s) of the config dropped")
            callbacks = trainer_cfg["callbacks"] = kept


def _class_path(spec) -> str:
    """The class path of a callback or strategy as the config gives it: a string or a ``class_path`` entry."""
    if isinstance(spec, str):
        return spec
    getter = getattr(spec, "get", None)
    return str((getter("class_path") if getter else getattr(spec, "class_path", None)) or "")


class ModelwrightCLI(LightningCLI):
    """LightningCLI with the project's defaults, input checks, ``last`` resolution and precision report."""

    def add_arguments_to_parser(self, parser) -> None:
        add_cpu_malloc_argument(parser)

    @property
    def run_config(self):
        """The config of the run: the subcommand's (``fit``, ...), or the whole config with ``run=False``."""
        sub = self.config.get("subcommand")
        return self.config[sub] if sub else self.config

    def before_instantiate_classes(self) -> None:
        set_cpu_malloc(self.run_config["cpu_malloc"])

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        cfg = self.run_config
        trainer = cfg["trainer"]
        accumulate = trainer.get("accumulate_grad_batches")
        require(
            isinstance(accumulate, int) and accumulate >= 1,
            f"trainer.accumulate_grad_batches: must be an integer >= 1, got {accumulate}",
        )
        _check_trainer_values(trainer)
        _check_strategy(trainer)
        _drop_disabled_callbacks(trainer)
        init_args = _logger_init_args(trainer)
        if init_args is not None and init_args.get("save_dir"):
            check_writable_dir(Path(init_args["save_dir"]), "trainer.logger.init_args.save_dir")
        if cfg.get("ckpt_path") == "last" and init_args is not None:
            root = Path(init_args["save_dir"]) / (init_args.get("name") or "")
            found = find_last_checkpoint(root)
            if found is None:
                _say(f"ckpt_path: 'last', but no run under {root} has a checkpoint; starting from the beginning")
            cfg["ckpt_path"] = None if found is None else str(found)
        if cfg.get("ckpt_path"):
            check_checkpoint(Path(cfg["ckpt_path"]))

    def instantiate_trainer(self, **kwargs):
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError, TypeError) as err:
            raise ConfigError(trainer_error(err)) from None

    def after_instantiate_classes(self) -> None:
        requested = str(self.run_config["trainer"].get("precision"))
        actual = str(self.trainer.precision)
        if requested != actual:
            _say(
                f"precision: requested {requested}, running {actual} on {type(self.trainer.accelerator).__name__}; "
                f"the run is recorded as {actual}"
            )


@rank_zero_only
def _say(message: str) -> None:
    log.warning(message)


def cli_main(args: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0, or 2 for a configuration error)."""
    debug = os.environ.get("MODELWRIGHT_DEBUG") == "1"
    try:
        argv = sys.argv[1:] if args is None else list(args)
        check_no_generic_optimizer(argv)
        argv = resolve_config_args(argv)
        if args is None:  # LightningCLI warns when given args beside a non-empty sys.argv
            sys.argv[1:], argv = argv, None
        ModelwrightCLI(
            ImageClassifier,
            ImageDataModule,
            parser_kwargs={
                "exit_on_error": False,
                **{
                    sub: {"default_config_files": [str(BASE_CONFIG)], "exit_on_error": False}
                    for sub in ("fit", "validate", "test")
                },
            },
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,  # the model builds its own: one way to choose an optimizer
            args=argv,
        )
    except (ConfigError, argparse.ArgumentError) as err:
        if debug:
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except FloatingPointError as err:  # callbacks.fault_tolerance.NonFiniteLossError: the run diverged
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a full disk or quota: the run's record says so too, where it could be written
        if debug or err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    return 0
