"""benchmarks/mutation.py: how it reads mutmut's results (every outcome, equivalents, a stopped run) and the
table it writes. mutmut itself is not run here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "mutation.py"
MODULE = "planner/example.py"
PREFIX = "modelwright.planner.example."


@pytest.fixture
def bench(tmp_path, monkeypatch):
    """The script with its repository root in ``tmp_path``: a pyproject naming two modules, an equivalents list."""
    spec = importlib.util.spec_from_file_location("mutation_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "pyproject.toml").write_text('[tool.mutmut]\nonly_mutate = ["src/modelwright/planner/example.py", '
                                             '"src/modelwright/record.py"]\n')
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "mutation_equivalent.txt").write_text(
        f"# a comment\n\n{PREFIX}x_f__mutmut_7 it reads the same either way\n")
    monkeypatch.setattr(module, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(module, "EQUIVALENT_FILE", tmp_path / "benchmarks" / "mutation_equivalent.txt")
    return module


def _meta(bench, exit_codes: dict) -> None:
    path = bench.meta_path(MODULE)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"exit_code_by_key": {PREFIX + name: code for name, code in exit_codes.items()}}))


def test_every_exit_code_is_scored_as_its_outcome(bench):
    """Killed: a failing test (1), a timeout or signal; survived: 0; no tests: 5, 33; skipped: 34; not run:
    None; anything else is suspicious. The score is killed over what ran, less the equivalents."""
    codes = dict(bench.OUTCOME_BY_EXIT_CODE)
    codes[99] = "suspicious"
    _meta(bench, {f"x_f__mutmut_{index}": code for index, code in enumerate(codes)})
    equivalent = {f"{PREFIX}x_f__mutmut_{list(codes).index(0)}": "why"}
    entry = bench.score(MODULE, 12.4, equivalent)
    killed = sum(outcome == "killed" for outcome in codes.values())
    assert entry == {
        "mutants": len(codes), "killed": killed, "survived": 0, "no tests": 2, "skipped": 1, "not run": 1,
        "suspicious": 1, "equivalent": 1, "score_percent": round(100 * killed / (killed + 3), 1), "seconds": 12,
        "not_killed": sorted(f"{PREFIX}x_f__mutmut_{index}" for index, code in enumerate(codes)
                             if codes[code] in ("no tests", "suspicious", "not run")),
    }


def test_the_equivalents_list_skips_comments_and_blank_lines(bench):
    assert bench.read_equivalents() == {f"{PREFIX}x_f__mutmut_7": "it reads the same either way"}


def test_a_module_of_equivalents_only_has_no_score(bench):
    _meta(bench, {"x_f__mutmut_7": 0})
    assert bench.score(MODULE, None, bench.read_equivalents())["score_percent"] is None


def test_results_so_far_count_the_mutants_with_an_exit_code(bench):
    assert bench.results_so_far(MODULE) == 0  # not generated yet
    _meta(bench, {"x_f__mutmut_1": 1, "x_f__mutmut_2": None, "x_f__mutmut_3": 0})
    assert bench.results_so_far(MODULE) == 2


def test_the_table_has_a_row_per_mutated_module_in_the_configured_order(bench):
    entry = {"mutants": 10, "killed": 8, "survived": 1, "no tests": 0, "not run": 0, "equivalent": 1,
             "score_percent": 88.9, "seconds": 30, "commit": "0123456789abcdef", "date": "2026-12-06"}
    table = bench.markdown_table({MODULE: entry})
    assert table.splitlines()[-2:] == [
        "| planner/example.py | 10 | 8 | 1 | 0 | 0 | 1 | 88.9% | 30 | 0123456789 | 2026-12-06 |",
        "| record.py | not run yet | | | | | | | | | |"]


class _Child:
    """A stand-in for the mutmut process: ``wait`` gives its exit code, or times out once."""

    def __init__(self, returncode: int | None):
        self.pid = 4321
        self.returncode = returncode
        self.waits = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if self.returncode is None and len(self.waits) == 1:
            raise subprocess.TimeoutExpired("mutmut", timeout)
        return self.returncode


@pytest.mark.parametrize(("returncode", "stopped"), [(0, False), (None, True)])
def test_a_run_past_its_time_is_stopped_whole_and_said_so(bench, monkeypatch, tmp_path, returncode, stopped):
    child = _Child(returncode)
    killed = []
    monkeypatch.setattr(bench.subprocess, "Popen", lambda *args, **kwargs: child)
    monkeypatch.setattr(bench.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    seconds, was_stopped = bench.run_mutmut(MODULE, 2, [], max_seconds=60)
    assert was_stopped is stopped and seconds >= 0 and child.waits[0] == 60
    assert killed == ([(4321, bench.signal.SIGTERM)] if stopped else [])


def test_a_failed_mutmut_run_is_an_error(bench, monkeypatch):
    monkeypatch.setattr(bench.subprocess, "Popen", lambda *args, **kwargs: _Child(2))
    with pytest.raises(subprocess.CalledProcessError):
        bench.run_mutmut(MODULE, 2, ["f"], max_seconds=None)


def test_the_script_runs_as_a_program():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--max-minutes" in done.stdout
