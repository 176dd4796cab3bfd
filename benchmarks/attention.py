"""Memory-efficient attention: peak memory and step time against sequence length, written out vs SDPA.

To run: ``uv run python benchmarks/attention.py`` (CPU, fp32, batch 1, the small ViT's 6 heads of 32 dims,
sequences 256..8192; about 3 minutes on a 2-core CPU); on a GPU
``uv run python benchmarks/attention.py --device cuda --dtype bfloat16 --batch 8 --seqs 1024 2048 4096 8192 16384 32768
--impls naive sdpa sdpa-flash sdpa-efficient sdpa-math``.

One self-attention block, ``nn.MultiheadAttention`` as the small ViT builds it
(:class:`modelwright.train.models.SmallViT`: its heads and head dimension are the defaults), runs forward and
backward with its attention core computed two ways on the same weights and input:

* ``naive``: attention written out, ``softmax(Q K^T / sqrt(d)) V``. The full ``batch x heads x seq x seq`` score
  matrix is materialised, and autograd keeps the softmax output for backward, so memory grows with ``seq**2``;
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with every backend allowed (PyTorch picks; the ViT
  runs this path). ``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn`` and ``sdpa-math`` allow one backend each
  (``torch.nn.attention.sdpa_kernel``). Flash and memory-efficient kernels compute the softmax block by block and
  keep only a per-row log-sum-exp for backward, so their memory grows with ``seq``. The kernel that ran is recorded
  from the ATen ops dispatched in the first warm-up step (no fused op seen means the math path, which is
  ``bmm`` + ``softmax`` like ``naive``).

Per (impl, seq): the median step time (forward + backward) over ``--repeats`` steps after ``--warmup`` steps, with
the min-max spread, the device synchronized around each step; then one more step for peak memory. Peak memory is
the highest tensor memory during that step, parameters and their gradients included, the input excluded: on CPU
PyTorch's MemTracker (:class:`modelwright.measure.MemoryAnatomy`, which also splits it into activations and
temporaries), on CUDA ``torch.cuda.max_memory_allocated`` minus what was allocated before the step, plus the
parameters. Beside it stands the expected quadratic term, the bytes of one score matrix
(``batch * heads * seq**2 * dtype bytes``), computed from the shapes alone. The outputs and the gradient of the
input projection from that step are compared with ``naive``'s (``allclose`` within a tolerance for the dtype) and
stored under ``checks``.

An impl stops growing once its median step exceeds ``--max-seconds``, or when it ran out of memory (CUDA), or,
on CPU, when its last peak scaled by ``seq**2`` would not fit in free memory (a CPU out-of-memory kills the process).
Results: ``results/<hardware slug>/attention.json`` and ``attention.png`` (``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT / "src") not in sys.path:  # `modelwright` without an install
    sys.path.insert(0, str(REPO_ROOT / "src"))

from modelwright.measure import (  # noqa: E402
    MIB,
    MemoryAnatomy,
    StepTimer,
    device_sync,
    error_status,
    hardware_info,
    one_line_error,
    reset_peak_memory,
    versions,
)
from modelwright.record import provenance, write_record  # noqa: E402

IMPLS = ("naive", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Relative tolerance (to the largest reference magnitude) for naive vs SDPA; 16-bit softmax in `naive` rounds
# the probabilities where fused kernels keep them in fp32.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 1e-2}


def vit_attention_shape() -> tuple[int, int]:
    """Heads and head dimension of the small ViT's attention (the defaults)."""
    from modelwright.train.models import SmallViT

    attn = SmallViT().encoder.layers[0].self_attention
    return attn.num_heads, attn.head_dim


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(Q K^T / sqrt(d)) V`` with the whole score matrix in memory."""
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def sdpa_backends(impl: str) -> list | None:
    """The ``SDPBackend`` list ``impl`` allows, or None for PyTorch's own choice among all enabled ones."""
    one = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
           "math": "MATH"}
    return None if impl == "sdpa" else [getattr(SDPBackend, one[impl.removeprefix("sdpa-")])]


