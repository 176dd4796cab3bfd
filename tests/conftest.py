"""Shared fixtures. Tests run on CPU; every run writes under tmp_path, never into the working tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--data.batch_size", "8",
    "--data.train_size", "32",
    "--data.val_size", "16",
    "--trainer.limit_val_batches", "1",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]


CACHE_DIR = pytest.StashKey[str]()


def pytest_configure(config) -> None:
    """Nothing a test does may read or write the user's caches: the peak-FLOP cache goes to a folder of this run,
    inherited by every child process, so no test depends on which tests (or which earlier runs) came before it."""
    cache = tempfile.mkdtemp(prefix="modelwright-test-cache-")
    config.stash[CACHE_DIR] = cache
    os.environ["MODELWRIGHT_CACHE_DIR"] = cache
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        one_thread_per_worker()


def pytest_unconfigure(config) -> None:
    """The cache folder goes with the run that made it (each xdist worker makes and removes its own)."""
    if CACHE_DIR in config.stash:
        shutil.rmtree(config.stash[CACHE_DIR], ignore_errors=True)


def one_thread_per_worker() -> None:
    """Under ``pytest -n 2`` each worker computes on one thread, and so do the processes it starts: two workers
    of a core's worth of threads each would ask a 2-core machine for four, and OpenMP's threads spin while they
    wait for one another."""
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


UNTRACKED_BEFORE = pytest.StashKey[frozenset]()


def untracked_files() -> frozenset[str]:
    """The working tree's files that git neither tracks nor ignores (none where git cannot say)."""
    done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "-z"], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    entries = done.stdout.split("\0") if done.returncode == 0 else []
    return frozenset(entry[3:] for entry in entries if entry.startswith("?? "))


def pytest_sessionstart(session) -> None:
    session.config.stash[UNTRACKED_BEFORE] = untracked_files()


def pytest_sessionfinish(session, exitstatus) -> None:
    """A run that left a new file in the working tree fails, naming it (once, in the main process)."""
    if hasattr(session.config, "workerinput") or UNTRACKED_BEFORE not in session.config.stash:
        return
    written = sorted(untracked_files() - session.config.stash[UNTRACKED_BEFORE])
    if written:
        print(f"\nthe tests wrote into the working tree: {', '.join(written)}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


#: The long end-to-end tests (two processes, whole studies, subprocess benchmarks), by file and test name prefix
#: ("" for every test of the file): ``uv run pytest -m "not slow"`` is the fast tier, and ``.ci/run`` runs it first,
#: then these.
SLOW = {
    "test_distributed.py": ("",),
    "test_study.py": ("test_tiny_study_", "test_a_rerun_skips_what_is_recorded", "test_a_killed_study_leaves_no_child",
                      "test_a_users_job_is_studied_with_each_technique"),
    "test_overhead_benchmark.py": ("test_smoke_three_loops", "test_cpu_defaults_smoke"),
    "test_scripts.py": ("test_check_imports_resolves_the_plans",),
    "test_reliability.py": ("test_ddp_rank_failure_ends_the_job", "test_sigkill_at_every_kill_point",
                            "test_a_second_sigterm_as_the_process_exits", "test_the_record_exists_while_the_run_runs"),
    "test_accelerate_loop.py": ("test_two_cpu_processes_with_torchrun",
                                "test_the_loop_trains_without_lightnings_trainer"),
    "test_bad_inputs.py": ("test_a_refused_run_prints_none_of_lightnings_startup_lines",),
    "test_runtime.py": ("test_retain_reuses_freed_memory",),
    "test_planner.py": ("test_with_room_for_everything", "test_with_a_small_budget", "test_the_table_is_ordered"),
    # bf16 is emulated on CPUs without bf16 instructions: these two take 10 s there
    "test_measure.py": ("test_resnet18_peak_activations_drop[bf16",),
    "test_cli.py": ("test_config_trains[all.yaml]",),
    "test_predict.py": ("test_every_category_on_networks_the_project_does_not_ship",
                        "test_the_largest_batch_is_confirmed_by_runs",
                        "test_advisor_recommendation_fits", "test_the_vits_bf16_runs"),
}


#: Tests that share a module fixture's minutes of work, by file and test name prefix as in SLOW: under
#: ``pytest -n 2 --dist loadgroup`` each file's go together to one worker, every other test to whichever worker is
#: free. (pytest-xdist's own ``xdist_group`` marks group nothing under pytest 9.2, which no longer reads the node
#: id they rewrite.)
SHARED = {
    "test_study.py": ("test_tiny_study_", "test_a_rerun_skips_what_is_recorded"),
    "test_planner.py": ("test_with_room_for_everything", "test_with_a_small_budget", "test_the_table_is_ordered"),
    "test_predict.py": ("test_advisor_recommendation_fits",),
    "test_distributed.py": ("",),
    "test_attention.py": ("",),
}


#: The longest of the slow tests that no other test shares a fixture with, longest first, as in SLOW: each is
#: handed to a worker before any shorter one, so that neither worker is left with one of them at the end while
#: the other waits (pytest-xdist hands out the groups of SHARED first, the largest first).
LONGEST = (
    ("test_scripts.py", "test_check_imports_resolves_the_plans"),  # 100 s
    ("test_reliability.py", "test_sigkill_at_every_kill_point"),  # 45 s
    ("test_overhead_benchmark.py", "test_smoke_three_loops"),  # 30 s
)


def scheduling_unit(nodeid: str) -> str:
    """What one worker runs as a whole: the test's file's shared tests, or the test alone."""
    path, _, name = nodeid.partition("::")
    prefixes = SHARED.get(Path(path).name, ())
    return f"{path}::shared" if prefixes and name.startswith(prefixes) else nodeid


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: xdist's scope scheduler over :func:`scheduling_unit` (its ``_split_scope``, a
    private method, overridden here only)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_unit(nodeid)

    return SharedFixtureScheduling(config, log)


