"""The command line: LightningCLI over :class:`ImageClassifier` and :class:`ImageDataModule`.

To run: ``uv run main.py fit --config configs/amp.yaml`` (``configs/base.yaml`` is always loaded first).
Added to a plain LightningCLI: every input checked before any work (modelwright.train.checks, .checkpoints),
with Lightning's start-up lines held until then; ``--ckpt_path last`` resolution; a log line for a precision
the Trainer changed (``16-mixed`` runs as ``bf16-mixed`` on CPU); the user's errors as one line on stderr with
exit status 2 (``MODELWRIGHT_DEBUG=1`` shows the traceback). :func:`resolved_config` is the config a run would
see, by the same parser, without running anything.
"""

import argparse
import errno
import inspect
import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonargparse.typing import PositiveInt
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch import cli as lightning_cli
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from torch.distributed import DistStoreError

from modelwright import CONFIGS_DIR, importable_working_folder, resolve_config_args
from modelwright.errors import ConfigError, one_line, require
from modelwright.inputs import require_creatable_folder
from modelwright.record import os_error, to_jsonable
from modelwright.techniques import OPTIMIZERS
from modelwright.train._internals import HeldLogs
from modelwright.train.args import DataArgs, ImageFolderArgs, ModelArgs, from_hparams
from modelwright.train.checkpoints import (
    CONFIG_KEY,
    RunComplete,
    check_architecture,
    completed,
    find_last_checkpoint,
    read_checkpoint,
    resume_differences,
    run_of,
)
from modelwright.train.checks import check_finite, check_launch, check_run, check_trainer
from modelwright.train.data import ImageDataModule, ImageFolderDataModule
from modelwright.train.module import ImageClassifier
from modelwright.train.runtime import set_cpu_malloc

BASE_CONFIG = CONFIGS_DIR / "base.yaml"
log = logging.getLogger("modelwright")
say = rank_zero_only(log.warning)

#: Lightning's flag that refuses a callback of its kind in the list, and the kind (base.yaml lists some).
_FLAGGED_CALLBACKS = (("enable_checkpointing", "ModelCheckpoint"), ("enable_progress_bar", "ProgressBar"),
                      ("enable_model_summary", "ModelSummary"))


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


def _logger_args(trainer) -> Any:
    """The logger's ``init_args`` (``save_dir``, ``name``), or None without a configurable logger."""
    logger = trainer.get("logger")
    if not hasattr(logger, "get"):
        return None
    return logger.get("init_args")


#: The data modules whose arguments are checked before anything is built, by the dataclass of each.
_DATA_ARGS = {ImageDataModule: DataArgs, ImageFolderDataModule: ImageFolderArgs}


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_sections(config) -> None:
    """The model's and data's arguments where they are the project's classes (their dataclasses check
    themselves); a class of the user's checks its own when it is built."""
    model = to_jsonable(config["model"])
    if model.get("class_path") == class_path(ImageClassifier):
        arguments = dict(model.get("init_args") or {})
        arguments.pop("network", None)
        ModelArgs(**arguments)
    data = to_jsonable(config["data"])
    for cls, args in _DATA_ARGS.items():
        if data.get("class_path") == class_path(cls):
            from_hparams(args, data.get("init_args") or {})


def _check_config(config) -> None:
    """The parsed config, before anything is built: the trainer's values, the model's and data's, a
    multi-node launch, the log folder."""
    for section in ("trainer", "model", "data"):
        values = config[section].as_dict() if hasattr(config[section], "as_dict") else config[section]
        check_finite(section, values)
    trainer = config["trainer"]
    check_trainer(trainer)
    check_launch(trainer.get("num_nodes"))
    _check_sections(config)
    logger_args = _logger_args(trainer)
    if logger_args is not None and logger_args.get("save_dir"):
        require_creatable_folder("trainer.logger.init_args.save_dir", logger_args["save_dir"])


def _split_global_batch(config) -> None:
    """``global_batch_size`` given: ``data.batch_size`` is its share per process."""
    if config.get("global_batch_size") is None:
        return
    trainer = config["trainer"]
    devices = trainer.get("devices")
    count = len(devices) if isinstance(devices, list) else devices
    require(str(count).isdigit() and int(count) > 0, f"global_batch_size: needs trainer.devices as a number "
            f"of processes, not {devices!r}")
    count = int(count)
    processes = count * trainer.get("num_nodes", 1)
    batch = config["global_batch_size"]
    require(batch % processes == 0, f"global_batch_size: {batch} is not a multiple of the {processes} "
            f"processes (trainer.devices {count} × trainer.num_nodes {trainer.get('num_nodes', 1)})")
    data = config["data"].get("init_args") or config["data"]
    require("batch_size" in data, "global_batch_size: the data module has no batch_size to set")
    data["batch_size"] = batch // processes


