"""Do the fast tests catch the bugs nobody thought of? mutmut 3 mutates the modules where decisions live and runs,
for each mutant, the module's own fast tests that reach the mutated function; this script scores each module.

To run: ``uv run python benchmarks/mutation.py --module planner/memory.py`` (``--module`` again for more; none: all
of ``[tool.mutmut] only_mutate`` in pyproject.toml). Not a test and not in CI.

Each module is mutated in its own workspace, ``.mutation/<module>/`` (git-ignored): a copy of the working tree
whose pyproject.toml names that module and its test files (``TESTS`` below: the fast tests written for it). There
mutmut copies ``src/`` and ``[tool.mutmut] also_copy`` into ``mutants/``, runs those tests once to learn which
reach which function (reused while the sources and tests are unchanged), then one test run per mutant. A mutant is
killed when a test fails or times out. Only the module's own test files run: a mutant they kill is killed by the
whole fast tier too, so the score is a lower bound on the fast tier's (every fit reaches the record, the checks
and the timing, and running all the tests that reach them takes many hours a module on 2 cores). Mutants listed
in ``benchmarks/mutation_equivalent.txt`` (name, then why no test can tell it from the original) leave the
score's denominator. Each module's result, with its survivors by name, is merged into
``results/<hardware slug>/mutation.json``; ``uv run mutmut show NAME``, run in the module's workspace, prints a
mutant's diff.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import tomllib

REPO_ROOT = Path(__file__).resolve().parents[1]
EQUIVALENT_FILE = REPO_ROOT / "benchmarks" / "mutation_equivalent.txt"
WORKSPACES = ".mutation"
SOURCE_PREFIX = "src/modelwright/"
#: Each mutated module's test files: the fast tests written for it (mutmut runs, for each mutant, those of their
#: tests that reach the mutated function).
TESTS = {
    "train/checks.py": ("tests/test_checks_units.py", "tests/test_bad_inputs.py"),
    "train/checkpoints.py": ("tests/test_checkpoint_units.py", "tests/test_resume_rules.py"),
    "train/resume.py": ("tests/test_resume_units.py", "tests/test_resume_rules.py"),
    "record.py": ("tests/test_record_units.py", "tests/test_record.py"),
    "measure/timing.py": ("tests/test_timing_units.py", "tests/test_measure.py"),
    "measure/flops.py": ("tests/test_flops_units.py", "tests/test_measure.py"),
    "planner/advisor.py": ("tests/test_advisor.py", "tests/test_planner.py"),
    "planner/scale.py": ("tests/test_scale_model.py",),
    "planner/memory.py": ("tests/test_planner_memory.py",),
    "report/tables.py": ("tests/test_report_tables.py", "tests/test_report.py"),
    "study/runner.py": ("tests/test_runner_units.py",),
}
#: mutmut's exit codes (mutmut.stats.status_by_exit_code) folded into what the score needs.
OUTCOME_BY_EXIT_CODE = {1: "killed", 3: "killed", 36: "killed", 24: "killed", -24: "killed", 152: "killed",
                        255: "killed", -11: "killed", -9: "killed", 0: "survived", 5: "no tests", 33: "no tests",
                        34: "skipped", None: "not run"}
#: Every outcome a mutant can have: any other exit code is suspicious.
OUTCOMES = sorted({*OUTCOME_BY_EXIT_CODE.values(), "equivalent", "suspicious"})


def mutated_modules() -> list[str]:
    """The modules mutmut mutates, as paths under src/modelwright/, read from pyproject.toml."""
    settings = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    return [path.removeprefix(SOURCE_PREFIX) for path in settings["only_mutate"]]


def read_equivalents() -> dict[str, str]:
    """Mutant name -> why it behaves as the original, from the committed list."""
    equivalents = {}
    for line in EQUIVALENT_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, reason = line.partition(" ")
            equivalents[name] = reason.strip()
    return equivalents


def workspace(module: str) -> Path:
    """The folder where ``module`` is mutated: ``.mutation/train-checks`` for train/checks.py."""
    return REPO_ROOT / WORKSPACES / module.removesuffix(".py").replace("/", "-")


def working_tree_files() -> list[str]:
    """The files of the working tree as git sees them: tracked, and untracked but not ignored."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True)
    return [name for name in listed.stdout.split("\0") if name and (REPO_ROOT / name).is_file()]


def workspace_settings(module: str) -> str:
    """The ``[tool.mutmut]`` table of ``module``'s workspace: the repository's, mutating ``module`` alone and
    selecting its test files; file changes are found by content (the workspace is not a git checkout)."""
    settings = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    settings.update(only_mutate=[SOURCE_PREFIX + module],
                    pytest_add_cli_args_test_selection=["-m", "not slow", *TESTS[module]],
                    use_git_change_detection=False)
    # A JSON string, list of strings or boolean is written the same in TOML.
    return "[tool.mutmut]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items())


