"""The run record: the typed schema, validation, the generated document, and atomic files."""

from __future__ import annotations

import json
import stat
import warnings
from pathlib import Path

import pytest

from modelwright import measure
from modelwright.record import (
    ANATOMY_KEYS,
    DEFINITIONS_VERSION,
    RecordError,
    RunRecord,
    append_record,
    build_record,
    check_record,
    read_record,
    read_records,
    schema_fields,
    schema_markdown,
    validate_record,
    write_record,
)

REPO = Path(__file__).resolve().parents[1]


#: A resnet18 step's memory by category, MiB.
ANATOMY = {"parameters": 42.6, "buffers": 0.0, "gradients": 42.6, "optimizer_state": 85.3,
           "activations": 180.0, "temporaries": 12.5, "comm_buffers": 0.0, "inputs": 1.5, "other": 0.0,
           "total": 363.0}


def _full_record() -> dict:
    record = build_record(run_id="r-1")
    record["config"] = {"trainer": {"precision": "16-mixed"}}
    record["techniques"].update(
        model_name="resnet18",
        network="modelwright.train.models.ResNet18",
        precision="bf16-mixed",
        precision_requested="16-mixed",
        accumulate_grad_batches=4,
        gradient_checkpointing="block",
        optimizer="adamw",
        optimizer_impl="torch.optim.AdamW[for-loop]",
        channels_last=False,
        compile=False,
        strategy="ddp",
        world_size=2,
        num_nodes=1,
        micro_batch_size=32,
        effective_batch_size=256,
    )
    record["hardware"].update(measure.hardware_info("cpu", num_devices=2))
    record["versions"].update(measure.versions())
    record["timing"].update(
        warmup_steps=2,
        measured_steps=10,
        step_time_median_ms=3000.0,
        step_time_p90_ms=3100.0,
        step_time_min_ms=2900.0,
        step_time_max_ms=3200.0,
        steps_per_epoch=16,
        epoch_time_s=48.0,
        samples_per_s=85.3,
        wall_time_s=60.0,
    )
    record["flops"].update(
        flops_per_step=426e9,
        achieved_flops_per_s=142e9,
        peak_flops_per_s=233.6e9,
        peak_flops_source="cpu-isa-clock",
        peak_flops_method="2 cores x 32 float32 FLOP/cycle x 3.65 GHz",
        mfu=0.61,
    )
    record["memory"].update(
        peak_allocated_mib=363.0,
        peak_reserved_mib=None,
        anatomy_step=2,
        anatomy_mib=dict(ANATOMY),
        model_parameters=11_173_962,
        rss_peak_mib=1500.0,
    )
    record["metrics"].update({"train/loss": 1.2, "train/acc": 0.6, "val/loss": 1.3, "val/acc": 0.55})
    record["history"] = {"train/loss": [[4, 2.0], [8, 1.2]], "val/acc": [[8, 0.55]]}
    return record


def test_empty_and_full_records_validate():
    assert validate_record(build_record()) == []
    check_record(_full_record())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda record: record.pop("timing"), "timing: missing"),
        (lambda record: record["timing"].pop("step_time_median_ms"), "timing.step_time_median_ms: missing"),
        (lambda record: record.update(status="crashed"), "status:"),
        (lambda record: record.update(schema_version=4), "schema_version:"),
        (lambda record: record["timing"].update(step_time_median_ms="3 s"),
         "timing.step_time_median_ms: expected"),
        (lambda record: record["memory"].update(peak_allocated_mib=-1.0), "negative"),
        (lambda record: record["memory"]["anatomy_mib"].pop("activations"),
         "anatomy_mib.activations: missing"),
        (lambda record: record["memory"]["anatomy_mib"].update(inputs=-1.0),
         "memory.anatomy_mib.inputs: negative"),
        (lambda record: record["memory"].update(anatomy_end_mib=[1.0]),
         "memory.anatomy_end_mib: expected dict | null"),
        (lambda record: record["flops"].update(peak_flops_source="guess"), "peak_flops_source"),
        (lambda record: record["techniques"].update(effective_batch_size=128), "effective_batch_size"),
        (lambda record: record["techniques"].update(world_size=True), "world_size"),
        (lambda record: record.update(status="failed", error=None), "error:"),
        (lambda record: record["history"]["train/loss"].append([3, 1.0]), "history.train/loss[2]"),
        (lambda record: record["metrics"].update({"val/acc": float("nan")}), "non-finite"),
    ],
)
def test_invalid_records_are_reported(mutate, message):
    record = _full_record()
    mutate(record)
    errors = validate_record(record)
    assert any(message in error for error in errors), errors
    with pytest.raises(RecordError):
        check_record(record)


