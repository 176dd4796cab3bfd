"""A job's step rehearsed as Lightning's automatic optimization runs it, at two small micro-batches, for the
memory predictor (:mod:`modelwright.measure.rehearsal`): the job built from its resolved config as ``main.py
fit`` builds it, the precision plugin's autocast, the closure inside ``optimizer.step``, the gradients zeroed
after the first micro-batch's forward, accumulation with DDP's ``no_sync``; DDP and FSDP2 over a process group
of the run's size in this one process (a fake one: collectives move no data).

To run: ``planner.predict_peak(config)`` (the study predicts every run this way before it starts)."""

import contextlib
import copy
import functools
import json
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch.utils._pytree import tree_map

from modelwright.errors import ConfigError
from modelwright.measure.rehearsal import Rehearsal, Timeline, capture
from modelwright.record import get_path, to_jsonable
from modelwright.techniques import precision as precision_of
from modelwright.train._internals import fake_allreduce_hook, fake_process_group, set_device_mesh
from modelwright.train.cli import build_job

#: The micro-batches a step is rehearsed at: the smallest at which BatchNorm has two samples, and twice it.
MICRO_BATCHES = (2, 4)
#: The arguments of ``Trainer.fit`` a resolved ``fit`` config holds beside the job's.
FIT_ONLY = ("ckpt_path", "weights_only")
#: DDP's arguments a config's DDPStrategy may set.
DDP_KEYS = ("gradient_as_bucket_view", "bucket_cap_mb", "static_graph", "find_unused_parameters")


class NotRehearsable(ConfigError):
    """A job whose step cannot be rehearsed here (say why in one line): no prediction is made for it."""


def strategy_kind(config: Mapping) -> str:
    """``single``, ``ddp`` or ``fsdp2`` (ModelParallelStrategy), from ``trainer.strategy``."""
    strategy = get_path(config, "trainer.strategy", "auto")
    name = str(strategy.get("class_path", "") if isinstance(strategy, Mapping) else strategy).lower()
    if "modelparallel" in name:
        return "fsdp2"
    if "fsdp" in name or "deepspeed" in name:
        raise NotRehearsable(f"trainer.strategy: {name} is not rehearsed (DDP and ModelParallelStrategy are)")
    return "ddp" if "ddp" in name else "single"


def world_size(config: Mapping) -> int:
    devices = get_path(config, "trainer.devices", 1)
    count = len(devices) if isinstance(devices, list) else int(devices) if str(devices).isdigit() else 1
    return count * int(get_path(config, "trainer.num_nodes", 1) or 1)


def precision_plugin(name: str, device: torch.device) -> Precision:
    """Lightning's precision plugin for ``name`` on ``device`` (16-mixed runs as bf16-mixed on a CPU)."""
    if name.endswith("-mixed"):
        if device.type == "cpu":
            name = "bf16-mixed"
        return MixedPrecision(name, device.type)
    if name in ("bf16-true", "16-true"):
        return HalfPrecision(name)
    return DoublePrecision() if name == "64-true" else Precision()


def build_from_config(config: Mapping) -> Any:
    """The job of a resolved config, built here (seeded as a fit seeds it)."""
    runnable = {key: value for key, value in to_jsonable(config).items() if key not in FIT_ONLY}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(yaml.safe_dump(runnable, sort_keys=False), encoding="utf-8")
        return build_job(["--config", str(path)])


#: The trainer's keys a rehearsal takes from the config itself (:class:`_Setting`), not from the job it
#: builds: configs that differ in these alone (the advisor's options) share one built job.
SETTING_KEYS = ("precision", "accumulate_grad_batches")


def _built_job(config: Mapping) -> Any:
    """The job of ``config`` (:func:`build_from_config`), built once for every config that differs from it
    only in :data:`SETTING_KEYS`; a rehearsal steps deep copies of its network."""
    runnable = dict(to_jsonable(config))
    runnable["trainer"] = {key: value for key, value in (runnable.get("trainer") or {}).items()
                           if key not in SETTING_KEYS}
    return _job_of(json.dumps(runnable, sort_keys=True))


