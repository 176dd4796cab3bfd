"""benchmarks/attention.py: a tiny CPU run of written-out attention vs SDPA, and what its figures must show."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "benchmarks" / "attention.py"
SEQS = (128, 256, 512)
BATCH, HEADS, HEAD_DIM = 2, 4, 16


def _load():
    spec = importlib.util.spec_from_file_location("attention_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(out: Path, *args: str) -> dict:
    bench = _load()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared; one thread keeps the tiny run quick and steady
    try:
        assert bench.main(["--device", "cpu", "--warmup", "1", "--repeats", "1", "--out", str(out), *args]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "attention.json").read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("attention")
    data = _run(out, "--seqs", *map(str, SEQS), "--batch", str(BATCH), "--heads", str(HEADS),
                "--head-dim", str(HEAD_DIM), "--max-seconds", "60")
    return data, out


def _peaks(data: dict, impl: str) -> dict[int, float]:
    return {r["seq"]: r["peak_mib"] for r in data["results"] if r["impl"] == impl and r["status"] == "ok"}


def test_every_seq_measured_and_written(tiny):
    data, out = tiny
    assert (out / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    s = data["settings"]
    assert (s["dtype"], s["batch"], s["heads"], s["head_dim"]) == ("float32", BATCH, HEADS, HEAD_DIM)
    assert data["hardware"]["accelerator"] == "cpu" and data["versions"]["torch"] == torch.__version__
    assert "benchmarks/attention.py" in data["command"] and "--seqs 128 256 512" in data["command"]
    assert set(_peaks(data, "naive")) == set(_peaks(data, "sdpa")) == set(SEQS)
    for r in data["results"]:
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"], r
    # On CPU PyTorch picks its flash kernel when every backend is allowed.
    sdpa = [r for r in data["results"] if r["impl"] == "sdpa"]
    assert all(r["backend"] == "flash" and "MATH" in r["allowed_backends"] for r in sdpa), sdpa


def test_score_matrix_term_is_batch_heads_seq_squared(tiny):
    data, _ = tiny
    for r in data["results"]:
        assert r["score_matrix_mib"] == BATCH * HEADS * r["seq"] ** 2 * 4 / 2**20


def test_naive_peak_holds_the_score_matrix(tiny):
    data, _ = tiny
    for r in data["results"]:
        if r["impl"] == "naive":
            assert r["peak_mib"] >= r["score_matrix_mib"], r


def test_naive_needs_more_memory_than_sdpa_at_the_largest_seq(tiny):
    data, _ = tiny
    naive, sdpa = _peaks(data, "naive")[SEQS[-1]], _peaks(data, "sdpa")[SEQS[-1]]
    assert naive > 2 * sdpa, (naive, sdpa)


def test_naive_grows_quadratically_and_sdpa_does_not(tiny):
    data, _ = tiny
    # Equal seq ratios r: for a + b*S + c*S**2 the later increment over the earlier is r**2 when S**2
    # dominates and r when linear terms do.
    ratio = (SEQS[1] / SEQS[0]) ** 2
    for impl, lo, hi in (("naive", 0.75 * ratio, 1.1 * ratio), ("sdpa", 0.0, 0.75 * ratio)):
        p = _peaks(data, impl)
        growth = (p[SEQS[2]] - p[SEQS[1]]) / (p[SEQS[1]] - p[SEQS[0]])
        assert lo <= growth <= hi, (impl, growth, p)


def test_sdpa_matches_the_written_out_attention(tiny):
    data, _ = tiny
    assert {c["seq"] for c in data["checks"]} == set(SEQS)
    for c in data["checks"]:
        assert c["allclose"] and c["max_rel_diff_out"] < 1e-4 and c["max_rel_diff_grad_in_proj"] < 1e-4, c


def test_compare_fails_on_a_wrong_result():
    bench = _load()
    ref = (torch.ones(4, 4), torch.ones(3))
    assert bench.compare(ref, (ref[0] + 1e-6, ref[1]), tol=1e-4)["allclose"]
    wrong = bench.compare(ref, (ref[0], ref[1] * 1.01), tol=1e-4)
    assert not wrong["allclose"] and wrong["max_rel_diff_grad_in_proj"] == pytest.approx(0.01)


def test_growth_stops_at_max_seconds_and_unsupported_backend_is_recorded(tmp_path):
    data = _run(tmp_path, "--seqs", "32", "64", "--heads", "2", "--head-dim", "8", "--max-seconds", "0",
                "--impls", "naive", "sdpa-efficient")
    rows = {(r["impl"], r["seq"]): r for r in data["results"]}
    # No step is faster than 0 s: naive stops after its first seq; the efficient kernel has no CPU version.
    assert set(rows) == {("naive", 32), ("sdpa-efficient", 32)}
    assert rows["naive", 32]["status"] == "ok" and "max-seconds" in data["stopped"]["naive"]
    assert rows["sdpa-efficient", 32]["status"] == "unsupported"
    assert rows["sdpa-efficient", 32]["allowed_backends"] == ["EFFICIENT_ATTENTION"]
    assert data["checks"] == []
