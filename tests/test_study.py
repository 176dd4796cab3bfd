"""The study: plans, configs resolved by LightningCLI, the budget phase, predictions, the lock, the children's
group, and a tiny study end to end (smallcnn, batch 8, child processes)."""

from __future__ import annotations

import inspect
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from modelwright import REPO_ROOT, planner
from modelwright import __main__ as cli
from modelwright.errors import ConfigError
from modelwright.record import ANATOMY_KEYS, append_record, build_record, get_path, read_records
from modelwright.study import budget, plan, runner
from modelwright.study import study as study_command
from modelwright.study_rows import peak_mib

SLUG = "cpu-test-2cores"
TINY = {"data.batch_size": 8, "data.train_size": 32, "data.val_size": 16}


def _settings(**kw) -> plan.Settings:
    base = dict(slug=SLUG, accelerator="cpu", warmup_steps=1, measured_steps=2, repeats=1, val_batches=0,
                model="smallcnn", overrides={})
    return plan.Settings(**{**base, **kw})


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# -- plans ---------------------------------------------------------------------------------------------------


def test_default_plan_keeps_the_core_rows_and_measures_noise():
    default = plan.load_plan(REPO_ROOT / "configs/study/plan_default.yaml")
    names = [e.name for e in default.entries]
    assert names[0] == "baseline"
    assert {"baseline", "amp", "accumulate", "checkpointing-block", "all", "ddp"} <= set(names)
    extra = [e.name for e in plan.load_plan(REPO_ROOT / "configs/study/plan_extra.yaml").entries]
    for moved in ("contiguous", "system-malloc", "fused", "compile", "checkpointing-stage", "fsdp2"):
        assert moved in extra and moved not in names
    assert default.repeats >= 3
    assert plan.for_device(default.measured_steps, "cpu") >= 10
    assert plan.for_device(default.measured_steps, "cuda") >= 20
    bf16 = {e.name: e.accelerators for e in default.entries if e.name in ("amp", "all")}
    assert bf16 == {"amp": ["cuda", "cpu-bf16"], "all": ["cuda", "cpu-bf16"]}  # emulated bf16 is ~15x slower
    specs = [plan.build_spec(e, i, _settings(model=None)) for i, e in enumerate(default.entries)
             if e.accelerators != ["cuda"]]
    assert {plan.effective_batch(s.resolved) for s in specs} == {128}
    plan.check_effective_batch(specs, default.entries)


@pytest.mark.parametrize("text, message", [
    ("runs: []\n", "runs: must be a non-empty list"),
    ("runs:\n  - {name: a, config: configs/nope.yaml}\n",
     "runs[0].config: no config file at configs/nope.yaml"),
    ("runs:\n  - {name: a}\n  - {name: a}\n", "runs[1].name: 'a' appears twice"),
    ("speed: 2\nruns:\n  - {name: a}\n", "unknown key 'speed'"),
    ("runs:\n  - {name: a, colour: red}\n", "runs[0]: unknown key 'colour'"),
    ("measured_steps: {cpu: 0}\nruns:\n  - {name: a}\n", "measured_steps: must be an integer >= 1"),
    ("repeats: 0\nruns:\n  - {name: a}\n", "repeats: must be an integer >= 1"),
    ("max_repeats: 0\nruns:\n  - {name: a}\n", "max_repeats: must be an integer >= 1"),
    ("budget: {gib: 1, runs: [b]}\nruns:\n  - {name: a}\n", "budget.runs: 'b' is not a run of this plan"),
    ("runs:\n  - {name: a, accelerators: [cpu_bf16]}\n",
     "runs[0].accelerators: a list of cpu, cpu-bf16, cuda"),
])
def test_bad_plans_are_one_line_errors(tmp_path, text, message):
    with pytest.raises(ConfigError) as err:
        plan.load_plan(_write(tmp_path / "plan.yaml", text))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_effective_batch_mismatch_is_refused_unless_the_run_is_about_batch():
    base = plan.Entry("baseline", "configs/baseline.yaml")
    small = plan.Entry("small", "configs/baseline.yaml", {"data.batch_size": 32})
    specs = [plan.build_spec(base, 0, _settings()), plan.build_spec(small, 1, _settings())]
    with pytest.raises(ConfigError, match="runs.small: effective batch 32 differs from baseline's 128"):
        plan.check_effective_batch(specs, [base, small])
    small.vary_batch = True
    plan.check_effective_batch(specs, [base, small])


# -- configs: LightningCLI's parse, identity, the child's command line ---------------------------------------


def test_resolve_config_is_lightningclis_own_parse():
    resolved = plan.resolve_config(["configs/accumulate.yaml"], {"model.lr": 0.1, "trainer.devices": 2})
    assert get_path(resolved, "data.batch_size") == 32  # the delta
    assert resolved["trainer"]["accumulate_grad_batches"] == 4
    # override, base.yaml
    assert get_path(resolved, "model.lr") == 0.1 and get_path(resolved, "model.weight_decay") == 0.05
    assert resolved["trainer"]["logger"]["init_args"]["name"] == "accumulate"
    # Defaults no YAML file names: only the CLI's parser knows them (a merge of the files did not).
    assert resolved["trainer"]["logger"]["init_args"]["flush_secs"] == 120
    assert get_path(resolved, "model.label_smoothing") == 0.0
    assert plan.effective_batch(resolved) == 32 * 4 * 2
    with pytest.raises(ConfigError) as err:  # what the child would refuse, refused before anything runs
        bad = plan.Entry("bad", None, {"model.network": "no_such.Net"})
        plan.build_spec(bad, 0, _settings(model=None))
    assert str(err.value).startswith("runs.bad: model.network") and "\n" not in str(err.value)


