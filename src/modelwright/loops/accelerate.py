"""The same training as ``main.py fit``, in a plain loop driven by Hugging Face Accelerate.

To run: ``uv run python -m modelwright accelerate --config configs/amp.yaml`` (one process, CPU or GPU).
On N GPUs: ``uv run accelerate launch --num_processes N -m modelwright accelerate --config configs/ddp.yaml``;
on N CPU processes: ``uv run torchrun --nproc_per_node N -m modelwright accelerate --config configs/ddp.yaml``
(``accelerate launch --cpu --num_processes 2`` was seen to start one process only).

"The same" means the same files and the same objects:

* the parser is LightningCLI's (``configs/base.yaml`` first, then ``--config`` deltas, then ``--key value``
  overrides, checked against the same signatures), so ``--trainer.max_steps 3`` or ``--model.lr 0.01`` work
  as they do for ``main.py fit``;
* the network, loss, metrics and technique switches are :class:`ImageClassifier`'s (``configure_model``
  applies gradient checkpointing, channels_last and compile), the data is :class:`ImageDataModule`'s;
* the optimizer and schedule come from ``modelwright.train.module.build_optimizer`` / ``build_scheduler``, as in
  ``ImageClassifier.configure_optimizers``;
* the seed and the order of everything that draws from the global RNG before the first batch match
  LightningCLI's, so a one-process fp32 run reproduces the Lightning run's losses step by step;
* measurement settings come from the measurement callbacks' ``init_args`` in ``trainer.callbacks``, measured
  with the same :mod:`modelwright.measure` code, and the run record is the same schema with
  ``loop: accelerate`` (written by rank 0 to ``<save_dir>/<name>/accelerate/version_N/record.json``).

Lightning precisions map onto Accelerate's: ``32-true`` → ``no``; ``bf16-mixed`` → ``bf16``; ``16-mixed`` →
``fp16`` (``bf16`` on CPU, where float16 autocast is unavailable, said in a log line and recorded);
``bf16-true``, ``16-true``, ``64-true`` cast the model and inputs and run with ``no``.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from jsonargparse import ActionConfigFile
from lightning.fabric.utilities.seed import seed_everything
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser
from torch import nn

from callbacks.fault_tolerance import GracefulStop, NonFiniteLossError, NonFiniteLossGuard
from callbacks.flops_monitor import FlopsMonitor
from callbacks.memory_monitor import MemoryMonitor
from callbacks.run_record import RunRecord
from callbacks.step_timer import StepTimeMonitor
from modelwright.errors import ConfigError, one_line, require
from modelwright.measure import (
    AnatomyUnavailable,
    CudaEventTimer,
    MemoryAnatomy,
    StepTimer,
    channels_last_applied,
    compute_dtype,
    device_sync,
    error_status,
    hardware_info,
    is_compiled,
    mfu,
    one_line_error,
    optimizer_impl,
    peak_memory_mib,
    process_rss_peak_mib,
    reset_peak_memory,
    resolve_peak_flops,
    training_flops,
    versions,
)
from modelwright.record import METRIC_KEYS, append_record, new_record, to_jsonable, write_record
from modelwright.train.cli import BASE_CONFIG, add_cpu_malloc_argument
from modelwright.train.data import ImageDataModule
from modelwright.train.module import ImageClassifier, build_optimizer, build_scheduler
from modelwright.train.runtime import set_cpu_malloc

log = logging.getLogger("modelwright")

# Lightning's short precision names and the unified names they stand for.
_PRECISION_ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
# Unified Lightning precision → (Accelerator mixed_precision, dtype the model and inputs are cast to).
_PRECISIONS: dict[str, tuple[str, torch.dtype | None]] = {
    "32-true": ("no", None),
    "bf16-mixed": ("bf16", None),
    "16-mixed": ("fp16", None),
    "bf16-true": ("no", torch.bfloat16),
    "16-true": ("no", torch.float16),
    "64-true": ("no", torch.float64),
}
# Strategies that are plain data parallelism: the launcher starts the processes, Accelerate wraps in DDP.
_DATA_PARALLEL = {"auto", "ddp", "ddp_find_unused_parameters_false", "ddp_find_unused_parameters_true"}
# Trainer arguments this loop applies; the rest either change nothing in the training (listed next) or
# are reported as not applied when they differ from the Trainer's default.
_APPLIED = {
    "accelerator", "strategy", "devices", "num_nodes", "precision", "logger", "callbacks", "max_epochs",
    "max_steps", "limit_train_batches", "limit_val_batches", "check_val_every_n_epoch", "log_every_n_steps",
    "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm", "deterministic", "benchmark",
    "default_root_dir",
}
_NO_EFFECT = {
    "enable_progress_bar", "enable_model_summary", "enable_checkpointing", "num_sanity_val_steps",
    "inference_mode", "limit_test_batches", "limit_predict_batches", "barebones", "model_registry",
    "enable_autolog_hparams",
}


# --------------------------------------------------------------------------------------------------
# What the Lightning run would build, built without a Trainer
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrecisionPlan:
    """How a Lightning ``trainer.precision`` runs under Accelerate.

    Attributes:
        requested: the configured value, as written.
        precision: Lightning's unified name of what runs (recorded as ``techniques.precision``).
        mixed_precision: the ``Accelerator(mixed_precision=...)`` value.
        cast_dtype: dtype the model and floating inputs are cast to (``*-true`` precisions), else None.
        note: a line to log when the precision run differs from the one requested.
    """

    requested: str
    precision: str
    mixed_precision: str
    cast_dtype: torch.dtype | None
    note: str | None = None


def plan_precision(requested: str | int, device_type: str) -> PrecisionPlan:
    """Map a Lightning precision onto Accelerate on ``device_type`` (``cpu``, ``cuda``, ...).

    Raises:
        ConfigError: for a precision this loop cannot run (transformer-engine, ...).
    """
    name = _PRECISION_ALIASES.get(str(requested), str(requested))
    note = None
    if name == "16-mixed" and device_type == "cpu":
        # Accelerate would silently run fp32 here; Lightning switches to bf16-mixed, and so do we.
        note = (
            f"precision: requested {requested}, running bf16-mixed on cpu (float16 autocast needs a GPU); "
            "the run is recorded as bf16-mixed"
        )
        name = "bf16-mixed"
    if name not in _PRECISIONS:
        raise ConfigError(
            f"trainer.precision: {requested!r} is not supported by the accelerate loop; valid: "
            + ", ".join(_PRECISIONS)
        )
    mixed, cast = _PRECISIONS[name]
    return PrecisionPlan(str(requested), name, mixed, cast, note)


def estimated_stepping_batches(train_batches: int, accumulate: int, max_epochs: int, max_steps: int) -> float:
    """Optimizer steps of the whole fit, as Lightning's ``Trainer.estimated_stepping_batches`` counts them."""
    if max_epochs == -1:
        return float("inf") if max_steps == -1 else max_steps
    steps = math.ceil(train_batches / accumulate) * max(max_epochs, 1)
    return min(steps, max_steps) if max_steps != -1 else steps


