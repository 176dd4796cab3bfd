"""The planner's arithmetic against published and hand-computed figures, and its command line."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from modelwright import REPO_ROOT
from modelwright.errors import ConfigError
from modelwright.planner import Assumptions, markdown_tables, memory, predict_step, spec_from_record
from modelwright.planner.advisor import choose, machine_warning, options, step_times
from modelwright.planner.memory import (
    ALIASES,
    STRATEGIES,
    VALID_NAMES,
    normalize,
    param_state_bytes,
    state_bytes_per_rank,
)
from modelwright.planner.scale import (
    STRATEGY_LABELS,
    JobSpec,
    cannot_split,
    collective_units,
    comm_bytes_per_step,
    communication_time,
    pipeline_bubble_fraction,
    predict_memory_mib,
)
from modelwright.techniques import PRECISIONS


def test_bytes_per_parameter_table():
    assert param_state_bytes("32-true", "adamw").total == 16
    assert param_state_bytes("32-true", "sgd").total == 12
    assert param_state_bytes("32-true", "sgd-nomomentum").total == 8
    assert param_state_bytes("bf16-mixed", "adamw").total == 16  # autocast keeps fp32 weights and grads
    assert param_state_bytes("bf16-true", "adamw").total == 8
    playbook = param_state_bytes("playbook-mixed", "adamw")
    assert (playbook.weights, playbook.gradients, playbook.optimizer) == (2, 2, 12)
    assert param_state_bytes("playbook-mixed-fp32-grads", "adamw").total == 20
    assert param_state_bytes("bf16-true", "adamw").regime == PRECISIONS["bf16-true"].description
    with pytest.raises(ConfigError, match="^precision: unknown precision '8-true'"):
        param_state_bytes("8-true", "adamw")
    with pytest.raises(ConfigError, match=r"^optimizer: adafactor's state depends on the parameters' shapes; plan "
                                          r"from a record of it \(its measured optimizer state\)$"):
        param_state_bytes("32-true", "adafactor")
    assert param_state_bytes("32-true", "adafactor", optimizer_bytes=1.5).optimizer == 1.5


def test_every_alias_of_the_planner_names():
    """Every alias (Lightning's strategy names, short ones) and every valid name, spelled in any case."""
    for alias, name in ALIASES.items():
        key = "optimizer" if name in VALID_NAMES["optimizer"] else "strategy"
        assert normalize(key, f" {alias.upper()} ") == name
    for key, names in VALID_NAMES.items():
        assert [normalize(key, name) for name in names] == list(names)
    assert normalize("strategy", {"class_path": "lightning.pytorch.strategies.FSDPStrategy"}) == "fsdp"
    assert normalize("strategy", {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}) == "fsdp"
    assert normalize("strategy", {"class_path": "lightning.pytorch.strategies.DDPStrategy"}) == "dp"
    assert normalize("strategy", {"init_args": {}}) == "dp"
    with pytest.raises(ConfigError, match=f"^strategy: unknown 'ring'; valid: {', '.join(STRATEGIES)}$"):
        normalize("strategy", "ring")


def test_the_largest_batch_of_a_rehearsal_and_a_budget_in_bytes(monkeypatch):
    """The batch is the rehearsal's; one of 2**25 samples or more means a budget given in bytes, not MiB."""
    budgets = []

    class Rehearsal:
        def largest_batch(self, budget_mib):
            budgets.append(budget_mib)
            return int(budget_mib)

    monkeypatch.setattr(memory, "rehearsal", lambda config: Rehearsal())
    assert memory.largest_batch({}, 2**25 - 1) == 2**25 - 1 and budgets == [2**25 - 1]
    with pytest.raises(ConfigError, match="^budget_mib: fits more than 32 M samples; is the budget in MiB\\?$"):
        memory.largest_batch({}, 2**25)


@pytest.mark.parametrize(("strategy", "expected_gb"), [("dp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("fsdp", 1.9)])
def test_zero_paper_example(strategy, expected_gb):
    """ZeRO paper, Figure 1: 7.5B parameters, N = 64, mixed-precision Adam (k = 12)."""
    per_rank = state_bytes_per_rank(7.5e9, param_state_bytes("playbook-mixed", "adamw"), strategy, 64)
    assert sum(per_rank.values()) / 1e9 == pytest.approx(expected_gb, abs=0.05)


def test_communication_volumes_by_hand():
    spec = JobSpec(num_params=1_000_000)
    dp = comm_bytes_per_step(spec, "dp", 8)
    assert dp == pytest.approx(2 * 1_000_000 * 4 * 7 / 8)
    assert comm_bytes_per_step(spec, "fsdp", 8) / dp == pytest.approx(1.5)
    assert comm_bytes_per_step(spec, "dp", 1) == 0.0
    # mixed precision: FSDP gathers 16-bit weights (2 B) twice, reduces fp32 gradients (4 B)
    mixed = JobSpec(num_params=1_000_000, precision="bf16-mixed")
    assert comm_bytes_per_step(mixed, "fsdp", 8) == pytest.approx((2 * 2 + 4) * 1_000_000 * 7 / 8)


def test_nvlink_inside_a_node_infiniband_across():
    a = Assumptions(device="H100 SXM")
    assert a.bandwidth(8) == 450.0 and a.bandwidth(16) == 50.0


def test_step_time_latency_overlap_and_bubble():
    spec = JobSpec(num_params=1_000_000, micro_batch_size=100, step_time_ms=1000.0)
    one = predict_step(spec, "dp", 1)
    assert one.step_s == pytest.approx(1.0) and one.samples_per_s == pytest.approx(100.0)
    # 64 ranks cross nodes: 2·4 MB·63/64 at 50 GB/s = 0.1575 ms, plus a ring's 2·63 steps of 5 µs; 4 MB is one
    # bucket, ready only when backward ends: nothing hides it
    ring = predict_step(spec, "dp", 64)
    assert ring.comm_s == pytest.approx(7.875e-3 / 50 + 2 * 63 * 5e-6)
    assert ring.step_s == pytest.approx(1.0 + ring.comm_s)
    # 100 M fp32 parameters: 400 MB in 16 buckets of 25 MiB; the last one's share is exposed, the rest hides
    # behind the backward (2/3 of the step) until that is used up
    big = JobSpec(num_params=100_000_000, micro_batch_size=100, step_time_ms=1000.0)
    slow = predict_step(big, "dp", 64, Assumptions(inter_node_gb_per_s=0.5, overlap_fraction=1.0))
    assert slow.comm_exposed_s == pytest.approx(slow.comm_s / 16 + (slow.comm_s * 15 / 16 - 2 / 3))
    assert slow.step_s == pytest.approx(1.0 + slow.comm_exposed_s)
    assert pipeline_bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert pipeline_bubble_fraction(4, 8, interleave=2) == pytest.approx(3 / 16)
    pp = predict_step(JobSpec(num_params=10, micro_batch_size=1, step_time_ms=1000, num_layers=8), "pp", 4,
                      Assumptions(pp_microbatches=8))
    assert pp.bubble_of_compute == pytest.approx(3 / 8)  # of the ideal compute
    assert pp.bubble_of_step == pytest.approx(3 / (8 + 4 - 1))  # of the whole step


def test_a_pipeline_of_one_stage_is_the_measured_step():
    """PP splits the measured step's batch into micro-batches: at N = 1 it is the measured step, at N = 4
    a quarter of it plus the bubble, always with the measured batch (was: m × the step, m × the samples)."""
    spec = JobSpec(num_params=10, micro_batch_size=128, step_time_ms=3240.0, num_layers=8)
    one = predict_step(spec, "pp", 1)
    assert one.step_s == pytest.approx(3.24) and one.samples_per_step == 128
    assert one.samples_per_s == pytest.approx(predict_step(spec, "dp", 1).samples_per_s)
    four = predict_step(spec, "pp", 4)  # m = 16 micro-batches of 8
    assert four.step_s == pytest.approx(3.24 / 4 * (1 + 3 / 16), rel=1e-3) and four.samples_per_step == 128


def test_tables_price_the_job_and_give_every_row_its_header_width():
    # 8 devices × 100 samples per 1 s step: 50,000 samples in 62.5 s = 500 device-seconds at $2.50/h = $0.35
    spec = JobSpec(num_params=1_000_000, micro_batch_size=100, step_time_ms=1000.0, num_layers=4, min_width=16)
    text = markdown_tables(spec, (1, 8), Assumptions(usd_per_device_hour=2.5), epochs=1)
    assert "| DP (DDP) | 8 |" in text and "| 62.5 s (est.) | $0.35 (est.) |" in text
    assert "$2.50/device-hour given" in text
    # TP over 8 ranks of a 16-channel layer and PP with 8 stages of 4 blocks are refused, with the table intact
    assert "| TP | 8 | TP: the narrowest layer has 16 channels" in text and "| PP | 8 | PP: 8 stages" in text
    for block in text.split("\n\n"):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert all(row.count("|") == rows[0].count("|") for row in rows), block


def test_tp_and_pp_only_where_the_model_splits():
    resnet = JobSpec(num_params=11_173_962, num_layers=8, min_width=64, micro_batch_size=10)
    a = Assumptions()
    assert cannot_split(resnet, "tp", 8, a) is None
    assert "node" in cannot_split(resnet, "tp", 64, a)
    assert "8 blocks" in cannot_split(resnet, "pp", 64, a)
    assert cannot_split(resnet, "dp", 64, a) is None
    tp = predict_memory_mib(JobSpec(num_params=1_000_000, micro_batch_size=10, activation_bytes_per_sample=2**20),
                            "tp", 4)
    assert tp["activations"] == pytest.approx(10 / 4)


def _record() -> dict:
    return {
        "run_id": "r1", "status": "ok", "loop": "lightning", "hardware": {"accelerator": "cpu", "device_name": "cpu"},
        "techniques": {"model_name": "resnet18", "precision": "32-true", "optimizer": "adamw", "world_size": 1,
                       "micro_batch_size": 128, "accumulate_grad_batches": 1},
        "memory": {"model_parameters": 11_173_962, "anatomy_mib": {"activations": 256.0, "temporaries": 20.0}},
        "timing": {"step_time_median_ms": 400.0},
        "study": {"name": "baseline"},
    }


def test_spec_from_record_labels_the_step_time_as_measured():
    spec = spec_from_record(_record())
    assert spec.activation_bytes_per_sample == pytest.approx(2 * 2**20)
    assert "measured, run r1" in spec.step_time_source
    record = _record()
    del record["memory"]["model_parameters"]
    with pytest.raises(KeyError, match="memory.model_parameters"):
        spec_from_record(record)


def _plan(*args: str, cwd=None) -> SimpleNamespace:
    """``python -m modelwright plan ARGS``, in this process (a fresh one spends seconds importing torch)."""
    from modelwright.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    previous = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["plan", *args])
    finally:
        os.chdir(previous)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_cli_tables_never_price_a_cpu_step_at_gpu_rates(tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps(_record()) + "\n")
    out = _plan("--record", str(records), "--devices", "[1, 8, 64]")
    assert out.returncode == 0, out.stderr
    assert "| ZeRO-2 | 8 |" in out.stdout and "(est.)" in out.stdout
    assert out.stdout.count("not priced") == 1 and "pass --price_per_hour" in out.stdout  # once, with the fix
    assert "measured, run r1" in out.stdout and "2026-05" in out.stdout
    priced = _plan("--record", str(records), "--gpu_step_time_ms", "5").stdout
    assert "$" in priced and "not priced" not in priced


def test_cli_errors_are_one_line(tmp_path):
    proc = _plan(cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--record" in proc.stderr
    proc = _plan("--overlap", "2", cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "error: overlap" in proc.stderr


def _tiny_job(tmp_path, batch_size: int = 16) -> Path:
    """A job file of a small network at a small batch: its options rehearse in a fraction of a second each."""
    job = tmp_path / "job.yaml"
    job.write_text(f"model:\n  network: SmallCNN\ndata:\n  batch_size: {batch_size}\n  train_size: 64\n"
                   "trainer:\n  logger: {init_args: {name: my-job}}\n")
    return job


def test_cli_advisor_rehearses_the_job_of_its_config_files(tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps(_record()) + "\n")
    # Batch 2: 12 options (two precisions, three checkpointing policies, accumulating 1 or 2), not 30.
    job = _tiny_job(tmp_path, batch_size=2)
    out = _plan("--config", str(job), "--record", str(records), "--budget_gib", "1")
    assert out.returncode == 0, out.stderr
    assert "peaks predicted by rehearsing each option's step on this machine" in out.stdout
    from modelwright.planner import predict_peak_mib
    from modelwright.train.cli import resolved_config

    plain = predict_peak_mib(resolved_config(["fit", "--config", str(job)]))["total"]
    # no study records of this job: no step times to show a technique faster
    assert (f"Recommended: the plain run, 32-true, 1 × off — predicted peak {plain:.3g} MiB. Why: the plain run "
            "fits") in out.stdout


def test_the_advisor_takes_the_step_times_of_the_jobs_own_study(tmp_path, monkeypatch):
    """``plan --config my_job.yaml`` reads results/<this machine>/<job name>/records.jsonl, the job's own study,
    before the newest study of another network; the table names the network the step times are of."""
    import modelwright.study

    monkeypatch.setattr(modelwright.study, "hardware_slug", lambda accelerator="auto": "cpu-here")
    job = _tiny_job(tmp_path)

    def timed(name: str, step_ms: float, repeat: int) -> dict:
        return {"run_id": f"{name}-{repeat}", "status": "ok", "timing": {"step_time_median_ms": step_ms},
                "techniques": {"effective_batch_size": 16, "model_name": "SmallCNN"},
                "study": {"name": name, "kind": "run", "repeat": repeat, "config_hash": name}}

    own = tmp_path / "results" / "cpu-here" / "my-job" / "records.jsonl"
    own.parent.mkdir(parents=True)
    own.write_text("".join(json.dumps(timed(name, ms, i)) + "\n" for name, times in
                           (("baseline", (100, 101, 99)), ("amp", (50, 51, 49))) for i, ms in enumerate(times)))
    other = tmp_path / "results" / "cpu-other" / "records.jsonl"
    other.parent.mkdir(parents=True)
    other.write_text(json.dumps({**timed("baseline", 400, 0), "techniques": {"model_name": "resnet18"}}) + "\n")
    out = _plan("--config", str(job), "--budget_gib", "1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "step times of SmallCNN measured on" in out.stdout and "bf16-mixed 0.50× (amp, 3 repeats)" in out.stdout
    own.unlink()  # no study of its own yet: the newest study's, and the table says whose
    out = _plan("--config", str(job), "--budget_gib", "1", cwd=tmp_path)
    assert "step times of resnet18 measured on" in out.stdout or "step times unknown" in out.stdout


def test_cli_advisor_refuses_a_missing_config_file_in_one_line(tmp_path):
    proc = _plan("--config", str(tmp_path / "none.yaml"), "--budget_gib", "1")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "none.yaml" in proc.stderr


# The AVX2 EPYC study at fa0db18 (its bf16-check and profile beside it), frozen here: the advisor's answers below
# are of these records, and results/ is rewritten by every new study.
STUDY_RECORDS = REPO_ROOT / "tests" / "data" / "advisor-study" / "cpu-amd-epyc-avx2-2cores" / "records.jsonl"


def recommendation(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("Recommended:"))


@pytest.fixture(scope="module")
def peaks_rehearsed_once():
    """The advisor's tests below plan one job under two budgets: each option's peak is rehearsed once (the same
    config rehearses to the same peak on a CPU) and read again by the next plan, which saves minutes."""
    from modelwright.planner import advisor
    from modelwright.record import to_jsonable

    rehearse = advisor.predict_peak_mib
    peaks = {}

    def remembered(config):
        key = json.dumps(to_jsonable(config), sort_keys=True)
        if key not in peaks:
            peaks[key] = rehearse(config)
        return peaks[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(advisor, "predict_peak_mib", remembered)
        yield peaks


@pytest.fixture(scope="module")
def plan_16gib(peaks_rehearsed_once):
    return _plan("--record", str(STUDY_RECORDS), "--budget_gib", "16")


def test_with_room_for_everything_the_advisor_recommends_the_plain_run(plan_16gib):
    """16 GiB: everything fits; accumulation's 0.98× is inside the baseline's spread (-7.6% / +7.0%), so it
    is no reason to accumulate (the advisor chose accumulation 2 for it before)."""
    out = plan_16gib
    assert out.returncode == 0, out.stderr
    line = recommendation(out.stdout)
    assert line.startswith("Recommended: the plain run, 32-true, 1 × off")
    assert "accumulate 0.98× (no measurable change)" in line and "-7.6% / +7.0%" in line
    assert "step times of resnet18 measured on AMD EPYC, 2 cores, avx2" in out.stdout
    assert "bf16-mixed 19× (amp, 1 repeat)" in out.stdout  # from the bf16-check folder beside the study


def test_with_a_small_budget_the_advisor_recommends_what_fits_and_says_why(peaks_rehearsed_once):
    out = _plan("--record", str(STUDY_RECORDS), "--budget_gib", "0.3")
    assert len(peaks_rehearsed_once) == 24  # the options of one job: rehearsed once for both budgets
    assert out.returncode == 0, out.stderr
    line = recommendation(out.stdout)
    # 4 × 32 is predicted at 324 MiB, over 307 MiB; 8 × 16 at 252 MiB is the first that fits
    assert line.startswith("Recommended: 32-true, 8 × off")
    assert "the plain run does not fit (721 MiB)" in line


def test_the_table_is_ordered_by_precision_then_checkpointing_then_accumulation(plan_16gib):
    out = plan_16gib
    rows = [line.split("|")[1:4] for line in out.stdout.splitlines() if line.startswith("| 32-true")
            or line.startswith("| bf16-mixed")]
    keys = [(cells[0].strip(), cells[1].strip(), int(cells[2])) for cells in rows]
    order = {"32-true": 0, "bf16-mixed": 1, "off": 0, "stage": 1, "block": 2}
    assert keys == sorted(keys, key=lambda key: (order[key[0]], order[key[1]], key[2])) and len(keys) == 24


def test_a_technique_is_recommended_for_a_measurably_faster_step(monkeypatch):
    """bf16 at 0.5× the baseline's step, outside its spread: recommended although fp32 fits too (every option
    fits: its peak is a stand-in, the rehearsal is tested above)."""
    from modelwright.planner import advisor

    monkeypatch.setattr(advisor, "predict_peak_mib", lambda config: {"total": 10.0})

    def timed(name: str, step_ms: float, repeat: int) -> dict:
        return {"run_id": f"{name}-{repeat}", "status": "ok", "timing": {"step_time_median_ms": step_ms},
                "study": {"name": name, "kind": "run", "repeat": repeat, "config_hash": name}}

    records = [timed("baseline", ms, i) for i, ms in enumerate((2900, 3000, 3100))]
    records += [timed("amp", ms, i) for i, ms in enumerate((1450, 1500, 1550))]
    for record in records:
        record["techniques"] = {"effective_batch_size": 16}
    from modelwright.train.cli import resolved_config

    config = resolved_config(["fit", "--model.network=SmallCNN", "--data.batch_size=16", "--data.train_size=64"])
    times = step_times(records)
    chosen = choose(options(config, 16, times=times), 16 * 1024, times)
    assert (chosen.option.precision, chosen.option.accumulate, chosen.option.checkpointing) == ("bf16-mixed", 1,
                                                                                                "off")
    assert "measurably faster" in chosen.reason and "0.50×" in chosen.reason


def test_the_advisor_warns_when_the_times_are_another_machines():
    avx2 = {"accelerator": "cpu", "cpu_model": "AMD EPYC", "cpu_cores": 2, "vector_isa": "avx2"}
    assert machine_warning(avx2, dict(avx2)) is None
    warning = machine_warning(avx2, {**avx2, "vector_isa": "avx512"})
    assert warning.startswith("Warning: the step times are from AMD EPYC, 2 cores, avx2")
    assert "vector instruction set" in warning
    gpu = {"accelerator": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "num_devices": 1}
    assert "GPU" in machine_warning(gpu, {**gpu, "device_name": "NVIDIA A100-SXM4-80GB"})
    assert "kind of device" in machine_warning(avx2, {**gpu, "cpu_model": "AMD EPYC", "cpu_cores": 2})


# -- whole tables: every strategy's communication, the advisor's choice among several faster options -------

#: 10⁸ parameters in playbook-mixed-fp32-grads (w = 2 weight bytes, c = 4 gradient bytes on the wire: a term
#: that takes one for the other shows), r = 3 micro-batches of 4 samples, 5 blocks of 1000 B a sample at their
#: boundary, N = 8 ranks in one node (ring 7/8).
COMM_SPEC = JobSpec(num_params=100_000_000, precision="playbook-mixed-fp32-grads", micro_batch_size=4,
                    accumulate_grad_batches=3, num_layers=5, min_width=64, boundary_bytes_per_sample=1000.0)
#: strategy → (bytes one rank sends per step, collectives one after another), by hand from the ZeRO paper's
#: volumes (Rajbhandari et al. 2020, §7) and the docstring of comm_bytes_per_step.
COMMUNICATION = {
    "dp": (2 * 4 * 1e8 * 7 / 8, 16),  # all-reduce of c·Ψ = 400 MB once (no_sync): 16 buckets of 25 MiB
    "zero1": ((4 + 2) * 1e8 * 7 / 8, 16),  # reduce-scatter c·Ψ, all-gather w·Ψ
    "zero2": ((3 * 4 + 2) * 1e8 * 7 / 8, 16),  # a reduce-scatter per micro-batch, one all-gather
    "fsdp": (3 * (2 * 2 + 4) * 1e8 * 7 / 8, 3 * 5 * 3),  # per micro-batch: 2 gathers of w, 1 scatter of c
    "tp": (3 * 5 * 4 * 2 * 7 / 8 * 1000 * 4, 4 * 5 * 3),  # 4 all-reduces per block of the boundary
    "pp": (2 * 1000 * 4 * 3, None),  # each sample's boundary forward and its gradient back; point to point
}


@pytest.mark.parametrize("strategy", list(STRATEGY_LABELS))
def test_every_strategys_communication_by_hand(strategy):
    assert set(COMMUNICATION) == set(STRATEGY_LABELS), "a new strategy: its volume by hand here"
    volume, units = COMMUNICATION[strategy]
    assert comm_bytes_per_step(COMM_SPEC, strategy, 8) == pytest.approx(volume)
    assert comm_bytes_per_step(COMM_SPEC, strategy, 1) == 0.0
    # 450 GB/s of NVLink; α = 10 µs / 14 ring steps, so a ring of 8 pays 14 α = 10 µs per collective; PP pays
    # α per message, one each way per micro-batch (m = 4 × 8 stages = 32)
    latency = 2 * 32 * 10e-6 / 14 if strategy == "pp" else units * 10e-6
    total = communication_time(COMM_SPEC, strategy, 8, Assumptions(), compute_s=1.0).total_s
    assert total == pytest.approx(volume / 450e9 + latency)
    if units is not None:
        assert collective_units(COMM_SPEC, strategy) == units


def test_mixed_precision_fsdp_gathers_16_bit_weights_of_32_bit_ones():
    """bf16-mixed keeps fp32 weights (w = 4) but FSDP's MixedPrecisionPolicy gathers them in 16 bits; 32-true
    gathers all 4 bytes."""
    for precision, gathered in (("bf16-mixed", 2), ("32-true", 4)):
        spec = JobSpec(num_params=1_000_000, precision=precision, accumulate_grad_batches=3)
        assert comm_bytes_per_step(spec, "fsdp", 4) == pytest.approx(3 * (2 * gathered + 4) * 1e6 * 3 / 4)


def _option(precision: str, accumulate: int, checkpointing: str, peak_mib: float, step_ms: float | None):
    from modelwright.planner.advisor import Option

    return Option(precision, accumulate, checkpointing, peak_mib, step_ms)


#: The advisor's table in its order (precision, checkpointing, accumulation), under a 400 MiB budget: the plain
#: run does not fit, the first that fits is 32-true 2 × off; of the options that fit, bf16 2 × off is the first
#: measurably faster one and bf16 1 × block the fastest; bf16 1 × off, faster still, does not fit.
RANKED = [
    _option("32-true", 1, "off", 500, 100.0),
    _option("32-true", 2, "off", 300, 102.0),
    _option("32-true", 1, "block", 250, 130.0),
    _option("bf16-mixed", 1, "off", 450, 40.0),
    _option("bf16-mixed", 2, "off", 200, 60.0),
    _option("bf16-mixed", 1, "block", 400, 50.0),  # at the budget exactly: fits
]


def _times(low: float = -0.05, high: float = 0.05):
    from modelwright.planner.advisor import StepTimes
    from modelwright.study_rows import SpreadBand

    return StepTimes({}, 100.0, SpreadBand(low, high), {})


def test_the_advisor_takes_the_fastest_of_several_measurably_faster_options():
    chosen = choose(RANKED, 400, _times())
    assert chosen.option == RANKED[5]
    assert "its predicted step is 0.49× of 32-true, 2 × off's" in chosen.reason


def test_the_advisor_keeps_the_first_that_fits_unless_another_is_outside_the_spread():
    # 32-true 2 × off at 100 ms; within -5 % the others are no reason to change: 95 ms is on the edge
    for step_ms, expected in ((96.0, 1), (95.0, 1), (94.9, 2)):
        ranked = [RANKED[0], RANKED[1]._replace(step_ms=100.0), RANKED[4]._replace(step_ms=step_ms)]
        assert choose(ranked, 400, _times()).option == ranked[expected], step_ms
    # no spread (one repeat) or no step time: nothing is measurably faster
    assert choose(RANKED, 400, _times()._replace(band=None)).option == RANKED[1]
    unknown = [option._replace(step_ms=None) if option.precision == "bf16-mixed" else option for option in RANKED]
    assert choose(unknown, 400, _times()).option == RANKED[1]
    # the plain run fits: it is the simplest, and still loses to a measurably faster option (now bf16 1 × off)
    assert choose(RANKED, 500, _times()).option == RANKED[3]
    assert choose(RANKED[:3], 500, _times()).option == RANKED[0]
    assert choose(RANKED, 199, _times()) is None
