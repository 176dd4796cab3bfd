"""record.py unit by unit, without a run: validation tried on every field of every section of the schema (the cases
are generated from schema_fields, so a new field cannot be forgotten), the record builder, provenance, get_path,
to_jsonable, and the record files (atomic writes, appends, reads, stale temp files). Every refusal is asserted as
the line a user reads."""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import locale
import os
import re
import stat
import subprocess
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
import torch
from jsonargparse import Namespace

from modelwright import REPO_ROOT
from modelwright import record as record_module
from modelwright.record import (
    DEFINITIONS_VERSION,
    SCHEMA_VERSION,
    RecordError,
    RunRecord,
    Timing,
    _accepted_type,
    _field,
    _git,
    append_record,
    build_record,
    check_record,
    get_path,
    now_iso,
    os_error,
    provenance,
    read_record,
    read_records,
    remove_stale_temp_files,
    schema_fields,
    schema_markdown,
    to_jsonable,
    validate_record,
    write_atomic,
    write_record,
    write_text_atomic,
)


def _fields(cls: type = RunRecord, prefix: str = ""):
    """(path, metadata, section class or None, accepted types) of every field, sections and their fields."""
    for key, meta, section, accepted in schema_fields(cls):
        yield prefix + key, meta, section, accepted
        if section is not None:
            yield from _fields(section, f"{prefix}{key}.")


FIELDS = list(_fields())
LEAVES = [(path, meta, accepted) for path, meta, section, accepted in FIELDS if section is None]
NUMBERS = [(path, meta) for path, meta, accepted in LEAVES
           if (int in accepted or float in accepted) and not meta["choices"]]
FLOATS = [path for path, meta, accepted in LEAVES if float in accepted]
WITH_CHOICES = [(path, meta) for path, meta, accepted in LEAVES if meta["choices"]]
#: A value of each JSON type; a generated record holds, for each field, the sample of its first type.
SAMPLE = {int: 2, float: 2.5, str: "text", bool: True, list: [], dict: {}}
#: Values of every JSON type: each is wrong for a field that accepts none of its types.
CANDIDATES = ["text", 2.5, True, [1.0], {"a": 1}, None]
BATCH_PARTS = ("techniques.micro_batch_size", "techniques.accumulate_grad_batches", "techniques.world_size")
EFFECTIVE = "techniques.effective_batch_size"


def _generated(cls: type = RunRecord) -> dict:
    """Every field of ``cls`` and of its sections, optional ones included, each with a valid value."""
    values = {}
    for key, meta, section, accepted in schema_fields(cls):
        if section is not None:
            values[key] = _generated(section)
        elif meta["choices"]:
            values[key] = next(choice for choice in meta["choices"] if choice is not None)
        else:
            values[key] = copy.deepcopy(SAMPLE[accepted[0]])
    return values


def _record() -> dict:
    """A valid record with every field; the batch of 1 × 1 × 1 = 1 also agrees with a bool taken as an int."""
    record = _generated()
    record["techniques"].update(micro_batch_size=1, accumulate_grad_batches=1, world_size=1, effective_batch_size=1)
    return record


def _parent(record: dict, path: str) -> tuple[dict, str]:
    *sections, key = path.split(".")
    for section in sections:
        record = record[section]
    return record, key


def _with(path: str, value) -> dict:
    record = _record()
    parent, key = _parent(record, path)
    parent[key] = value
    return record


def _without(path: str) -> dict:
    record = _record()
    parent, key = _parent(record, path)
    del parent[key]
    return record


def _mismatch(effective, product) -> str:
    return f"techniques.effective_batch_size: {effective} != micro × accumulate × world_size = {product}"


def _batch_tail(path: str, value) -> list[str]:
    """The effective batch check's line when ``value`` replaces one of the four batch keys of ``_record``'s 1s."""
    if path == EFFECTIVE and value != 1:
        return [_mismatch(value, 1)]
    if path in BATCH_PARTS and value != 1:
        return [_mismatch(1, value)]
    return []


# -- the schema's own helpers -----------------------------------------------------------------------------------------

def test_a_schema_field_carries_its_metadata_and_default():
    plain = _field("Doc.")
    assert dict(plain.metadata) == {"doc": "Doc.", "unit": None, "choices": None, "signed": False, "key": None,
                                    "optional": False}
    assert plain.default is None and plain.default_factory is dataclasses.MISSING
    given = _field("Doc.", "ms", choices=(1, 2), signed=True, key="train/loss", optional=True, default=1)
    assert dict(given.metadata) == {"doc": "Doc.", "unit": "ms", "choices": (1, 2), "signed": True,
                                    "key": "train/loss", "optional": True}
    assert given.default == 1
    section = _field("", default=dict)  # a class: a factory, so records do not share one dict
    assert section.default_factory is dict and section.default is dataclasses.MISSING
    assert dict(section.metadata) == {**plain.metadata, "doc": ""}