def _log_root(config) -> Path | None:
    """The logger's folder of runs, ``<save_dir>/<name>``; None without a logger that has one."""
    logger_args = _logger_args(config["trainer"])
    if logger_args is None or not logger_args.get("save_dir"):
        return None
    return Path(logger_args["save_dir"]) / (logger_args.get("name") or "")


def _resolve_last(config, resolved: dict) -> tuple[str | None, Path | None]:
    """``ckpt_path: last`` becomes the newest checkpoint of the latest run of this job (``resolved``) that
    wrote one, or None (a fresh start): in the folder of the job's run that wrote none, if that is the latest.
    Returns how the checkpoint was found, for the lines about it, and a run folder to start afresh in."""
    root = _log_root(config)
    require(root is not None, "ckpt_path: 'last' is the newest checkpoint of the logger's runs "
            "(<save_dir>/<name>/version_N); with trainer.logger false there are none: name a checkpoint file")
    last = find_last_checkpoint(root, resolved)
    config["ckpt_path"] = None if last.path is None else str(last.path)
    passed_over = ""
    if last.skipped:
        passed_over = f" ({', '.join(run.name for run in last.skipped)} of {root} wrote no checkpoint)"
    if last.run is None:
        say(f"ckpt_path: 'last', but no run under {root} has a checkpoint; starting from the beginning")
        return None, None
    if last.path is None:
        say(f"ckpt_path: 'last' is {last.run}, a run of this job that wrote no checkpoint; starting it "
            f"afresh there{passed_over}")
        return None, last.run
    found = f"'last' is {last.path}{passed_over}"
    if last.skipped:
        say(f"ckpt_path: {found}; resuming it")
    return found, None


def _continue_in(config, run: Path, purge_step: int) -> None:
    """The fit goes on in its run's own folder (one run in TensorBoard, the same checkpoint folder): the
    logger's version set to it, unless the config sets one, and the events the run logged from
    ``purge_step`` on hidden (this fit logs them again)."""
    logger_args = _logger_args(config["trainer"])
    if "version" not in logger_args or logger_args["version"] is not None:
        return
    logger_args["version"] = int(run.name.removeprefix("version_"))
    if "purge_step" in logger_args:  # TensorBoard's
        logger_args["purge_step"] = purge_step


@rank_zero_only
def _keep_earlier_record(run: Path) -> None:
    """A run continued in its folder keeps the record of its earlier part: ``record.json`` becomes
    ``record.1.json`` (the next free number) before the fit writes its own."""
    record = run / "record.json"
    if not record.is_file():
        return
    number = 1
    while (run / f"record.{number}.json").exists():
        number += 1
    record.rename(run / f"record.{number}.json")


def _check_resume(config, resolved: dict, subcommand: str, found: str | None) -> dict:
    """The checkpoint to resume from (``found``: how ``last`` found it): a Lightning checkpoint of this
    model, of a fit not yet complete under this run's limits (else :class:`RunComplete`), with the arguments
    of its run except those that may change on resume (or ``--allow_resume_changes true``). Returns the
    checkpoint (its tensors not loaded)."""
    path = config["ckpt_path"]
    named = found or path
    checkpoint = read_checkpoint(path)
    check_architecture(checkpoint, to_jsonable(config["model"]), path)
    if subcommand != "fit":  # validate, test: a finished fit's checkpoint is what they take
        return checkpoint
    done = completed(checkpoint, config["trainer"])
    if done:
        raise RunComplete(f"ckpt_path: {named}, of a finished fit ({done}): nothing to resume; raise "
                          "trainer.max_epochs or trainer.max_steps to train on")
    if config.get("allow_resume_changes"):
        return checkpoint
    differences = resume_differences(checkpoint, resolved, path)
    require(not differences, f"ckpt_path: {named}, whose run had other arguments: {'; '.join(differences)}; "
            "resume with the run's, or pass --allow_resume_changes true to resume with these")
    return checkpoint


def _first_mentioned(text: str, words: Mapping[str, str]) -> str | None:
    """The key of ``words`` whose word comes first in ``text``, or None."""
    found = []
    for key, word in words.items():
        match = re.search(rf"\b{re.escape(word)}\b", text)
        if match:
            found.append((match.start(), key))
    return min(found)[1] if found else None