def without_mutmut_table(pyproject: str) -> str:
    """pyproject.toml's text less its ``[tool.mutmut]`` table (which runs to the next table or the end)."""
    kept, inside = [], False
    for line in pyproject.splitlines(keepends=True):
        if line.startswith("["):
            inside = line.strip() == "[tool.mutmut]"
        if not inside:
            kept.append(line)
    return "".join(kept)


def sync_workspace(module: str) -> Path:
    """Bring ``module``'s workspace to the working tree: copy each file that differs, remove those gone, and
    write its pyproject.toml. Files left as they were keep mutmut's results for them."""
    root = workspace(module)
    wanted = set(working_tree_files()) - {"pyproject.toml"}
    for name in wanted:
        copy = root / name
        source = (REPO_ROOT / name).read_bytes()
        if not copy.is_file() or copy.read_bytes() != source:
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_bytes(source)
    for copy in root.rglob("*"):
        name = copy.relative_to(root).as_posix()
        if copy.is_file() and name.split("/")[0] != "mutants" and name != "pyproject.toml" and name not in wanted:
            copy.unlink()
    pyproject = without_mutmut_table((REPO_ROOT / "pyproject.toml").read_text())
    (root / "pyproject.toml").write_text(pyproject.rstrip("\n") + "\n\n" + workspace_settings(module))
    return root


def refresh_unmutated_copies(root: Path, module: str) -> None:
    """Remove the copies in ``root``/mutants/src/ of modules other than ``module`` that differ from src/: mutmut
    copies a module only if its copy is missing, so a module changed since would be tested as it was."""
    for copy in (root / "mutants" / "src").rglob("*.py"):
        source = root / copy.relative_to(root / "mutants")
        relative = source.relative_to(root).as_posix()
        if relative != SOURCE_PREFIX + module and (not source.exists() or source.read_bytes() != copy.read_bytes()):
            copy.unlink()


def run_mutmut(module: str, max_children: int, only: list[str], max_seconds: float | None) -> tuple[float, bool]:
    """Run the mutants of ``module`` (those of its functions named in ``only`` if any) in its workspace, for at
    most ``max_seconds``; returns the wall time in seconds and whether it was stopped there. mutmut keeps each
    mutant's result as it goes, so a stopped run is scored on those that ran (and a run of the functions left,
    ``only``, goes on from there). mutmut's output goes to mutants/mutmut.log in the workspace."""
    prefix = "modelwright." + module.removesuffix(".py").replace("/", ".") + "."
    # mutmut's names: module.x_function__mutmut_N, module.xǁClassǁmethod__mutmut_N.
    mangled = ["x" + "ǁ".join(["", *function.split(".")]) if "." in function else "x_" + function
               for function in only]
    patterns = [f"{prefix}{name}__mutmut_*" for name in mangled] or [prefix + "*"]
    root = sync_workspace(module)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The tests' child processes (python -m modelwright, main.py) must import the mutated copy too: the editable
    # install puts the original src/ on their path otherwise. The folder exists before Python caches its absence.
    (root / "mutants" / "src").mkdir(parents=True, exist_ok=True)
    refresh_unmutated_copies(root, module)
    env["PYTHONPATH"] = os.pathsep.join([str(root / "mutants" / "src"), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "mutmut", "run", *patterns, "--max-children", str(max_children)]
    start = time.perf_counter()
    with open(root / "mutants" / "mutmut.log", "w") as log:
        child = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            returncode = child.wait(timeout=max_seconds)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGTERM)  # mutmut and the test processes it forked
            child.wait()
            return time.perf_counter() - start, True
    if returncode != 0:
        raise subprocess.CalledProcessError(returncode, command)
    return time.perf_counter() - start, False


def results_so_far(module: str) -> int:
    """How many of the module's mutants have a result in its workspace (0 before mutmut first made them)."""
    if not meta_path(module).exists():
        return 0
    exit_codes = json.loads(meta_path(module).read_text())["exit_code_by_key"]
    return sum(code is not None for code in exit_codes.values())


def meta_path(module: str) -> Path:
    """mutmut's results file of ``module``: each mutant's exit code."""
    return workspace(module) / "mutants" / (SOURCE_PREFIX + module + ".meta")


def score(module: str, seconds: float | None, equivalents: dict[str, str]) -> dict:
    """The module's outcome counts, survivors and score, from mutmut's results file in its workspace."""
    exit_codes = json.loads(meta_path(module).read_text())["exit_code_by_key"]
    outcome_by_name = {name: OUTCOME_BY_EXIT_CODE.get(code, "suspicious") for name, code in exit_codes.items()}
    for name in outcome_by_name.keys() & equivalents.keys():
        outcome_by_name[name] = "equivalent"
    counts = Counter(outcome_by_name.values())
    # An interrupted run leaves some not run: the score is of those that ran.
    scored = len(outcome_by_name) - counts["equivalent"] - counts["skipped"] - counts["not run"]
    return {
        "mutants": len(outcome_by_name),
        **{outcome: counts[outcome] for outcome in OUTCOMES},
        "score_percent": round(100 * counts["killed"] / scored, 1) if scored else None,
        "seconds": round(seconds) if seconds is not None else None,
        "not_killed": sorted(name for name, outcome in outcome_by_name.items()
                             if outcome in ("survived", "no tests", "suspicious", "not run")),
    }