def test_a_fields_accepted_types_name_null_and_sections_by_json_type():
    assert _accepted_type(type(None), Timing) is None
    assert _accepted_type(Timing, Timing) is dict
    assert _accepted_type(float, None) is float
    assert _accepted_type(float, Timing) is float


# -- validate_record / check_record over the whole schema -------------------------------------------------------------

def test_a_record_with_every_field_is_valid_and_check_record_returns_it():
    record = _record()
    assert [path for path, *_ in FIELDS if get_path(record, path, "absent") == "absent"] == []
    assert validate_record(record) == []
    assert check_record(record) is record


@pytest.mark.parametrize(("path", "accepted"), [(path, accepted) for path, _, _, accepted in FIELDS],
                         ids=[path for path, *_ in FIELDS])
def test_every_field_refuses_every_type_it_does_not_accept(path, accepted):
    names = " | ".join("null" if kind is None else kind.__name__ for kind in accepted)
    for value in CANDIDATES:
        errors = validate_record(_with(path, value))
        if value is None and None in accepted:
            assert errors == []
        elif (None if value is None else type(value)) not in accepted:
            assert errors == [f"{path}: expected {names}, got {type(value).__name__} {value!r}"]


@pytest.mark.parametrize(("path", "optional"), [(path, meta["optional"]) for path, meta, *_ in FIELDS],
                         ids=[path for path, *_ in FIELDS])
def test_every_required_field_is_missed_and_every_optional_one_is_not(path, optional):
    assert validate_record(_without(path)) == ([] if optional else [f"{path}: missing"])


@pytest.mark.parametrize(("path", "choices"), [(path, meta["choices"]) for path, meta in WITH_CHOICES],
                         ids=[path for path, _ in WITH_CHOICES])
def test_every_field_with_choices_refuses_a_value_outside_them(path, choices):
    value = 99 if all(isinstance(choice, int) for choice in choices if choice is not None) else "no-such-choice"
    assert validate_record(_with(path, value)) == [f"{path}: {value!r} is not one of {list(choices)}"]
    for choice in choices:
        assert validate_record(_with(path, choice)) == []


@pytest.mark.parametrize(("path", "signed"), [(path, meta["signed"]) for path, meta in NUMBERS],
                         ids=[path for path, _ in NUMBERS])
def test_every_number_is_refused_below_zero_unless_signed(path, signed):
    """Numbers are never negative, except metrics; zero is a number like any other (an int for a float too)."""
    negatives = (-1, -0.5) if path in FLOATS else (-1,)
    for value in negatives:
        expected = [] if signed else [f"{path}: negative value {value!r}"]
        assert validate_record(_with(path, value)) == expected + _batch_tail(path, value)
    for value in (0, 0.5) if path in FLOATS else (0,):
        assert validate_record(_with(path, value)) == _batch_tail(path, value)


@pytest.mark.parametrize("path", FLOATS)
def test_every_float_refuses_nan_and_infinities(path):
    for value in (float("nan"), float("inf"), float("-inf")):
        assert validate_record(_with(path, value)) == [f"{path}: non-finite number {value!r}"]


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("memory.anatomy_end_mib", [1.0], "memory.anatomy_end_mib: expected dict | null, got list [1.0]"),
        ("techniques.world_size", True, "techniques.world_size: expected int | null, got bool True"),
        ("techniques.compile", 2.5, "techniques.compile: expected bool | str | null, got float 2.5"),
        ("run_id", None, "run_id: expected str, got NoneType None"),
        ("config", "x" * 100, "config: expected dict, got str '" + "x" * 59),  # the value cut at 60 characters
        ("status", "crashed",
         "status: 'crashed' is not one of ['ok', 'failed', 'diverged', 'interrupted', 'oom', 'running']"),
        ("schema_version", 4, "schema_version: 4 is not one of [1, 2, 3]"),
        ("flops.peak_flops_source", "guess",
         "flops.peak_flops_source: 'guess' is not one of ['datasheet', 'lightning-table', 'cpu-isa-clock', "
         "'config', None]"),
        ("memory.anatomy_mib.inputs", -1.5, "memory.anatomy_mib.inputs: negative value -1.5"),
        ("timing.step_time_median_ms", float("inf"), "timing.step_time_median_ms: non-finite number inf"),
    ],
)
def test_refusals_read_as_one_line_naming_the_key(path, value, message):
    assert validate_record(_with(path, value)) == [message]