def _rank_by_length(item) -> int:
    """An item's place in LONGEST (its length if it is not there): a stable sort puts those first, in order."""
    for rank, (file, prefix) in enumerate(LONGEST):
        if item.path.name == file and item.name.startswith(prefix):
            return rank
    return len(LONGEST)


def pytest_collection_modifyitems(config, items) -> None:
    modules = {}
    for item in items:
        modules[item.path.name] = getattr(item, "module", None)
        if item.name.startswith(SLOW.get(item.path.name, ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_rank_by_length)
    # A renamed test would silently leave the slow tier for the fast one: every name must still name a test.
    for name, module in modules.items():
        tests = [test for test in vars(module or object) if test.startswith("test")]
        named = (*SLOW.get(name, ()), *SHARED.get(name, ()), *(prefix for file, prefix in LONGEST if file == name))
        # a prefix may name one parameter of a test ("test_x[bf16"): its function must exist
        missing = [prefix for prefix in named if not any(test.startswith(prefix.split("[")[0]) for test in tests)]
        if missing:
            raise pytest.UsageError(f"tests/conftest.py SLOW or SHARED names no test of {name}: {', '.join(missing)}")


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def subprocess_env() -> dict:
    """Environment for child processes: the repo's modules importable, one thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def fit_args(log_dir: Path, *extra: str) -> list[str]:
    """``fit`` arguments for a tiny run that logs under ``log_dir``.

    ``--config`` files come first and the tiny sizes next, so that both give way to the other ``extra``
    arguments (later arguments win in jsonargparse, a ``--config`` included).
    """
    configs, others, i = [], [], 0
    while i < len(extra):
        (configs if extra[i] == "--config" else others).extend(extra[i : i + 2])
        i += 2
    return ["fit", *configs, *TINY, "--trainer.logger.init_args.save_dir", str(log_dir), *others]


sys.path.insert(0, str(REPO_ROOT))