def limit_batches(length: int, limit: int | float, key: str) -> int:
    """Batches used per epoch under Lightning's ``limit_*_batches`` (an int count or a float fraction)."""
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit < 0:
        raise ConfigError(f"{key}: must be an int or a fraction in [0, 1], got {limit!r}")
    if isinstance(limit, int):
        return min(length, limit)
    require(limit <= 1.0, f"{key}: a fraction must be <= 1.0, got {limit}")
    batches = int(length * limit)
    require(batches > 0 or limit == 0 or length == 0, f"{key}: {limit} of {length} batches is less than one batch")
    return batches


# --------------------------------------------------------------------------------------------------
# Configuration: LightningCLI's parser, without the Trainer
# --------------------------------------------------------------------------------------------------


def build_parser():
    """The ``fit`` parser of ``main.py`` (base config first, same signatures) plus ``--record``."""
    parser = LightningArgumentParser(
        prog="python -m modelwright accelerate",
        description="Train with Hugging Face Accelerate from the same configs as `main.py fit`.",
        default_config_files=[str(BASE_CONFIG)],
        exit_on_error=False,
    )
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="A config file; deltas over base.yaml.")
    parser.add_argument(
        "--seed_everything", type=bool | int, default=True,
        help="Seed as LightningCLI does: an int, true (a random seed, recorded) or false (no seeding).",
    )
    add_cpu_malloc_argument(parser)
    parser.add_lightning_class_args(Trainer, "trainer")
    parser.add_lightning_class_args(ImageClassifier, "model")
    parser.add_lightning_class_args(ImageDataModule, "data")
    parser.add_argument(
        "--record", type=str | None, default=None,
        help="Where to write the run record ({log_dir} and {run_id} are filled in); default: the "
        "RunRecord callback's record_path, else {log_dir}/record.json.",
    )
    parser.add_argument(
        "--records_jsonl", type=str | None, default=None,
        help="Also append the record to this .jsonl file; default: the RunRecord callback's records_jsonl.",
    )
    return parser


def _get(ns: Any, key: str, default: Any = None) -> Any:
    if ns is None:
        return default
    if isinstance(ns, Mapping):
        return ns.get(key, default)
    return getattr(ns, key, default)


def _as_dict(ns: Any) -> dict[str, Any]:
    if ns is None:
        return {}
    if hasattr(ns, "as_dict"):
        return ns.as_dict()
    return dict(ns)


def callback_args(callbacks: Any, class_name: str) -> dict[str, Any] | None:
    """``init_args`` of the first callback in ``trainer.callbacks`` whose class is named ``class_name``."""
    for cb in callbacks or []:
        path = _get(cb, "class_path") or f"{type(cb).__module__}.{type(cb).__qualname__}"
        if str(path).rsplit(".", 1)[-1] == class_name:
            return _as_dict(_get(cb, "init_args")) if _get(cb, "class_path") else dict(vars(cb))
    return None


def _strategy_name(strategy: Any) -> str:
    if isinstance(strategy, str):
        return strategy
    return str(_get(strategy, "class_path") or type(strategy).__name__)