def test_the_metrics_may_be_negative_and_extra_keys_are_allowed():
    record = _with("metrics.val/loss", -3.5)
    record["metrics"]["test/acc"] = -0.5  # Lightning's other scalars, under their own names
    record["timing"]["my_own"] = "x"
    record["custom"] = {"anything": [1]}
    assert validate_record(record) == []


def test_every_problem_is_listed_in_order_and_check_record_raises_them_all():
    record = _with("status", "failed")
    record["error"] = None
    del record["timing"]
    record["history"] = {"train/loss": [[1.5, 2.0]]}
    record["techniques"]["effective_batch_size"] = 2
    expected = [
        "timing: missing",
        "history.train/loss[0]: expected [int step, number or null] in step order, got [1.5, 2.0]",
        "error: status 'failed' needs a one-line error message",
        _mismatch(2, 1),
    ]
    assert validate_record(record) == expected
    with pytest.raises(RecordError) as refused:
        check_record(record)
    assert str(refused.value) == "invalid run record:\n" + "\n".join(expected)


def test_a_record_that_is_not_an_object():
    assert validate_record([]) == ["record: expected an object, got list"]
    assert validate_record("{}") == ["record: expected an object, got str"]


@pytest.mark.parametrize(
    ("micro", "accumulate", "world", "effective", "product"),
    [
        (2, 4, 8, 64, None),  # agrees
        (3, 4, 8, 64, 96),
        (2, 5, 8, 64, 80),
        (2, 4, 9, 64, 72),
        (2, 4, 8, 65, 64),
        (None, 4, 8, 99, None),  # a part unknown: nothing to compare
        (2, 4, 8, None, None),
    ],
)
def test_the_effective_batch_is_micro_times_accumulate_times_world_size(micro, accumulate, world, effective,
                                                                        product):
    record = _record()
    record["techniques"].update(micro_batch_size=micro, accumulate_grad_batches=accumulate, world_size=world,
                                effective_batch_size=effective)
    assert validate_record(record) == ([] if product is None else [_mismatch(effective, product)])


# -- the history ------------------------------------------------------------------------------------------------------

def _history_errors(history) -> list[str]:
    return validate_record({**_record(), "history": history})


def test_a_history_in_step_order_is_valid():
    history = {
        # Steps may repeat (train and validation at one step); values may be below or above the steps.
        "train/loss": [[10, 1.0], [20, 2.0], [20, 2.5], [30, 500.0], [40, 3], [50, None]],
        "val/acc": [[0, 0.5]],
        "lr": [],
        "from_python": [(1, 0.1), (2, 0.2)],
    }
    assert _history_errors(history) == []


@pytest.mark.parametrize(
    ("points", "index", "shown"),
    [
        ([[1.5, 2.0]], 0, "[1.5, 2.0]"),  # a float step
        ([[True, 2.0]], 0, "[True, 2.0]"),
        ([[1, "x"]], 0, "[1, 'x']"),
        ([[1, True]], 0, "[1, True]"),
        ([[1, 2.0, 3]], 0, "[1, 2.0, 3]"),
        ([[1]], 0, "[1]"),
        ([5], 0, "5"),
        ([None], 0, "None"),
        ([[5, 1.0], [3, 2.0]], 1, "[3, 2.0]"),  # back in time
        ([[0, 1.0], [9, 1.0], [5, 1.0]], 2, "[5, 1.0]"),  # before the point ahead of it, not the first
        ([[0, 1.0], [1, 1.0], [2, 1.0], [3, 1.0], [2, 1.0], [1, "x"]], 4, "[2, 1.0]"),  # the first bad one only
    ],
)
def test_a_bad_history_point_is_named_by_metric_and_index(points, index, shown):
    expected = f"history.train/loss[{index}]: expected [int step, number or null] in step order, got {shown}"
    assert _history_errors({"train/loss": points}) == [expected]


@pytest.mark.parametrize(("series", "shown"),
                         [({"step": 1}, "{'step': 1}"), (None, "None"), ("x" * 80, "'" + "x" * 59)])
def test_a_series_that_is_no_list_is_named_with_what_it_holds(series, shown):
    expected = f"history.train/loss: expected a list of [int step, number or null], got {shown}"
    assert _history_errors({"train/loss": series, "lr": [[0, 0.1]]}) == [expected]