#: Every status of the schema, and whether a record of it must carry its one-line error (RunRecord.error: every
#: status but ok; a diverged run's may be set; a running one has not ended).
STATUSES = {"ok": False, "running": False, "diverged": False, "failed": True, "interrupted": True, "oom": True}
SCHEMA_STATUSES = next(meta["choices"] for key, meta, *_ in schema_fields(RunRecord) if key == "status")


@pytest.mark.parametrize("status", SCHEMA_STATUSES)
def test_every_status_and_whether_it_must_carry_an_error(status):
    assert set(STATUSES) == set(SCHEMA_STATUSES), "a new status: say here whether it must carry an error"
    needs_error = STATUSES[status]
    for missing in (None, ""):
        errors = validate_record({**_full_record(), "status": status, "error": missing})
        expected = [f"error: status {status!r} needs a one-line error message"] if needs_error else []
        assert errors == expected
    assert validate_record({**_full_record(), "status": status, "error": "RuntimeError: by hand"}) == []


def test_write_record_is_atomic_and_refuses_invalid_records(tmp_path):
    path = tmp_path / "runs" / "record.json"
    record = _full_record()
    record["metrics"]["train/loss"] = float("nan")  # a diverged loss: written as null
    write_record(path, record)
    back = read_record(path)
    assert back["metrics"]["train/loss"] is None and back["run_id"] == "r-1"
    bad = _full_record()
    bad["status"] = "crashed"
    with pytest.raises(RecordError):
        write_record(path, bad)
    assert read_record(path)["status"] == "ok"  # the old file is untouched
    assert sorted(p.name for p in path.parent.iterdir()) == ["record.json"]  # no temp files left


def test_append_and_read_records_skip_damaged_lines(tmp_path):
    path = tmp_path / "records.jsonl"
    for i in range(3):
        record = _full_record()
        record["run_id"] = f"r-{i}"
        append_record(path, record)
    text = path.read_text()
    assert text.count("\n") == 3 and all(json.loads(line) for line in text.splitlines())
    with path.open("a") as f:
        f.write('{"run_id": "torn", "status": "o\n')  # a torn write
        f.write("[1, 2]\n")
    append_record(path, _full_record())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = read_records(path)
    assert [record["run_id"] for record in records] == ["r-0", "r-1", "r-2", "r-1"]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "records.jsonl:4: skipped damaged" in messages[0]
    assert "records.jsonl:5: skipped" in messages[1]


