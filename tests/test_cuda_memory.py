"""The GPU memory model (modelwright.planner.cuda): the caching allocator's rounding on hand-made cases, each
tensor of a rehearsed peak rounded, the committed H200 predictions reproduced by rehearsing the rows again,
and, on a CUDA machine, the allocator's rules and the cuBLAS workspaces read off the real allocator."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from datetime import datetime

import pytest
import torch

from modelwright import REPO_ROOT
from modelwright.measure.memtracker import TRACKER_TO_CATEGORY
from modelwright.measure.rehearsal import CATEGORIES, Rehearsal, Timeline
from modelwright.planner import cuda
from modelwright.planner.memory import MIB

PREDICTIONS = REPO_ROOT / "results" / "cuda-nvidia-h200" / "predicted-before-gpu.json"
KIB = 1024

# (request bytes, rounded, small pool, segment cudaMalloc'd for it, allocated from a fresh segment)
ALLOCATOR_CASES = [
    (0, 0, False, 0, 0),
    (1, 512, True, 2 * MIB, 512),
    (512, 512, True, 2 * MIB, 512),
    (513, 1024, True, 2 * MIB, 1024),
    (MIB, MIB, True, 2 * MIB, MIB),  # 1 MiB is still small (kSmallSize)
    (MIB + 1, MIB + 512, False, 20 * MIB, MIB + 512),
    (9 * MIB + MIB // 2, 9 * MIB + MIB // 2, False, 20 * MIB, 9 * MIB + MIB // 2),  # rest 10.5 MiB: split
    (10 * MIB - 512, 10 * MIB - 512, False, 20 * MIB, 10 * MIB - 512),
    (10 * MIB - 1, 10 * MIB, False, 10 * MIB, 10 * MIB),  # the segment is sized from the rounded request
    (10 * MIB, 10 * MIB, False, 10 * MIB, 10 * MIB),  # kMinLargeAlloc: a segment of its own size
    (10 * MIB + 1, 10 * MIB + 512, False, 12 * MIB, 10 * MIB + 512),  # rest just under 2 MiB: split
    (12 * MIB + MIB // 2, 12 * MIB + MIB // 2, False, 14 * MIB, 12 * MIB + MIB // 2),  # rest 1.5 MiB: split
    (13 * MIB, 13 * MIB, False, 14 * MIB, 14 * MIB),  # rest exactly 1 MiB: not split, counted allocated
    (19 * MIB + MIB // 2, 19 * MIB + MIB // 2, False, 20 * MIB, 20 * MIB),  # rest 0.5 MiB: not split
]


@pytest.mark.parametrize(("request_bytes", "rounded", "small", "segment", "fresh"), ALLOCATOR_CASES)
def test_the_allocator_rounding_as_documented(request_bytes, rounded, small, segment, fresh):
    assert cuda.rounded_request(request_bytes) == rounded
    assert cuda.is_small(request_bytes) is small
    assert cuda.segment_bytes(request_bytes) == segment
    assert cuda.fresh_block_bytes(request_bytes) == fresh


def _rehearsal(tensors_small: list[tuple[str, int]], tensors_large: list[tuple[str, int]],
               module_types: frozenset[str] = frozenset()) -> Rehearsal:
    """A rehearsal by hand: one operation, after which these tensors (MemTracker's type, bytes) are alive, at
    micro-batches 2 and 4."""
    def timeline(batch: int, tensors: list[tuple[str, int]]) -> Timeline:
        counted = dict.fromkeys(CATEGORIES, 0)
        for kind, size in tensors:
            category = TRACKER_TO_CATEGORY[kind]
            if category in counted:
                counted[category] += size
        alive = tuple((0, None, ((0, kind),), size) for kind, size in tensors)
        return Timeline(batch, (counted,), ("op",), alive)

    return Rehearsal.of([timeline(2, tensors_small), timeline(4, tensors_large)], "by hand", module_types)


def test_each_tensor_alive_at_the_peak_is_rounded_to_its_block_at_the_runs_batch():
    # a weight of 40 B, its gradient, an activation of 1 KiB + 1 B a sample, the data: 100 B a sample
    small = [("Parameter", 40), ("Gradient", 40), ("Activation", 1024 + 2), ("Inputs", 100)]
    large = [("Parameter", 40), ("Gradient", 40), ("Activation", 1024 + 4), ("Inputs", 200)]
    peak = cuda.predict_cuda_peak(_rehearsal(small, large), 1024, "32-true")
    figures = {category: figure.mib * MIB for category, figure in peak.categories.items()}
    assert figures == {"parameters": 512, "gradients": 512, "activations": 2048, "inputs": 51200}
    assert peak.cudnn_workspace_max_mib * MIB == 2048  # the largest activation
    assert peak.beside_tensors == {}
    # the small pool holds the weight and its gradient in one 2 MiB segment
    assert peak.small_pool_slack_mib * MIB == 2 * MIB - 1024
    assert peak.allocated_mib * MIB == 512 + 512 + 2048 + 51200


@pytest.mark.parametrize(("types", "precision", "beside"), [
    (frozenset({"Conv2d"}), "32-true", set()),
    (frozenset({"Linear"}), "bf16-mixed", {"cublas_workspace_forward", "cublaslt_workspace",
                                           "cublas_workspace_backward"}),
    (frozenset({"Conv2d"}), "16-mixed", {"grad_scaler"}),
])
def test_what_the_allocator_holds_beside_the_tensors(types, precision, beside):
    rehearsal = _rehearsal([("Parameter", 40)], [("Parameter", 40)], types)
    assert set(cuda.predict_cuda_peak(rehearsal, 8, precision).beside_tensors) == beside


def test_the_largest_batch_on_a_gpu_fits_and_one_more_does_not():
    rehearsal = _rehearsal([("Activation", 2 * MIB)], [("Activation", 4 * MIB)])  # 1 MiB a sample
    batch = cuda.largest_cuda_batch(rehearsal, "32-true", 100.0)
    assert cuda.predict_cuda_peak(rehearsal, batch, "32-true").allocated_mib <= 100.0
    assert cuda.predict_cuda_peak(rehearsal, batch + 1, "32-true").allocated_mib > 100.0


def _committed() -> dict:
    return json.loads(PREDICTIONS.read_text(encoding="utf-8"))


# That the committed file is what scripts/predict_cuda.py writes now (its --check, about 100 s of rehearsals on an
# AVX2 CPU) is checked once, by the GPU call's rehearsal: tests/test_scripts.py::test_check_imports_resolves_the_plans.


def test_the_h200_predictions_say_what_each_figure_rests_on_and_what_is_not_predicted():
    predicted = _committed()
    assert predicted["predicted_by"]["commit"]
    assert [row["run"] for row in predicted["rows"]] == ["baseline", "amp", "amp-fp16", "accumulate",
                                                         "checkpointing-block", "all"]
    for row in predicted["rows"]:
        figures = [*row["categories_mib"].values(), *row["beside_tensors_mib"].values(), row["cudnn_workspace_mib"]]
        assert {figure["basis"] for figure in figures} <= {"modelled", "assumed", "guessed"}
        assert row["allocated_mib"] <= row["allocated_upper_mib"] and row["allocated_mib"] <= row["reserved_floor_mib"]
        assert row["rehearsal"]["method"] == "rehearsal"
    assert {row["run"] for row in predicted["not_predicted"]} >= {"ddp"}


def _predict_command():
    """scripts/predict_cuda.py as a module (its ``main`` takes an argument list)."""
    spec = importlib.util.spec_from_file_location("predict_cuda", REPO_ROOT / "scripts" / "predict_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_predictions_command_refuses_a_missing_plan_in_one_line(tmp_path, capsys):
    assert _predict_command().main(["--plan", str(tmp_path / "none.yaml"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "plan" in err
    assert not (tmp_path / "predicted-before-gpu.json").exists()


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False)


def test_no_gpu_record_is_older_than_the_predictions():
    """Every GPU record was made after the predictions, and committed in a commit that descends from theirs (the
    GPU machine's copy of the tree has no git history, so the records themselves may name no commit)."""
    predicted = _committed()
    made = datetime.fromisoformat(predicted["predicted_by"]["created_at"])
    record_files = sorted(REPO_ROOT.glob("results/cuda-*/**/records.jsonl"))
    for records in record_files:
        for line in records.read_text(encoding="utf-8").splitlines():
            created = datetime.fromisoformat(json.loads(line)["created_at"])
            assert created > made, f"{records}: a record of {created} is older than the predictions ({made})"
    added = _git("log", "--diff-filter=A", "--format=%H", "--", str(PREDICTIONS.relative_to(REPO_ROOT)))
    if added.returncode != 0 or not added.stdout.strip():
        pytest.skip("no git history here: the commits' order is not checked")
    first = added.stdout.split()[-1]
    for records in record_files:
        commits = _git("log", "--format=%H", "--", str(records.relative_to(REPO_ROOT))).stdout.split()
        for commit in commits:
            assert _git("merge-base", "--is-ancestor", first, commit).returncode == 0, (records, commit)


def _on_a_fresh_gpu(code: str) -> object:
    """What ``code`` prints (JSON) in a fresh process: an allocator that nothing else has used."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_allocator_rules_on_the_real_allocator():
    sizes = [case[0] for case in ALLOCATOR_CASES]
    measured = _on_a_fresh_gpu(f"""
        import json, torch
        rows = []
        for size in {sizes}:
            torch.cuda.empty_cache()
            allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            block = torch.empty(size, dtype=torch.uint8, device="cuda")
            rows.append([torch.cuda.memory_allocated() - allocated, torch.cuda.memory_reserved() - reserved])
            del block
        print(json.dumps(rows))
    """)
    expected = [[fresh, segment] for _, _, _, segment, fresh in ALLOCATOR_CASES]
    assert measured == expected


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cublas_workspaces_as_the_predictions_assume():
    """A linear layer's first forward allocates the main thread's cuBLAS workspace and cuBLASLt's beside its
    output; its backward, on autograd's device thread, one more cuBLAS workspace (docs/gpu.md)."""
    measured = _on_a_fresh_gpu("""
        import json, torch
        layer = torch.nn.Linear(512, 10).cuda()
        inputs = torch.randn(128, 512, device="cuda", requires_grad=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = layer(inputs)
        forward = torch.cuda.memory_allocated() - before - 128 * 10 * 4  # the output: 5,120 B, ten blocks
        before = torch.cuda.memory_allocated()
        out.sum().backward()
        torch.cuda.synchronize()
        gradients = sum(-(-t.numel() * 4 // 512) * 512 for t in (inputs, layer.weight, layer.bias))
        backward = torch.cuda.memory_allocated() - before - gradients
        print(json.dumps([forward, backward]))
    """)
    forward_mib, backward_mib = (value / MIB for value in measured)
    assert forward_mib == (cuda.CUBLAS_WORKSPACE + cuda.CUBLASLT_WORKSPACE) / MIB, f"forward: {forward_mib} MiB"
    assert backward_mib == cuda.CUBLAS_WORKSPACE / MIB, f"backward: {backward_mib} MiB"