def test_the_series_after_one_that_is_no_list_are_still_checked():
    assert _history_errors({"train/loss": None, "lr": [["a", 0.1]]}) == [
        "history.train/loss: expected a list of [int step, number or null], got None",
        "history.lr[0]: expected [int step, number or null] in step order, got ['a', 0.1]"]


def test_every_metric_with_a_bad_point_is_reported_and_a_history_that_is_no_mapping_once():
    errors = _history_errors({"train/loss": [[1, "x"]], "val/acc": [[0, 0.5]], "lr": [["a", 0.1]]})
    assert errors == [
        "history.train/loss[0]: expected [int step, number or null] in step order, got [1, 'x']",
        "history.lr[0]: expected [int step, number or null] in step order, got ['a', 0.1]",
    ]
    assert _history_errors([[0, 1.0]]) == ["history: expected dict, got list [[0, 1.0]]"]


# -- get_path ---------------------------------------------------------------------------------------------------------

CONFIG = {
    "trainer": {"precision": "bf16-mixed", "max_steps": 0},
    "model": {"class_path": "modelwright.train.module.Classifier",
              "init_args": {"lr": 0.1, "network": {"class_path": "Net", "init_args": {"depth": 18}}}},
    "data": 5,
}


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("trainer.precision", "bf16-mixed"),
        ("trainer.max_steps", 0),
        ("trainer", {"precision": "bf16-mixed", "max_steps": 0}),
        ("model.lr", 0.1),  # read through init_args, as LightningCLI resolves a class path
        ("model.init_args.lr", 0.1),
        ("model.class_path", "modelwright.train.module.Classifier"),
        ("model.network.depth", 18),
        ("model.missing", "absent"),
        ("trainer.missing", "absent"),
        ("data.batch_size", "absent"),  # a number has no parts
        ("missing.key", "absent"),
    ],
)
def test_get_path(path, expected):
    assert get_path(CONFIG, path, "absent") == expected
    assert get_path(CONFIG, path) == (None if expected == "absent" else expected)


# -- to_jsonable and the record builder -------------------------------------------------------------------------------

class _Scalar:
    """Anything with ``item()`` and no ``ndim`` is taken as a scalar."""

    def item(self):
        return 7

    def __repr__(self) -> str:  # the test's id: the same in every process (pytest-xdist compares them)
        return "_Scalar()"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (float("nan"), None), (float("inf"), None), (float("-inf"), None), (1.5, 1.5), (0, 0), (True, True),
        ("text", "text"), (None, None),
        ({1: (2, 3), "k": {"n": float("nan")}}, {"1": [2, 3], "k": {"n": None}}),
        ({5}, [5]), (frozenset({6}), [6]), ([(1, 2.0)], [[1, 2.0]]),
        (torch.tensor(2.5), 2.5), (torch.tensor(3), 3), (torch.tensor(float("inf")), None),
        (torch.tensor([1, 2]), "tensor([1, 2])"),
        (np.float32(1.5), 1.5), (np.int64(4), 4), (np.float64("nan"), None),
        (Namespace(a=1, b=Namespace(c=(1, 2))), {"a": 1, "b": {"c": [1, 2]}}),
        (Path("runs/x.json"), "runs/x.json"), (_Scalar(), 7),
    ],
    ids=repr,
)
def test_to_jsonable(value, expected):
    converted = to_jsonable(value)
    assert converted == expected and type(converted) is type(expected)
    json.dumps(converted, allow_nan=False)


def _no_git(monkeypatch) -> None:
    monkeypatch.setattr(record_module, "_git", lambda *args: None)
    monkeypatch.delenv("MODELWRIGHT_COMMIT", raising=False)
    monkeypatch.delenv("MODELWRIGHT_COMMAND", raising=False)


def _keys(cls: type) -> list[str]:
    return [key for key, meta, *_ in schema_fields(cls) if not meta["optional"]]


def test_an_empty_record_has_every_key_but_the_optional_ones_and_nothing_measured(monkeypatch):
    _no_git(monkeypatch)
    record = build_record(command=["fit"])
    assert list(record) == _keys(RunRecord)
    assert {key: record[key] for key in ("schema_version", "status", "error", "loop", "config", "history")} == {
        "schema_version": SCHEMA_VERSION, "status": "ok", "error": None, "loop": "lightning", "config": {},
        "history": {}}
    assert record["provenance"] == {"commit": None, "dirty": None, "command": "fit", "definitions": DEFINITIONS_VERSION}
    for key, _, section, _ in schema_fields(RunRecord):
        if section is not None and key != "provenance":
            assert record[key] == dict.fromkeys(_keys(section)), key
    assert validate_record(record) == []