@functools.lru_cache(maxsize=4)
def _job_of(config_json: str) -> Any:
    return build_from_config(json.loads(config_json))


def _example_batch(datamodule: Any, samples: int) -> Any:
    """A training batch of the job's own data with at least ``samples`` samples (its first, repeated)."""
    require_data = datamodule is not None and hasattr(datamodule, "train_dataloader")
    if not require_data:
        raise NotRehearsable("data: the job has no data module to take a batch from")
    datamodule.prepare_data()
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    tensors = [leaf for leaf in torch.utils._pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor)]
    have = len(tensors[0])
    repeat = -(-samples // have)
    return tree_map(lambda t: t.repeat(repeat, *[1] * (t.ndim - 1)) if isinstance(t, torch.Tensor) else t,
                    batch)


def _micro_batches(batch: Any, size: int, count: int, device: torch.device, plugin: Precision) -> list:
    """``count`` micro-batches of ``size`` samples, each a tensor of its own on ``device``, as a loader gives
    them."""
    def piece(index: int) -> Any:
        def cut(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            return t[index * size:(index + 1) * size].clone().to(device)

        return plugin.convert_input(tree_map(cut, batch))

    return [piece(index) for index in range(count)]


class _TrainingStep(nn.Module):
    """What Lightning's DDP wraps: a module whose forward is the LightningModule's ``training_step``."""

    def __init__(self, module: Any) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any, batch_idx: int) -> Any:
        return self.module.training_step(batch, batch_idx)


class _Step:
    """One optimizer step of Lightning's automatic optimization over a list of micro-batches."""

    def __init__(self, module: Any, optimizer: torch.optim.Optimizer, plugin: Precision,
                 ddp: nn.Module | None) -> None:
        self.module = module
        self.optimizer = optimizer
        self.plugin = plugin
        self.ddp = ddp
        self.scaler = getattr(plugin, "scaler", None)

    def closure(self, micro: Any, index: int, count: int) -> torch.Tensor:
        with self.plugin.forward_context():
            output = (self.ddp(micro, index) if self.ddp is not None
                      else self.module.training_step(micro, index))
        loss = output if isinstance(output, torch.Tensor) else output["loss"]
        loss = loss / count  # Lightning divides by accumulate_grad_batches before backward
        if index == 0:  # Lightning zeroes the gradients after the first micro-batch's forward
            self.module.optimizer_zero_grad(0, index, self.optimizer)
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        scaled.backward()
        return loss

    def __call__(self, micro_batches: list, tracker: Any = None) -> None:
        count = len(micro_batches)
        for index, micro in enumerate(micro_batches):
            if tracker is not None and index:
                tracker.reset_mod_stats()
            if index < count - 1:
                no_sync = self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()
                with no_sync:
                    self.closure(micro, index, count)
                continue
            self._update(functools.partial(self.closure, micro, index, count), index, tracker)

    def _update(self, closure: Callable[[], torch.Tensor], index: int, tracker: Any) -> None:
        def marked() -> torch.Tensor:  # on_before_optimizer_step: where the probe marks the update
            loss = closure()
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if tracker is not None:
                tracker.update_marked = True
            return loss

        if self.scaler is None:
            self.module.optimizer_step(0, index, self.optimizer, marked)
            return
        marked()
        self.scaler.step(self.optimizer)
        self.scaler.update()


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer of what ``configure_optimizers`` returned (an optimizer, a list, a dict)."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, Mapping):
        return _first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    raise NotRehearsable("model: configure_optimizers returned no optimizer the rehearsal can step")


@contextlib.contextmanager
def _ranks(kind: str, ranks: int, device: torch.device) -> Iterator[Any]:
    """A process group of ``ranks`` in this process for DDP and FSDP2; FSDP2's device mesh."""
    if kind == "single" or ranks == 1 and kind == "ddp":
        yield None
        return
    with fake_process_group(ranks):
        mesh = None
        if kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (ranks, 1),
                                    mesh_dim_names=("data_parallel", "tensor_parallel"))
        yield mesh