def allowed_backends(impl: str) -> list[str] | None:
    """What ``impl`` let PyTorch choose from (None for ``naive``)."""
    if impl == "naive":
        return None
    backends = sdpa_backends(impl)
    if backends is not None:
        return [b.name for b in backends]
    flags = {"FLASH_ATTENTION": torch.backends.cuda.flash_sdp_enabled(),
             "EFFICIENT_ATTENTION": torch.backends.cuda.mem_efficient_sdp_enabled(),
             "CUDNN_ATTENTION": torch.backends.cuda.cudnn_sdp_enabled(),
             "MATH": torch.backends.cuda.math_sdp_enabled()}
    return [name for name, on in flags.items() if on]


class AttentionBlock(nn.Module):
    """Self-attention on the ViT's module (``nn.MultiheadAttention``'s projections) with a swappable core."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads = heads
        self.mha = nn.MultiheadAttention(heads * head_dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor, core: Callable[..., torch.Tensor]) -> torch.Tensor:
        b, s, e = x.shape
        qkv = F.linear(x, self.mha.in_proj_weight, self.mha.in_proj_bias)
        q, k, v = qkv.view(b, s, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        out = core(q, k, v).transpose(1, 2).reshape(b, s, e)
        return self.mha.out_proj(out)


class _OpNames(TorchDispatchMode):
    """Collects the names of the ATen ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def backend_from_ops(names: set[str]) -> tuple[str, list[str]]:
    """The SDPA backend that ran, from the ops seen, and the fused attention ops among them."""
    fused = sorted(n for n in names if "attention" in n and "backward" not in n)
    for key, backend in (("flash", "flash"), ("efficient", "efficient"), ("cudnn", "cudnn"), ("overrideable",
                                                                                             "overrideable")):
        if any(key in n for n in fused):
            return backend, fused
    return "math", fused