def test_build_record_merges_sections_and_takes_the_rest_as_given(monkeypatch):
    _no_git(monkeypatch)
    record = build_record(
        loop="accelerate", status="failed", error="ValueError: x", run_id="b-1", command=["fit", "--x"],
        timing={"measured_steps": 3}, memory=None, metrics={"val/acc": float("nan")},
        config=Namespace(trainer=Namespace(precision="32-true")), history={"train/loss": [(0, 1.0)]},
        study={"name": "baseline"}, profile={"peak_mib": 1.0})
    assert (record["loop"], record["status"], record["error"], record["run_id"]) == (
        "accelerate", "failed", "ValueError: x", "b-1")
    assert record["timing"] == {**dict.fromkeys(_keys(Timing)), "measured_steps": 3}
    assert record["memory"]["anatomy_mib"] is None and record["metrics"]["val/acc"] is None
    assert record["config"] == {"trainer": {"precision": "32-true"}}
    assert record["history"] == {"train/loss": [[0, 1.0]]}
    assert (record["study"], record["profile"]) == ({"name": "baseline"}, {"peak_mib": 1.0})
    assert "prediction" not in record and "faults" not in record
    assert validate_record(record) == []


def test_a_given_provenance_is_taken_whole(monkeypatch):
    """Not merged with this checkout's git state: a record rebuilt elsewhere keeps the commit it names."""
    _no_git(monkeypatch)
    assert build_record(provenance={"commit": "abc"})["provenance"] == {"commit": "abc"}


@pytest.fixture
def far_from_utc(monkeypatch):
    monkeypatch.setenv("TZ", "IST-5:30")  # POSIX: UTC+05:30, no time zone database needed
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_the_default_run_id_is_utc_time_and_created_at_local_time_with_its_offset(far_from_utc, monkeypatch):
    _no_git(monkeypatch)
    before = datetime.now(timezone.utc).replace(microsecond=0)
    record = build_record()
    after = datetime.now(timezone.utc)
    stamp, suffix = record["run_id"].split("-")
    assert before <= datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc) <= after
    assert re.fullmatch("[0-9a-f]{8}", suffix)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+05:30", record["created_at"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+05:30", now_iso())
    assert build_record()["run_id"] != record["run_id"]


# -- provenance -------------------------------------------------------------------------------------------------------

HEAD = ("rev-parse", "HEAD")
STATUS = ("status", "--porcelain", "--untracked-files=no")


@pytest.mark.parametrize(
    ("outputs", "env_commit", "commit", "dirty"),
    [
        ({HEAD: "abc", STATUS: ""}, None, "abc", False),
        ({HEAD: "abc", STATUS: " M src/x.py"}, None, "abc", True),
        ({HEAD: "abc", STATUS: ""}, "0123", "abc", False),  # git wins over the environment
        ({HEAD: "abc"}, None, "abc", None),  # git status failed: unknown
        ({}, "0123", "0123", None),  # a copy without git history: the environment names the commit
        ({}, "", None, None),
        ({}, None, None, None),
    ],
)
def test_provenance_reads_the_commit_and_whether_tracked_files_changed(monkeypatch, outputs, env_commit, commit,
                                                                       dirty):
    _no_git(monkeypatch)
    monkeypatch.setattr(record_module, "_git", lambda *args: outputs.get(args))
    if env_commit is not None:
        monkeypatch.setenv("MODELWRIGHT_COMMIT", env_commit)
    assert provenance(["fit"]) == {"commit": commit, "dirty": dirty, "command": "fit",
                                   "definitions": DEFINITIONS_VERSION}


@pytest.mark.parametrize(
    ("command", "env_command", "line"),
    [
        (["fit", "--trainer.max_steps", "3"], None, "fit --trainer.max_steps 3"),
        (["fit"], "study --repeats 2", "fit"),  # the caller's own command wins over its parent's
        (None, "study --repeats 2", "study --repeats 2"),
        (None, None, "prog a b"),  # this process's command line, the program by its name
        (None, "", "prog a b"),
        ([], None, "prog a b"),
    ],
)
def test_provenance_names_the_command_line(monkeypatch, command, env_command, line):
    _no_git(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/prog", "a", "b"])
    if env_command is not None:
        monkeypatch.setenv("MODELWRIGHT_COMMAND", env_command)
    assert provenance(command)["command"] == line


def test_git_runs_in_the_checkout_from_any_working_directory(tmp_path, monkeypatch):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    monkeypatch.chdir(tmp_path)
    assert _git("rev-parse", "HEAD") == head.stdout.strip()
    assert re.fullmatch("[0-9a-f]{40}", _git("rev-parse", "HEAD"))
    assert _git("no-such-command") is None


def test_a_git_that_hangs_or_is_missing_gives_none(monkeypatch):
    timeouts = []

    def hung(command, **kwargs):
        timeouts.append(kwargs.get("timeout"))
        raise subprocess.TimeoutExpired(command, kwargs.get("timeout"))

    monkeypatch.setattr(subprocess, "run", hung)
    assert _git("status") is None
    assert timeouts == [10]  # seconds: a hung git must not hold up the record

    def missing(command, **kwargs):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "git")

    monkeypatch.setattr(subprocess, "run", missing)
    assert _git("status") is None


