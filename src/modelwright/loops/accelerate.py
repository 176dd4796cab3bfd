"""The training of ``main.py fit`` as one plain PyTorch loop driven by Hugging Face Accelerate, without
Lightning's Trainer: the job is read and built as ``main.py fit`` builds it (:func:`~modelwright.train.cli
.build_job`), its LightningModule holding the network and the techniques' arguments, its data module giving
the loaders.

To run: ``uv run python -m modelwright accelerate --config configs/amp.yaml`` (N processes:
docs/accelerate.md). The loop reads like Accelerate's ``examples/by_feature`` scripts: the forward, backward
and optimizer step, with the same :class:`~modelwright.measure.StepProbe` calls as the Lightning callback's
hooks around them.
"""

import inspect
import math
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import broadcast_object_list
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader
from torchmetrics.functional.classification import multiclass_accuracy
from tqdm import tqdm

from modelwright import measure, techniques
from modelwright.errors import require
from modelwright.record import build_record, write_record
from modelwright.report.run_summary import summary_lines, write_tensorboard
from modelwright.techniques import precision as precision_of
from modelwright.train.args import (
    DataArgs,
    ImageFolderArgs,
    ModelArgs,
    TrainerArgs,
    counts_batches,
    limited_batches,
)
from modelwright.train.checks import check_accelerate_run
from modelwright.train.cli import build_job
from modelwright.train.module import ImageClassifier
from modelwright.train.optim import build_scheduler
from modelwright.train.runtime import set_cpu_malloc

#: The ``trainer:`` keys the loop reads (:class:`TrainerArgs`); the rest of Lightning's are ignored.
TRAINER_KEYS = {argument.name for argument in fields(TrainerArgs)}