def _trainer_error(err: Exception, given: Mapping) -> ConfigError:
    """Lightning's refusal of a Trainer argument, named as ``trainer.<key>``: the argument its message
    mentions first, else the one whose value it names (``--trainer.accelerator gpu`` without a GPU: "No
    supported gpu backend found!")."""
    text = " ".join(str(err).split())
    names = [name for name in inspect.signature(Trainer.__init__).parameters if name != "self"]
    key = _first_mentioned(text, {name: name for name in names})
    if key is None:
        values = {name: value for name, value in given.items() if isinstance(value, str) and value.strip()}
        key = _first_mentioned(text, values)
    if "FSDP" in text:
        text += "; on a CPU, FSDP2 runs: configs/fsdp2.yaml"
    if key is None:
        return ConfigError(f"trainer: {text}")
    return ConfigError(f"trainer.{key}: {text}")


class SaveConfigCallback(lightning_cli.SaveConfigCallback):
    """LightningCLI's, which also puts the run's resolved config into each checkpoint (``CONFIG_KEY``): a
    checkpoint copied out of its run's folder is still compared with the arguments it was trained under."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        checkpoint[CONFIG_KEY] = yaml.safe_load(self.parser.dump(self.config, skip_none=False))


def _cli_kwargs() -> dict:
    """How the project builds its LightningCLI, for a run and for :func:`resolved_config` alike (fresh each
    time: LightningCLI writes into its parser arguments)."""
    # allow_abbrev: --trainer.max_epoch would be taken for --trainer.max_epochs, a typo accepted unseen
    subcommand = {"default_config_files": [str(BASE_CONFIG)], "exit_on_error": False, "allow_abbrev": False}
    return {
        # Any LightningModule and LightningDataModule by class path; configs/base.yaml names the project's.
        "model_class": LightningModule,
        "datamodule_class": LightningDataModule,
        "subclass_mode_model": True,
        "subclass_mode_data": True,
        "parser_kwargs": {"exit_on_error": False, "allow_abbrev": False, "fit": subcommand,
                          "validate": subcommand, "test": subcommand},
        "save_config_callback": SaveConfigCallback,
        "save_config_kwargs": {"overwrite": True},
        "auto_configure_optimizers": False,  # the model builds its own: one way to choose an optimizer
    }


def _named_subcommand(args: Any, run: bool) -> str | None:
    """The subcommand (``fit``, ...) that ``args`` begin with, if they are a list that does."""
    if not run or not isinstance(args, list) or not args:
        return None
    first = args[0]
    return first if first in LightningCLI.subcommands() else None


def _without_other_subcommands(parser_kwargs: dict, named: str) -> dict:
    """``parser_kwargs`` less the parser arguments of the subcommands other than ``named``."""
    others = set(LightningCLI.subcommands()) - {named}
    return {key: value for key, value in parser_kwargs.items() if key not in others}


class ModelwrightCLI(LightningCLI):
    """LightningCLI with the project's defaults, input checks, ``last`` resolution and precision report.
    Lightning's start-up lines are held until the run is known to be valid (``startup_logs``)."""

    def __init__(self, *args: Any, startup_logs: HeldLogs | None = None, **kwargs: Any) -> None:
        self.startup_logs = startup_logs or HeldLogs()
        named = _named_subcommand(kwargs.get("args"), kwargs.get("run", True))
        self.named_subcommand = named
        if named is not None and "parser_kwargs" in kwargs:
            kwargs["parser_kwargs"] = _without_other_subcommands(kwargs["parser_kwargs"], named)
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:
        """Lightning's subcommands, or only the one the arguments begin with: each subcommand's parser takes
        0.04 s to build, and a run or a resolved config needs one of the four (``--help`` before any still
        lists them all)."""
        every = LightningCLI.subcommands()
        if self.named_subcommand is None:
            return every
        return {self.named_subcommand: every[self.named_subcommand]}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--cpu_malloc", type=Literal["retain", "system"], default="retain",
            help="glibc malloc: retain freed memory for the next step (fewer page faults) or leave it as it "
                 "is.",
        )
        # SUPPRESS: in a config only where given, so that the study's config hashes stay as they were
        parser.add_argument(
            "--allow_resume_changes", type=bool, default=argparse.SUPPRESS,
            help="with --ckpt_path: resume although arguments other than those that may change on resume "
                 "(modelwright.train.checkpoints.MAY_CHANGE_ON_RESUME) differ from the checkpoint's run.",
        )
        parser.add_argument(
            "--global_batch_size", type=PositiveInt, default=argparse.SUPPRESS,
            help="the samples of one step's forward passes over all processes: data.batch_size becomes it ÷ "
                 "(trainer.devices × trainer.num_nodes). Unset: data.batch_size is per process, and more "
                 "processes make a larger batch.",
        )

    @property
    def run_config(self):
        """The subcommand's config (``fit``, ...), or the whole config with ``run=False``."""
        subcommand = self.config.get("subcommand")
        if subcommand:
            return self.config[subcommand]
        return self.config

    def parse_arguments(self, parser, args) -> None:
        self.startup_logs.hold()
        # LightningCLI's own, less its warning that ``args`` were given beside a non-empty ``sys.argv``: the
        # project always gives them (cli_main takes them from sys.argv).
        self.config = parser.parse_args(args)
        config = self.run_config
        _check_config(config)
        _split_global_batch(config)
        self.continued_run = None
        if config.get("ckpt_path"):
            self._resume(parser, config)
        self.model_as_given = config["model"].clone()

    def _resume(self, parser, config) -> None:
        """``ckpt_path`` resolved and checked; a fit that continues a run of the logger's goes on in its
        folder."""
        subcommand = self.config.get("subcommand") or "fit"
        dumped = yaml.safe_load(parser.dump(self.config, skip_unset=False))
        resolved = dumped.get(subcommand, dumped)
        found = None
        if config["ckpt_path"] == "last":
            found, self.continued_run = _resolve_last(config, resolved)
        purge_step = 0
        if config["ckpt_path"]:
            checkpoint = _check_resume(config, resolved, subcommand, found)
            self.continued_run = run_of(Path(config["ckpt_path"]), _log_root(config) or Path("."))
            purge_step = int(checkpoint.get("global_step", 0)) + 1
        if subcommand != "fit":
            self.continued_run = None
        if self.continued_run is not None:
            _continue_in(config, self.continued_run, purge_step)

    def before_instantiate_classes(self) -> None:  # not when parsing: --print_config changes nothing
        config = self.run_config
        # LightningCLI has put the checkpoint's model arguments over the config's: equal, unless
        # --allow_resume_changes let them differ, and then the config's are the ones asked for.
        config["model"] = self.model_as_given
        set_cpu_malloc(config["cpu_malloc"])
        _drop_flagged_callbacks(config["trainer"])

    def instantiate_trainer(self, **kwargs):
        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError, TypeError) as err:
            raise _trainer_error(err, to_jsonable(self.run_config["trainer"])) from None

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ConfigError:
            raise
        except (TypeError, ValueError, RuntimeError, ImportError, AttributeError, OSError) as err:
            if isinstance(err, (MisconfigurationException, DistStoreError)):
                raise
            # the user's own class refused its arguments, or failed to build
            raise ConfigError(f"model/data: building the config's classes failed: {one_line(err)}") from err

    def after_instantiate_classes(self) -> None:
        config = self.run_config
        check_data(self.model, self.datamodule)
        if isinstance(self.datamodule, ImageDataModule) and self.trainer.local_rank == 0:
            self.datamodule.prepare_data()  # a download that fails leaves no run folder
        if self.continued_run is not None:
            _keep_earlier_record(self.continued_run)
        # Now that the Trainer knows how many processes there are: a run that would train nothing.
        data_args = getattr(self.datamodule, "args", None)
        if self.subcommand in (None, "fit") and isinstance(data_args, (DataArgs, ImageFolderArgs)):
            check_run(config["trainer"], data_args, self.trainer.world_size, loop="lightning")
        requested = str(config["trainer"].get("precision"))
        actual = str(self.trainer.precision)
        if requested != actual:
            accelerator = type(self.trainer.accelerator).__name__
            say(f"precision: requested {requested}, running {actual} on {accelerator}; the run is recorded "
                f"as {actual}")
        self.startup_logs.release()