# -- os_error ---------------------------------------------------------------------------------------------------------

def _raised(raise_it) -> BaseException:
    try:
        raise_it()
    except BaseException as err:  # noqa: BLE001 - the exception is the value under test
        return err
    raise AssertionError("nothing raised")


def _full_disk():
    raise OSError(errno.ENOSPC, "No space left on device")


def _wrapped_by_context():
    """What torch.save raises on a full disk: its own error, the disk's only its context."""
    try:
        _full_disk()
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos 64 vs 0")  # noqa: B904


def test_os_error_finds_the_disk_error_behind_a_wrapper():
    direct = _raised(_full_disk)
    assert os_error(direct) is direct
    by_context = _raised(_wrapped_by_context)
    assert os_error(by_context).errno == errno.ENOSPC
    by_cause = RuntimeError("wrapped")
    by_cause.__cause__ = direct
    by_cause.__context__ = ValueError("an unrelated one")
    assert os_error(by_cause) is direct
    deeper = ValueError("outer")
    deeper.__context__ = by_cause
    assert os_error(deeper) is direct


def test_os_error_is_none_without_an_errno_or_an_os_error_in_the_chain():
    assert os_error(ValueError("no chain")) is None
    assert os_error(OSError("no errno")) is None
    looped, other = RuntimeError("a"), RuntimeError("b")
    looped.__context__, other.__context__ = other, looped  # a chain that loops ends
    assert os_error(looped) is None
    itself = RuntimeError("c")
    itself.__cause__ = itself
    assert os_error(itself) is None


# -- write_atomic, write_text_atomic, remove_stale_temp_files ---------------------------------------------------------

def test_the_temp_file_sits_beside_the_target_readable_by_all_until_renamed(tmp_path):
    path = tmp_path / "runs" / "version_0" / "record.json"  # folders made
    temps = []

    def write(file):
        temps.extend((temp.name, stat.S_IMODE(temp.stat().st_mode)) for temp in path.parent.iterdir())
        file.write(b"{}\n")

    assert write_atomic(path, write) == path
    assert len(temps) == 1 and re.fullmatch(r"\.record\.json\..+\.tmp", temps[0][0]) and temps[0][1] == 0o644
    assert path.read_bytes() == b"{}\n" and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert write_text_atomic(path, "µ → ×\n") == path  # again, into the folder that now exists
    assert path.read_bytes() == "µ → ×\n".encode()
    assert os.listdir(path.parent) == ["record.json"]


def test_a_writer_that_fails_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "record.json"
    write_text_atomic(path, "old\n")

    def bad(file):
        file.write(b"half")
        raise ValueError("not a disk error")

    with pytest.raises(ValueError, match="^not a disk error$"):
        write_atomic(path, bad)
    missing = tmp_path / "elsewhere" / "weights.pt"

    def reads_a_missing_file(file):
        missing.open("rb")

    with pytest.raises(FileNotFoundError) as refused:  # an error that names its own file keeps it
        write_atomic(path, reads_a_missing_file)
    assert refused.value.filename == str(missing) and refused.value.__cause__ is None
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["record.json"]


def test_a_disk_error_a_writer_wrapped_is_raised_naming_the_file(tmp_path):
    path = tmp_path / "last.ckpt"

    def torch_like_save(file):
        file.write(b"partial")
        _wrapped_by_context()

    with pytest.raises(OSError) as refused:
        write_atomic(path, torch_like_save)
    error = refused.value
    assert (error.errno, error.strerror, error.filename) == (errno.ENOSPC, "No space left on device", str(path))
    assert isinstance(error.__cause__, RuntimeError)
    assert os.listdir(tmp_path) == []