def test_resolve_config_is_what_print_config_shows(capsys):
    """The resolver parses with the CLI's own parser (no stdout scraping), and gets what --print_config
    prints: the study's config hashes stay those of the committed records."""
    import yaml

    from modelwright.train.cli import cli_main

    args = ["fit", "--config", "configs/accumulate.yaml", "--model.lr=0.1",
            "--trainer.enable_checkpointing=false"]
    with pytest.raises(SystemExit):
        cli_main([*args, "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    overrides = {"model.lr": 0.1, "trainer.enable_checkpointing": False}
    assert plan.resolve_config(["configs/accumulate.yaml"], overrides) == printed
    assert "dropped" not in capsys.readouterr().err, "resolving instantiates nothing, drops no callback"


def test_a_budget_run_of_an_image_folder_takes_its_steps_over_several_epochs(tmp_path):
    """A generated set grows to the run's window; an image folder cannot, so a budget run (one batch may be
    all of it) may span as many epochs as it has steps, and a timed run keeps its one short epoch."""
    from PIL import Image

    for split in ("train", "val"):
        for name in ("a", "b"):
            (tmp_path / split / name).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(tmp_path / split / name / "0.png")
    job = _write(tmp_path / "job.yaml", "data:\n  class_path: modelwright.train.data.ImageFolderDataModule\n"
                                        f"  init_args: {{root: {tmp_path}, batch_size: 8}}\n")
    entry = plan.Entry("baseline", "configs/baseline.yaml")
    settings = _settings(warmup_steps=2, measured_steps=3, job=(str(job),))
    budget = plan.build_spec(entry, 0, settings, kind="budget", batch_size=600)
    assert budget.overrides["trainer.max_epochs"] == 3 and budget.overrides["trainer.max_steps"] == 3
    assert "data.train_size" not in budget.overrides
    timed = plan.build_spec(entry, 0, settings)
    assert timed.overrides["trainer.max_epochs"] == 1
    generated = plan.build_spec(entry, 0, _settings(warmup_steps=2, measured_steps=3), kind="budget",
                                batch_size=2000)
    assert generated.overrides["trainer.max_epochs"] == 1 and generated.overrides["data.train_size"] == 3 * 2000


def test_window_overrides_hash_and_command():
    entry = plan.Entry("accumulate", "configs/accumulate.yaml")
    spec = plan.build_spec(entry, 0, _settings(warmup_steps=2, measured_steps=3))
    overrides = spec.overrides
    assert overrides["trainer.max_steps"] == 6
    assert overrides["trainer.limit_train_batches"] == 6 * 4  # micro-batches: steps × accumulation
    assert overrides["model.network"] == "modelwright.train.models.SmallCNN" and spec.measured_steps == 3
    callbacks = spec.resolved["trainer"]["callbacks"]
    monitor = next(c for c in callbacks if c["class_path"].endswith("RunMonitor"))
    assert monitor["init_args"]["warmup_steps"] == 2
    assert not any(c["class_path"].endswith("ModelCheckpoint") for c in callbacks)
    same = plan.build_spec(entry, 0, _settings(warmup_steps=2, measured_steps=3))
    longer = plan.build_spec(entry, 0, _settings(warmup_steps=2, measured_steps=4))
    assert same.config_hash == spec.config_hash and longer.config_hash != spec.config_hash
    other = plan.build_spec(entry, 0, _settings(warmup_steps=2, measured_steps=3, slug="other"))
    assert other.config_hash != spec.config_hash
    args = plan.command(spec, REPO_ROOT / "lightning_logs" / "study" / "x")
    assert args[:4] == ["main.py", "fit", "--config", "configs/accumulate.yaml"]
    assert "lightning_logs/study/x/callbacks.yaml" in args  # relative: no machine paths
    assert "--trainer.max_steps=6" in args and "--trainer.enable_checkpointing=false" in args


@pytest.mark.parametrize("kind", ["run", "epoch", "budget"])
@pytest.mark.parametrize("name", ["accumulate", "ddp"])
def test_a_runs_config_is_what_its_command_line_resolves_to(name, kind):
    """build_spec parses a row once and sets the window's values (or the epoch's) in the parsed config: that
    config is the one LightningCLI resolves from the child's arguments (accumulation sets the window's batches;
    two processes, the generated set's size)."""
    default = plan.load_plan(REPO_ROOT / "configs/study/plan_default.yaml")
    (entry,) = [entry for entry in default.entries if entry.name == name]
    settings = _settings(warmup_steps=2, measured_steps=3, overrides={"data.train_size": 16})  # grown to the window
    spec = plan.build_spec(entry, 0, settings, kind=kind, batch_size=8 if kind == "budget" else None)
    assert kind == "epoch" or spec.overrides["data.train_size"] > 16
    parsed = plan.resolve_config(spec.files, spec.overrides)
    parsed["trainer"]["callbacks"] = spec.resolved["trainer"]["callbacks"]  # the study's own, patched after
    assert parsed == spec.resolved


def test_patch_callbacks_needs_the_run_monitor():
    with pytest.raises(ConfigError, match="trainer.callbacks: the study needs callbacks.run_monitor.RunMonitor"):
        plan.patch_callbacks([{"class_path": "callbacks.progress_bar.ThrottledProgressBar"}], 1, "r.json")
    monitor = {"class_path": "callbacks.run_monitor.RunMonitor",
               "init_args": {"records_jsonl": "x.jsonl", "history": True}}
    out = plan.patch_callbacks([monitor], 1, "r.json")
    assert out[0]["init_args"] == {"records_jsonl": None, "record_path": "r.json", "history": True,
                                   "warmup_steps": 1, "measure_steps": None, "anatomy": True, "anatomy_step": None}


def test_failures_are_classified_and_summarised():
    output = ("Seed set to 0\nTraceback (most recent call last):\n  File x\nRuntimeError: boom happened\n"
              "extra\n")
    assert runner.diagnose(output, 1) == ("failed", "exit status 1: RuntimeError: boom happened")
    assert runner.diagnose("", -9) == ("oom", "killed by signal 9")
    assert runner.diagnose("torch.OutOfMemoryError: CUDA out of memory.", 1)[0] == "oom"
    assert runner.diagnose("ValueError: no", 1) == ("failed", "exit status 1: ValueError: no")


def test_slugs():
    from modelwright.study import slugify

    assert slugify("Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz") == "intel-xeon-gold-6338"
    assert slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


# -- largest batch per budget --------------------------------------------------------------------------------


def _fake_record(batch: int, accumulate: int, per_sample: float, fixed: float = 20.0, **extra) -> dict:
    record = build_record(run_id=f"b{batch}")
    anatomy = {"parameters": fixed / 2, "optimizer_state": fixed / 2, "activations": per_sample * batch}
    anatomy["total"] = sum(anatomy.values())
    record["memory"].update(anatomy_mib=anatomy, peak_allocated_mib=anatomy["total"])
    record["techniques"].update(micro_batch_size=batch, accumulate_grad_batches=accumulate,
                                model_name="smallcnn")
    return {**record, **extra}


class _FakeRehearsal:
    """What the planner's rehearsal of a config predicts, by hand: 20 MiB fixed and 1 MiB a sample."""

    def peak(self, batch: int) -> dict:
        return {"total": 20.0 + batch}

    def largest_batch(self, budget_mib: float) -> int:
        return int(budget_mib - 20)

    def json(self) -> dict:
        return {"method": "rehearsal", "what": "by hand"}


def _budget_study(tmp_path, entries, budget_runs, predict=False):
    the_plan = plan.Plan("p", entries, budget_runs=budget_runs)
    study = runner.Study(the_plan, _settings(), tmp_path / SLUG, tmp_path, predict=predict)
    ran: list[tuple[int, int, dict]] = []

    def fake_run(spec, progress):
        batch = get_path(spec.resolved, "data.batch_size")
        ran.append((batch, spec.resolved["trainer"]["accumulate_grad_batches"], spec.extra))
        return _fake_record(batch, 1, 1.0 if batch <= 130 else 1.5)

    study.run = fake_run
    return study, ran


def test_budget_confirms_the_planners_batch_corrects_a_miss_then_runs_a_few_percent_over(tmp_path,
                                                                                         monkeypatch):
    entry = plan.Entry("baseline", "configs/baseline.yaml")
    study, ran = _budget_study(tmp_path, [entry], ["baseline"], predict=True)
    # The planner: 20 MiB fixed + 1 MiB per sample; measured, a micro-batch holds 1.5 MiB per sample above
    # 130.
    configs = []
    monkeypatch.setattr(planner.memory, "rehearsal", lambda config: configs.append(config) or _FakeRehearsal())
    budget.budget_phase(study, [entry], runner.Progress(0), budget_mib=200.0)
    assert [get_path(config, "trainer.accumulate_grad_batches") for config in configs] == [1]
    first, second, over = ran
    assert first[:2] == (180, 1) and first[2]["prediction_method"] == "planner"
    # 20 + 1.5 × 180 = 290 measured against 200 predicted: predicted again for a budget 90 MiB less
    assert second[0] == 90 and second[2]["prediction_method"] == "planner, corrected by the miss"
    assert second[2]["attempt"] == 2 and second[2]["predicted_batch"] == 90
    assert over[0] == 90 + math.ceil(90 * budget.OVER_FRACTION) and over[2]["role"] == "over"
    assert over[2]["confirmed_batch"] == 90 and all(x["budget_mib"] == 200.0 for *_, x in ran)


@pytest.mark.parametrize(("over_peak", "verdict"), [
    (None, "batch 95 recorded no peak: not known to be the largest"),  # the run over it failed
    (150.0, "batch 95 peaks at 150 MiB: not the largest (batch + 5.0% fits)"),
    (250.0, "batch 95 peaks at 250 MiB: the largest"),
])
def test_the_budget_batch_is_called_the_largest_only_where_the_run_over_it_exceeded(tmp_path, capsys, monkeypatch,
                                                                                     over_peak, verdict):
    entry = plan.Entry("baseline", "configs/baseline.yaml")
    study, ran = _budget_study(tmp_path, [entry], ["baseline"], predict=True)
    monkeypatch.setattr(planner.memory, "rehearsal", lambda config: _FakeRehearsal())
    confirm = study.run

    def run_over_at(spec, progress):
        record = confirm(spec, progress)
        if spec.extra.get("role") == "over":
            record["memory"]["peak_allocated_mib"] = over_peak
        return record

    study.run = run_over_at
    budget.budget_phase(study, [entry], runner.Progress(0), budget_mib=200.0)
    assert capsys.readouterr().err.rstrip().endswith(f"batch 90 fits 200 MiB, {verdict}")


def test_budget_without_a_prediction_is_skipped_with_one_line(tmp_path, capsys, monkeypatch):
    entry = plan.Entry("baseline", "configs/baseline.yaml")
    study, ran = _budget_study(tmp_path, [entry], ["baseline"])

    def unrehearsable(config):
        raise ConfigError("trainer.strategy: deepspeed is not rehearsed")

    monkeypatch.setattr(planner.memory, "rehearsal", unrehearsable)
    budget.budget_phase(study, [entry], runner.Progress(0), budget_mib=200.0)
    assert ran == []
    skipped = "baseline (budget): skipped (no prediction: trainer.strategy: deepspeed is not rehearsed)\n"
    assert skipped in capsys.readouterr().err


# -- runs: predictions before, provenance, resume ------------------------------------------------------------


def test_a_run_writes_its_prediction_before_it_starts(tmp_path, monkeypatch):
    entry = plan.Entry("baseline", "configs/baseline.yaml")
    cmd = ["python", "-m", "modelwright", "study", "--repeats=2"]
    study = runner.Study(plan.Plan("p", [entry]), _settings(), tmp_path / SLUG, tmp_path / "work", cmd=cmd,
                         predict=True)
    spec = plan.build_spec(entry, 0, _settings(), repeat=1)
    monkeypatch.setattr(planner.memory, "rehearsal", lambda config: _FakeRehearsal())
    seen = {}

    def fake_child(args, log_path, env, timeout_s, tick):
        # already there at the start
        seen["predictions"] = read_records(tmp_path / SLUG / "predictions.jsonl")
        seen["env"] = env["MODELWRIGHT_COMMAND"]
        log_path.write_text("")
        (log_path.parent / "record.json").write_text(json.dumps(_fake_record(8, 1, 1.0)))
        return runner.ChildResult(0, False, 0.1)

    monkeypatch.setattr(runner, "run_child", fake_child)
    record = study.run(spec, runner.Progress(1))
    [line] = seen["predictions"]
    assert line["run"] == "baseline" and line["config_hash"] == spec.config_hash
    assert line["predicted_mib"] == {"total": 20.0 + get_path(spec.resolved, "data.batch_size")}
    assert line["from"] == {"method": "rehearsal", "what": "by hand"} and record["prediction"] == line
    assert seen["env"] == " ".join(cmd) and record["provenance"]["command"] == " ".join(cmd)
    assert record["study"]["repeat"] == 1 and record["study"]["name"] == "baseline"
    assert read_records(tmp_path / SLUG / "records.jsonl")[-1]["prediction"] == line


def test_a_run_that_cannot_be_rehearsed_runs_unpredicted_and_says_why(tmp_path, monkeypatch, capsys):
    entry = plan.Entry("baseline", "configs/baseline.yaml")
    study = runner.Study(plan.Plan("p", [entry]), _settings(), tmp_path / SLUG, tmp_path / "work", predict=True)

    def unrehearsable(config):
        raise ConfigError("model: manual optimization (automatic_optimization false) is not rehearsed")

    monkeypatch.setattr(planner.memory, "rehearsal", unrehearsable)
    assert study._predict(plan.build_spec(entry, 0, _settings())) is None
    assert "baseline r0: not predicted (model: manual optimization" in capsys.readouterr().err
    assert not (tmp_path / SLUG / "predictions.jsonl").exists()


def test_an_ok_record_of_a_child_that_exited_non_zero_is_a_failure(tmp_path, monkeypatch):
    """A run whose process died after writing an ok record (say in teardown) did not end as its record says: it
    is recorded failed with the exit status and the output's last error line."""
    entry = plan.Entry("baseline", "configs/baseline.yaml")
    study = runner.Study(plan.Plan("p", [entry]), _settings(), tmp_path / SLUG, tmp_path / "work")

    def fake_child(args, log_path, env, timeout_s, tick):
        log_path.write_text("RuntimeError: teardown broke\n")
        (log_path.parent / "record.json").write_text(json.dumps(_fake_record(8, 1, 1.0)))
        return runner.ChildResult(1, False, 0.1)

    monkeypatch.setattr(runner, "run_child", fake_child)
    record = study.run(plan.build_spec(entry, 0, _settings()), runner.Progress(1))
    assert record["status"] == "failed" and record["error"] == "exit status 1: RuntimeError: teardown broke"
    assert study.failed == 1 and study.executed == 1


def test_resume_reads_past_a_torn_last_line(tmp_path):
    records = tmp_path / SLUG / "records.jsonl"
    record = build_record(run_id="r1")
    record["study"] = {"name": "a", "kind": "run", "config_hash": "h1", "repeat": 0}
    append_record(records, record)
    with records.open("ab") as file:
        file.write(b'{"schema_version": 1, "run_id": "torn')  # what a kill -9 mid-write could leave
    with pytest.warns(UserWarning):
        study = runner.Study(plan.Plan("p", [plan.Entry("a", None)]), _settings(), tmp_path / SLUG, tmp_path)
    assert set(study.done) == {("a", "run", "h1", 0)}


#: Whether a study runs a recorded run again, by its record's status: (plainly, with --retry_failed, --rerun).
#: An interrupted run is no result; a running one was killed with the study.
RUNS_AGAIN = {"ok": (False, False, True), "diverged": (False, False, True), "failed": (False, True, True),
              "oom": (False, True, True), "interrupted": (True, True, True), "running": (True, True, True)}


@pytest.mark.parametrize("status", RUNS_AGAIN)
def test_which_recorded_runs_a_study_runs_again(status, tmp_path):
    from modelwright.record import RunRecord, schema_fields

    statuses = next(meta["choices"] for key, meta, *_ in schema_fields(RunRecord) if key == "status")
    assert set(RUNS_AGAIN) == set(statuses), "a new status: say here whether a study runs it again"
    record = build_record(run_id="r1", status=status, error=None if status == "ok" else "RuntimeError: x")
    record["study"] = {"name": "a", "kind": "run", "config_hash": "h1", "repeat": 0}
    append_record(tmp_path / SLUG / "records.jsonl", record)
    spec = plan.RunSpec("a", "run", 0, 0, None, {}, {}, "h1", 2)
    again = []
    for flags in ({}, {"retry_failed": True}, {"rerun": True}):
        study = runner.Study(plan.Plan("p", [plan.Entry("a", None)]), _settings(), tmp_path / SLUG, tmp_path,
                             **flags)
        again.append(study.recorded(spec) is None)
    assert tuple(again) == RUNS_AGAIN[status]


# -- the command: order of repeats, the lock, no orphans -----------------------------------------------------

TINY_PLAN = """\
model: smallcnn
warmup_steps: 1
measured_steps: 2
repeats: 1
# smallcnn: batch 14 fits (30.8 MiB), 15 does not: no corrected attempt
budget: {gib: 0.0308, runs: [baseline]}
runs:
  - name: baseline
    config: configs/baseline.yaml
  - name: broken  # valid as a config, refused by Lightning's Trainer in the child: a run that crashes
    config: configs/baseline.yaml
    overrides: {trainer.strategy: fsdp}
"""


def _args(root: Path, *extra: str) -> list[str]:
    return ["study", "--plan", str(root / "plan.yaml"), "--slug", SLUG, "--accelerator", "cpu",
            "--overrides", json.dumps(TINY), "--results", str(root / "results"),
            "--workdir", str(root / "work"),
            "--readme", "null", *extra]


def test_repeats_run_round_robin(tmp_path, capsys):
    _write(tmp_path / "plan.yaml", TINY_PLAN)
    assert cli.main(_args(tmp_path, "--repeats", "2", "--dry_run", "true")) == 0
    err = capsys.readouterr().err
    order = [line.split("[")[0].strip() for line in err.splitlines() if " r0 [" in line or " r1 [" in line]
    assert order == ["baseline r0", "broken r0", "baseline r1", "broken r1"]
    assert "6 runs (6 to run): 4 of 1 warm-up + 1 anatomy + 2 measured steps (2 repeats, round-robin), " \
        "then 2 whole epoch(s), one per run" in err
    assert "baseline (one whole epoch) [" in err and "broken (one whole epoch) [" in err
    assert "estimate: none: no record of these runs on " in err


def test_an_epoch_run_is_one_whole_epoch_as_the_config_has_it():
    entry = plan.Entry("accumulate", "configs/accumulate.yaml")
    spec = plan.build_spec(entry, 0, _settings(warmup_steps=2, measured_steps=3), kind="epoch")
    trainer = spec.resolved["trainer"]
    assert spec.kind == "epoch" and spec.label == "accumulate (one whole epoch)"
    assert (trainer["max_epochs"], trainer["max_steps"], trainer["num_sanity_val_steps"]) == (1, -1, 0)
    base = plan.resolve_config(["configs/accumulate.yaml"])["trainer"]
    for key in ("limit_train_batches", "limit_val_batches", "val_check_interval", "accumulate_grad_batches"):
        assert trainer.get(key) == base.get(key), f"the config's own {key}, not the study window's"
    assert (get_path(spec.resolved, "data.train_size")
            == get_path(plan.resolve_config(["configs/accumulate.yaml"]), "data.train_size"))
    monitor = next(c for c in trainer["callbacks"] if c["class_path"].endswith("RunMonitor"))
    assert monitor["init_args"]["anatomy"] is False, "a memory capture would slow one of its steps"
    timed = plan.build_spec(entry, 0, _settings(warmup_steps=2, measured_steps=3))
    assert spec.config_hash != timed.config_hash and spec.folder.endswith("-e0")


def test_the_dry_run_estimates_from_the_records_of_the_same_runs(tmp_path, capsys):
    _write(tmp_path / "plan.yaml", TINY_PLAN)
    folder = tmp_path / "results" / SLUG
    folder.mkdir(parents=True)
    lines = []
    for name, kind, seconds in (("baseline", "run", 40.0), ("baseline", "run", 60.0), ("broken", "run", 30.0),
                                ("baseline", "epoch", 120.0)):
        record = build_record(study={"name": name, "kind": kind, "process_wall_s": seconds})
        lines.append(json.dumps(record))
    (folder / "records.jsonl").write_text("\n".join(lines) + "\n")
    assert cli.main(_args(tmp_path, "--dry_run", "true")) == 0
    err = capsys.readouterr().err
    # baseline r0 50 s (the median of 40 and 60), broken r0 30 s, the baseline epoch 120 s: 200 s in all
    assert "estimate: about 3.33 min for the 4 runs to run" in err and "1 of them with no record to go by" in err


def test_bf16_runs_only_on_a_cpu_with_bf16_instructions_unless_named(tmp_path, capsys, monkeypatch):
    from modelwright.measure import facts

    _write(tmp_path / "plan.yaml", "model: smallcnn\nrepeats: 1\nruns:\n"
           "  - {name: base, config: configs/baseline.yaml}\n"
           "  - {name: amp, config: configs/amp.yaml, accelerators: [cuda, cpu-bf16]}\n")
    for flags, runs in (("avx2 fma", False), ("avx2 avx512_bf16", True), ("amx_bf16 amx_tile", True)):
        monkeypatch.setattr(facts, "cpuinfo", lambda flags=flags: {"flags": flags})
        assert cli.main(_args(tmp_path, "--dry_run", "true")) == 0
        err = capsys.readouterr().err
        assert ("amp r0 [" in err) == runs and "base r0 [" in err
        assert ("\n  amp: not on cpu (runs on cuda, cpu-bf16: bf16 is emulated on this CPU)\n" in err) != runs
    monkeypatch.setattr(facts, "cpuinfo", lambda: {"flags": "avx2"})
    # asked for by name: it runs
    assert cli.main(_args(tmp_path, "--only", "[amp]", "--dry_run", "true")) == 0
    assert "amp r0 [" in capsys.readouterr().err


def test_lock_refuses_a_live_study_and_takes_over_a_dead_ones(tmp_path):
    folder = tmp_path / SLUG
    folder.mkdir()
    code = ("import fcntl, os, sys, time\nf = open(sys.argv[1], 'a')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
            "f.write(f'{os.getpid()}\\n')\nf.flush()\nprint(flush=True)\ntime.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(folder / "study.lock")],
                              stdout=subprocess.PIPE)
    try:
        holder.stdout.readline()  # it holds the lock
        with pytest.raises(ConfigError, match=rf"another study \(PID {holder.pid}\) is running"):
            with runner.study_lock(folder):
                pass
    finally:
        holder.kill()
        holder.wait()
    with runner.study_lock(folder) as lock:  # its holder is dead now: taken over
        assert lock.read_text() == f"{os.getpid()}\n"
    assert not (folder / "study.lock").exists()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_study_leaves_no_child_and_a_second_study_is_refused(tmp_path, capsys, subprocess_env):
    _write(tmp_path / "plan.yaml", "model: smallcnn\nmeasured_steps: 3000\nrepeats: 1\n"
           "runs:\n  - {name: baseline, config: configs/baseline.yaml}\n")
    args = [*_args(tmp_path), "--overrides", json.dumps({"data.batch_size": 2}), "--predict", "false"]
    proc = subprocess.Popen([sys.executable, "-m", "modelwright", *args], cwd=REPO_ROOT, env=subprocess_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not list((tmp_path / "work").rglob("events.out.tfevents*")):  # the child is training
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.5)
        assert cli.main(args) == 2  # beside a live study of the same results: refused
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and f"another study (PID {proc.pid}) is running" in errors[0]
        family = _descendants(proc.pid)
        assert len(family) >= 2  # the guard and the run
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in family if _alive(pid)]
    finally:
        proc.kill()
        for pid in _descendants(proc.pid):  # only if the test failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)


# -- a tiny study end to end ---------------------------------------------------------------------------------


class TinyStudy(NamedTuple):
    root: Path
    status: int
    records: list[dict]


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory) -> TinyStudy:
    root = tmp_path_factory.mktemp("study")
    _write(root / "plan.yaml", TINY_PLAN)
    environment = pytest.MonkeyPatch()
    environment.setenv("OMP_NUM_THREADS", "1")
    environment.setenv("MODELWRIGHT_CACHE_DIR", str(root / "cache"))
    try:
        status = cli.main(_args(root))
    finally:
        environment.undo()
    return TinyStudy(root, status, read_records(root / "results" / SLUG / "records.jsonl"))