def score_matrix_bytes(batch: int, heads: int, seq: int, dtype: torch.dtype) -> int:
    """Bytes of one ``batch x heads x seq x seq`` score matrix: the term that makes written-out attention quadratic."""
    return batch * heads * seq * seq * (torch.finfo(dtype).bits // 8)


def free_host_bytes() -> int:
    """Physical memory free now (a CPU run's ceiling)."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Runner:
    """Runs one impl's steps on one block and input: timing, backend, peak memory, outputs for the check."""

    def __init__(self, block: AttentionBlock, device: torch.device, impl: str) -> None:
        self.block, self.device, self.impl = block, device, impl
        self.core = naive_attention if impl == "naive" else F.scaled_dot_product_attention
        backends = None if impl == "naive" else sdpa_backends(impl)
        self.context = nullcontext if backends is None else partial(sdpa_kernel, backends)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        for p in self.block.parameters():
            p.grad = None
        with self.context():
            out = self.block(x, self.core)
            out.float().sum().backward()
        return out

    def timed(self, x: torch.Tensor, warmup: int, repeats: int) -> tuple[dict[str, Any], str | None, list[str]]:
        """Median and spread of ``repeats`` steps after ``warmup``; the backend seen in the first step."""
        timer = StepTimer(warmup_steps=warmup, measure_steps=repeats, sync=device_sync(self.device))
        ops = _OpNames()
        for i in range(warmup + repeats):
            timer.start()
            with ops if i == 0 else nullcontext():
                self.step(x)
            timer.stop()
        backend, fused = backend_from_ops(ops.names)
        ms = [d * 1e3 for d in timer.durations_s]
        summary = timer.summary()
        return ({"median_ms": summary["step_time_median_ms"], "min_ms": summary["step_time_min_ms"],
                 "max_ms": summary["step_time_max_ms"], "times_ms": ms},
                None if self.impl == "naive" else backend, fused)

    def peak(self, x: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
        """Peak tensor memory of one step (MiB); the step's output and input-projection gradient."""
        param_bytes = sum(p.numel() * p.element_size() for p in self.block.parameters())
        if self.device.type == "cuda":
            for p in self.block.parameters():
                p.grad = None
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            reset_peak_memory(self.device)
            out = self.step(x)
            torch.cuda.synchronize(self.device)
            raw = torch.cuda.max_memory_allocated(self.device)
            mem = {"peak_mib": (raw - before + param_bytes) / MIB, "max_memory_allocated_mib": raw / MIB}
        else:
            anatomy = MemoryAnatomy(device=self.device)
            with anatomy.capture(self.block):
                out = self.step(x)
            peak = anatomy.peak_mib()
            mem = {"peak_mib": peak["total"], "anatomy_at_peak_mib": peak}
        return mem, out.detach().float(), self.block.mha.in_proj_weight.grad.detach().float()


def compare(ref: tuple[torch.Tensor, torch.Tensor], got: tuple[torch.Tensor, torch.Tensor], tol: float) -> dict:
    """``got`` vs ``ref`` (output, input-projection gradient): max differences relative to the reference's scale."""
    out: dict[str, Any] = {"tolerance_rel": tol}
    ok = True
    for name, r, g in (("out", ref[0], got[0]), ("grad_in_proj", ref[1], got[1])):
        scale = r.abs().max().item()
        diff = (r - g).abs().max().item()
        out[f"max_abs_diff_{name}"] = diff
        out[f"max_rel_diff_{name}"] = diff / scale if scale else diff
        ok = ok and torch.allclose(g, r, rtol=tol, atol=tol * scale)
    out["allclose"] = bool(ok)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every impl over the growing sequences; returns the results dict (also written to ``--out``)."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    block = AttentionBlock(args.heads, args.head_dim).to(device=device, dtype=dtype)
    embed = args.heads * args.head_dim
    runners = {impl: Runner(block, device, impl) for impl in args.impls}
    stopped: dict[str, str] = {}
    results: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    last_peak: dict[str, tuple[int, float]] = {}
    t0 = time.perf_counter()
    print(f"{'impl':<15}{'seq':>7}{'peak MiB':>11}{'scores MiB':>12}{'peak/scores':>13}{'median ms':>11}"
          f"{'min-max ms':>20}  backend")
    for seq in args.seqs:
        score_mib = score_matrix_bytes(args.batch, args.heads, seq, dtype) / MIB
        x = torch.randn(args.batch, seq, embed, device=device, dtype=dtype)
        outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for impl, runner in runners.items():
            if impl in stopped:
                continue
            row: dict[str, Any] = {"impl": impl, "seq": seq, "score_matrix_mib": score_mib,
                                   "allowed_backends": allowed_backends(impl)}
            if device.type == "cpu":
                # Upper bound: no impl grows faster than seq**2 (the first guess: a few score matrices).
                s0, p0 = last_peak.get(impl, (seq, 4 * score_mib))
                need = p0 * (seq / s0) ** 2 * MIB
                if need > 0.8 * free_host_bytes():
                    stopped[impl] = f"seq {seq} would need ~{need / MIB:.0f} MiB, more than free memory"
                    results.append({**row, "status": "skipped", "reason": stopped[impl]})
                    print(f"{impl:<15}{seq:>7}  skipped: {stopped[impl]}")
                    continue
            try:
                timing, backend, fused = runner.timed(x, args.warmup, args.repeats)
                mem, out, grad = runner.peak(x)
            except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
                oom = error_status(err) == "oom"
                if not oom and impl == "naive":
                    raise
                # A backend allowed alone may not support this device, dtype or shape ("No available kernel").
                status = "oom" if oom else "unsupported"
                stopped[impl] = f"out of memory at seq {seq}" if oom else one_line_error(err)
                results.append({**row, "status": status, "reason": stopped[impl]})
                print(f"{impl:<15}{seq:>7}  {status}: {stopped[impl][:100]}")
                continue
            outputs[impl] = (out, grad)
            last_peak[impl] = (seq, mem["peak_mib"])
            row.update(status="ok", backend=backend, fused_ops=fused, **mem,
                       peak_over_score_matrix=mem["peak_mib"] / score_mib, **timing)
            results.append(row)
            print(f"{impl:<15}{seq:>7}{mem['peak_mib']:>11.1f}{score_mib:>12.1f}{row['peak_over_score_matrix']:>13.2f}"
                  f"{timing['median_ms']:>11.1f}{timing['min_ms']:>10.1f}-{timing['max_ms']:<9.1f}  "
                  f"{backend or '-'}")
            if timing["median_ms"] > args.max_seconds * 1e3:
                stopped[impl] = f"step at seq {seq} took {timing['median_ms'] / 1e3:.1f} s > --max-seconds"
        if "naive" in outputs:
            for impl, got in outputs.items():
                if impl != "naive":
                    checks.append({"seq": seq, "impl": impl, "reference": "naive",
                                   **compare(outputs["naive"], got, TOLERANCE[args.dtype])})
        del x, outputs
        if len(stopped) == len(runners):
            break

    command = ["uv", "run", "python", "benchmarks/attention.py", *args.argv]
    data = {
        "benchmark": "attention",
        "command": shlex.join(command),
        "provenance": provenance(command),
        "hardware": hardware_info(device),
        "versions": versions(),
        "settings": {
            "device": device.type, "dtype": args.dtype, "batch": args.batch, "heads": args.heads,
            "head_dim": args.head_dim, "embed_dim": embed, "seqs_requested": args.seqs, "impls": args.impls,
            "warmup_steps": args.warmup, "repeats": args.repeats, "max_seconds": args.max_seconds,
            "torch_threads": torch.get_num_threads(),
            "step": "forward + backward of one nn.MultiheadAttention block (in/out projections included)",
            "peak_memory": ("torch.cuda.max_memory_allocated during the step - allocated before + parameters"
                            if device.type == "cuda" else "MemTracker peak total (parameters, gradients, "
                            "activations, temporaries; input excluded)"),
            "score_matrix": "batch * heads * seq**2 * dtype bytes, from the shapes",
        },
        "results": results,
        "checks": checks,
        "stopped": stopped,
        "wall_time_s": time.perf_counter() - t0,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out_dir = Path(args.out)
    write_record(out_dir / "attention.json", data, validate=False)
    plot(data, out_dir / "attention.png")
    bad = [c for c in checks if not c["allclose"]]
    print(f"checks: {len(checks) - len(bad)}/{len(checks)} allclose to naive"
          + (f"; NOT close: {[(c['impl'], c['seq']) for c in bad]}" if bad else ""))
    print(f"results: {os.path.relpath(out_dir / 'attention.json')}, {os.path.relpath(out_dir / 'attention.png')}")
    return data


def plot(data: dict[str, Any], path: Path) -> None:
    """Two log-log panels: peak MiB (with the score matrix's bytes) and step ms against sequence length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = data["settings"]
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    ok = [r for r in data["results"] if r["status"] == "ok"]
    for impl in s["impls"]:
        rows = [r for r in ok if r["impl"] == impl]
        if not rows:
            continue
        backend = rows[-1]["backend"]
        label = impl + (f" ({backend})" if backend and impl == "sdpa" else "")
        if impl in data["stopped"] and "memory" in data["stopped"][impl]:
            label += f", {data['stopped'][impl]}"
        seqs = [r["seq"] for r in rows]
        mem_ax.plot(seqs, [r["peak_mib"] for r in rows], marker="o", label=label)
        time_ax.plot(seqs, [r["median_ms"] for r in rows], marker="o", label=label)
        time_ax.fill_between(seqs, [r["min_ms"] for r in rows], [r["max_ms"] for r in rows], alpha=0.2)
    seqs = sorted({r["seq"] for r in data["results"]})
    mem_ax.plot(seqs, [score_matrix_bytes(s["batch"], s["heads"], q, DTYPES[s["dtype"]]) / MIB for q in seqs],
                "k--", lw=1, label="one score matrix (B·H·S²·bytes)")
    for ax, ylabel in ((mem_ax, "peak tensor memory (MiB)"), (time_ax, "forward + backward step (ms, median)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Attention on {data['hardware']['device_name']}: {s['dtype']}, batch {s['batch']}, "
                 f"{s['heads']} heads x {s['head_dim']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192],
                   help="sequence lengths, grown in this order")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="default: the small ViT's (6)")
    p.add_argument("--head-dim", type=int, default=None, help="default: the small ViT's (32)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=["naive", "sdpa"])
    p.add_argument("--warmup", type=int, default=1, help="untimed steps (the first records the kernel that ran)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-seconds", type=float, default=2.0,
                   help="an impl stops growing once its median step takes longer than this")
    p.add_argument("--out", type=Path, default=None, help="folder (default: results/<hardware slug>)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    for name in ("batch", "repeats", "warmup", "heads", "head_dim"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device: cuda, but no CUDA device is visible")
    if args.heads is None or args.head_dim is None:
        heads, head_dim = vit_attention_shape()
        args.heads = args.heads or heads
        args.head_dim = args.head_dim or head_dim
    if args.out is None:
        from modelwright import REPO_ROOT as root
        from modelwright.study import hardware_slug

        args.out = root / "results" / hardware_slug(args.device)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
