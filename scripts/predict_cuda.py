"""Each default-study row's peak on one H200, predicted before any GPU run from its step rehearsed here.

To run: ``uv run python scripts/predict_cuda.py`` writes
``results/cuda-nvidia-h200/predicted-before-gpu.json`` and a table of it, ``predicted-before-gpu.md``;
``--check`` predicts again and exits 1 where a figure differs from the committed file. The rows are the
plan's, resolved as the study resolves them on CUDA with the GPU run's window (``scripts/gpu_run.sh``), each
step rehearsed on this machine's CPU with CUDA's optimizer kernel (foreach); the tensors alive at its peak go
through :mod:`modelwright.planner.cuda` (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT / "src") not in sys.path:  # `modelwright` without an install (the GPU machine)
    sys.path.insert(0, str(REPO_ROOT / "src"))

from modelwright.errors import ConfigError, require  # noqa: E402
from modelwright.planner import cuda, memory  # noqa: E402
from modelwright.record import get_path, now_iso, provenance, write_text_atomic  # noqa: E402
from modelwright.techniques import precision  # noqa: E402

PLAN = "configs/study/plan_default.yaml"
SLUG = "cuda-nvidia-h200"
GPU_STEPS = 200  # the measured steps scripts/gpu_run.sh asks of every row
BUDGET_GIB = 40  # its --budget_gib
#: What the memory model reads of a resolved config: the row's config in the file.
CONFIG_KEYS = ("trainer.accelerator", "trainer.precision", "trainer.accumulate_grad_batches",
               "trainer.devices", "data.batch_size", "model.network.class_path", "model.optimizer",
               "model.optimizer_impl", "model.momentum", "model.gradient_checkpointing",
               "model.channels_last")
GPU_DIFFERENCES = (
    "The batch is copied to the device for each micro-batch (MemTracker's inputs; on CPU a view of the "
    "dataset).",
    "AdamW's auto implementation is foreach for CUDA parameters: its update holds one fp32 copy of every "
    "weight (for-loop on CPU: one weight at a time).",
    "Each tensor is a block of the caching allocator, rounded up to 512 B; MemTracker rounds the same way on "
    "CUDA (torch.distributed._tools.mem_tracker _PYTORCH_MIN_ALLOCATE), so its categories compare directly.",
    "cuBLAS and cuBLASLt workspaces are allocator blocks kept from the first matmul on: in allocated and "
    "reserved, not in MemTracker's categories.",
    "cuDNN's convolution workspaces are allocator blocks for the length of a call: in allocated at a "
    "convolution's moment, not in MemTracker's categories (guessed).",
    "channels_last copies the NCHW batch to NHWC in the LightningModule on both devices; autocast caches its "
    "16-bit weight copies for the forward on both (the same saved tensors).",
    "The CUDA context, cuDNN's and cuBLAS's handles and the kernels' code live outside the allocator: in "
    "nvidia-smi's figure, in neither allocated nor reserved; not predicted.",
    "fp32 convolutions run on TF32 tensor cores (torch.backends.cudnn.allow_tf32 defaults to True) and fp32 "
    "matmuls in full fp32 (matmul precision 'highest'): the same memory, and MFU's fp32 peak is then TF32's "
    "dense 494.7 TFLOP/s (measure/flops.py); bf16 runs divide by the dense bf16 989 TFLOP/s.",
)
COMPARISON = (
    "Part 2 (docs/gpu.md): per row and category, the CUDA record's memory.anatomy_mib (MemTracker on CUDA) "
    "against categories_mib, error in MiB and %, within 5% or 2 MiB as for the CPU rows; "
    "memory.peak_allocated_mib against allocated_mib (the residual over the anatomy's total and inputs is "
    "what the allocator holds beside tensors: set it beside beside_tensors_mib and the guessed cuDNN range); "
    "memory.peak_reserved_mib against reserved_floor_mib (how far above the floor fragmentation and the "
    "cache go).")


def row_configs(plan_path: Path) -> list[tuple[str, dict | None, str | None]]:
    """Each plan row as the study resolves it on CUDA: (name, its resolved config, why not predicted)."""
    from modelwright.study import plan as study_plan  # loads Lightning: only here

    plan = study_plan.load_plan(plan_path)
    settings = study_plan.Settings(SLUG, "cuda", study_plan.for_device(plan.warmup_steps, "cuda"), GPU_STEPS,
                                   plan.repeats, plan.val_batches, plan.model, {})
    rows = []
    for index, entry in enumerate(plan.entries):
        if entry.accelerators and "cuda" not in entry.accelerators:
            continue
        resolved = study_plan.build_spec(entry, index, settings).resolved
        devices = study_plan.world_size(resolved)
        why = f"{devices} processes on {devices} GPUs; the lent machine has one H200" if devices > 1 else None
        rows.append((entry.name, resolved, why))
    return rows


def on_this_cpu(resolved: dict) -> dict:
    """A CUDA row rehearsed on this machine's CPU: CUDA's AdamW kernel (``auto`` is foreach for CUDA
    parameters), no GPU asked for."""
    kernel = get_path(resolved, "model.optimizer_impl")
    values = {"trainer.accelerator": "cpu", "model.optimizer_impl": "foreach" if kernel == "auto" else kernel}
    return memory.with_values(resolved, values)


def budget_prediction(name: str, resolved: dict) -> dict:
    """The largest micro-batch (no accumulation, as in the study's budget runs) under the budget, and its
    peak."""
    plain = memory.with_values(resolved, {"trainer.accumulate_grad_batches": 1})
    rehearsal = memory.rehearsal(on_this_cpu(plain))
    name_of = precision(get_path(plain, "trainer.precision")).name
    batch = cuda.largest_cuda_batch(rehearsal, name_of, BUDGET_GIB * 1024)
    peak = cuda.predict_cuda_peak(rehearsal, batch, name_of)
    return {"run": name, "largest_batch": batch, "allocated_mib": peak.allocated_mib,
            "allocated_upper_mib": peak.allocated_upper_mib}


def predictions(rows: list[tuple[str, dict | None, str | None]], budget_runs: list[str]) -> dict:
    """The file's figures: a prediction per one-GPU row, the budget rows, the rows not predicted."""
    predicted, budget, not_predicted = [], [], []
    for name, resolved, why in rows:
        if why is not None:
            not_predicted.append({"run": name, "why": why})
            continue
        rehearsal = memory.rehearsal(on_this_cpu(resolved))
        peak = cuda.predict_cuda_peak(rehearsal, int(get_path(resolved, "data.batch_size")),
                                      precision(get_path(resolved, "trainer.precision")).name)
        config = {key: get_path(resolved, key) for key in CONFIG_KEYS}
        predicted.append({"run": name, "config": config, "rehearsal": rehearsal.json(),
                          **cuda.peak_json(peak)})
        if name in budget_runs:
            budget.append(budget_prediction(name, resolved))
    not_predicted.append({"run": "fsdp2 (configs/study/plan_extra.yaml)",
                          "why": "2 processes on 2 GPUs; plan_extra is not in the one GPU call either"})
    return {"rows": predicted, "budget": {"gib": BUDGET_GIB, "rows": budget}, "not_predicted": not_predicted}


def document(plan_path: Path) -> dict:
    from modelwright.study import plan as study_plan

    figures = predictions(row_configs(plan_path), study_plan.load_plan(plan_path).budget_runs)
    return {
        "what": "Each default-study row's CUDA peak on one NVIDIA H200, predicted from its step rehearsed on "
                "a CPU before any GPU run (the GPU records of results/cuda-nvidia-h200/ come after this "
                "file's commit).",
        "predicted_by": {**provenance(["python", "scripts/predict_cuda.py"]), "created_at": now_iso()},
        "settings": {"plan": PLAN, "slug": SLUG, "accelerator": "cuda", "devices": 1,
                     "warmup_steps": 3, "measured_steps": GPU_STEPS, "budget_gib": BUDGET_GIB},
        "bases": {"modelled": "from the rehearsed step's tensors and the allocator's rules",
                  "assumed": "a stated fact with its source", "guessed": "no source: a range to measure"},
        "allocator": {"source": cuda.ALLOCATOR_SOURCE, "min_block_bytes": cuda.MIN_BLOCK,
                      "small_request_max_bytes": cuda.SMALL_SIZE, "small_segment_bytes": cuda.SMALL_SEGMENT,
                      "large_segment_bytes": cuda.LARGE_SEGMENT,
                      "min_large_alloc_bytes": cuda.MIN_LARGE_ALLOC, "round_large_bytes": cuda.ROUND_LARGE},
        "reserved": "reserved_floor_mib is a floor (the allocated peak, the small pool in whole 2 MiB "
                    "segments); what reserved holds above it, cached free blocks and fragmentation, is not "
                    "predicted",
        "differences_from_cpu": list(GPU_DIFFERENCES),
        "comparison": COMPARISON,
        **figures,
    }


def figures_of(predicted: dict) -> dict:
    """What ``--check`` compares: every figure, none of the provenance."""
    return {key: predicted[key] for key in ("rows", "budget", "not_predicted")}


def markdown(predicted: dict) -> str:
    lines = [f"# Predicted before any GPU run: {predicted['settings']['slug']}", "",
             "Written by `python scripts/predict_cuda.py` at commit "
             f"`{predicted['predicted_by']['commit']}`, each row's step rehearsed on a CPU; the figures and "
             "what each rests on: [predicted-before-gpu.json](predicted-before-gpu.json).", "",
             "| run | tensors MiB (modelled) | beside tensors MiB (assumed, guessed) | allocated MiB | "
             "with cuDNN's guessed workspace | reserved floor MiB |", "|:--|--:|--:|--:|--:|--:|"]
    for row in predicted["rows"]:
        tensors = sum(figure["mib"] for figure in row["categories_mib"].values())
        beside = sum(figure["mib"] for figure in row["beside_tensors_mib"].values())
        lines.append(f"| {row['run']} | {tensors:,.1f} | {beside:,.1f} | {row['allocated_mib']:,.1f} | "
                     f"{row['allocated_upper_mib']:,.1f} | {row['reserved_floor_mib']:,.1f} |")
    budget = predicted["budget"]
    lines += ["", f"Largest micro-batch whose predicted allocated peak fits {budget['gib']} GiB:", "",
              "| run | batch | allocated MiB | with cuDNN's guessed workspace |", "|:--|--:|--:|--:|"]
    lines += [f"| {row['run']} | {row['largest_batch']:,} | {row['allocated_mib']:,.0f} | "
              f"{row['allocated_upper_mib']:,.0f} |" for row in budget["rows"]]
    lines += ["", "Not predicted: " + "; ".join(f"{row['run']} ({row['why']})"
                                                for row in predicted["not_predicted"]) + "."]
    return "\n".join(lines) + "\n"


def differences(expected: object, actual: object, where: str = "") -> list[str]:
    """Where two JSON values differ (numbers within a relative 1e-9)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        keys = sorted(set(expected) | set(actual))
        return [line for key in keys
                for line in differences(expected.get(key), actual.get(key), f"{where}.{key}")]
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [line for index, pair in enumerate(zip(expected, actual, strict=True))
                for line in differences(*pair, f"{where}[{index}]")]
    numbers = all(isinstance(value, (int, float)) and not isinstance(value, bool)
                  for value in (expected, actual))
    same = math.isclose(expected, actual, rel_tol=1e-9, abs_tol=1e-12) if numbers else expected == actual
    return [] if same else [f"{where or '.'}: committed {expected!r}, now {actual!r}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=Path, default=REPO_ROOT / PLAN)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / SLUG)
    parser.add_argument("--check", action="store_true", help="compare with the committed file; write nothing")
    args = parser.parse_args(argv)
    target = args.out / "predicted-before-gpu.json"
    try:
        require(not args.check or target.is_file(), f"--out: no {target} to check")
        fresh = document(args.plan)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.check:
        moved = differences(figures_of(json.loads(target.read_text(encoding="utf-8"))), figures_of(fresh))
        print("\n".join(moved) or f"{target}: every figure reproduced")
        return 1 if moved else 0
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(target, json.dumps(fresh, indent=2) + "\n")
    write_text_atomic(target.with_suffix(".md"), markdown(fresh))
    print(f"wrote {target} and {target.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
