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


@pytest.mark.parametrize(("tests", "cell"), [(["tests/test_a.py", "tests/test_b.py"], "test_a.py, test_b.py"),
                                             ("fast tier (-m 'not slow'), the tests that reach each mutant",
                                              "whole fast tier")])
def test_the_table_has_a_row_per_mutated_module_in_the_configured_order(bench, tests, cell):
    entry = {"mutants": 10, "killed": 8, "survived": 1, "no tests": 0, "not run": 0, "equivalent": 1,
             "score_percent": 88.9, "seconds": 30, "tests": tests, "commit": "0123456789abcdef", "date": "2026-12-06"}
    table = bench.markdown_table({MODULE: entry})
    assert table.splitlines()[-2:] == [
        f"| planner/example.py | 10 | 8 | 1 | 0 | 0 | 1 | 88.9% | 30 | {cell} | 0123456789 | 2026-12-06 |",
        "| record.py | not run yet | | | | | | | | | | |"]


def test_every_mutated_module_names_test_files_that_exist():
    """The real script: a module added to ``only_mutate`` without its tests would fail to run."""
    spec = importlib.util.spec_from_file_location("mutation_benchmark_real", SCRIPT)
    real = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real)
    assert sorted(real.TESTS) == sorted(real.mutated_modules())
    for module, files in real.TESTS.items():
        assert files and all((real.REPO_ROOT / name).is_file() for name in files), module


def test_the_workspace_mutates_its_module_with_its_tests_and_keeps_the_rest_of_pyproject(bench, tmp_path,
                                                                                       monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.mutmut]\nsource_paths = ["src"]\n'
                                             'only_mutate = ["src/modelwright/a.py", "src/modelwright/b.py"]\n'
                                             'process_isolation = "forkserver"\n\n[tool.pytest.ini_options]\n'
                                             'testpaths = ["tests"]\n')
    for name in ("src/modelwright/b.py", "tests/test_b.py", "README.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    monkeypatch.setattr(bench, "TESTS", {"b.py": ("tests/test_b.py",)})
    monkeypatch.setattr(bench, "working_tree_files",
                        lambda: ["pyproject.toml", "src/modelwright/b.py", "tests/test_b.py", "README.md"])
    root = bench.sync_workspace("b.py")
    assert root == tmp_path / ".mutation" / "b"
    settings = bench.tomllib.loads((root / "pyproject.toml").read_text())
    assert settings["project"] == {"name": "x"} and settings["tool"]["pytest"]["ini_options"]["testpaths"] == ["tests"]
    assert settings["tool"]["mutmut"] == {
        "source_paths": ["src"], "only_mutate": ["src/modelwright/b.py"], "process_isolation": "forkserver",
        "pytest_add_cli_args_test_selection": ["-m", "not slow", "tests/test_b.py"],
        "use_git_change_detection": False}
    assert (root / "tests" / "test_b.py").read_text() == "tests/test_b.py"


def test_a_workspace_follows_the_working_tree_and_keeps_mutmuts_folder(bench, tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[tool.mutmut]\nonly_mutate = ["src/modelwright/b.py"]\n')
    monkeypatch.setattr(bench, "TESTS", {"b.py": ("tests/test_b.py",)})
    files = {"src/modelwright/b.py": "one", "tests/test_b.py": "test", "docs/gone.md": "soon removed"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(bench, "working_tree_files", lambda: sorted(files))
    root = bench.sync_workspace("b.py")
    (root / "mutants" / "results.meta").parent.mkdir()
    (root / "mutants" / "results.meta").write_text("kept")
    del files["docs/gone.md"]
    files["src/modelwright/b.py"] = "two"
    (tmp_path / "src/modelwright/b.py").write_text("two")
    bench.sync_workspace("b.py")
    assert (root / "src/modelwright/b.py").read_text() == "two" and not (root / "docs/gone.md").exists()
    assert (root / "mutants" / "results.meta").read_text() == "kept"


def test_a_copy_of_another_module_that_changed_is_removed_so_mutmut_copies_it_again(bench, tmp_path):
    root = tmp_path / ".mutation" / "b"
    for name, (source, copy) in {"a.py": ("new", "old"), "b.py": ("new", "mutated"), "c.py": ("same", "same"),
                                 "gone.py": (None, "old")}.items():
        if source is not None:
            (root / "src/modelwright" / name).parent.mkdir(parents=True, exist_ok=True)
            (root / "src/modelwright" / name).write_text(source)
        (root / "mutants/src/modelwright" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "mutants/src/modelwright" / name).write_text(copy)
    bench.refresh_unmutated_copies(root, "b.py")
    left = sorted(path.name for path in (root / "mutants/src/modelwright").iterdir())
    assert left == ["b.py", "c.py"]


def test_score_only_passes_over_a_module_never_run(bench, tmp_path, capsys):
    out = tmp_path / "mutation.json"
    bench.git_commit = lambda: "0" * 40
    bench.main(["--score-only", "--module", MODULE, "--out", str(out)])
    assert "planner/example.py: no results in .mutation/planner-example to score" in capsys.readouterr().out


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
    monkeypatch.setattr(bench, "sync_workspace", lambda module: tmp_path)
    monkeypatch.setattr(bench.subprocess, "Popen", lambda *args, **kwargs: child)
    monkeypatch.setattr(bench.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    seconds, was_stopped = bench.run_mutmut(MODULE, 2, [], max_seconds=60)
    assert was_stopped is stopped and seconds >= 0 and child.waits[0] == 60
    assert killed == ([(4321, bench.signal.SIGTERM)] if stopped else [])


def test_a_failed_mutmut_run_is_an_error(bench, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "sync_workspace", lambda module: tmp_path)
    monkeypatch.setattr(bench.subprocess, "Popen", lambda *args, **kwargs: _Child(2))
    with pytest.raises(subprocess.CalledProcessError):
        bench.run_mutmut(MODULE, 2, ["f"], max_seconds=None)


def test_the_script_runs_as_a_program():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--max-minutes" in done.stdout


@pytest.mark.parametrize(("earlier", "seconds"), [(0, 30), (2, 130)])
def test_a_run_that_goes_on_from_kept_results_counts_the_earlier_runs_time(bench, monkeypatch, tmp_path, earlier,
                                                                          seconds):
    out = tmp_path / "mutation.json"
    out.write_text(json.dumps({"modules": {MODULE: {"seconds": 100}}}))
    counts = iter([earlier, 3])
    monkeypatch.setattr(bench, "results_so_far", lambda module: next(counts))
    monkeypatch.setattr(bench, "run_mutmut", lambda *args: (30.0, False))
    monkeypatch.setattr(bench, "git_commit", lambda: "0" * 40)
    monkeypatch.setattr(bench, "TESTS", {MODULE: ("tests/test_example.py",)})
    _meta(bench, {"x_f__mutmut_1": 1, "x_f__mutmut_2": 1, "x_f__mutmut_3": 1})
    bench.main(["--module", MODULE, "--out", str(out)])
    entry = json.loads(out.read_text())["modules"][MODULE]
    assert (entry["seconds"], entry["seconds_this_run"], entry["results_from_earlier_runs"]) == (seconds, 30, earlier)