def test_tiny_study_records_every_run_and_goes_on_after_a_crash(tiny_study):
    root = tiny_study.root
    records = tiny_study.records
    assert tiny_study.status == 0
    for name in ("records.jsonl", "study.json", "table.md"):
        assert (root / "results" / SLUG / name).stat().st_size > 0, name
    runs = [r for r in records if r["study"]["kind"] == "run"]
    assert [(r["study"]["name"], r["status"]) for r in runs] == [("baseline", "ok"), ("broken", "failed")]
    epochs = [r for r in records if r["study"]["kind"] == "epoch"]
    assert [(r["study"]["name"], r["status"]) for r in epochs] == [("baseline", "ok")], "broken's would fail too"
    epoch = epochs[0]["timing"]
    assert epoch["epoch_steps"] == 4 and epoch["epoch_validations"] == 2, "32 samples in 8s; validated twice"
    assert 0 < epoch["epoch_validation_s"] < epoch["epoch_time_s"]
    assert epochs[0]["memory"]["anatomy_mib"] is None
    base, broken = runs
    assert base["timing"]["measured_steps"] == 2 and base["study"]["repeat"] == 0
    assert base["techniques"]["model_name"] == "smallcnn" and base["techniques"]["effective_batch_size"] == 8
    assert broken["error"].startswith("exit status 2: error: trainer.strategy")
    assert broken["study"]["output_tail"]
    assert broken["techniques"]["model_name"] == "smallcnn" and broken["provenance"]["commit"]
    for r in records:
        assert r["provenance"]["command"].startswith("python -m modelwright study --plan=")