def test_an_interrupt_just_after_the_rename_keeps_the_new_file(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    rename = os.replace

    def rename_then_interrupt(source, target):
        rename(source, target)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", rename_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n" and os.listdir(tmp_path) == ["record.json"]


def test_the_stale_temp_files_of_one_file_are_removed(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    names = [".record.json.a1.tmp", ".record.json.b2.tmp", ".records.jsonl.c3.tmp", "record.json", ".record.json.tmp"]
    for name in names:
        (tmp_path / name).write_text("x")
    removed = remove_stale_temp_files(path)
    assert sorted(temp.name for temp in removed) == [".record.json.a1.tmp", ".record.json.b2.tmp"]
    assert sorted(os.listdir(tmp_path)) == [".record.json.tmp", ".records.jsonl.c3.tmp", "record.json"]
    assert remove_stale_temp_files(tmp_path / "absent" / "record.json") == []
    gone = tmp_path / ".record.json.gone.tmp"  # listed, then removed by another process before this one
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter([gone]))
    assert remove_stale_temp_files(path) == [gone]


# -- write_record, append_record, read_record, read_records -----------------------------------------------------------

def _named_record(run_id: str) -> dict:
    record = _record()
    record["run_id"] = run_id
    record["hardware"]["device_name"] = "Intel® Xeon® µ"
    record["metrics"]["val/loss"] = float("nan")  # a diverged loss: written as null
    return record


def _as_written(record: dict) -> dict:
    written = copy.deepcopy(record)
    written["metrics"]["val/loss"] = None
    return written


def test_write_record_writes_indented_utf8_json_and_refuses_an_invalid_record(tmp_path):
    path = tmp_path / "runs" / "record.json"
    assert write_record(path, _named_record("r-1")) == path
    assert path.read_bytes() == (json.dumps(_as_written(_named_record("r-1")), indent=2, ensure_ascii=False)
                                 + "\n").encode("utf-8")
    with pytest.raises(RecordError, match="status: 'crashed' is not one of"):
        write_record(path, {**_named_record("r-2"), "status": "crashed"})
    assert read_record(path)["run_id"] == "r-1"
    write_record(path, {"run_id": "by hand"}, validate=False)
    assert path.read_text(encoding="utf-8") == '{\n  "run_id": "by hand"\n}\n'


def test_append_writes_one_utf8_line_per_record_readable_by_all(tmp_path):
    path = tmp_path / "results" / "cpu" / "records.jsonl"  # folders made
    umask = os.umask(0o022)
    try:
        assert append_record(path, _named_record("r-0")) == path
    finally:
        os.umask(umask)
    append_record(path, _named_record("r-1"))
    lines = [json.dumps(_as_written(_named_record(run_id)), ensure_ascii=False) + "\n" for run_id in ("r-0", "r-1")]
    assert path.read_bytes() == "".join(lines).encode("utf-8")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_append_terminates_a_torn_last_line_first(tmp_path):
    path = tmp_path / "records.jsonl"
    line = (json.dumps(_as_written(_named_record("after")), ensure_ascii=False) + "\n").encode("utf-8")
    path.write_bytes(b'{"run_id": "torn", "st')
    append_record(path, _named_record("after"))
    assert path.read_bytes() == b'{"run_id": "torn", "st\n' + line
    path.write_bytes(b"")
    append_record(path, _named_record("after"))
    assert path.read_bytes() == line


def test_append_refuses_an_invalid_record_before_touching_the_file(tmp_path):
    path = tmp_path / "records.jsonl"
    with pytest.raises(RecordError, match="schema_version: missing"):
        append_record(path, {"run_id": "x"})
    assert not path.exists()
    append_record(path, {"run_id": "x"}, validate=False)
    assert path.read_bytes() == b'{"run_id": "x"}\n'


def test_append_finishes_a_line_the_disk_took_in_parts(tmp_path, monkeypatch):
    path = tmp_path / "records.jsonl"
    write = os.write
    sizes = []

    def seven_bytes_at_a_time(fd, data):
        assert data, "a write of nothing"
        sizes.append(len(data))
        assert len(sizes) < 10_000, "the line never ends"
        return write(fd, data[:7])

    monkeypatch.setattr(os, "write", seven_bytes_at_a_time)
    append_record(path, _named_record("r-0"))
    monkeypatch.undo()
    assert read_records(path) == [_as_written(_named_record("r-0"))]
    assert sizes[1] == sizes[0] - 7


def test_read_record_validates_unless_told_not_to(tmp_path):
    path = tmp_path / "record.json"
    path.write_text('{"run_id": "x"}')
    with pytest.raises(RecordError, match="schema_version: missing"):
        read_record(path)
    assert read_record(path, validate=False) == {"run_id": "x"}


@pytest.fixture
def ascii_locale():
    """A machine whose locale is plain C: Python's default text encoding is then ASCII."""
    previous = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    yield
    locale.setlocale(locale.LC_CTYPE, previous)


def test_record_files_and_the_schema_document_are_utf8_whatever_the_locale(tmp_path, ascii_locale):
    path = tmp_path / "record.json"
    write_record(path, _named_record("r-1"))
    assert read_record(path)["hardware"]["device_name"] == "Intel® Xeon® µ"
    assert "micro × accumulate × world_size" in schema_markdown()


def test_read_records_skips_damaged_and_invalid_lines_naming_file_and_line(tmp_path):
    path = tmp_path / "records.jsonl"
    good = [json.dumps(_as_written(_named_record(run_id)), ensure_ascii=False).encode("utf-8") for run_id in "ab"]
    lines = [good[0], b"", b'{"run_id": "torn", "st', b'{"run_id": "partial"}', b"[1, 2]", good[1], b"\xff\xfe", b""]
    path.write_bytes(b"\n".join(lines))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [record["run_id"] for record in read_records(path)] == ["a", "partial", "b"]
        assert [record["run_id"] for record in read_records(path, validate=True)] == ["a", "b"]
    messages = [str(warning.message) for warning in caught]
    damaged = [f"{path}:3: skipped damaged record line (", f"{path}:7: skipped damaged record line ("]
    not_an_object = f"{path}:5: skipped invalid record (record: expected an object, got list)"
    assert [message.startswith(start) for message, start in zip(messages[:3:2], damaged, strict=True)] == [True, True]
    assert messages[1] == not_an_object
    assert messages[3:] == [messages[0], f"{path}:4: skipped invalid record (schema_version: missing)",
                            not_an_object, messages[2]]
    assert all(warning.category is UserWarning for warning in caught)
    # The warning points at the caller's line, not at record.py.
    assert record_module.__file__ not in {warning.filename for warning in caught}


# -- schema_markdown --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("last_line", ["Figures come from a Ryzen 9 7950X", "A line that ends in a Markdown break  "])
def test_the_schema_document_keeps_its_prose_and_states_the_version(tmp_path, monkeypatch, last_line):
    head = f"# The run record (schema version 1)\n\nRecords of schema version 2 are still read.\n{last_line}"
    doc = tmp_path / "record-schema.md"
    doc.write_text(f"{head}\n\n\n## Top level\n\nan old table\n\n## `timing`\n\nanother\n", encoding="utf-8")
    monkeypatch.setattr(record_module, "SCHEMA_DOC", doc)
    markdown = schema_markdown()
    new_head = head.replace("schema version 1", f"schema version {SCHEMA_VERSION}")
    assert markdown.startswith(f"{new_head}\n\n## Top level\n\n| key | type | unit | meaning |\n|---|---|---|---|\n")
    assert "old table" not in markdown and "another" not in markdown


ROW = re.compile(r"\| `(?P<key>[^`]+)` \| (?P<type>.*?) \| (?P<unit>.*?) \| (?P<doc>.*) \|")


def test_the_schema_document_has_a_row_for_every_field_of_every_section():
    tables = {}
    for block in schema_markdown().split("\n## ")[1:]:
        heading, *lines = block.split("\n")
        tables[heading] = [ROW.fullmatch(line) for line in lines if line.startswith("| `")]
    # Breadth first: memory's own section after those of the top level.
    assert list(tables) == ["Top level", "`techniques`", "`hardware`", "`versions`", "`timing`", "`flops`",
                            "`memory`", "`metrics`", "`provenance`", "`anatomy`"]
    by_heading = {f"`{section.__name__.lower()}`": section for _, _, section, _ in FIELDS if section is not None}
    for heading, rows in tables.items():
        cls = by_heading.get(heading, RunRecord)
        fields = schema_fields(cls)
        assert [row["key"] for row in rows] == [key for key, *_ in fields]
        for row, (key, meta, section, accepted) in zip(rows, fields, strict=True):
            types = ["null" if kind is None else "object" if section and kind is dict else kind.__name__
                     for kind in accepted]
            assert row["type"] == " \\| ".join(types), key
            assert row["unit"] == (meta["unit"] or ""), key
            assert row["doc"].startswith(meta["doc"] or "Section "), key
            assert row["doc"].endswith(" *Optional.*") == meta["optional"], key
            if section is not None:
                name = section.__name__.lower()
                assert f"[`{name}`](#{name})." in row["doc"], key
            if meta["choices"]:
                named = ", ".join(f"`{choice}`" for choice in meta["choices"] if choice is not None)
                assert f" One of {named}." in row["doc"], key