def check_data(model: LightningModule, datamodule: LightningDataModule | None) -> None:
    """The project's classifier against the data's classes and image shape, before any work."""
    if isinstance(model, ImageClassifier):
        model.check_data(getattr(datamodule, "num_classes", None), getattr(datamodule, "input_shape", None))


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
    startup_logs = HeldLogs()
    try:
        with startup_logs.dropped_unless_released():
            _ParseOnly(**_cli_kwargs(), args=resolve_config_args(args), startup_logs=startup_logs)
    except _Parsed as parsed:
        return parsed.config
    except argparse.ArgumentError as err:
        raise ConfigError(one_line(err)) from None
    raise AssertionError("_ParseOnly returned without a config")


@dataclass
class Job:
    """A training job as ``main.py fit`` would build it: the resolved config (JSON-ready), the LightningModule
    and the LightningDataModule, instantiated after seeding, checked, and no Trainer."""

    config: dict
    model: LightningModule
    datamodule: LightningDataModule | None


#: An argument a tool adds to the job's: its type, default and help.
Extra = tuple[Any, Any, str]


class _JobOnly(ModelwrightCLI):
    """ModelwrightCLI that builds the model and the data (seeded as a fit seeds them) and stops there; with
    arguments of the calling tool's own (``extra``)."""

    def __init__(self, *args: Any, extra: dict[str, Extra] | None = None, **kwargs: Any) -> None:
        self.extra = extra or {}
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        for name, (kind, default, text) in self.extra.items():
            parser.add_argument(f"--{name}", type=kind, default=default, help=text)

    def instantiate_trainer(self, **kwargs):
        return None

    def after_instantiate_classes(self) -> None:
        check_data(self.model, self.datamodule)  # Lightning's start-up lines ("Seed set to 0") are dropped


