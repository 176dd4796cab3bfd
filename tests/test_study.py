"""The study runner: plan checks, config resolution and identity, the budget prediction, and a tiny study end to end.

The end-to-end tests share one tiny study (smallcnn, batch 8, 2 measured steps, runs in child processes):
two runs that work and one that crashes between them, plus one largest-batch confirmation run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelwright import study
from modelwright.errors import ConfigError
from modelwright.record import append_record, new_record, read_records

SLUG = "cpu-test-2cores"


def _write_plan(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _settings(**kw) -> study.Settings:
    base = dict(
        slug=SLUG,
        accelerator="cpu",
        warmup_steps=1,
        measured_steps=2,
        repeats=1,
        val_batches=1,
        model="smallcnn",
        set_overrides={},
    )
    base.update(kw)
    return study.Settings(**base)


# --------------------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------------------


def test_default_plan_loads_and_keeps_the_effective_batch():
    plan = study.load_plan(study.DEFAULT_PLAN)
    names = [e.name for e in plan.entries]
    for name in (
        "baseline",
        "amp",
        "accumulate",
        "checkpointing-stage",
        "checkpointing-block",
        "all",
        "contiguous",
        "compile",
        "fused",
        "amp-fp16",
    ):
        assert name in names
    assert plan.model == "resnet18"
    assert next(e for e in plan.entries if e.name == "amp-fp16").accelerators == ["cuda"]
    specs = [study.build_spec(e, i, _settings(model=None)) for i, e in enumerate(plan.entries)]
    assert {study.effective_batch(s.resolved) for s in specs} == {128}
    study.check_effective_batch(specs, plan.entries)  # raises if any run trained on another batch


@pytest.mark.parametrize(
    "text, message",
    [
        ("runs: []\n", "runs: must be a non-empty list"),
        ("runs:\n  - {name: a, config: configs/nope.yaml}\n", "runs[0].config: no config file at configs/nope.yaml"),
        ("runs:\n  - {name: a}\n  - {name: a}\n", "runs[1].name: 'a' appears twice"),
        ("speed: 2\nruns:\n  - {name: a}\n", "unknown key 'speed'"),
        ("runs:\n  - {name: a, colour: red}\n", "runs[0]: unknown key 'colour'"),
        ("measured_steps: 0\nruns:\n  - {name: a}\n", "measured_steps: must be an integer >= 1"),
        ("budget: {gib: 1, runs: [b]}\nruns:\n  - {name: a}\n", "budget.runs: 'b' is not a run of this plan"),
    ],
)
def test_bad_plans_are_one_line_errors(tmp_path, text, message):
    plan = _write_plan(tmp_path / "plan.yaml", text)
    with pytest.raises(ConfigError) as err:
        study.load_plan(plan)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_effective_batch_mismatch_is_refused_unless_the_run_is_about_batch():
    base = study.Entry("baseline", "configs/baseline.yaml")
    small = study.Entry("small", "configs/baseline.yaml", {"data.batch_size": 32})
    specs = [study.build_spec(base, 0, _settings()), study.build_spec(small, 1, _settings())]
    with pytest.raises(ConfigError, match="runs.small: effective batch 32 differs from baseline's 128"):
        study.check_effective_batch(specs, [base, small])
    small.vary_batch = True
    study.check_effective_batch(specs, [base, small])


# --------------------------------------------------------------------------------------------------
# Resolution, identity and the child's command line
# --------------------------------------------------------------------------------------------------


def test_resolve_config_merges_base_delta_and_overrides():
    resolved = study.resolve_config(["configs/accumulate.yaml"], {"model.lr": 0.1, "trainer.devices": 2})
    assert resolved["data"]["batch_size"] == 32  # the delta
    assert resolved["trainer"]["accumulate_grad_batches"] == 4
    assert resolved["model"]["lr"] == 0.1  # the override
    assert resolved["model"]["weight_decay"] == 0.05  # base.yaml
    assert resolved["trainer"]["logger"]["init_args"]["name"] == "accumulate"
    assert resolved["trainer"]["logger"]["init_args"]["default_hp_metric"] is False  # merged, not replaced
    assert study.effective_batch(resolved) == 32 * 4 * 2


def test_window_overrides_and_hash():
    entry = study.Entry("accumulate", "configs/accumulate.yaml")
    spec = study.build_spec(entry, 0, _settings(warmup_steps=2, measured_steps=3))
    o = spec.overrides
    assert spec.total_steps == 2 + 1 + 3
    assert o["trainer.max_steps"] == 6
    assert o["trainer.limit_train_batches"] == 6 * 4  # micro-batches: steps × accumulation
    assert o["model.model_name"] == "smallcnn"
    timer = next(c for c in spec.callbacks if c["class_path"].endswith("StepTimeMonitor"))
    assert timer["init_args"]["warmup_steps"] == 2
    assert not any(c["class_path"].endswith("ModelCheckpoint") for c in spec.callbacks)
    again = study.build_spec(entry, 0, _settings(warmup_steps=2, measured_steps=3))
    assert again.config_hash == spec.config_hash
    assert study.build_spec(entry, 0, _settings(warmup_steps=2, measured_steps=4)).config_hash != spec.config_hash
    assert study.build_spec(entry, 0, _settings(warmup_steps=2, measured_steps=3, slug="other")).config_hash != (
        spec.config_hash
    )

    args = study.command(spec, study.REPO_ROOT / "lightning_logs" / "study" / "x")
    assert args[:4] == ["main.py", "fit", "--config", "configs/accumulate.yaml"]
    assert "--config" in args and "lightning_logs/study/x/callbacks.yaml" in args  # relative: no machine paths
    assert "--trainer.max_steps=6" in args
    assert "--trainer.enable_checkpointing=false" in args


def test_patch_callbacks_needs_the_run_record():
    with pytest.raises(ConfigError, match="trainer.callbacks: the study needs callbacks.run_record.RunRecord"):
        study.patch_callbacks([{"class_path": "callbacks.step_timer.StepTimeMonitor"}], 1, "r.json")
    out = study.patch_callbacks(
        [{"class_path": "callbacks.run_record.RunRecord", "init_args": {"records_jsonl": "x.jsonl"}}], 1, "r.json"
    )
    assert out[0]["init_args"] == {"records_jsonl": None, "record_path": "r.json"}


def test_failures_are_classified_and_summarised():
    output = "Seed set to 0\nTraceback (most recent call last):\n  File x\nRuntimeError: boom happened\nextra\n"
    assert study.error_line(output, 1) == "exit status 1: RuntimeError: boom happened"
    assert study.error_line("error: model.model_name: invalid value 'x'\n", 2) == (
        "exit status 2: error: model.model_name: invalid value 'x'"
    )
    assert study.error_line("", -9) == "killed by signal 9"
    assert study.classify_failure("torch.OutOfMemoryError: CUDA out of memory.", 1) == "oom"
    assert study.classify_failure("", -9) == "oom"
    assert study.classify_failure("ValueError: nope", 1) == "failed"


def test_slugs():
    assert study.slugify("Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz") == "intel-xeon-gold-6338"
    assert study.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert study.slugify("AMD EPYC 7763 64-Core Processor") == "amd-epyc-7763-64-core"


# --------------------------------------------------------------------------------------------------
# Largest batch per budget
# --------------------------------------------------------------------------------------------------


def test_predict_largest_batch_from_the_anatomy():
    anatomy = {
        "parameters": 40.0,
        "gradients": 40.0,
        "optimizer_state": 80.0,
        "activations": 500.0,
        "temporaries": 12.0,
        "other": 0.0,
    }
    p = study.predict_largest_batch(anatomy, peak_mib=672.0, batch=128, budget_mib=1024.0)
    assert p["per_sample_mib"] == pytest.approx(512.0 / 128)
    assert p["fixed_mib"] == pytest.approx(160.0)
    assert p["batch"] == 216  # (1024 - 160) / 4
    assert p["predicted_peak_mib"] == pytest.approx(160.0 + 4.0 * 216) and p["predicted_peak_mib"] <= 1024.0
    assert study.predict_largest_batch(anatomy, 672.0, 128, budget_mib=100.0)["batch"] == 0


def test_two_point_prediction_is_the_line_through_both():
    p = study.predict_from_two_points(100, 500.0, 200, 900.0, budget_mib=1000.0)
    assert p["per_sample_mib"] == pytest.approx(4.0)
    assert p["fixed_mib"] == pytest.approx(100.0)
    assert p["batch"] == 225


def _fake_record(batch: int, accumulate: int, activations_per_sample: float, fixed: float = 20.0) -> dict:
    record = new_record(run_id=f"b{batch}")
    anatomy = {"parameters": fixed / 2, "optimizer_state": fixed / 2, "activations": activations_per_sample * batch}
    anatomy["total"] = sum(anatomy.values())
    record["memory"].update(anatomy_mib=anatomy, peak_allocated_mib=anatomy["total"])
    record["techniques"].update(micro_batch_size=batch, accumulate_grad_batches=accumulate)
    return record


def test_budget_phase_probes_an_accumulating_run_and_corrects_an_overshoot(tmp_path):
    entry = study.Entry("all", "configs/all.yaml")  # bf16 + checkpointing + 4 × 32
    plan = study.Plan(path="p", entries=[entry], budget_runs=["all"])
    s = study.Study(plan, _settings(), tmp_path / SLUG, tmp_path / "work")
    main = study.build_spec(entry, 0, _settings())
    # The accumulating run's anatomy claims 2 MiB per sample; alone, a micro-batch holds 1 MiB per sample
    # up to batch 100 and 1.5 above (a step the linear model cannot see from one point).
    s.done[main.key] = _fake_record(32, 4, activations_per_sample=2.0)
    ran: list[tuple[int, int, dict]] = []

    def fake_run(spec, progress):
        batch = study.get_dotted(spec.resolved, "data.batch_size")
        accumulate = study.get_dotted(spec.resolved, "trainer.accumulate_grad_batches")
        ran.append((batch, accumulate, spec.extra))
        return _fake_record(batch, accumulate, 1.0 if batch <= 100 else 1.5)

    s.run = fake_run
    study.budget_phase(s, [main], [entry], study.Progress(total=1, to_run=0), budget_mib=200.0)
    probe, first, second = ran
    assert probe[:2] == (32, 1) and probe[2]["prediction"] == "probe"
    assert first[:2] == (180, 1)  # (200 - 20) / 1 MiB per sample, from the probe's anatomy
    assert first[2]["from_batch"] == 32 and first[2]["predicted_peak_mib"] == pytest.approx(200.0)
    # 20 + 1.5 × 180 = 290 > 200: the line through (32, 52) and (180, 290) gives the second batch.
    slope = (290.0 - 52.0) / (180 - 32)
    assert second[:2] == (int((200.0 - (52.0 - slope * 32)) / slope), 1)
    assert second[2]["prediction"] == "two-point" and second[2]["attempt"] == 2


def test_resume_reads_past_a_torn_last_line(tmp_path):
    records = tmp_path / SLUG / "records.jsonl"
    record = new_record(run_id="r1")
    record["study"] = {"name": "a", "kind": "run", "config_hash": "h1", "repeat": 0}
    append_record(records, record)
    with records.open("ab") as f:
        f.write(b'{"schema_version": 1, "run_id": "torn')  # what a kill -9 mid-write could leave
    plan = study.Plan(path="p", entries=[study.Entry("a", None)])
    with pytest.warns(UserWarning, match="skipped damaged record line"):
        s = study.Study(plan, _settings(), tmp_path / SLUG, tmp_path / "work")
    assert set(s.done) == {("run", "h1", 0)}


# --------------------------------------------------------------------------------------------------
# A tiny study end to end (child processes)
# --------------------------------------------------------------------------------------------------

TINY_PLAN = """\
model: smallcnn
warmup_steps: 1
measured_steps: 2
val_batches: 1
budget: {gib: 0.03, runs: [baseline]}
runs:
  - name: baseline
    config: configs/baseline.yaml
  - name: broken
    config: configs/baseline.yaml
    overrides: {model.model_name: no-such-model}
  - name: amp
    config: configs/amp.yaml
