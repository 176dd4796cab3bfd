"""The planner's arithmetic against published figures, its record adapter and its CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from modelwright import planner
from modelwright.errors import ConfigError
from modelwright.planner import (
    GB,
    MIB,
    Assumptions,
    JobSpec,
    comm_bytes_per_step,
    compare,
    cost_usd,
    param_state_bytes,
    pipeline_bubble_fraction,
    predict_memory_mib,
    predict_record_memory_mib,
    predict_step,
    spec_from_record,
    state_bytes_per_rank,
)


def _record(**techniques) -> dict:
    """A small hand-made record shaped like measure.py's."""
    tech = {
        "model_name": "resnet18",
        "precision": "bf16-mixed",
        "optimizer": "adamw",
        "strategy": "auto",
        "world_size": 1,
        "micro_batch_size": 128,
        "accumulate_grad_batches": 1,
        "gradient_checkpointing": "off",
    }
    tech.update(techniques)
    return {
        "run_id": "r1",
        "status": "ok",
        "loop": "lightning",
        "techniques": tech,
        "memory": {
            "model_parameters": 11_173_962,
            "anatomy_mib": {
                "parameters": 42.6,
                "gradients": 42.6,
                "optimizer_state": 85.3,
                "activations": 256.0,
                "temporaries": 20.0,
            },
        },
        "timing": {"step_time_median_ms": 400.0, "samples_per_s": 320.0},
    }


def test_bytes_per_parameter_table():
    assert param_state_bytes("32-true", "adamw").total == 16
    assert param_state_bytes("32-true", "sgd").total == 12
    assert param_state_bytes("32-true", "sgd-nomomentum").total == 8
    # autocast keeps fp32 weights and grads: our bf16-mixed runs hold what fp32 runs hold
    assert param_state_bytes("bf16-mixed", "adamw").total == 16
    assert param_state_bytes("bf16", "adam").weights == 4
    assert param_state_bytes("bf16-true", "adamw").total == 8
    playbook = param_state_bytes("playbook-mixed", "adamw")
    assert (playbook.weights, playbook.gradients, playbook.optimizer, playbook.total) == (2, 2, 12, 16)
    assert param_state_bytes("playbook-mixed-fp32-grads", "adamw").total == 20
    with pytest.raises(ConfigError, match="precision"):
        param_state_bytes("8-true", "adamw")


