"""The training of ``main.py fit`` as one plain PyTorch loop driven by Hugging Face Accelerate; no Lightning.

To run: ``uv run python -m modelwright accelerate --config configs/amp.yaml`` (N processes: docs/accelerate.md).
"""

import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import set_seed
from torchmetrics.functional.classification import multiclass_accuracy

from modelwright import CONFIGS_DIR, measure
from modelwright.errors import require
from modelwright.precision import precision as precision_of
from modelwright.record import build_record, write_record
from modelwright.train.args import DataArgs, ModelArgs, TrainerArgs, limited_batches
from modelwright.train.checks import check_accelerate_run
from modelwright.train.datasets import image_datasets, image_loader
from modelwright.train.models import apply_gradient_checkpointing, build_model, checkpointed_modules
from modelwright.train.optim import build_optimizer, build_scheduler
from modelwright.train.runtime import set_cpu_malloc

#: What ``python -m modelwright accelerate`` gives jsonargparse: base.yaml under every ``--config``.
PARSER_KWARGS = {"default_config_files": [str(CONFIGS_DIR / "base.yaml")]}
def accelerate(  # the defaults are instances: jsonargparse reads their fields as the sections' defaults
    model: ModelArgs = ModelArgs(),  # noqa: B008
    data: DataArgs = DataArgs(),  # noqa: B008
    trainer: TrainerArgs = TrainerArgs(),  # noqa: B008
    seed_everything: int = 0,
    cpu_malloc: Literal["retain", "system"] = "retain",
    warmup_steps: int = 2,
    out: str = "lightning_logs",
):
    """Train as ``main.py fit`` does, in a plain Accelerate loop; write the run record (``loop: accelerate``) to
    ``<out>/<trainer.logger.init_args.name>/accelerate/version_N/record.json``. Returns the trained network
    (unwrapped) and the run record, on every process.

    Args:
        model: the network, optimizer and schedule (ImageClassifier's arguments).
        data: the data (ImageDataModule's arguments).
        trainer: precision, accumulation, length, validation cadence; Lightning's plumbing keys are ignored.
        seed_everything: seeds Python, numpy and torch before the network is built, as LightningCLI does.
        cpu_malloc: ``retain``: glibc malloc keeps freed memory for the next step (modelwright.train.runtime).
        warmup_steps: optimizer steps left out of timing and memory peaks; the next one's anatomy is captured.
        out: the folder that holds ``<name>/accelerate/version_N`` (Lightning's ``save_dir``).
    """
    check_accelerate_run(data, trainer, out)  # what main.py fit checks, before any work (train/checks.py)
    m, t, k = model, trainer, trainer.accumulate_grad_batches
    require(warmup_steps >= 0, f"warmup_steps: must be >= 0, got {warmup_steps}")
    config = {"seed_everything": seed_everything, "cpu_malloc": cpu_malloc, "warmup_steps": warmup_steps,
              "model": asdict(m), "data": asdict(data), "trainer": asdict(t)}
    set_cpu_malloc(cpu_malloc)
    cpu = t.accelerator == "cpu" or not torch.cuda.is_available()
    precision = precision_of(t.precision).name
    if precision == "16-mixed" and cpu:  # as Lightning: float16 autocast needs a GPU
        precision = "bf16-mixed"
    mixed = precision_of(precision).accelerate
    logger = (t.logger.get("init_args") if isinstance(t.logger, dict) else None) or {}
    root = Path(out) / (logger.get("name") or "lightning_logs") / "accelerate"  # beside the Lightning runs
    accelerator = Accelerator(cpu=cpu, mixed_precision=mixed, gradient_accumulation_steps=k,
                              log_with="tensorboard", project_dir=str(root))
    set_seed(seed_everything)  # before the network draws its initial weights, as LightningCLI orders it
    net = build_model(m.model_name, m.num_classes)
    apply_gradient_checkpointing(net, m.gradient_checkpointing)
    if m.channels_last:
        net = net.to(memory_format=torch.channels_last)
    if m.compile:
        net.compile()
    with accelerator.main_process_first():
        train_set, val_set = image_datasets(data, download=data.download)
    train_loader, val_loader = image_loader(train_set, data, train=True), image_loader(val_set, data, train=False)
    optimizer = build_optimizer(net.parameters(), optimizer=m.optimizer, lr=m.lr, momentum=m.momentum,
                                weight_decay=m.weight_decay, optimizer_impl=m.optimizer_impl)
    net, optimizer, train_loader, val_loader = accelerator.prepare(net, optimizer, train_loader, val_loader)

    train_batches = limited_batches(len(train_loader), t.limit_train_batches)
    val_batches = limited_batches(len(val_loader), t.limit_val_batches)
    v = t.val_check_interval
    val_every = v if isinstance(v, int) else max(1, int(train_batches * v))
    require(train_batches == len(train_loader) or train_batches % k == 0,  # Lightning steps at a limited epoch's end
            f"trainer.limit_train_batches: {train_batches} batches, not a multiple of accumulate_grad_batches {k}")
    steps_per_epoch = math.ceil(train_batches / k)
    max_epochs = t.max_epochs if t.max_epochs is not None else (1000 if t.max_steps == -1 else -1)
    total = min(s for s in (steps_per_epoch * max_epochs if max_epochs != -1 else -1, t.max_steps) if s != -1)
    # Not prepared: Accelerate would step it once per process per optimizer step; Lightning steps it once.
    scheduler = build_scheduler(optimizer.optimizer, m.scheduler, lr=m.lr, total_steps=total)
    run_dir = root / f"version_{len(list(root.glob('version_*')))}"
    accelerator.init_trackers(run_dir.name)
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    device, world, plain = accelerator.device, accelerator.num_processes, accelerator.unwrap_model(net)
    with accelerator.main_process_first():  # one process per machine measures the clock, the others read its cache
        peak = measure.hardware_peak(device, measure.compute_dtype(precision))
    timer = measure.StepTimer(warmup_steps, sync=measure.device_sync(device))
    tracker, anatomy, peaks, flops_per_micro, last = None, {}, {}, None, {}
    history: dict[str, list] = {}
    status, error, step, epoch, micro, t0 = "ok", None, 0, 0, 0, time.perf_counter()

    def remember(scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            history.setdefault(key, []).append([step, value])
        accelerator.log({k: v for k, v in scalars.items() if math.isfinite(v)}, step=step)

    try:
        net.train()
        while (epoch < max_epochs or max_epochs == -1) and status == "ok" and step != t.max_steps:
            validate_epoch = (epoch + 1) % t.check_val_every_n_epoch == 0
            for batch_idx, (x, y) in enumerate(train_loader):
                if m.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                if micro == 0:  # an optimizer step begins
                    if flops_per_micro is None:  # counted on a meta-device copy, before the clock starts
                        flops_per_micro = measure.training_flops(plain, x)
                    if step == warmup_steps:
                        measure.reset_peak_memory(device)
                        tracker = measure.MemoryAnatomy(device)
                        tracker.start(plain, [optimizer.optimizer])
                    timer.start()
                elif tracker is not None:
                    tracker.next_micro_batch()
                if tracker is not None:
                    tracker.register((x, y))  # the batch is data, not the step's activations
                micro += 1
                with accelerator.accumulate(net):
                    logits = net(x)
                    loss = F.cross_entropy(logits, y, label_smoothing=m.label_smoothing)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and t.gradient_clip_val:
                        accelerator.clip_grad_norm_(net.parameters(), t.gradient_clip_val)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if accelerator.sync_gradients:
                    if scheduler is not None:
                        scheduler.step()
                    step, micro = step + 1, 0
                    dt = timer.stop(exclude=tracker is not None)
                    if tracker is not None:
                        tracker.stop()
                        anatomy = {"anatomy_step": step - 1, "anatomy_mib": tracker.peak_mib(),
                                   "anatomy_end_mib": tracker.end_mib(), "anatomy_caveat": tracker.caveat}
                        tracker = None
                    if step > warmup_steps:
                        peaks = measure.peak_memory_mib(device)
                    # The last micro-batch's loss and accuracy, as Lightning logs them.
                    last = {"train/loss": loss.item(), "train/acc": multiclass_accuracy(
                        logits.detach(), y, num_classes=m.num_classes).item()}
                    if not math.isfinite(last["train/loss"]):
                        status, error = "diverged", f"train/loss is {last['train/loss']} at step {step}"
                    if step % t.log_every_n_steps == 0 or status != "ok":
                        remember(last | ({"perf/step_time_ms": dt * 1e3} if dt else {}))
                # Lightning validates after every val_check batch of an epoch (its last by default), also the
                # batch at which max_steps stops the fit, never once it diverged.
                if status == "ok" and val_batches and (batch_idx + 1) % val_every == 0 and validate_epoch:
                    remember(evaluate(accelerator, net, val_loader, val_batches, m))
                if status != "ok" or step == t.max_steps or batch_idx + 1 == train_batches:
                    break
            epoch += 1
    except BaseException as err:
        status, error = measure.error_status(err), measure.one_line_error(err)
        raise
    finally:
        if tracker is not None:
            tracker.stop()
        batch, local = data.batch_size, int(os.environ.get("LOCAL_WORLD_SIZE", world))
        median_s, per_step = timer.median_s(), flops_per_micro * k if flops_per_micro else None
        if anatomy.get("anatomy_mib") and device.type != "cuda":  # no allocator peak on a CPU: the tracker's
            peaks = {"peak_allocated_mib": anatomy["anatomy_mib"]["total"], "peak_reserved_mib": None}
        source = "cuda-allocator" if device.type == "cuda" else "mem-tracker"
        source = source if peaks.get("peak_allocated_mib") is not None else None
        record = build_record(
            loop="accelerate", status=status, error=error, config=config,
            techniques={
                "model_name": m.model_name, "precision": precision, "precision_requested": str(t.precision),
                "mixed_precision": mixed, "accumulate_grad_batches": k, "optimizer": m.optimizer,
                "gradient_checkpointing": m.gradient_checkpointing,
                "checkpointed_segments": len(checkpointed_modules(plain)),
                "optimizer_impl": measure.optimizer_impl(optimizer.optimizer),
                "channels_last": measure.channels_last_applied(plain), "compile": measure.is_compiled(plain),
                "strategy": "ddp" if world > 1 else "single_device", "world_size": world,
                "strategy_class": "DistributedDataParallel" if world > 1 else None, "num_nodes": world // local,
                "micro_batch_size": batch, "effective_batch_size": batch * k * world,
            },
            hardware=measure.hardware_info(device, num_devices=local), versions=measure.versions(),
            timing={**timer.summary(steps_per_epoch, batch * k * world), "wall_time_s": time.perf_counter() - t0},
            flops={"flops_per_step": per_step, "flops_per_micro_batch": flops_per_micro,
                   "achieved_flops_per_s": per_step / median_s if per_step and median_s else None,
                   "peak_flops_per_s": peak.flops_per_s, "peak_flops_source": peak.source,
                   "peak_flops_method": peak.method, "mfu": measure.mfu(per_step, median_s, peak.flops_per_s),
                   "peak_flops_dtype": str(measure.compute_dtype(precision)).removeprefix("torch.")},
            memory={**peaks, **anatomy, "rss_peak_mib": measure.process_rss_peak_mib(),
                    "peak_source": source, "window_warmup_steps": warmup_steps,
                    "model_parameters": sum(p.numel() for p in plain.parameters())},
            metrics={**{key: points[-1][1] for key, points in history.items() if key.startswith("val/")}, **last},
            history={key: points for key, points in history.items() if not key.startswith("perf/")},
        )
        if accelerator.is_main_process:
            print(f"record: {write_record(run_dir / 'record.json', record)}", flush=True)
        accelerator.end_training()
        if world == 1:  # Accelerate's process-wide state would pin the next in-process run to these settings
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
    return plain, record


@torch.no_grad()
def evaluate(accelerator: Accelerator, net: torch.nn.Module, loader, batches: int, m: ModelArgs) -> dict[str, float]:
    """``val/loss`` and ``val/acc`` over the first ``batches`` batches of every process."""
    net.eval()
    outputs = []
    for _, (x, y) in zip(range(batches), loader, strict=False):
        if m.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        outputs.append(accelerator.gather_for_metrics((net(x).float(), y)))
    loader.end()  # left early, Accelerate's loader would stay the active one, whose end closes accumulation cycles
    net.train()
    logits, labels = torch.cat([o[0] for o in outputs]), torch.cat([o[1] for o in outputs])
    loss = F.cross_entropy(logits, labels, label_smoothing=m.label_smoothing)
    return {"val/loss": loss.item(), "val/acc": multiclass_accuracy(logits, labels, num_classes=m.num_classes).item()}


def main(args: list[str]) -> int:
    """``python -m modelwright accelerate ARGS`` (base.yaml loaded first); returns the exit status."""
    from modelwright.__main__ import main as tool_main

    return tool_main(["accelerate", *args])