"""


def _study_args(root: Path) -> list[str]:
    return [
        "--plan",
        str(root / "plan.yaml"),
        "--slug",
        SLUG,
        "--accelerator",
        "cpu",
        "--set",
        "data.batch_size=8",
        "--set",
        "data.train_size=32",
        "--set",
        "data.val_size=16",
        "--results",
        str(root / "results"),
        "--workdir",
        str(root / "work"),
        "--readme",
        str(root / "README.md"),
    ]


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    _write_plan(root / "plan.yaml", TINY_PLAN)
    (root / "README.md").write_text(
        "# Project\n\nIntro.\n\n<!-- results:start -->\nSTALE-SECTION\n<!-- results:end -->\n\nEnd.\n"
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("OMP_NUM_THREADS", "1")
    try:
        code = study.main(_study_args(root))
    finally:
        mp.undo()
    return root, code


def _records(root: Path) -> list[dict]:
    return read_records(root / "results" / SLUG / "records.jsonl")


def test_tiny_study_writes_every_output(tiny_study):
    root, code = tiny_study
    assert code == 0
    out = root / "results" / SLUG
    for name in (
        "records.jsonl",
        "table.md",
        "summary.json",
        "study.json",
        "memory_anatomy.png",
        "step_time.png",
        "memory_vs_time.png",
        "loss_curves.png",
        "largest_batch.png",
    ):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    by_name = {(r["study"]["name"], r["study"]["kind"]): r for r in _records(root)}
    base = by_name[("baseline", "run")]
    assert base["status"] == "ok"
    assert base["timing"]["measured_steps"] == 2
    assert base["techniques"]["model_name"] == "smallcnn"
    assert base["techniques"]["effective_batch_size"] == 8
    assert base["memory"]["anatomy_mib"]["activations"] > 0
    assert base["metrics"]["val/acc"] is not None
    assert len(base["history"]["train/loss"]) == 4  # warm-up + anatomy + 2 measured steps
    assert by_name[("amp", "run")]["techniques"]["precision"] == "bf16-mixed"

    table = (out / "table.md").read_text()
    assert "| baseline | 32-true, 8," in table and "| amp | bf16-mixed, 8," in table
    summary = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in summary["runs"]] == ["baseline", "broken", "amp"]
    assert summary["runs"][0]["memory_vs_reference"] == 1.0

    readme = (root / "README.md").read_text()
    assert readme.startswith("# Project\n\nIntro.\n\n<!-- results:start -->\n")
    assert readme.endswith("<!-- results:end -->\n\nEnd.\n")
    assert "STALE-SECTION" not in readme
    assert f"![Peak tensor memory per run, by what holds it](results/{SLUG}/memory_anatomy.png)" in readme


def test_a_crashing_run_is_recorded_and_the_next_still_runs(tiny_study):
    root, _ = tiny_study
    names = [(r["study"]["name"], r["status"]) for r in _records(root) if r["study"]["kind"] == "run"]
    assert names == [("baseline", "ok"), ("broken", "failed"), ("amp", "ok")]
    broken = next(r for r in _records(root) if r["study"]["name"] == "broken")
    assert broken["error"].startswith("exit status 2: error: model.model_name")
    assert broken["study"]["output_tail"]
    assert broken["techniques"]["model_name"] == "no-such-model"
    table = (root / "results" / SLUG / "table.md").read_text()
    assert "| broken | failed | exit status 2: error: model.model_name" in table


def test_the_budget_batch_is_confirmed_under_the_budget(tiny_study):
    root, _ = tiny_study
    budget = [r for r in _records(root) if r["study"]["kind"] == "budget"]
    assert len(budget) >= 1
    last = budget[-1]["study"]
    assert last["budget_mib"] == pytest.approx(0.03 * 1024)
    assert last["predicted_batch"] > 8  # the budget holds more than the measured batch of 8
    assert budget[-1]["techniques"]["micro_batch_size"] == last["predicted_batch"]
    assert study.record_peak_mib(budget[-1]) <= last["budget_mib"]
    assert study.record_peak_mib(budget[-1]) == pytest.approx(last["predicted_peak_mib"], rel=0.1)


def test_a_rerun_skips_what_is_recorded(tiny_study, capsys, monkeypatch):
    root, _ = tiny_study
    before = _records(root)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert study.main([*_study_args(root), "--no-readme"]) == 0
    err = capsys.readouterr().err
    assert "0 to run" in err
    assert err.count("skipped (recorded") == len(before)
    assert len(_records(root)) == len(before)
    info = json.loads((root / "results" / SLUG / "study.json").read_text())
    assert info["runs_executed"] == 0 and info["runs_skipped"] == len(before)


def test_usage_errors_exit_2_with_one_line(tmp_path, capsys):
    assert study.main(["--plan", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --plan: no plan file at") and err.count("\n") == 1