def _check_trainer(trainer: Any) -> dict[str, Any]:
    """One-line errors for what this loop cannot run; returns the DDP keyword arguments to use."""
    accumulate = _get(trainer, "accumulate_grad_batches")
    require(
        isinstance(accumulate, int) and not isinstance(accumulate, bool) and accumulate >= 1,
        f"trainer.accumulate_grad_batches: must be an integer >= 1, got {accumulate}",
    )
    strategy = _strategy_name(_get(trainer, "strategy"))
    short = strategy.rsplit(".", 1)[-1]
    if strategy not in _DATA_PARALLEL and short != "DDPStrategy":
        raise ConfigError(
            f"trainer.strategy: {short} is not supported by the accelerate loop (data parallel only: "
            f"{', '.join(sorted(_DATA_PARALLEL))} or DDPStrategy); run it with main.py fit"
        )
    find_unused = strategy == "ddp_find_unused_parameters_true" or bool(
        _get(_get(_get(trainer, "strategy"), "init_args"), "find_unused_parameters", False)
    )
    clip_algorithm = _get(trainer, "gradient_clip_algorithm") or "norm"
    require(
        clip_algorithm in ("norm", "value"),
        f"trainer.gradient_clip_algorithm: {clip_algorithm!r}; valid: norm, value",
    )
    check_every = _get(trainer, "check_val_every_n_epoch")
    require(
        check_every is None or (isinstance(check_every, int) and check_every >= 1),
        f"trainer.check_val_every_n_epoch: must be an integer >= 1, got {check_every}",
    )
    return {"find_unused_parameters": True} if find_unused else {}