def test_write_record_is_readable_by_everyone(tmp_path):
    # mkstemp makes 0600 files: a record written by one user was unreadable by the report run by another.
    path = write_record(tmp_path / "record.json", _full_record())
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_append_after_a_torn_last_line_keeps_the_new_record(tmp_path):
    path = tmp_path / "records.jsonl"
    for i in range(2):
        append_record(path, {**_full_record(), "run_id": f"r-{i}"})
    text = path.read_bytes()
    path.write_bytes(text[: len(text) - 40])  # a crash mid-line: the file no longer ends in a newline
    append_record(path, {**_full_record(), "run_id": "after"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [record["run_id"] for record in read_records(path)] == ["r-0", "after"]
    assert len(caught) == 1 and "records.jsonl:2: skipped damaged" in str(caught[0].message)
    append_record(path, {**_full_record(), "run_id": "next"})  # a clean tail gets no blank line
    assert "\n\n" not in path.read_text()
    with pytest.warns(UserWarning, match="skipped damaged"):
        assert [record["run_id"] for record in read_records(path)][-2:] == ["after", "next"]


def test_every_schema_leaf_has_a_doc_and_metric_keys_keep_their_names():
    def leaves(cls, prefix=""):
        for key, meta, section, _ in schema_fields(cls):
            yield from leaves(section, f"{prefix}{key}.") if section else [(prefix + key, meta)]

    fields = dict(leaves(RunRecord))
    assert all(meta["doc"] for meta in fields.values())
    assert fields["timing.step_time_median_ms"]["unit"] == "ms"
    assert fields["memory.anatomy_mib.activations"]["unit"] == "MiB"
    expected = {"metrics.train/loss", "metrics.val/acc", "provenance.commit", "flops.peak_flops_method"}
    assert expected <= set(fields)
    assert set(build_record()["metrics"]) == {"train/loss", "train/acc", "val/loss", "val/acc"}
    assert "comm_buffers" in ANATOMY_KEYS and "inputs" in ANATOMY_KEYS


def test_build_record_carries_provenance_and_optional_sections():
    record = build_record(loop="accelerate", status="failed", error="ValueError: x", run_id="b-1",
                          command=["fit", "--x"], timing={"measured_steps": 3}, study={"name": "baseline"},
                          prediction={"peak_mib": 1.0})
    assert validate_record(record) == []
    assert record["provenance"]["command"] == "fit --x"
    assert record["provenance"]["definitions"] == DEFINITIONS_VERSION
    assert record["timing"]["measured_steps"] == 3
    assert record["timing"]["warmup_steps"] is None  # merged over the skeleton
    assert record["study"] == {"name": "baseline"} and "profile" not in record
    bad = {**record, "study": "baseline"}
    assert any(error.startswith("study: expected") for error in validate_record(bad))


def test_schema_document_is_generated_from_the_code():
    committed = (REPO / "docs" / "record-schema.md").read_text(encoding="utf-8")
    stale = "docs/record-schema.md is stale: run `uv run python -m modelwright.record`"
    assert committed == schema_markdown(), stale


def test_a_copy_without_git_history_names_its_commit_from_the_environment(monkeypatch):
    """The GPU machine gets a copy of the working tree without .git: its records name the commit it was made
    from (scripts/gpu_run.sh exports it) instead of none."""
    from modelwright import record as record_module

    monkeypatch.setattr(record_module, "_git", lambda *args: None)
    monkeypatch.setenv("MODELWRIGHT_COMMIT", "0123456789abcdef")
    assert record_module.provenance()["commit"] == "0123456789abcdef"
    assert record_module.provenance()["dirty"] is None
    monkeypatch.delenv("MODELWRIGHT_COMMIT")
    assert record_module.provenance()["commit"] is None


def test_a_write_that_fails_midway_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    """Atomic: the new text goes to a temp file, is synced, and only then replaces the old one. A plain
    write_text would have overwritten the file before failing (and never synced it)."""
    import errno
    import os

    from modelwright.record import write_text_atomic

    path = tmp_path / "record.json"
    write_text_atomic(path, "old\n")

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="record.json"):
        write_text_atomic(path, "new, cut short\n")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"], "no temp file left"


def test_the_record_of_a_resumed_run(tmp_path):
    """A fit of one epoch (4 steps of batch 8), resumed for a second: the resumed part's record counts its
    window from the step it resumed at (anatomy at 4 + 2 warm-up, 1 step measured after it), not from 0, and
    the first part's record stays beside it as record.1.json."""
    from conftest import fit_args
    from modelwright.train.cli import cli_main

    common = fit_args(tmp_path, "--model.network", "SmallCNN", "--model.scheduler", "none",
                      "--trainer.max_epochs", "1")
    assert cli_main(common) == 0
    assert cli_main([*common, "--trainer.max_epochs", "2", "--ckpt_path", "last"]) == 0
    (run,) = [path for path in (tmp_path / "base").iterdir() if path.name.startswith("version_")]
    first = read_record(run / "record.1.json")
    resumed = read_record(run / "record.json")
    assert (first["status"], resumed["status"]) == ("ok", "ok")
    assert (first["memory"]["anatomy_step"], resumed["memory"]["anatomy_step"]) == (2, 6)
    assert (first["timing"]["measured_steps"], resumed["timing"]["measured_steps"]) == (1, 1)
    assert [step for step, _ in resumed["history"]["train/loss"]][0] > 4