@dataclass
class Run:
    """What the loop trains with, prepared by Accelerate, and how long it trains."""

    accelerator: Accelerator
    net: torch.nn.Module  # wrapped for distributed training where several processes run
    plain: torch.nn.Module  # the network itself
    optimizer: Any  # Accelerate's wrapper; .optimizer is torch's
    scheduler: Any
    train_loader: DataLoader
    val_loader: DataLoader
    train_set: Any
    precision: str
    train_batches: int
    val_batches: int
    val_every: int
    steps_per_epoch: int
    max_epochs: int  # -1: until max_steps
    total_steps: int
    check_val_every_n_epoch: int
    run_dir: Path
    num_classes: int
    args: ModelArgs

    def validates(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` (0-based) validates."""
        return (epoch + 1) % self.check_val_every_n_epoch == 0


#: The Accelerate loop's own arguments, beside every argument of ``main.py fit``.
EXTRA_ARGUMENTS = {
    "warmup_steps": (int, 2, "optimizer steps left out of timing and memory peaks; the next one's anatomy is "
                             "captured"),
    "out": (str, "lightning_logs",
            "the folder that holds <name>/accelerate/version_N (Lightning's save_dir)"),
}
USAGE = """usage: python -m modelwright accelerate [--config FILE ...] [--key=value ...] [--warmup_steps N] \
[--out DIR]

Train as `main.py fit` does, in a plain Hugging Face Accelerate loop, and write the run record (loop:
accelerate) to <out>/<trainer.logger.init_args.name>/accelerate/version_N/record.json, the next free N. The
job is read as main.py fit reads it (configs/base.yaml first, then each --config, then the flags; `uv run
main.py fit --help` lists them): the network and the techniques of model:, any data module under data:, and
of trainer: precision, accumulation, length, validation cadence, gradient clipping (Lightning's plumbing keys
are accepted and ignored). The data module's loaders must give (inputs, labels) batches.

  --warmup_steps N   optimizer steps left out of timing and memory peaks (default 2)
  --out DIR          the folder that holds <name>/accelerate/version_N (default lightning_logs)
"""


def accelerate(argv: list[str]) -> tuple[torch.nn.Module, dict]:
    """Train the job ``argv`` describes (:data:`USAGE`) in a plain Accelerate loop; returns the trained
    network (unwrapped) and the run record, on every process."""
    job = build_job(argv, EXTRA_ARGUMENTS)
    require(isinstance(job.model, ImageClassifier), f"model: the accelerate loop trains the project's "
            f"ImageClassifier (any network under model.network), not {type(job.model).__name__}; a "
            "LightningModule of your own trains with main.py fit")
    config = job.config
    refuse_unused_trainer_keys(config["trainer"])
    trainer = TrainerArgs(**{key: value for key, value in config["trainer"].items() if key in TRAINER_KEYS})
    data_args = getattr(job.datamodule, "args", None)
    check_accelerate_run(data_args if isinstance(data_args, (DataArgs, ImageFolderArgs)) else None, trainer,
                         config["out"])
    require(config["warmup_steps"] >= 0, f"warmup_steps: must be >= 0, got {config['warmup_steps']}")
    set_cpu_malloc(config["cpu_malloc"])
    run = prepare(job.model, job.datamodule, trainer, config["out"])
    probe = measure.StepProbe(config["warmup_steps"])
    probe.prepare(run.plain)
    accelerator = run.accelerator
    with accelerator.main_process_first():  # one process per machine measures the CPU clock; the rest read it
        probe.start(device=accelerator.device, precision=run.precision, modules=[run.plain],
                    optimizers=[run.optimizer.optimizer],
                    micro_batches_per_step=trainer.accumulate_grad_batches,
                    world_size=accelerator.num_processes, main_process=accelerator.is_main_process,
                    reduce=lambda value: accelerator.reduce(value, "sum"),
                    data=getattr(run.train_set, "tensors", ()))
    history = History(run.accelerator)
    status, error = "ok", None
    try:
        train(run, probe, history, job.model.args, trainer)
    except BaseException as err:
        status, error = measure.error_status(err), measure.one_line_error(err)
        raise
    finally:
        probe.stop()
        record = finish(run, probe, history, config, status, error)
    return run.plain, record


def refuse_unused_trainer_keys(trainer_config: dict) -> None:
    """A ``trainer:`` key the loop does not read, set off Lightning's default (``overfit_batches: 2``),
    would be silently ignored: refused instead, naming it."""
    defaults = inspect.signature(Trainer.__init__).parameters
    for key, value in trainer_config.items():
        if key in TRAINER_KEYS or key not in defaults:
            continue
        default = defaults[key].default
        require(value == default, f"trainer.{key}: the accelerate loop does not apply it (got {value!r}; "
                f"Lightning's default is {default!r}); `python -m modelwright accelerate --help` lists what "
                "it reads")


def train(run: Run, probe: measure.StepProbe, history: "History", model: ModelArgs,
          trainer: TrainerArgs) -> None:
    """The training loop: every epoch, every micro-batch, the validations between them."""
    accelerator = run.accelerator
    net = run.net
    optimizer = run.optimizer
    bar = tqdm(total=run.total_steps, desc="train", unit="step", dynamic_ncols=True, leave=False,
               disable=not accelerator.is_main_process or trainer.enable_progress_bar is False)
    step, epoch = 0, 0
    net.train()
    while (epoch < run.max_epochs or run.max_epochs == -1) and step != run.total_steps:
        probe.epoch_begins()
        for batch_idx, (x, y) in enumerate(run.train_loader):
            if model.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            probe.before_micro_batch(step, (x, y))
            with accelerator.accumulate(net):
                logits = net(x)
                loss = F.cross_entropy(logits, y, label_smoothing=model.label_smoothing)
                probe.observe_loss(loss, epoch, batch_idx)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    if trainer.gradient_clip_val:
                        accelerator.clip_grad_norm_(net.parameters(), trainer.gradient_clip_val)
                    probe.before_update(optimizer.optimizer)
                optimizer.step()  # Accelerate's wrapper steps only on the last micro-batch of a step
                optimizer.zero_grad(set_to_none=True)
            if accelerator.sync_gradients:
                if run.scheduler is not None:
                    run.scheduler.step()
                step += 1
                bar.update(1)
            reading = probe.after_micro_batch(step, trainer.log_every_n_steps)
            if reading is not None:
                history.train_step(reading, loss, logits, y, run.num_classes, trainer.log_every_n_steps)
                bar.set_postfix(loss=f"{history.last_train['train/loss']:.3g}", refresh=False)
            # Lightning validates after every val_check batch of an epoch (its last by default).
            if run.val_batches and (batch_idx + 1) % run.val_every == 0 and run.validates(epoch):
                with probe.evaluating():
                    history.validation(probe.cycle.step or 0, evaluate(run, model))
            if step == run.total_steps or batch_idx + 1 == run.train_batches:
                break
        probe.epoch_ends(expected_steps=run.steps_per_epoch)
        epoch += 1
    bar.close()


def prepare(classifier: ImageClassifier, datamodule: Any, trainer: TrainerArgs, out: str) -> Run:
    """The Accelerator, the network with its techniques, the optimizer, the loaders and the schedule (the
    network was built, seeded, as LightningCLI builds it)."""
    cpu = trainer.accelerator == "cpu" or not torch.cuda.is_available()
    precision = precision_of(trainer.precision).name
    if precision == "16-mixed" and cpu:  # as Lightning: float16 autocast needs a GPU
        precision = "bf16-mixed"
    logger = (trainer.logger.get("init_args") if isinstance(trainer.logger, dict) else None) or {}
    root = Path(out) / (logger.get("name") or "lightning_logs") / "accelerate"  # beside the Lightning runs
    accelerator = Accelerator(cpu=cpu, mixed_precision=precision_of(precision).accelerate,
                              gradient_accumulation_steps=trainer.accumulate_grad_batches,
                              log_with="tensorboard", project_dir=str(root))
    args = classifier.args
    net = classifier.net
    techniques.prepare_network(net, args)
    with accelerator.main_process_first():
        datamodule.prepare_data()
        datamodule.setup("fit")
    train_loader = datamodule.train_dataloader()
    val_loader = datamodule.val_dataloader()
    trained = [param for param in net.parameters() if param.requires_grad]
    optimizer = techniques.build_optimizer(trained, args, lr=args.lr, momentum=args.momentum,
                                           weight_decay=args.weight_decay)
    net, optimizer, train_loader, val_loader = accelerator.prepare(net, optimizer, train_loader, val_loader)
    lengths = _lengths(trainer, len(train_loader), len(val_loader))
    # Not prepared: Accelerate would step it once per process per optimizer step; Lightning steps it once.
    scheduler = build_scheduler(optimizer.optimizer, args.scheduler, lr=args.lr,
                                total_steps=lengths["total_steps"])
    run_dir = next_version(accelerator, root)
    return Run(accelerator=accelerator, net=net, plain=accelerator.unwrap_model(net), optimizer=optimizer,
               scheduler=scheduler, train_loader=train_loader, val_loader=val_loader,
               train_set=getattr(datamodule, "train_set", None), precision=precision, run_dir=run_dir,
               num_classes=classifier.num_classes, args=args, **lengths)


def _lengths(trainer: TrainerArgs, train_length: int, val_length: int) -> dict[str, int]:
    """Batches per epoch, the validation cadence and the steps of the fit, as Lightning counts them."""
    accumulate = trainer.accumulate_grad_batches
    train_batches = limited_batches(train_length, trainer.limit_train_batches)
    # Lightning steps at the end of a whole epoch, not of one that limit_train_batches cut short.
    require(train_batches == train_length or train_batches % accumulate == 0,
            f"trainer.limit_train_batches: {train_batches} batches, not a multiple of "
            f"accumulate_grad_batches {accumulate}")
    interval = trainer.val_check_interval
    val_every = int(interval) if counts_batches(interval) else max(1, int(train_batches * interval))
    steps_per_epoch = math.ceil(train_batches / accumulate)
    if trainer.max_epochs is not None:
        max_epochs = trainer.max_epochs
    else:
        max_epochs = 1000 if trainer.max_steps == -1 else -1
    by_epochs = steps_per_epoch * max_epochs if max_epochs != -1 else -1
    total_steps = min(steps for steps in (by_epochs, trainer.max_steps) if steps != -1)
    val_batches = limited_batches(val_length, trainer.limit_val_batches)
    return {"train_batches": train_batches, "val_batches": val_batches, "val_every": val_every,
            "steps_per_epoch": steps_per_epoch, "max_epochs": max_epochs, "total_steps": total_steps,
            "check_val_every_n_epoch": trainer.check_val_every_n_epoch}


def next_version(accelerator: Accelerator, root: Path) -> Path:
    """``root/version_N`` for the next free N (the highest there plus one, as Lightning numbers its runs),
    made by the main process, never one that exists; every process gets its name."""
    name = [None]
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        numbers = [int(p.name.removeprefix("version_")) for p in root.glob("version_*")
                   if p.name.removeprefix("version_").isdigit()]
        number = max(numbers, default=-1) + 1
        while True:
            try:
                (root / f"version_{number}").mkdir()
                break
            except FileExistsError:  # another run took it meanwhile
                number += 1
        name = [f"version_{number}"]
    if accelerator.num_processes > 1:
        broadcast_object_list(name)
    accelerator.init_trackers(name[0])
    return root / name[0]


class History:
    """The metrics logged along the run, ``{name: [[step, value], ...]}``, also sent to Accelerate's trackers;
    steps are 0-based optimizer-step indices, as Lightning logs them."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.points: dict[str, list[list[float]]] = {}
        self.last_train: dict[str, float] = {}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            if not key.startswith(("perf/", "mem/")):
                self.points.setdefault(key, []).append([step, value])
        self.accelerator.log({k: v for k, v in scalars.items() if math.isfinite(v)}, step=step)

    def train_step(self, reading: measure.StepReading, loss: torch.Tensor, logits: torch.Tensor,
                   labels: torch.Tensor, num_classes: int, every: int) -> None:
        """A closed optimizer step: the last micro-batch's loss and accuracy, as Lightning logs them."""
        accuracy = multiclass_accuracy(logits.detach(), labels, num_classes=num_classes)
        self.last_train = {"train/loss": loss.item(), "train/acc": accuracy.item()}
        if (reading.step + 1) % every == 0:
            self.log(reading.step, {**self.last_train, **reading.scalars})

    def validation(self, step: int, metrics: dict[str, float]) -> None:
        self.log(step, metrics)

    def final_metrics(self) -> dict[str, float]:
        validation = {key: points[-1][1] for key, points in self.points.items() if key.startswith("val/")}
        return {**validation, **self.last_train}


@torch.no_grad()
def evaluate(run: Run, model: ModelArgs) -> dict[str, float]:
    """``val/loss`` and ``val/acc`` over the first ``run.val_batches`` batches of every process."""
    run.net.eval()
    outputs = []
    for _, (x, y) in zip(range(run.val_batches), run.val_loader, strict=False):
        if model.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        outputs.append(run.accelerator.gather_for_metrics((run.net(x).float(), y)))
    # Left early, Accelerate's loader would stay the active one, and its end closes accumulation cycles.
    run.val_loader.end()
    run.net.train()
    logits = torch.cat([output[0] for output in outputs])
    labels = torch.cat([output[1] for output in outputs])
    loss = F.cross_entropy(logits, labels, label_smoothing=model.label_smoothing)
    accuracy = multiclass_accuracy(logits, labels, num_classes=run.num_classes)
    return {"val/loss": loss.item(), "val/acc": accuracy.item()}


def finish(run: Run, probe: measure.StepProbe, history: History, config: dict, status: str,
           error: str | None) -> dict:
    """The run record (written, summarised and put into TensorBoard by the main process), then Accelerate's
    process-wide state reset."""
    accelerator = run.accelerator
    sections = probe.sections(run.steps_per_epoch)
    if sections["faults"]["diverged"] and status != "interrupted":
        status = "diverged"
    world = accelerator.num_processes
    local_devices = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    loop = techniques.LoopFacts(
        precision=run.precision, precision_requested=str(config["trainer"]["precision"]),
        accumulate_grad_batches=accelerator.gradient_accumulation_steps,
        strategy="ddp" if world > 1 else "single_device",
        strategy_class="DistributedDataParallel" if world > 1 else None, world_size=world,
        num_nodes=world // local_devices)
    section = techniques.record_section(run.args, run.plain, loop, sections.pop("techniques"))
    hardware = measure.hardware_info(accelerator.device, num_devices=local_devices)
    record = build_record(loop="accelerate", status=status, error=error, config=config, techniques=section,
                          hardware=hardware, versions=measure.versions(), metrics=history.final_metrics(),
                          history=history.points, **sections)
    if accelerator.is_main_process:
        path = write_record(run.run_dir / "record.json", record)
        (run.run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        lines = summary_lines(record, str(path), str(run.run_dir))
        print("\n" + "\n".join(lines), file=sys.stdout, flush=True)
        writer = accelerator.get_tracker("tensorboard", unwrap=True)
        step = probe.captured_step if probe.captured_step is not None else 0
        write_tensorboard(writer, record, lines, step)
    accelerator.end_training()
    if world == 1:
        reset_accelerate_state()
    return record


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide state (its private ``_reset_state``), which would pin the next run in
    this process to these settings; ``tests/test_accelerate_loop.py`` checks that it still does."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def main(args: list[str]) -> int:
    """``python -m modelwright accelerate ARGS``; returns the exit status."""
    from modelwright.__main__ import main as tool_main

    return tool_main(["accelerate", *args])