@pytest.mark.parametrize(
    ("strategy", "expected_gb"), [("dp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("fsdp", 1.9)]
)
def test_zero_paper_example(strategy, expected_gb):
    """ZeRO paper, Figure 1: 7.5B parameters, N = 64, mixed-precision Adam (k = 12)."""
    state = param_state_bytes("playbook-mixed", "adamw")
    per_rank = state_bytes_per_rank(7.5e9, state, strategy, 64)
    assert sum(per_rank.values()) / GB == pytest.approx(expected_gb, abs=0.05)


def test_zero3_sends_one_and_a_half_times_dp():
    spec = JobSpec(num_params=1_000_000, precision="32-true", optimizer="adamw")
    dp = comm_bytes_per_step(spec, "dp", 8)
    assert dp == pytest.approx(2 * 1_000_000 * 4 * 7 / 8)
    assert comm_bytes_per_step(spec, "fsdp", 8) / dp == pytest.approx(1.5)
    assert comm_bytes_per_step(spec, "zero1", 8) == pytest.approx(dp)
    assert comm_bytes_per_step(spec, "dp", 1) == 0.0


def test_pipeline_bubble():
    assert pipeline_bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert pipeline_bubble_fraction(4, 8, interleave=2) == pytest.approx(3 / 16)
    assert pipeline_bubble_fraction(1, 8) == 0.0


def test_step_time_cost_and_throughput():
    spec = JobSpec(num_params=1_000_000, micro_batch_size=100, step_time_ms=1000.0)
    one = predict_step(spec, "dp", 1)
    assert one.step_s == pytest.approx(1.0) and one.samples_per_s == pytest.approx(100.0)
    # 1 GB/s, nothing overlapped: DP at 8 adds 2·Ψ·4 B·7/8 = 7 ms of communication
    slow = Assumptions(bus_bandwidth_gb_per_s=1.0, overlap_fraction=0.0)
    eight = predict_step(spec, "dp", 8, slow)
    assert eight.comm_s == pytest.approx(0.007)
    assert eight.samples_per_s == pytest.approx(800 / 1.007)
    # fully overlapped communication is hidden behind the 1 s of compute
    hidden = Assumptions(bus_bandwidth_gb_per_s=1.0, overlap_fraction=1.0)
    assert predict_step(spec, "dp", 8, hidden).step_s == pytest.approx(1.0)
    # 8 devices × 10 h × $2.50
    assert cost_usd(8, 10.0, 2.5) == pytest.approx(200.0)
    assert planner.train_time_s(100.0, epochs=2, dataset_size=500) == pytest.approx(10.0)
    pp = predict_step(spec, "pp", 4, Assumptions(pp_microbatches=8))
    assert pp.compute_s == pytest.approx(8 * 1.0 / 4 * (1 + 3 / 8))


def test_tp_and_pp_memory():
    spec = JobSpec(num_params=1_000_000, micro_batch_size=10, activation_bytes_per_sample=MIB)
    full = predict_memory_mib(spec, "dp", 4)
    tp = predict_memory_mib(spec, "tp", 4, Assumptions(tp_activation_sharded_fraction=1.0))
    assert tp["parameters"] == pytest.approx(full["parameters"] / 4)
    assert tp["activations"] == pytest.approx(10 / 4)
    # 1F1B: min(p, m) micro-batches in flight, each 1/p of the model
    pp = predict_memory_mib(spec, "pp", 4, Assumptions(pp_microbatches=2))
    assert pp["activations"] == pytest.approx(10 * 2 / 4)
    assert pp["total"] == pytest.approx(sum(v for k, v in pp.items() if k != "total"))


def test_spec_from_record_and_prediction_beside_measurement():
    record = _record()
    spec = spec_from_record(record)
    assert spec.num_params == 11_173_962
    assert spec.precision == "bf16-mixed" and spec.optimizer == "adamw"
    assert spec.activation_bytes_per_sample == pytest.approx(2 * MIB)
    assert spec.step_time_ms == pytest.approx(400.0)
    predicted = predict_record_memory_mib(record)
    assert predicted["parameters"] == pytest.approx(11_173_962 * 4 / MIB)
    errors = compare(predicted, planner.measured_memory_mib(record))
    assert abs(errors["total"]) < 0.10
    assert abs(errors["activations"]) < 1e-9
    fsdp = predict_record_memory_mib(record, "fsdp", 2)
    assert fsdp["optimizer_state"] == pytest.approx(predicted["optimizer_state"] / 2)


def test_spec_from_record_accumulation_and_missing_keys():
    # 400 ms at 320 samples/s is 128 samples: one micro-batch, so a step of 4 micro-batches is 1.6 s
    spec = spec_from_record(_record(accumulate_grad_batches=4))
    assert spec.step_time_ms == pytest.approx(1600.0)
    record = _record()
    del record["memory"]["model_parameters"]
    with pytest.raises(KeyError, match="memory.model_parameters"):
        spec_from_record(record)


def test_compare():
    errors = compare({"total": 110.0, "activations": 0.0}, {"total": 100.0, "activations": 0.0})
    assert errors == {"total": pytest.approx(0.10), "activations": 0.0}
    assert math.isinf(compare({"a": 1.0}, {"a": 0.0})["a"])


def test_cli_prints_markdown(tmp_path):
    numbers = ["--params", "11173962", "--activation-mib-per-sample", "4", "--step-time-ms", "3000"]
    out = subprocess.run(
        [sys.executable, "-m", "modelwright", "plan", *numbers, "--devices", "1", "8"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=tmp_path,
    ).stdout
    assert "FSDP" in out and "| ZeRO-2 | 8 |" in out
    assert "2026-05" in out
    records = tmp_path / "records.jsonl"
    records.write_text(
        json.dumps(_record(strategy="ddp", world_size=2)) + "\n" + json.dumps(_record()) + "\n"
    )
    from_record = subprocess.run(
        [sys.executable, "-m", "modelwright", "plan", "--record", str(records), "--devices", "1", "8"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    assert "FSDP" in from_record
    assert "r1" in planner.markdown_tables(spec_from_record(planner.load_record(records)), devices=[1, 8])


def test_cli_without_numbers_or_records_says_what_it_needs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "modelwright", "plan"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "--record" in proc.stderr




def test_cli_bad_argument_names_the_flag():
    result = subprocess.run(
        [sys.executable, "-m", "modelwright", "plan", "--devices", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--devices" in result.stderr.strip().splitlines()[-1]