def markdown_table(modules: dict) -> str:
    """The scores of ``mutation.json``'s modules as a Markdown table, one row per module in the order mutated."""
    header = ["module", "mutants", "killed", "survived", "no tests", "not run", "equivalent", "score",
              "seconds", "tests", "commit", "date"]
    lines = ["# Mutation scores", "",
             "By `benchmarks/mutation.py` (mutmut). Score: killed over the mutants that ran, less the "
             "equivalents (`benchmarks/mutation_equivalent.txt`); a timed-out mutant counts as killed. Seconds: "
             "of every run whose results the row holds. Tests: the "
             "fast tests run against each mutant, those that reach it of either the whole fast tier or the "
             "module's own test files (a lower bound on the fast tier's score).", "",
             "| " + " | ".join(header) + " |", "|:--|" + "--:|" * (len(header) - 4) + ":--|:--|:--|"]
    for module in mutated_modules():
        entry = modules.get(module)
        if entry is None:
            lines.append(f"| {module} | not run yet |" + " |" * (len(header) - 2))
            continue
        score = "–" if entry["score_percent"] is None else f"{entry['score_percent']}%"
        cells = [module, entry["mutants"], entry["killed"], entry["survived"], entry["no tests"], entry["not run"],
                 entry["equivalent"], score, entry.get("seconds") or "–", tests_cell(entry.get("tests")),
                 entry.get("commit", "")[:10], entry.get("date", "")]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def tests_cell(tests: list[str] | str | None) -> str:
    """The tests a run used, for the table: its test files by name, or the whole fast tier (the runs before
    ``TESTS`` named the files, recorded as a sentence)."""
    if isinstance(tests, list):
        return ", ".join(Path(name).name for name in tests)
    return "whole fast tier"


def default_results_file() -> Path:
    """results/<this machine's hardware slug>/mutation.json."""
    sys.path.insert(0, str(REPO_ROOT / "src"))
    from modelwright.study import hardware_slug

    return REPO_ROOT / "results" / hardware_slug("cpu") / "mutation.json"


def git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", action="append", choices=mutated_modules(),
                        help="a module under src/modelwright/ (repeat for more; default: all)")
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once")
    parser.add_argument("--only", nargs="+", metavar="FUNCTION",
                        help="run the mutants of these functions only (a method: Class.method)")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="stop each module's run after this long and score the mutants that ran; go on with "
                             "--only and the functions left")
    parser.add_argument("--score-only", action="store_true",
                        help="score mutmut's results in the workspaces again without running (after an interrupted "
                             "run, or a changed list of equivalents)")
    parser.add_argument("--out", type=Path, default=None, help="default: results/<hardware slug>/mutation.json")
    args = parser.parse_args(argv)
    out = args.out or default_results_file()
    results = json.loads(out.read_text()) if out.exists() else {"modules": {}}
    equivalents = read_equivalents()
    commit = git_commit()  # the sources mutated: HEAD as the run starts
    for module in args.module or mutated_modules():
        if args.score_only and not meta_path(module).exists():
            print(f"{module}: no results in {workspace(module).relative_to(REPO_ROOT)} to score")
            continue
        if args.score_only:
            # Rescored (equivalents changed, a run interrupted): the run's own figures stay.
            entry = results["modules"].get(module, {})
            entry.update(score(module, entry.get("seconds"), equivalents))
        else:
            earlier = results_so_far(module)
            # The results kept from earlier runs took the earlier runs' time: the entry's seconds are all of it.
            earlier_seconds = (results["modules"].get(module, {}).get("seconds") or 0) if earlier else 0
            max_seconds = args.max_minutes * 60 if args.max_minutes else None
            seconds, stopped = run_mutmut(module, args.max_children, args.only or [], max_seconds)
            ran = results_so_far(module) - earlier
            entry = {
                "functions_run": args.only or "all",
                "stopped_for_time": stopped,
                "results_from_earlier_runs": earlier,
                "seconds_this_run": round(seconds),
                "seconds_per_mutant_run": round(seconds / max(ran, 1), 1),
                **score(module, earlier_seconds + seconds, equivalents),
                "mutmut": version("mutmut"),
                "commit": commit,
                "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                "max_children": args.max_children,
                "tests": list(TESTS[module]),
            }
        results["modules"][module] = entry
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        out.with_suffix(".md").write_text(markdown_table(results["modules"]))
        print(f"{module}: {entry['score_percent']}% of {entry['mutants'] - entry['not run']} mutants killed "
              f"({entry['not run']} not run) in {entry['seconds']} s")


if __name__ == "__main__":
    main()