def _not_applied(trainer: Any) -> list[str]:
    """Trainer settings that differ from the Trainer's defaults and that this loop does not apply."""
    defaults = {
        name: p.default for name, p in inspect.signature(Trainer.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    out = []
    for key, value in _as_dict(trainer).items():
        if key in _APPLIED or key in _NO_EFFECT or key not in defaults:
            continue
        if value != defaults[key]:
            out.append(f"trainer.{key}={value!r}")
    return out


def _device_type(accelerator: Any) -> tuple[str, bool]:
    """The device type the run will use and whether Accelerate must be told ``cpu=True``."""
    name = accelerator if isinstance(accelerator, str) else str(_get(accelerator, "class_path", accelerator))
    if name == "cpu":
        return "cpu", True
    if name in ("gpu", "cuda"):
        require(torch.cuda.is_available(), f"trainer.accelerator: {name} but no CUDA device is available")
        return "cuda", False
    if name == "mps":
        return "mps", False
    if name != "auto":
        raise ConfigError(
            f"trainer.accelerator: {name!r} is not supported by the accelerate loop; valid: auto, cpu, gpu, cuda, mps"
        )
    if torch.cuda.is_available():
        return "cuda", False
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps", False
    return "cpu", True


def _log_root(trainer: Any) -> tuple[Path, bool]:
    """Where this loop's runs go (``<save_dir>/<name>/accelerate``) and whether to write TensorBoard events.

    Next to the Lightning runs of the same config, so one TensorBoard shows both loops.
    """
    logger = _get(trainer, "logger")
    root = Path(_get(trainer, "default_root_dir") or ".")
    if logger is None or logger is False:
        return root, False
    if logger is True:
        return root / "lightning_logs" / "accelerate", True
    if isinstance(logger, list):
        logger = logger[0] if logger else None
    init = _get(logger, "init_args")
    save_dir = _get(init, "save_dir") or root
    name = _get(init, "name")
    name = "lightning_logs" if name is None else str(name)
    tensorboard = str(_get(logger, "class_path", "")).endswith("TensorBoardLogger")
    return Path(save_dir) / name / "accelerate", tensorboard


def _next_version(root: Path) -> Path:
    versions = [int(p.name.split("_", 1)[1]) for p in root.glob("version_*") if p.name.split("_", 1)[1].isdigit()]
    return root / f"version_{max(versions, default=-1) + 1}"


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def _or(value: Any, default: Any) -> Any:
    """``value``, or ``default`` where the Trainer takes None to mean its default."""
    return default if value is None else value


def _say(accelerator: Any, message: str) -> None:
    if accelerator is None or accelerator.is_main_process:
        log.warning(message)


def _cast_inputs(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return x.to(dtype) if dtype is not None and x.is_floating_point() else x


def _scalar(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item())
    return float(value)


def _clip(accelerator: Any, params: list[nn.Parameter], value: float | None, algorithm: str) -> None:
    if not value:
        return
    if algorithm == "value":
        accelerator.clip_grad_value_(params, value)
    else:
        accelerator.clip_grad_norm_(params, value)


@torch.no_grad()
def _validate(model, module, loader, num_batches: int, accelerator, cast_dtype) -> dict[str, float | None]:
    """Mean validation loss (weighted by batch size, averaged over processes) and the epoch accuracy."""
    model.eval()
    total = torch.zeros((), device=accelerator.device)
    count = torch.zeros((), device=accelerator.device)
    for i, (x, y) in enumerate(loader):
        if i >= num_batches:
            break
        logits = model(_cast_inputs(x, cast_dtype))
        loss = F.cross_entropy(logits, y, label_smoothing=module.hparams.label_smoothing)
        module.val_acc.update(logits, y)
        total += loss.float() * len(y)
        count += len(y)
    model.train()
    if count.item() == 0:
        return {"val/loss": None, "val/acc": None}
    loss = accelerator.reduce(total / count, reduction="mean")
    acc = module.val_acc.compute()  # torchmetrics syncs its counts across processes here
    module.val_acc.reset()
    return {"val/loss": _scalar(loss), "val/acc": _scalar(acc)}


def train(cfg: Any, parser: Any = None) -> dict[str, Any]:
    """Run one fit as configured (a namespace from :func:`build_parser`, which ``parser`` is); returns the record.

    Rank 0 writes the record (and TensorBoard events, and the resolved ``config.yaml``) under the log
    directory; every rank returns it. A fit that raises still writes a record before the exception
    propagates: ``diverged`` (``NonFiniteLossError`` from the guard), ``interrupted`` (SIGTERM with
    ``GracefulStop`` configured: ``SystemExit`` with its exit code, after the current step), ``oom`` or ``failed``.
    """
    t = cfg.trainer
    ddp_kwargs = _check_trainer(t)
    device_type, cpu = _device_type(t.accelerator)
    plan = plan_precision(t.precision, device_type)
    cbs = _Callbacks.from_config(t.callbacks, cfg)
    log_root, tensorboard = _log_root(t)
    set_cpu_malloc(cfg.cpu_malloc)

    # LightningCLI's order: seed, then the model (its initialisation draws from the global RNG), then the data.
    if cfg.seed_everything is not False:
        cfg.seed_everything = seed_everything(None if cfg.seed_everything is True else cfg.seed_everything,
                                              workers=True)
    module = ImageClassifier(**_as_dict(cfg.model))
    datamodule = ImageDataModule(**_as_dict(cfg.data))

    accelerator = Accelerator(
        cpu=cpu,
        # ResumableRandomSampler draws each pass's seed from the global torch RNG: the same on every process.
        rng_types=["torch", "generator"],
        mixed_precision=plan.mixed_precision,
        gradient_accumulation_steps=t.accumulate_grad_batches,
        kwargs_handlers=[DistributedDataParallelKwargs(**ddp_kwargs)] if ddp_kwargs else None,
        log_with="tensorboard" if tensorboard else None,
        project_dir=str(log_root),
    )
    run = _Run(cfg, parser or build_parser(), plan, cbs, accelerator, module, datamodule, log_root)
    on_sigterm = cbs.stop is not None and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, run._on_sigterm) if on_sigterm else None
    try:
        run.fit()
    except ConfigError:
        raise
    except NonFiniteLossError as err:
        run.finish("diverged", str(err))
        raise
    except BaseException as err:
        if run.sigterm:
            run.finish("interrupted", f"SIGTERM: stopped at the end of step {run.global_step}")
        else:
            run.finish(error_status(err), one_line_error(err))
        raise
    finally:
        if on_sigterm:
            signal.signal(signal.SIGTERM, previous)
        accelerator.end_training()
    loss = run.metrics.get("train/loss")
    if loss is not None and not math.isfinite(loss):
        return run.finish("diverged", f"train/loss is {loss} at step {run.global_step}")
    return run.finish("ok", None)


# Callbacks of trainer.callbacks this loop carries out itself (by class name); others are named in a log line.
_APPLIED_CALLBACKS = {
    "StepTimeMonitor", "MemoryMonitor", "FlopsMonitor", "RunRecord", "LearningRateMonitor", "NonFiniteLossGuard",
    "GracefulStop",
    "ThrottledProgressBar",  # this loop draws no progress bar: nothing to carry out
}


@dataclass
class _Callbacks:
    """What the callbacks in ``trainer.callbacks`` ask for, built by their own constructors (which check their
    arguments); an absent callback is None: not measured, not guarded."""

    timer: StepTimeMonitor | None
    memory: MemoryMonitor | None
    flops: FlopsMonitor | None
    record: RunRecord | None
    guard: NonFiniteLossGuard | None
    stop: GracefulStop | None
    lr_monitor: bool
    not_applied: list[str]

    @classmethod
    def from_config(cls, callbacks: Any, cfg: Any) -> _Callbacks:
        def make(klass: type) -> Any:
            args = callback_args(callbacks, klass.__name__)
            if args is None:
                return None
            try:
                return klass(**args)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"trainer.callbacks: {err}") from None

        record = make(RunRecord)
        if cfg.record is not None or cfg.records_jsonl is not None:
            record = record or RunRecord()
            record.record_path = cfg.record or record.record_path
            record.records_jsonl = cfg.records_jsonl or record.records_jsonl
        names = [str(_get(cb, "class_path") or type(cb).__name__).rsplit(".", 1)[-1] for cb in callbacks or []]
        return cls(
            timer=make(StepTimeMonitor),
            memory=make(MemoryMonitor),
            flops=make(FlopsMonitor),
            record=record,
            guard=make(NonFiniteLossGuard),
            stop=make(GracefulStop),
            lr_monitor="LearningRateMonitor" in names,
            not_applied=sorted({n for n in names if n not in _APPLIED_CALLBACKS}),
        )


@dataclass
class _MicroBatch:
    finite: torch.Tensor  # bool, on the loss's device: read once per optimizer step
    loss: torch.Tensor
    step: int  # optimizer steps before this one (the first step is step 0), as NonFiniteLossGuard names it
    epoch: int
    batch_idx: int


class _Run:
    """One fit's state: the prepared objects, the step counter, what is measured and what the guards saw."""

    def __init__(self, cfg, parser, plan: PrecisionPlan, cbs: _Callbacks, accelerator, module, datamodule,
                 log_root: Path) -> None:
        self.cfg, self.parser, self.plan, self.cbs = cfg, parser, plan, cbs
        self.accelerator, self.module, self.datamodule = accelerator, module, datamodule
        self.t = cfg.trainer
        self.log_root = log_root
        self.log_dir: Path | None = None
        self.global_step = 0
        self.metrics: dict[str, float | None] = {}
        self.history: dict[str, list[list[float]]] = {}
        self.optimizer = None
        self.micro_batch_size: int | None = None
        self.steps_per_epoch: int | None = None
        self.timer = None
        self.tracker = None
        self.anatomy: dict[str, Any] = {}
        self.peaks: dict[str, float | None] = {"peak_allocated_mib": None, "peak_reserved_mib": None}
        self.flops: dict[str, Any] = {}
        self.t0 = time.perf_counter()
        self._finished: dict[str, Any] | None = None
        self.written_to: Path | None = None
        self._lr: float | None = None
        self._capture_at: int | None = None
        self._flops_step: int | None = None
        self._loss_tensor: torch.Tensor | None = None
        self._acc_tensor: torch.Tensor | None = None
        self._pending: list[_MicroBatch] = []
        self.skipped_at: list[int] = []
        self.diverged_at_step: int | None = None
        self.scaler_skipped_steps = 0
        self.sigterm = False

    # -- setup -----------------------------------------------------------------------------------

    def _setup_logging(self) -> None:
        acc = self.accelerator
        if not acc.is_main_process:
            return
        self.log_dir = _next_version(self.log_root)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if acc.log_with:
            acc.init_trackers(self.log_dir.name)
        # What ran, resolved (seed included), like LightningCLI's config.yaml beside the logs; it reruns with --config.
        (self.log_dir / "config.yaml").write_text(self.parser.dump(self.cfg))

    def fit(self) -> None:
        acc, module, t = self.accelerator, self.module, self.t
        if self.plan.note:
            _say(acc, self.plan.note)
        for item in _not_applied(t):
            _say(acc, f"{item}: not applied by the accelerate loop")
        if self.cbs.not_applied:
            _say(acc, f"trainer.callbacks: {', '.join(self.cbs.not_applied)} not applied by the accelerate loop")
        devices = t.devices
        local = int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes))
        if isinstance(devices, int) and devices != local:
            _say(acc, f"trainer.devices: {devices} in the config, {local} process(es) here (the launcher sets it)")
        if t.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=t.deterministic == "warn")
        if t.benchmark is not None and acc.device.type == "cuda":
            torch.backends.cudnn.benchmark = bool(t.benchmark)

        if acc.is_local_main_process:
            self.datamodule.prepare_data()
        acc.wait_for_everyone()
        self.datamodule.setup("fit")
        module.configure_model()
        if self.plan.cast_dtype is not None:
            module.to(self.plan.cast_dtype)
        model = acc.prepare(module)
        train_loader, val_loader = acc.prepare(self.datamodule.train_dataloader(), self.datamodule.val_dataloader())
        acc_steps = t.accumulate_grad_batches
        train_batches = limit_batches(len(train_loader), _or(t.limit_train_batches, 1.0), "trainer.limit_train_batches")
        val_batches = limit_batches(len(val_loader), _or(t.limit_val_batches, 1.0), "trainer.limit_val_batches")
        if train_batches < len(train_loader) and train_batches % acc_steps:
            # Accelerate closes a partial accumulation cycle only at the real end of the data loader.
            raise ConfigError(
                f"trainer.limit_train_batches: {train_batches} batches per epoch is not a multiple of "
                f"accumulate_grad_batches {acc_steps}, which the accelerate loop needs"
            )
        max_steps = -1 if t.max_steps is None else t.max_steps
        max_epochs = t.max_epochs if t.max_epochs is not None else (1000 if max_steps == -1 else -1)
        total = estimated_stepping_batches(train_batches, acc_steps, max_epochs, max_steps)
        params = [p for p in model.parameters() if p.requires_grad]
        hp = module.hparams
        optimizer = build_optimizer(
            params, optimizer=hp.optimizer, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay,
            optimizer_impl=hp.optimizer_impl,
        )
        # Not prepared: Accelerate would step it once per process per optimizer step; Lightning steps it once.
        steps = int(total) if math.isfinite(total) else 1
        scheduler = build_scheduler(optimizer, hp.scheduler, lr=hp.lr, total_steps=steps)
        self.optimizer = optimizer = acc.prepare(optimizer)
        self.steps_per_epoch = math.ceil(train_batches / acc_steps)
        self._setup_logging()
        self._setup_measurement()

        clip_value, clip_algorithm = t.gradient_clip_val, t.gradient_clip_algorithm or "norm"
        every = self._log_every()
        check_every = t.check_val_every_n_epoch or 1
        label_smoothing = module.hparams.label_smoothing
        cast = self.plan.cast_dtype
        guard = self.cbs.guard
        model.train()
        epoch, done = 0, False
        while not done and (max_epochs == -1 or epoch < max_epochs):
            cycle_open, batch_idx = False, -1
            for batch_idx, (x, y) in enumerate(train_loader):
                if batch_idx >= train_batches:
                    break
                if not cycle_open:
                    cycle_open = True
                    self._step_begins(x)
                elif self.tracker is not None:
                    self.tracker.next_micro_batch()
                with acc.accumulate(model):
                    logits = model(_cast_inputs(x, cast))
                    loss = F.cross_entropy(logits, y, label_smoothing=label_smoothing)
                    batch_acc = module.train_acc(logits, y)
                    if guard is not None:
                        self._pending.append(_MicroBatch(torch.isfinite(loss.detach()).all(), loss.detach(),
                                                         self.global_step, epoch, batch_idx))
                    acc.backward(loss)
                    if acc.sync_gradients:
                        if guard is not None and guard.on_nonfinite == "skip":
                            self._skip_if_nonfinite(optimizer)
                        _clip(acc, params, clip_value, clip_algorithm)
                        optimizer.step()
                        if scheduler is not None:
                            scheduler.step()
                        optimizer.zero_grad()
                if not acc.sync_gradients:
                    continue
                cycle_open = False
                self.global_step += 1
                if optimizer.step_was_skipped:  # GradScaler found inf/NaN gradients (fp16): loss-scale search
                    self.scaler_skipped_steps += 1
                self._step_ends(loss, batch_acc, every)
                if guard is not None and guard.on_nonfinite == "stop":
                    bad = self._first_nonfinite()
                    if bad is not None:
                        self._diverged(bad, "")
                if self.sigterm:
                    raise SystemExit(self.cbs.stop.exit_code)
                if max_steps != -1 and self.global_step >= max_steps:
                    done = True
                    break
            module.train_acc.reset()
            # Lightning validates at the end of an epoch, not when max_steps stops one midway.
            epoch_complete = batch_idx + 1 >= train_batches
            if epoch_complete and val_batches > 0 and (epoch + 1) % check_every == 0:
                self._validation(model, val_loader, val_batches)
            epoch += 1
        if self.timer is not None:
            self.timer.cancel()

    # -- faults (NonFiniteLossGuard, GracefulStop) -------------------------------------------------

    def _first_nonfinite(self) -> _MicroBatch | None:
        """The first micro-batch since the last check whose loss was not finite, on any process (one host read)."""
        pending, self._pending = self._pending, []
        if not pending:
            return None
        bad = (~torch.stack([mb.finite for mb in pending]).all()).float()
        if self.accelerator.num_processes > 1:  # every process takes the same decision
            bad = self.accelerator.reduce(bad, reduction="sum")
        if float(bad) == 0:
            return None
        return next((mb for mb in pending if not bool(mb.finite)), pending[0])

    def _skip_if_nonfinite(self, optimizer) -> None:
        bad = self._first_nonfinite()
        if bad is None:
            return
        optimizer.zero_grad(set_to_none=True)  # an optimizer step over no gradients changes nothing
        self.skipped_at.append(bad.step)
        limit = self.cbs.guard.max_skipped_steps
        if limit is not None and len(self.skipped_at) > limit:
            self._diverged(bad, f"; {len(self.skipped_at)} steps skipped, max_skipped_steps={limit}")

    def _diverged(self, bad: _MicroBatch, why: str) -> None:
        where = "on another rank" if bool(bad.finite) else f"{float(bad.loss.float().mean())}"
        self.diverged_at_step = bad.step
        raise NonFiniteLossError(
            f"train/loss is {where} at step {bad.step} (epoch {bad.epoch}, batch {bad.batch_idx}){why}; "
            f"stopped by NonFiniteLossGuard(on_nonfinite={self.cbs.guard.on_nonfinite})"
        )

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Like Lightning's handler: only a flag; the loop stops at the end of the current optimizer step.
        self.sigterm = True

    def _log_every(self) -> int:
        own = self.cbs.record.log_every_n_steps if self.cbs.record is not None else None
        return max(1, int(own if own is not None else _or(self.t.log_every_n_steps, 50)))

    def _setup_measurement(self) -> None:
        device = self.accelerator.device
        m = self.cbs
        if m.timer is not None:
            if device.type == "cuda" and m.timer.cuda_timing == "events":
                self.timer = CudaEventTimer(m.timer.warmup_steps, m.timer.measure_steps)
            else:
                self.timer = StepTimer(m.timer.warmup_steps, m.timer.measure_steps, sync=device_sync(device))
        if m.memory is not None and m.memory.anatomy:
            self._capture_at = m.memory.anatomy_step if m.memory.anatomy_step is not None else m.memory.warmup_steps
        if m.flops is not None:
            # Where Lightning's FlopsMonitor does it (on_train_start, before the first batch): a peak measured
            # here, not yet cached, draws from the global RNG in both loops alike.
            self._resolve_peak()

    def _resolve_peak(self) -> None:
        acc, fm = self.accelerator, self.cbs.flops
        dtype = compute_dtype(self.plan.precision)
        try:
            table = get_available_flops(acc.device, dtype)
        except Exception:  # an accelerator the table code does not handle
            table = None

        def resolve() -> None:
            try:
                peak, source = resolve_peak_flops(
                    acc.device, dtype, table_value=table, config_value=fm.peak_flops_per_s_config,
                    measure=fm.measure_peak, cache_path=fm.cache_path, matmul_size=fm.matmul_size,
                )
            except Exception as err:  # MFU is a nicety; it must not stop a run
                _say(acc, f"flops: no peak FLOP/s ({type(err).__name__}: {err})")
                peak, source = None, None
            self.flops.update(peak_flops_per_s=peak, peak_flops_source=source,
                              peak_flops_dtype=str(dtype).removeprefix("torch."))

        if not table and not fm.peak_flops_per_s_config and fm.measure_peak and acc.num_processes > 1:
            # One process per machine measures (the others would share its cores); the rest read its cache.
            if acc.is_local_main_process:
                resolve()
            acc.wait_for_everyone()
            if not acc.is_local_main_process:
                resolve()
        else:
            resolve()

    # -- per step --------------------------------------------------------------------------------

    def _step_begins(self, x: torch.Tensor) -> None:
        acc, m, step = self.accelerator, self.cbs, self.global_step
        if self.micro_batch_size is None:
            self.micro_batch_size = int(x.shape[0])
        if m.flops is not None and "flops_per_step" not in self.flops:
            self._flops_step = step
            try:
                per_micro = training_flops(self.module.net, _cast_inputs(x, self.plan.cast_dtype))
            except Exception as err:
                _say(acc, f"flops: not counted ({type(err).__name__}: {err})")
                per_micro = None
            self.flops["flops_per_micro_batch"] = per_micro
            self.flops["flops_per_step"] = per_micro * self.t.accumulate_grad_batches if per_micro else None
        if m.memory is not None and step == m.memory.warmup_steps:
            reset_peak_memory(acc.device)
        if self._capture_at is not None and step == self._capture_at and "anatomy_step" not in self.anatomy:
            tracker = MemoryAnatomy(acc.device)
            try:
                tracker.start(self.module, [self.optimizer.optimizer])
                self.tracker = tracker
            except AnatomyUnavailable as err:
                _say(acc, f"memory: no anatomy on this run: {err}")
                self._capture_at = None
        self._lr = self.optimizer.param_groups[0]["lr"]
        if self.timer is not None:
            self.timer.start()

    def _step_ends(self, loss: torch.Tensor, batch_acc: torch.Tensor, every: int) -> None:
        acc, m, index = self.accelerator, self.cbs, self.global_step - 1
        perturbed = index == self._flops_step or (self.tracker is not None)
        dt = None
        if self.timer is not None:
            measured = self.timer.in_window() and not perturbed
            self.timer.stop(exclude=perturbed)
            if measured and self.global_step % every == 0:
                dt = self.timer.durations_s[-1]
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.stop()
            self.anatomy = {"anatomy_step": index, "anatomy_mib": tracker.peak_mib(),
                            "anatomy_end_mib": tracker.end_mib()}
            if acc.device.type != "cuda" and self.anatomy["anatomy_mib"] is not None:
                self.peaks["peak_allocated_mib"] = self.anatomy["anatomy_mib"]["total"]
        if m.memory is not None and index >= m.memory.warmup_steps and (
            m.memory.measure_steps is None or index < m.memory.warmup_steps + m.memory.measure_steps
        ):
            peaks = peak_memory_mib(acc.device)
            if peaks["peak_allocated_mib"] is not None:
                self.peaks.update(peaks)
        self._loss_tensor, self._acc_tensor = loss.detach(), batch_acc
        if self.global_step % every:
            return
        scalars = {"train/loss": _scalar(loss), "train/acc": _scalar(batch_acc)}
        self.metrics.update(scalars)
        self._remember(scalars)
        if self.cbs.lr_monitor:
            scalars[self._lr_key()] = self._lr
        if dt is not None:
            scalars["perf/step_time_ms"] = dt * 1e3
        acc.log(scalars, step=self.global_step)

    def _lr_key(self) -> str:
        return f"lr-{type(self.optimizer.optimizer).__name__}"

    def _remember(self, scalars: Mapping[str, float | None]) -> None:
        if self.cbs.record is not None and not self.cbs.record.history:
            return
        for key, value in scalars.items():
            self.history.setdefault(key, []).append([self.global_step, value])

    def _validation(self, model, loader, batches: int) -> None:
        scalars = _validate(model, self.module, loader, batches, self.accelerator, self.plan.cast_dtype)
        self.metrics.update(scalars)
        self._remember(scalars)
        self.accelerator.log(scalars, step=self.global_step)

    # -- the record ------------------------------------------------------------------------------

    def finish(self, status: str, error: str | None) -> dict[str, Any]:
        """Assemble the record once and write it from rank 0; later calls return the same record."""
        if self._finished is not None:
            return self._finished
        if self.tracker is not None:  # a fit that ended inside the captured step
            tracker, self.tracker = self.tracker, None
            try:
                tracker.stop()
            except Exception:
                pass
        record = self.build(status, error)
        self._finished = record
        rec = self.cbs.record
        if self.accelerator.is_main_process and (rec is not None or self.cfg.record is not None):
            fill = {"log_dir": str(self.log_dir or self.log_root), "run_id": record["run_id"]}
            path = Path(((rec.record_path if rec else None) or "{log_dir}/record.json").format(**fill))
            try:
                self.written_to = write_record(path, record)
                if rec is not None and rec.records_jsonl:
                    append_record(Path(rec.records_jsonl.format(**fill)), record)
            except Exception as err:
                if status == "ok":
                    raise
                _say(self.accelerator, f"record: could not write the record of a {status} run: {err}")
            else:
                print(f"record: {self.written_to}", flush=True)
        return record

    def build(self, status: str, error: str | None) -> dict[str, Any]:
        acc, t, module, m = self.accelerator, self.t, self.module, self.cbs
        run_id = (m.record.run_id if m.record is not None else None) or os.environ.get("MODELWRIGHT_RUN_ID") or None
        record = new_record(run_id=run_id, loop="accelerate")
        record["status"], record["error"] = status, error
        record["config"] = to_jsonable(self.cfg)
        net = module.net
        world = acc.num_processes
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        micro = self.micro_batch_size
        accumulate = t.accumulate_grad_batches
        channels_last = channels_last_applied(net)
        record["techniques"] = {
            "model_name": module.hparams.model_name,
            "precision": self.plan.precision,
            "precision_requested": self.plan.requested,
            "accumulate_grad_batches": accumulate,
            "gradient_checkpointing": module.hparams.gradient_checkpointing,
            "checkpointed_segments": sum(1 for sub in net.modules() if "forward" in sub.__dict__),
            "optimizer": module.hparams.optimizer,
            "optimizer_impl": optimizer_impl(self.optimizer.optimizer) if self.optimizer is not None else None,
            "channels_last": channels_last if channels_last is not None else module.hparams.channels_last,
            "compile": is_compiled(net),
            "strategy": "ddp" if world > 1 else "single_device",
            "strategy_class": "DistributedDataParallel" if world > 1 else None,
            "world_size": world,
            "num_nodes": max(1, world // max(1, local)),
            "micro_batch_size": micro,
            "effective_batch_size": micro * accumulate * world if micro else None,
            "mixed_precision": acc.mixed_precision,
        }
        record["hardware"] = hardware_info(acc.device, num_devices=local)
        record["versions"] = versions()

        timing = record["timing"]
        if self.timer is not None:
            samples = micro * accumulate * world if micro else None
            timing.update(self.timer.summary(self.steps_per_epoch, samples))
        timing["wall_time_s"] = time.perf_counter() - self.t0
        median_s = timing["step_time_median_ms"] / 1e3 if timing.get("step_time_median_ms") else None
        if m.flops is not None:
            f = self.flops
            per_step = f.get("flops_per_step")
            record["flops"].update(
                flops_per_step=per_step,
                flops_per_micro_batch=f.get("flops_per_micro_batch"),
                achieved_flops_per_s=per_step / median_s if per_step and median_s else None,
                peak_flops_per_s=f.get("peak_flops_per_s"),
                peak_flops_source=f.get("peak_flops_source"),
                peak_flops_dtype=f.get("peak_flops_dtype"),
                mfu=mfu(per_step, median_s, f.get("peak_flops_per_s")),
            )
        memory = record["memory"]
        if m.memory is not None:
            peak = self.peaks["peak_allocated_mib"]
            memory.update(
                peak_allocated_mib=peak,
                peak_reserved_mib=self.peaks["peak_reserved_mib"],
                anatomy_step=self.anatomy.get("anatomy_step"),
                anatomy_mib=self.anatomy.get("anatomy_mib"),
                anatomy_end_mib=self.anatomy.get("anatomy_end_mib"),
                rss_peak_mib=process_rss_peak_mib(),
                peak_source=("cuda-allocator" if acc.device.type == "cuda" and peak is not None
                             else "mem-tracker" if peak is not None else None),
                window_warmup_steps=m.memory.warmup_steps,
            )
        memory["model_parameters"] = sum(p.numel() for p in net.parameters())

        metrics = dict(self.metrics)
        last_loss = self._loss_tensor
        if last_loss is not None:  # the last step's values, logged or not (Lightning's callback_metrics)
            metrics["train/loss"] = _scalar(last_loss)
            metrics["train/acc"] = _scalar(self._acc_tensor)
        if m.lr_monitor and self.optimizer is not None and self._lr is not None:
            metrics[self._lr_key()] = self._lr
        record["metrics"] = {**dict.fromkeys(METRIC_KEYS), **metrics}
        self.metrics = metrics
        record["history"] = {k: list(v) for k, v in self.history.items()}
        if m.guard is not None:  # NonFiniteLossGuard.summary()'s keys
            record["faults"] = {
                "on_nonfinite": m.guard.on_nonfinite,
                "diverged": self.diverged_at_step is not None,
                "diverged_at_step": self.diverged_at_step,
                "nonfinite_skipped_steps": len(self.skipped_at),
                "nonfinite_skipped_at": self.skipped_at[:100],
                "scaler_skipped_steps": self.scaler_skipped_steps if acc.mixed_precision == "fp16" else None,
            }
        return to_jsonable(record)


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def _reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide singletons so a later run in this process may use other settings.

    Only for a single process (tests and notebooks run several fits in one interpreter); Accelerate has no
    public call for it.
    """
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def main(args: list[str] | None = None) -> int:
    """Parse ``args``, train, write the record; returns the exit status (0, or 2 for a configuration error)."""
    debug = os.environ.get("MODELWRIGHT_DEBUG") == "1"
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        parser = build_parser()
        train(parser.parse_args(args), parser)
    except (ConfigError, argparse.ArgumentError) as err:
        if debug:
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    finally:
        if not distributed:
            _reset_accelerate_state()
    return 0


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s")
    sys.exit(main())