def test_tiny_study_confirms_the_budget_batch_and_one_a_few_percent_over(tiny_study):
    records = tiny_study.records
    *confirms, over = [r for r in records if r["study"]["kind"] == "budget"]
    confirm = confirms[-1]  # a planner miss over the budget would be corrected once, by the measured miss
    budget_mib = 0.0308 * 1024
    assert confirm["study"]["role"] == "confirm" and confirm["study"]["predicted_batch"] > 8
    assert confirm["techniques"]["micro_batch_size"] == confirm["study"]["predicted_batch"]
    assert peak_mib(confirm) <= budget_mib
    assert peak_mib(confirm) == pytest.approx(confirm["study"]["predicted_peak_mib"], rel=0.1)
    batch = confirm["techniques"]["micro_batch_size"]
    assert over["study"]["role"] == "over"
    assert over["techniques"]["micro_batch_size"] == batch + math.ceil(0.05 * batch)
    assert peak_mib(over) > peak_mib(confirm)


def test_a_rerun_skips_what_is_recorded(tiny_study, capsys):
    root = tiny_study.root
    records = tiny_study.records
    assert cli.main([*_args(root), "--report", "false"]) == 0
    err = capsys.readouterr().err
    assert "(0 to run)" in err and err.count("skipped (recorded") == len(records)
    assert len(read_records(root / "results" / SLUG / "records.jsonl")) == len(records)
    info = json.loads((root / "results" / SLUG / "study.json").read_text())
    assert info["runs_executed"] == 0 and info["runs_skipped"] == len(records)
    assert info["repeat_order"] == "round-robin"