def _prepared(module: Any, config: Mapping, device: torch.device, plugin: Precision, kind: str,
              mesh: Any) -> tuple[Any, torch.optim.Optimizer, nn.Module | None]:
    """The LightningModule as the strategy sets it up: on the device, in its precision, configured (FSDP2
    over ``mesh``), wrapped in DDP where the run is, and its optimizer."""
    if not module.automatic_optimization:
        raise NotRehearsable("model: manual optimization (automatic_optimization false) is not rehearsed")
    if mesh is not None:
        set_device_mesh(module, mesh)
    module.setup("fit")
    module.configure_model()
    module = plugin.convert_module(module.to(device))
    ddp = None
    if kind == "ddp":
        strategy = get_path(config, "trainer.strategy")
        given = (strategy.get("init_args") or {}) if isinstance(strategy, Mapping) else {}
        ddp = torch.nn.parallel.DistributedDataParallel(
            _TrainingStep(module), **{key: given[key] for key in DDP_KEYS if key in given})
        ddp.register_comm_hook(None, fake_allreduce_hook)
    return module, _first_optimizer(module.configure_optimizers()), ddp


@dataclass(frozen=True)
class _Setting:
    """How the run trains, as its config says: the strategy and its ranks, the device, the precision plugin,
    the micro-batches of a step."""

    kind: str
    ranks: int
    device: torch.device
    plugin: Precision
    accumulate: int

    @classmethod
    def of(cls, config: Mapping) -> "_Setting":
        accelerator = str(get_path(config, "trainer.accelerator", "auto"))
        gpu = accelerator in ("auto", "cuda", "gpu") and torch.cuda.is_available()
        device = torch.device("cuda" if gpu else "cpu")
        plugin = precision_plugin(precision_of(get_path(config, "trainer.precision")).name, device)
        accumulate = int(get_path(config, "trainer.accumulate_grad_batches", 1) or 1)
        return cls(strategy_kind(config), world_size(config), device, plugin, accumulate)


def _timeline(module: Any, config: Mapping, batch: Any, size: int, setting: _Setting) -> Timeline:
    """One warm-up step of ``size`` samples per micro-batch (the optimizer's state exists from there on, as at
    a run's captured step), then the captured one."""
    with _ranks(setting.kind, setting.ranks, setting.device) as mesh:
        module, optimizer, ddp = _prepared(module, config, setting.device, setting.plugin, setting.kind, mesh)
        step = _Step(module, optimizer, setting.plugin, ddp)
        pieces = _micro_batches(batch, size, setting.accumulate, setting.device, setting.plugin)
        step(pieces)
        return capture(lambda tracker: step(pieces, tracker), setting.device, [module], [optimizer], pieces,
                       size, explicit_update=True)


def rehearse(config: Mapping, micro_batches: tuple[int, int] = MICRO_BATCHES) -> Rehearsal:
    """Two rehearsed steps of the job ``config`` (resolved, as ``main.py fit --print_config`` shows it) on
    this machine, one per micro-batch of ``micro_batches``: what :class:`Rehearsal` predicts from."""
    setting = _Setting.of(config)
    job = _built_job(config)
    batch = _example_batch(job.datamodule, max(micro_batches) * setting.accumulate)
    pristine = copy.deepcopy(job.model)
    timelines = []
    with warnings.catch_warnings():
        # the module's self.log() outside a Trainer, once per call: nothing is logged in a rehearsal
        warnings.filterwarnings("ignore", message=r"You are trying to `self.log\(\)`")
        for size in micro_batches:
            # A module of its own per micro-batch: the first capture must leave nothing the second meets (a
            # torchmetrics metric's hash changes with its state, and the tracker's weak references keep the
            # old one).
            module = copy.deepcopy(pristine)
            timelines.append(_timeline(module, config, batch, size, setting))
    what = (f"{type(pristine).__name__}, {setting.plugin.__class__.__name__}, "
            f"{setting.kind} x {setting.ranks}, on {setting.device.type}")
    return Rehearsal.of(timelines, what, frozenset(type(module).__name__ for module in pristine.modules()))


__all__ = ["MICRO_BATCHES", "NotRehearsable", "Rehearsal", "Timeline", "rehearse"]
