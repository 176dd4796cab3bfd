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
    new_record,
    read_record,
    read_records,
    schema_fields,
    schema_markdown,
    validate_record,
    write_record,
)

REPO = Path(__file__).resolve().parents[1]


def _full_record() -> dict:
    r = new_record(run_id="r-1")
    r["config"] = {"trainer": {"precision": "16-mixed"}}
    r["techniques"].update(
        model_name="resnet18",
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
    r["hardware"].update(measure.hardware_info("cpu", num_devices=2))
    r["versions"].update(measure.versions())
    r["timing"].update(
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
    r["flops"].update(
        flops_per_step=426e9,
        achieved_flops_per_s=142e9,
        peak_flops_per_s=233.6e9,
        peak_flops_source="cpu-isa-clock",
        peak_flops_method="2 cores x 32 float32 FLOP/cycle x 3.65 GHz",
        mfu=0.61,
    )
    r["memory"].update(
        peak_allocated_mib=363.0,
        peak_reserved_mib=None,
        anatomy_step=2,
        anatomy_mib={
            "parameters": 42.6,
            "buffers": 0.0,
            "gradients": 42.6,
            "optimizer_state": 85.3,
            "activations": 180.0,
            "temporaries": 12.5,
            "comm_buffers": 0.0,
            "inputs": 1.5,
            "other": 0.0,
            "total": 363.0,
        },
        model_parameters=11_173_962,
        rss_peak_mib=1500.0,
    )
    r["metrics"].update({"train/loss": 1.2, "train/acc": 0.6, "val/loss": 1.3, "val/acc": 0.55})
    r["history"] = {"train/loss": [[4, 2.0], [8, 1.2]], "val/acc": [[8, 0.55]]}
    return r


def test_new_and_full_records_validate():
    assert validate_record(new_record()) == []
    check_record(_full_record())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.pop("timing"), "timing: missing"),
        (lambda r: r["timing"].pop("step_time_median_ms"), "timing.step_time_median_ms: missing"),
        (lambda r: r.update(status="crashed"), "status:"),
        (lambda r: r.update(schema_version=2), "schema_version:"),
        (lambda r: r["timing"].update(step_time_median_ms="3 s"), "timing.step_time_median_ms: expected"),
        (lambda r: r["memory"].update(peak_allocated_mib=-1.0), "negative"),
        (lambda r: r["memory"]["anatomy_mib"].pop("activations"), "anatomy_mib.activations: missing"),
        (lambda r: r["memory"]["anatomy_mib"].update(inputs=-1.0), "memory.anatomy_mib.inputs: negative"),
        (lambda r: r["memory"].update(anatomy_end_mib=[1.0]), "memory.anatomy_end_mib: expected dict | null"),
        (lambda r: r["flops"].update(peak_flops_source="guess"), "peak_flops_source"),
        (lambda r: r["techniques"].update(effective_batch_size=128), "effective_batch_size"),
        (lambda r: r["techniques"].update(world_size=True), "world_size"),
        (lambda r: r.update(status="failed", error=None), "error:"),
        (lambda r: r["history"]["train/loss"].append([3, 1.0]), "history.train/loss[2]"),
        (lambda r: r["metrics"].update({"val/acc": float("nan")}), "non-finite"),
    ],
)
def test_invalid_records_are_reported(mutate, message):
    r = _full_record()
    mutate(r)
    errors = validate_record(r)
    assert any(message in e for e in errors), errors
    with pytest.raises(RecordError):
        check_record(r)


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
        r = _full_record()
        r["run_id"] = f"r-{i}"
        append_record(path, r)
    text = path.read_text()
    assert text.count("\n") == 3 and all(json.loads(line) for line in text.splitlines())
    with path.open("a") as f:
        f.write('{"run_id": "torn", "status": "o\n')  # a torn write
        f.write("[1, 2]\n")
    append_record(path, _full_record())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = read_records(path)
    assert [r["run_id"] for r in records] == ["r-0", "r-1", "r-2", "r-1"]
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
        assert [r["run_id"] for r in read_records(path)] == ["r-0", "after"]
    assert len(caught) == 1 and "records.jsonl:2: skipped damaged" in str(caught[0].message)
    append_record(path, {**_full_record(), "run_id": "next"})  # a clean tail gets no blank line
    assert "\n\n" not in path.read_text()
    with pytest.warns(UserWarning, match="skipped damaged"):
        assert [r["run_id"] for r in read_records(path)][-2:] == ["after", "next"]


def test_every_schema_leaf_has_a_doc_and_metric_keys_keep_their_names():
    def leaves(cls, prefix=""):
        for key, meta, section, _ in schema_fields(cls):
            yield from leaves(section, f"{prefix}{key}.") if section else [(prefix + key, meta)]

    fields = dict(leaves(RunRecord))
    assert all(meta["doc"] for meta in fields.values())
    assert fields["timing.step_time_median_ms"]["unit"] == "ms"
    assert fields["memory.anatomy_mib.activations"]["unit"] == "MiB"
    assert {"metrics.train/loss", "metrics.val/acc", "provenance.commit", "flops.peak_flops_method"} <= set(fields)
    assert set(new_record()["metrics"]) == {"train/loss", "train/acc", "val/loss", "val/acc"}
    assert "comm_buffers" in ANATOMY_KEYS and "inputs" in ANATOMY_KEYS


def test_build_record_carries_provenance_and_optional_sections():
    r = build_record(loop="accelerate", status="failed", error="ValueError: x", run_id="b-1", command=["fit", "--x"],
                     timing={"measured_steps": 3}, study={"name": "baseline"}, prediction={"peak_mib": 1.0})
    assert validate_record(r) == []
    assert r["provenance"]["command"] == "fit --x" and r["provenance"]["definitions"] == DEFINITIONS_VERSION
    assert r["timing"]["measured_steps"] == 3 and r["timing"]["warmup_steps"] is None  # merged over the skeleton
    assert r["study"] == {"name": "baseline"} and "profile" not in r
    bad = {**r, "study": "baseline"}
    assert any(e.startswith("study: expected") for e in validate_record(bad))


def test_schema_document_is_generated_from_the_code():
    committed = (REPO / "docs" / "record-schema.md").read_text(encoding="utf-8")
    assert committed == schema_markdown(), "docs/record-schema.md is stale: run `uv run python -m modelwright.record`"