def build_job(args: list[str], extra: dict[str, Extra] | None = None) -> Job:
    """The job ``main.py fit ARGS`` would train (``--config`` files, ``--key=value`` flags), built in this
    process; a refusal is its one-line :class:`ConfigError`."""
    kwargs = _cli_kwargs()
    kwargs["parser_kwargs"] = kwargs["parser_kwargs"]["fit"]
    startup_logs = HeldLogs()
    try:
        with startup_logs.dropped_unless_released():
            cli = _JobOnly(**kwargs, args=resolve_config_args(args), run=False, startup_logs=startup_logs,
                           extra=extra)
    except argparse.ArgumentError as err:
        raise ConfigError(one_line(err)) from None
    config = yaml.safe_load(cli.parser.dump(cli.config, skip_unset=False))
    return Job(config, cli.model, cli.datamodule)


def _generic_optimizer_flag(argv: list[str]) -> None:
    """Lightning's --optimizer/--lr_scheduler would replace the model's own optimizer and schedule."""
    flags = [arg.split("=", 1)[0] for arg in argv]
    generic = [flag for flag in flags if flag.split(".", 1)[0] in ("--optimizer", "--lr_scheduler")]
    if generic:
        raise ConfigError(f"{generic[0][2:]}: not used here; the learning rate is --model.lr, the optimizer "
                          f"--model.optimizer ({', '.join(OPTIMIZERS)}) and --model.optimizer_impl, the "
                          "schedule --model.scheduler (none, cosine, onecycle)")


def _message(err: Exception) -> str:
    """The one line for a user's error, or a run's known end."""
    if isinstance(err, DistStoreError):  # peers that never came: the strategy's timeout ran out
        return (f"trainer.num_nodes: the job's processes did not all meet in time ({one_line(err)}); the "
                "wait is trainer.strategy's timeout (Lightning's default 30 min, configs/ddp.yaml 10 min)")
    cause = os_error(err)
    # a full disk, wrapped by its writer; a ConfigError raised while handling an OSError says it better
    if cause is not None and not isinstance(err, (OSError, ConfigError)):
        return one_line(cause)
    return one_line(err)


def _exit_status(err: Exception) -> int | None:
    """The exit status of an error that is the user's to fix (2) or a run's known end (1: diverged, a full
    disk), said in one line; None for a bug, which keeps its traceback."""
    if isinstance(err, (ConfigError, argparse.ArgumentError)):
        return 2
    # FloatingPointError: callbacks.fault_tolerance.NonFiniteLossError, the run diverged; DistStoreError: the
    # other processes never came. A full disk or quota: the run's record says so too, where it could be
    # written.
    if isinstance(err, (FloatingPointError, DistStoreError)):
        return 1
    cause = os_error(err)
    if cause is not None and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return 1
    return None


def cli_main(args: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0, 2 for a configuration error, 1 for a diverged run or a
    full disk)."""
    argv = sys.argv[1:] if args is None else list(args)
    importable_working_folder()
    startup_logs = HeldLogs()
    try:
        with startup_logs.dropped_unless_released():  # a refused run prints none of Lightning's start-up
            _generic_optimizer_flag(argv)
            ModelwrightCLI(**_cli_kwargs(), args=resolve_config_args(argv), startup_logs=startup_logs)
    except RunComplete as complete:  # a requeued job of a finished run: done, no new version
        print(complete, file=sys.stderr)
        return 0
    except Exception as err:
        status = _exit_status(err)
        if status is None or os.environ.get("MODELWRIGHT_DEBUG") == "1":
            raise
        print(f"error: {_message(err)}", file=sys.stderr)
        return status
    return 0