def test_usage_errors_exit_2_with_one_line(tmp_path, capsys):
    assert cli.main(["study", "--plan", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: plan: no file") and err.count("\n") == 1
    assert cli.main(["study", "--repeats", "0"]) == 2
    assert "repeats" in capsys.readouterr().err


def test_an_epoch_runs_callbacks_file_keeps_the_memory_capture_off(tmp_path):
    """The run folder's callbacks file is what the child runs: it once set the capture back on, so one step of
    every timed epoch ran under the memory tracker."""
    entry = plan.Entry("baseline", "configs/baseline.yaml")
    study = runner.Study(plan.Plan("p", [entry]), _settings(), tmp_path / SLUG, tmp_path / "work")
    for kind, anatomy in (("epoch", False), ("run", True)):
        run_dir = study._prepare(plan.build_spec(entry, 0, _settings(), kind=kind))
        callbacks = yaml.safe_load((run_dir / "callbacks.yaml").read_text())["trainer"]["callbacks"]
        monitor = next(c for c in callbacks if c["class_path"].endswith("RunMonitor"))
        assert monitor["init_args"]["anatomy"] is anatomy, kind


USER_JOB = """
trainer:
  logger:
    init_args:
      name: my-job
model:
  network:
    class_path: user_nets.ThreeLayerCNN
  channels_last: false
data:
  batch_size: {batch}
  channels: 1
  image_size: 28
"""


def _job_args(root: Path, job: Path, *extra: str) -> list[str]:
    return ["study", "--config", str(job), "--slug", SLUG, "--accelerator", "cpu", "--results",
            str(root / "results"), "--workdir", str(root / "work"), *extra]


def test_a_users_job_is_studied_with_each_technique_under_its_own_name(tmp_path, capsys, monkeypatch):
    """`study --config my_job.yaml`: every run is the job plus one change of plan_job.yaml; accumulation keeps
    the job's effective batch; the outputs go under the job's name."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "tests" / "jobs"))
    job = tmp_path / "my_job.yaml"
    job.write_text(USER_JOB.format(batch=32))
    assert cli.main(_job_args(tmp_path, job, "--repeats", "1", "--dry_run", "true")) == 0
    err = capsys.readouterr().err
    assert f"results: {tmp_path / 'results' / SLUG / 'my-job'}/" in err
    commands = [line for line in err.splitlines() if " r0 [" in line]
    names = [line.split(" r0 [")[0].strip() for line in commands]
    planned = [entry.name for entry in plan.load_plan(REPO_ROOT / "configs/study/plan_job.yaml").entries]
    assert set(names) <= set(planned) and {"baseline", "accumulate", "checkpointing", "sgd"} <= set(names)
    assert all(f"fit --config {job} --config " in line for line in commands), "the job's file first"
    (accumulate,) = [line for line in commands if line.strip().startswith("accumulate r0")]
    assert "--trainer.accumulate_grad_batches=4 --data.batch_size=8" in accumulate, "32 = 4 x 8"
    assert "--model.network" not in err, "the job's own network, not the plan's"


def test_a_users_job_whose_batch_accumulation_cannot_divide_is_refused_naming_the_run(tmp_path, capsys,
                                                                                       monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "tests" / "jobs"))
    job = tmp_path / "my_job.yaml"
    job.write_text(USER_JOB.format(batch=30))
    assert cli.main(_job_args(tmp_path, job, "--dry_run", "true")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "runs.accumulate.accumulate: 4 does not divide the job's data.batch_size 30" in line
    assert not (tmp_path / "results").exists() and not (tmp_path / "work").exists()


def _report_readme(tmp_path: Path, monkeypatch, *extra: str) -> Path | None:
    """The README a study of the tiny plan hands to the report (its runs left out: only the choice is
    checked), with the project's root at ``tmp_path``."""
    import modelwright.study as study_module

    _write(tmp_path / "plan.yaml", TINY_PLAN)
    _write(tmp_path / "README.md", "<!-- results:start -->\n<!-- results:end -->\n")
    monkeypatch.setattr(study_module, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(study_module, "_run_locked", lambda *args: True)
    handed = []
    monkeypatch.setattr(study_module, "generate", lambda folder, readme, allow_mixed: handed.append(readme) or [])
    without_readme = _args(tmp_path)[:-2]
    assert cli.main([*without_readme, *extra]) == 0
    (readme,) = handed
    return readme


def test_a_scratch_study_leaves_the_readme_alone_unless_asked(tmp_path, monkeypatch):
    """Before: a study into a scratch results folder rewrote the project's README from its one or two rows."""
    assert _report_readme(tmp_path, monkeypatch, "--results", str(tmp_path / "scratch")) is None
    asked = _report_readme(tmp_path, monkeypatch, "--results", str(tmp_path / "scratch"), "--readme",
                           str(tmp_path / "README.md"))
    assert asked == tmp_path / "README.md"
    own = _report_readme(tmp_path, monkeypatch, "--results", str(tmp_path / "results"))
    assert own == tmp_path / "README.md", "the project's own results folder fills the project's README"


# -- every flag of the study command, at a valid value -------------------------------------------------------

FLAG_PLAN = """\
model: smallcnn
warmup_steps: 1
measured_steps: 2
repeats: 1
budget: {gib: 0.05, runs: [baseline]}
runs:
  - name: baseline
    config: configs/baseline.yaml
  - name: slower
    config: configs/baseline.yaml
    overrides: {model.lr: 0.001}
"""


class FlagOutcome(NamedTuple):
    """What a study with fake children did: each child's arguments, timeout and callbacks file; the records;
    what the report was handed."""

    root: Path
    status: int
    children: list[dict]
    reports: list[dict]

    def records(self, slug: str = SLUG, results: str = "results", job: str = "") -> list[dict]:
        path = self.root / results / slug / job / "records.jsonl"
        return read_records(path) if path.is_file() else []

    def child_args(self, name: str) -> list[str]:
        return next(child["args"] for child in self.children if f"/{name}-" in child["args"][-1])


def _fake_children(monkeypatch, children: list[dict], status: str = "ok") -> None:
    """Children that write a record of ``status`` at once (peak: 20 MiB + 1 MiB a sample) and train nothing;
    each call's arguments, timeout and callbacks file are kept."""
    def fake_child(args, log_path, env, timeout_s, tick):
        run_dir = log_path.parent
        callbacks = yaml.safe_load((run_dir / "callbacks.yaml").read_text())["trainer"]["callbacks"]
        batches = [int(arg.split("=")[1]) for arg in args if arg.startswith("--data.batch_size=")]
        children.append({"args": [*args, str(run_dir)], "timeout_s": timeout_s, "callbacks": callbacks})
        log_path.write_text("")
        error = None if status == "ok" else f"{status}: by hand"
        record = _fake_record(batches[-1], 1, 1.0, status=status, error=error)
        record["memory"]["anatomy_mib"] = {key: 0.0 for key in ANATOMY_KEYS} | record["memory"]["anatomy_mib"]
        (run_dir / "record.json").write_text(json.dumps(record))
        return runner.ChildResult(0, False, 0.1)

    monkeypatch.setattr(runner, "run_child", fake_child)


def _flag_study(tmp_path: Path, monkeypatch, *extra: str, before: str | None = None) -> FlagOutcome:
    """The study of FLAG_PLAN with ``extra`` flags (after the test's own: later ones win), its children faked,
    its predictions by hand and its report caught; ``before``: a first study whose runs end with that status."""
    import modelwright.study as study_module

    _write(tmp_path / "plan.yaml", FLAG_PLAN)
    monkeypatch.setattr(planner.memory, "rehearsal", lambda config: _FakeRehearsal())
    reports: list[dict] = []
    monkeypatch.setattr(study_module, "generate", lambda folder, readme, allow_mixed: reports.append(
        {"folder": Path(folder), "readme": readme, "allow_mixed": allow_mixed}) or [])
    base = [*_args(tmp_path)[:-2], "--readme", str(tmp_path / "README.md")]
    _write(tmp_path / "README.md", "<!-- results:start -->\n<!-- results:end -->\n")
    if before:
        _fake_children(monkeypatch, [], status=before)
        assert cli.main(base) == (0 if before == "ok" else 1)  # 1: every run failed
        reports.clear()
    children: list[dict] = []
    _fake_children(monkeypatch, children)
    status = cli.main([*base, *extra])
    return FlagOutcome(tmp_path, status, children, reports)


def _monitor(child: dict) -> dict:
    return next(c["init_args"] for c in child["callbacks"] if c["class_path"].endswith("RunMonitor"))


def _kinds(records: list[dict]) -> list[tuple[str, str]]:
    return sorted((record["study"]["name"], record["study"]["kind"]) for record in records)


def _job_flag(tmp_path: Path) -> list[str]:
    job = _write(tmp_path / "job.yaml", "trainer:\n  logger:\n    init_args:\n      name: my-job\n")
    return ["--config", str(job)]


#: Every flag of ``python -m modelwright study``: a valid value other than the test's own, and what it must
#: change, checked on the study's children, records and report (``before``: the status of a first study's runs).
FLAGS = {
    "job": (_job_flag, lambda out: len(out.records(job="my-job")) == len(out.children) > 0
            and all("--config" in child["args"] and str(out.root / "job.yaml") in child["args"]
                    for child in out.children)),
    "plan": (lambda tmp: ["--plan", str(_write(tmp / "other.yaml", FLAG_PLAN.replace("slower", "other")))],
             lambda out: {name for name, _ in _kinds(out.records())} == {"baseline", "other"}),
    "only": (lambda tmp: ["--only", "[slower]"],
             lambda out: _kinds(out.records()) == [("slower", "epoch"), ("slower", "run")]),
    "model": (lambda tmp: ["--model", "vit"],
              lambda out: "--model.network=modelwright.train.models.SmallViT" in out.child_args("baseline")),
    "accelerator": (lambda tmp: ["--accelerator", "auto"],
                    lambda out: out.children and not any("--trainer.accelerator" in arg
                                                         for child in out.children for arg in child["args"])),
    "warmup_steps": (lambda tmp: ["--warmup_steps", "3"],
                     lambda out: {_monitor(child)["warmup_steps"] for child in out.children} == {3}
                     and {record["study"]["warmup_steps"] for record in out.records()} == {3}),
    "steps": (lambda tmp: ["--steps", "4"],
              lambda out: {r["study"]["measured_steps"] for r in out.records() if r["study"]["kind"] == "run"}
              == {4}),
    "repeats": (lambda tmp: ["--repeats", "2"],
                lambda out: sorted(r["study"]["repeat"] for r in out.records()
                                   if r["study"]["kind"] == "run") == [0, 0, 1, 1]),
    "val_batches": (lambda tmp: ["--val_batches", "2"],
                    lambda out: "--trainer.limit_val_batches=2" in out.child_args("baseline")),
    "overrides": (lambda tmp: ["--overrides", json.dumps({**TINY, "data.batch_size": 4})],
                  lambda out: "--data.batch_size=4" in out.child_args("slower")),
    "budget_gib": (lambda tmp: ["--budget_gib", "0.04"],  # 40.96 MiB: batch 20 (40 MiB) fits, 21 does not
                   lambda out: [(r["techniques"]["micro_batch_size"], r["study"]["budget_mib"])
                                for r in out.records() if r["study"]["kind"] == "budget"]
                   == [(20, 0.04 * 1024), (21, 0.04 * 1024)]),
    "budget": (lambda tmp: ["--budget", "false"],
               lambda out: out.records() and all(r["study"]["kind"] != "budget" for r in out.records())),
    "results": (lambda tmp: ["--results", str(tmp / "elsewhere")],
                lambda out: len(out.records(results="elsewhere")) == len(out.children) > 0
                and out.reports[0]["folder"] == out.root / "elsewhere" / SLUG),
    "slug": (lambda tmp: ["--slug", "cpu-other"],
             lambda out: len(out.records(slug="cpu-other")) == len(out.children) > 0 and not out.records()),
    "workdir": (lambda tmp: ["--workdir", str(tmp / "runs")],
                lambda out: out.children and all(child["args"][-1].startswith(str(out.root / "runs" / SLUG))
                                                 for child in out.children)),
    "readme": (lambda tmp: ["--readme", str(_write(tmp / "OTHER.md", "<!-- results:start -->\n"))],
               lambda out: [str(report["readme"]) for report in out.reports] == [str(out.root / "OTHER.md")]),
    "report": (lambda tmp: ["--report", "false"], lambda out: out.children and out.reports == []),
    "allow_mixed": (lambda tmp: ["--allow_mixed", "true"],
                    lambda out: [report["allow_mixed"] for report in out.reports] == [True]),
    # 6 runs: 2 timed, 2 epochs, the budget's batch (31: 51 MiB of 51.2) and one over it (33)
    "rerun": (lambda tmp: ["--rerun", "true"], lambda out: len(out.children) == 6 and len(out.records()) == 12),
    # the first study's 4 runs, all oom (no epoch of a run whose timed runs failed); all 6 now, none without
    "retry_failed": (lambda tmp: ["--retry_failed", "true"],
                     lambda out: len(out.children) == 6
                     and [r["status"] for r in out.records()] == ["oom"] * 4 + ["ok"] * 6),
    "run_timeout_s": (lambda tmp: ["--run_timeout_s", "30"],
                      lambda out: {child["timeout_s"] for child in out.children} == {30.0}),
    "predict": (lambda tmp: ["--predict", "false"],
                lambda out: out.children and not (out.root / "results" / SLUG / "predictions.jsonl").exists()),
    "epochs": (lambda tmp: ["--epochs", "false"],
               lambda out: _kinds(out.records()) == [("baseline", "budget")] * 2 + [("baseline", "run"),
                                                                                   ("slower", "run")]),
    "dry_run": (lambda tmp: ["--dry_run", "true"], lambda out: out.children == [] and out.records() == []),
}
#: The flags whose check needs a first study: what it left, by the status of its runs.
BEFORE = {"rerun": "ok", "retry_failed": "oom"}


@pytest.mark.parametrize("flag", list(inspect.signature(study_command).parameters))
def test_every_study_flag_runs_at_a_valid_value(flag, tmp_path, monkeypatch):
    """Generated from the study function's signature, so that a new flag cannot be left out: each one, given a
    valid value, runs (``--warmup_steps 1`` once crashed writing the run's callbacks file: jsonargparse's
    NonNegativeInt is no int to yaml.safe_dump) and changes what it says it changes."""
    assert flag in FLAGS, f"study's --{flag} has no case in FLAGS"
    make_args, check = FLAGS[flag]
    outcome = _flag_study(tmp_path, monkeypatch, *make_args(tmp_path), before=BEFORE.get(flag))
    assert outcome.status == 0
    assert check(outcome), outcome.children[:1]


def test_a_study_with_everything_recorded_says_how_to_measure_afresh(tmp_path, capsys, monkeypatch):
    """Issue 39. Before: on a machine whose slug already had results, the README's "what does each technique
    buy on this machine?" answered "0 to run" and nothing else."""
    _write(tmp_path / "plan.yaml", TINY_PLAN)
    monkeypatch.setattr(runner.Study, "recorded", lambda self, spec: {"status": "ok"})
    assert cli.main(_args(tmp_path, "--dry_run", "true")) == 0
    err = capsys.readouterr().err
    assert "(0 to run)" in err
    assert f"every run is recorded in {tmp_path / 'results' / SLUG}/ already: to measure afresh, give another " \
        "results folder (--results ../scratch/results) or --rerun true" in err


def test_the_dry_run_of_a_new_folder_estimates_from_the_projects_records_of_the_same_machine(tmp_path, capsys,
                                                                                             monkeypatch):
    """Issue 39. Before: a scratch results folder had no records, and the estimate said none."""
    import modelwright.study as study_module

    _write(tmp_path / "plan.yaml", TINY_PLAN)
    committed = tmp_path / "project" / "results" / SLUG
    committed.mkdir(parents=True)
    lines = [json.dumps(build_record(study={"name": name, "kind": kind, "process_wall_s": seconds}))
             for name, kind, seconds in (("baseline", "run", 40.0), ("broken", "run", 30.0),
                                         ("baseline", "epoch", 120.0), ("broken", "epoch", 10.0))]
    (committed / "records.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(study_module, "REPO_ROOT", tmp_path / "project")
    assert cli.main(_args(tmp_path, "--dry_run", "true")) == 0
    err = capsys.readouterr().err
    assert "estimate: about 3.33 min for the 4 runs to run, from the records of the same runs in " \
        f"{committed}/" in err


# -- more repeats where the first round leaves a row undecided ------------------------------------------------

MORE_PLAN = """\
model: smallcnn
warmup_steps: 1
measured_steps: 2
repeats: 3
max_repeats: 5
runs:
  - name: baseline
    config: configs/baseline.yaml
  - name: straddles
    config: configs/baseline.yaml
    overrides: {model.lr: 0.001}
  - name: faster
    config: configs/baseline.yaml
    overrides: {model.lr: 0.002}
  - name: same
    config: configs/baseline.yaml
    overrides: {model.lr: 0.003}
"""
#: Each run's median step (ms) by repeat. straddles: 1.15x the baseline over its first 3, its interval
#: 0.90-1.30x (undecided); faster: about 0.51x, its interval clear of 1.0; same: 1.00x (within 2%).
STEP_MS = {"baseline": [100.0] * 5, "straddles": [90.0, 130.0, 115.0, 120.0, 125.0],
           "faster": [50.0, 51.0, 52.0, 53.0, 54.0], "same": [100.0, 101.0, 99.0, 100.0, 100.0]}


def _timed_children(monkeypatch, ran: list[str], stop_at: str | None = None) -> None:
    """Children that record the step of :data:`STEP_MS` for their run and repeat at once; each one's label
    (``straddles r3``, ``same e0``) is kept; ``stop_at``: that child is interrupted as by Ctrl-C."""
    def fake_child(args, log_path, env, timeout_s, tick):
        name, _, repeat = log_path.parent.name.rpartition("-")
        label = f"{name.rsplit('-', 1)[0]} {repeat}"
        if label == stop_at:
            raise KeyboardInterrupt
        ran.append(label)
        log_path.write_text("")
        record = _fake_record(8, 1, 1.0)
        record["memory"]["anatomy_mib"] = {key: 0.0 for key in ANATOMY_KEYS} | record["memory"]["anatomy_mib"]
        record["timing"]["step_time_median_ms"] = STEP_MS[label.split()[0]][int(repeat[1:])]
        (log_path.parent / "record.json").write_text(json.dumps(record))
        return runner.ChildResult(0, False, 0.1)

    monkeypatch.setattr(runner, "run_child", fake_child)


def _more_study(tmp_path: Path, monkeypatch, stop_at: str | None = None, *extra: str) -> tuple[int, list[str]]:
    _write(tmp_path / "plan.yaml", MORE_PLAN)
    ran: list[str] = []
    _timed_children(monkeypatch, ran, stop_at)
    status = cli.main(_args(tmp_path, "--predict", "false", "--report", "false", *extra))
    return status, ran


def test_a_row_whose_interval_straddles_gets_repeats_up_to_max_repeats_its_baseline_in_turn(tmp_path,
                                                                                              monkeypatch,
                                                                                              capsys):
    status, ran = _more_study(tmp_path, monkeypatch, None, "--dry_run", "true")
    assert (status, ran) == (0, [])
    assert "then more repeats may follow: up to 5 of a row and of its baseline, in turn, where the first 3 " \
        "leave the row undecided" in capsys.readouterr().err
    status, ran = _more_study(tmp_path, monkeypatch)
    first_round = [f"{name} r{repeat}" for repeat in range(3) for name in STEP_MS]
    epochs = [f"{name} e0" for name in STEP_MS]
    assert status == 0
    assert ran == [*first_round, "baseline r3", "straddles r3", "baseline r4", "straddles r4", *epochs]
    err = capsys.readouterr().err
    assert "straddles: undecided after 3 repeats (1.15×, 0.900–1.30× (3 pairs)): up to 5, in turn with " \
        "baseline" in err


def test_a_decided_row_gets_no_more_repeats_and_the_summary_says_how_many_each_got(tmp_path, monkeypatch):
    assert _more_study(tmp_path, monkeypatch)[0] == 0
    records = read_records(tmp_path / "results" / SLUG / "records.jsonl")
    repeats: dict[str, list[int]] = {}
    for record in records:
        if record["study"]["kind"] == "run":
            repeats.setdefault(record["study"]["name"], []).append(record["study"]["repeat"])
    assert repeats == {"baseline": [0, 1, 2, 3, 4], "straddles": [0, 1, 2, 3, 4], "faster": [0, 1, 2],
                       "same": [0, 1, 2]}
    summary = json.loads((tmp_path / "results" / SLUG / "study.json").read_text())
    assert summary["repeats_by_run"] == {"baseline": 5, "straddles": 5, "faster": 3, "same": 3}
    assert summary["max_repeats"] == 5


def test_a_study_stopped_in_its_extra_repeats_resumes_them_and_then_runs_nothing(tmp_path, monkeypatch):
    status, ran = _more_study(tmp_path, monkeypatch, "baseline r4")
    assert status == 130 and ran[-2:] == ["baseline r3", "straddles r3"]
    status, ran = _more_study(tmp_path, monkeypatch)
    assert status == 0
    assert ran == ["baseline r4", "straddles r4", *(f"{name} e0" for name in STEP_MS)]
    status, ran = _more_study(tmp_path, monkeypatch)
    assert (status, ran) == (0, [])
    assert len(read_records(tmp_path / "results" / SLUG / "records.jsonl")) == 12 + 4 + 4
