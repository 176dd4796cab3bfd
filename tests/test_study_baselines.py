"""Each plan carries its own baseline, run in turn with its rows: a record of another plan's baseline with the
same config does not stand in for it."""

from __future__ import annotations

from modelwright import REPO_ROOT
from modelwright.record import append_record
from modelwright.study import plan, runner


def _spec(name: str, repeat: int = 0) -> plan.RunSpec:
    return plan.RunSpec(name, "run", 0, repeat, "configs/baseline.yaml", {}, {}, "samecfg", 10)


def test_a_plans_own_baseline_runs_though_another_plan_recorded_the_same_config(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    recorded = {"status": "ok", "run_id": "baseline-r0",
                "study": {"name": "baseline", "kind": "run", "config_hash": "samecfg", "repeat": 0}}
    append_record(results / "records.jsonl", recorded, validate=False)
    settings = plan.Settings(slug="cpu-x", accelerator="cpu", warmup_steps=1, measured_steps=10, repeats=1,
                             val_batches=0, model=None, overrides={})
    extra = plan.load_plan(REPO_ROOT / "configs/study/plan_extra.yaml")
    study = runner.Study(extra, settings, results, tmp_path / "work")
    assert study.recorded(_spec("baseline")) is not None  # the same run resumes as before
    assert study.recorded(_spec("extra-baseline")) is None  # was skipped: (kind, config hash, repeat) matched
    assert study.recorded(_spec("baseline", repeat=1)) is None


def test_every_project_plan_starts_with_a_baseline_of_its_own():
    for path in sorted((REPO_ROOT / "configs/study").glob("plan_*.yaml")):
        entries = plan.load_plan(path).entries
        assert entries[0].name.endswith("baseline"), path.name
    names = [plan.load_plan(REPO_ROOT / f"configs/study/{name}.yaml").entries[0].name
             for name in ("plan_default", "plan_extra")]
    assert names == ["baseline", "extra-baseline"]  # one name each: their rows are not merged into one


def _in_plan(record: dict, plan_file: str) -> dict:
    record["study"]["plan"] = plan_file
    return record


def test_a_row_of_a_plan_without_its_own_baseline_has_no_verdict_and_says_why():
    """The extra plan's rows of an older study ran half an hour after the default plan's baseline: their ratio is
    shown, but no interval and no verdict. A plan with a baseline of its own pairs its rows with it."""
    from modelwright import study_rows
    from modelwright.report import tables
    from test_report import rec

    records = [_in_plan(rec("baseline", ms, 700, repeat), "default.yaml")
               for repeat, ms in enumerate((2000, 2100, 2200))]
    records += [_in_plan(rec("fused", ms, 690, repeat, index=1), "extra.yaml")
                for repeat, ms in enumerate((1000, 1050, 1100))]
    records += [_in_plan(rec("own-baseline", ms, 700, repeat, index=2), "own.yaml")
                for repeat, ms in enumerate((2000, 2100, 2200))]
    records += [_in_plan(rec("amp", ms, 350, repeat, index=3), "own.yaml")
                for repeat, ms in enumerate((1000, 1050, 1100))]
    rows = {row.name: row for row in study_rows.build_rows(records)}
    fused = rows["fused"]
    assert fused.reference is rows["baseline"] and not fused.paired
    assert fused.vs("step_ms") == 0.5 and fused.interval is None
    assert fused.verdict == "no verdict: another plan's baseline"
    assert tables.interval_text(fused) == "– (another plan's baseline)"
    amp = rows["amp"]
    assert amp.reference is rows["own-baseline"] and amp.paired
    assert amp.interval is not None and amp.interval.pairs == 3
    assert amp.verdict == "faster" and tables.interval_text(amp) == amp.interval.text()
    assert rows["baseline"].paired and tables.interval_text(rows["baseline"]) == "reference"
