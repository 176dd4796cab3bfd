"""The GPU memory model (modelwright.planner.cuda): the caching allocator's rounding on hand-made cases, the
committed H200 predictions reproduced from the committed CPU profile, and, on a CUDA machine, the allocator's
rules and the cuBLAS workspaces read off the real allocator."""

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
from modelwright.planner import cuda
from modelwright.planner.memory import MIB, step_setup
from modelwright.planner.step_profile import read_profile

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


def test_resident_blocks_round_each_tensor_and_count_the_optimizer_words():
    profile = read_profile({"profile": {"batch_size": 8, "parameters": 74, "largest_param_bytes": 256,
                                        "units": [], "storages": [], "segments": {}, "peak_bytes": {}}})
    resident = cuda.Resident(parameter_bytes=(40, 256), buffer_bytes=(8,))
    blocks = cuda.state_blocks(profile, {"model.optimizer": "adamw"}, resident)
    assert cuda.rounding_bytes(blocks.parameters) == (512 - 40) + (512 - 256)
    assert len(blocks.optimizer_state) == 4  # AdamW: two moments per parameter
    assert blocks.small_bytes() == (2 + 2 + 4 + 1) * 512  # weights, gradients, moments, the buffer: 512 B each
    sgd = cuda.state_blocks(profile, {"model.optimizer": "sgd", "model.momentum": 0.9}, resident)
    assert len(sgd.optimizer_state) == 2


def test_auto_optimizer_is_foreach_on_cuda_only():
    profile = read_profile(json.loads((REPO_ROOT / "results/cpu-amd-epyc-avx2-2cores/profile.json").read_text()))
    assert step_setup(profile, {"trainer.accelerator": "cuda"}).optimizer_impl == "foreach"
    assert step_setup(profile, {"trainer.accelerator": "cpu"}).optimizer_impl == "auto"
    assert step_setup(profile, {"trainer.accelerator": "cuda", "model.optimizer_impl": "fused"}).optimizer_impl \
        == "fused"


def _committed() -> tuple[dict, dict]:
    predicted = json.loads(PREDICTIONS.read_text(encoding="utf-8"))
    profile = json.loads((REPO_ROOT / predicted["profile"]["path"]).read_text(encoding="utf-8"))
    return predicted, profile


def test_the_committed_h200_predictions_are_reproduced_from_the_committed_profile():
    predicted, profile = _committed()
    assert [row["run"] for row in predicted["rows"]] == ["baseline", "amp", "amp-fp16", "accumulate",
                                                         "checkpointing-block", "all"]
    for row in predicted["rows"]:
        resident = cuda.resident_of(row["config"]["model.model_name"])
        again = cuda.peak_json(cuda.predict_cuda_peak(profile, row["config"], resident))
        for key in ("allocated_mib", "allocated_upper_mib", "reserved_floor_mib"):
            assert again[key] == pytest.approx(row[key], rel=1e-9), (row["run"], key)
        for category, figure in row["categories_mib"].items():
            repeated = again["categories_mib"][category]
            assert repeated["mib"] == pytest.approx(figure["mib"], rel=1e-9), (row["run"], category)
            assert repeated["basis"] == figure["basis"]
        assert again["beside_tensors_mib"] == row["beside_tensors_mib"]
    budget = predicted["budget"]
    for row in budget["rows"]:
        config = next(found["config"] for found in predicted["rows"] if found["run"] == row["run"])
        config = {**config, "trainer.accumulate_grad_batches": 1}
        resident = cuda.resident_of(config["model.model_name"])
        assert cuda.largest_cuda_batch(profile, config, resident, budget["gib"] * 1024) == row["largest_batch"]


def test_the_h200_predictions_say_what_each_figure_rests_on_and_what_is_not_predicted():
    predicted, _ = _committed()
    assert predicted["predicted_by"]["dirty"] is False and predicted["predicted_by"]["commit"]
    for row in predicted["rows"]:
        figures = [*row["categories_mib"].values(), *row["beside_tensors_mib"].values(), row["cudnn_workspace_mib"]]
        assert {figure["basis"] for figure in figures} <= {"modelled", "assumed", "guessed"}
        assert row["allocated_mib"] <= row["allocated_upper_mib"] and row["allocated_mib"] <= row["reserved_floor_mib"]
        tensors = sum(figure["mib"] for figure in row["categories_mib"].values())
        assert row["allocated_mib"] > tensors  # the batch and the workspaces are on top of the CPU model's tensors
    assert {row["run"] for row in predicted["not_predicted"]} >= {"ddp"}


def _predict_command():
    """scripts/predict_cuda.py as a module (its ``main`` takes an argument list)."""
    spec = importlib.util.spec_from_file_location("predict_cuda", REPO_ROOT / "scripts" / "predict_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("content", "message"), [(None, "no such file"), ("{not json", "is not JSON"),
                                                   ("{}", "holds no 'profile' section")])
def test_the_predictions_command_refuses_a_bad_profile_in_one_line(tmp_path, capsys, content, message):
    profile = tmp_path / "profile.json"
    if content is not None:
        profile.write_text(content, encoding="utf-8")
    assert _predict_command().main(["--profile", str(profile), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--profile" in err and message in err
    assert not (tmp_path / "predicted-before-gpu.json").exists()


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False)


def test_no_gpu_record_is_older_than_the_predictions():
    """Every GPU record was made after the predictions, and committed in a commit that descends from theirs (the
    GPU machine's copy of the tree has no git history, so the records themselves may name no commit)."""
    predicted, _ = _committed()
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
