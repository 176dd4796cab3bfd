"""Do the tests fail when the behaviour breaks? Apply small, realistic bugs to the source one at a time, run the
tests named for each, and report which bugs the tests caught and which survived. Not a test itself (pytest
does not collect it) and not in CI's path: each mutation costs a test run.

To run: ``uv run python tests/mutation_check.py`` (``--only NAME ...`` for some, ``--list`` to list them).

Each mutation runs in a copy of the checkout (its tracked files and untracked ones git does not ignore), whose
``src/`` and root come first on ``PYTHONPATH``, so the installed project in ``.venv`` is not the one tested.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    """One bug: ``old`` replaced by ``new`` (once, and it must occur exactly once) in ``path``."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids or test files


CALLBACKS = "tests/test_callbacks.py::"
RELIABILITY = "tests/test_reliability.py::"
MEASURE = "tests/test_measure.py::"
ACCELERATE = "tests/test_accelerate_loop.py::"
RESUME = "tests/test_resume_rules.py::"
STUDY = "tests/test_study.py::"
VALIDATION_INSIDE = CALLBACKS + "test_a_validation_inside_the_captured_step_stays_out_of_the_capture"

MUTATIONS = (
    # -- the step probe (issue #24)
    Mutation("probe: evaluations enter the capture", "src/modelwright/measure/memory.py",
             "        tracker.pause()\n", "        pass\n",
             ("tests/test_memtracker.py", VALIDATION_INSIDE)),
    Mutation("probe: a step with an evaluation inside is timed", "src/modelwright/measure/probe.py",
             "        disturbed = self._capture is not None or self._evaluated_in_step",
             "        disturbed = self._capture is not None",
             (VALIDATION_INSIDE,)),
    Mutation("probe: the allocator peak not reset when the window opens", "src/modelwright/measure/probe.py",
             "            reset_peak_memory(self.device)\n", "            pass\n",
             (MEASURE + "test_the_probe_resets_the_allocator_peak_when_the_window_opens",)),
    Mutation("probe: the anatomy step timed", "src/modelwright/measure/probe.py",
             "        self.timer.stop(exclude=disturbed)", "        self.timer.stop(exclude=False)",
             (CALLBACKS + "test_short_run_logs_perf_and_mem_scalars_and_writes_a_valid_record",)),
    Mutation("probe: perf/ logged one step late (global_step)", "callbacks/run_monitor.py",
             "        log_scalars(trainer, reading.scalars, reading.step)",
             "        log_scalars(trainer, reading.scalars, reading.step + 1)",
             (CALLBACKS + "test_short_run_logs_perf_and_mem_scalars_and_writes_a_valid_record",)),
    Mutation("probe: an epoch cut short counted as whole", "src/modelwright/measure/probe.py",
             "        if epoch is not None and expected_steps is not None and epoch.steps == expected_steps:",
             "        if epoch is not None:",
             (MEASURE + "test_an_epoch_counts_as_whole_only_with_every_step_it_expected",
              CALLBACKS + "test_short_run_logs_perf_and_mem_scalars_and_writes_a_valid_record")),
    Mutation("probe: skip stops one step late", "src/modelwright/measure/divergence.py",
             "self.skipped_steps > self.max_skipped_steps", "self.skipped_steps > self.max_skipped_steps + 1",
             (MEASURE + "test_skip_stops_the_run_only_past_max_skipped_steps",)),
    Mutation("probe: skip stops one step early (>=)", "src/modelwright/measure/divergence.py",
             "self.skipped_steps > self.max_skipped_steps", "self.skipped_steps >= self.max_skipped_steps",
             (MEASURE + "test_skip_stops_the_run_only_past_max_skipped_steps",)),
    Mutation("accelerate: the record without mfu", "src/modelwright/measure/probe.py",
             '            "mfu": mfu(per_step, median_s, self.peak.flops_per_s),',
             '            "mfu": None,',
             (ACCELERATE + "test_fp32_losses_match_lightning_step_by_step",)),
    # -- stop and resume (issue #25)
    Mutation("stop: SIGTERM's handler not kept after teardown", "callbacks/fault_tolerance.py",
             "        _STOP.install()\n\n    def on_train_start", "        pass\n\n    def on_train_start",
             (RELIABILITY + "test_a_second_sigterm_as_the_process_exits_keeps_the_exit_status_143",)),
    Mutation("stop: Ctrl-C's exit status 1", "callbacks/fault_tolerance.py",
             "            exception.code = 128 + int(signum)", "            exception.code = 1",
             (RELIABILITY + "test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_the_command_that_resumes_exactly",
              )),
    Mutation("record: no running record", "callbacks/run_monitor.py",
             "        if trainer.is_global_zero and not trainer.fast_dev_run and not self._done:",
             "        if False:",
             (RELIABILITY + "test_the_record_exists_while_the_run_runs_and_survives_a_kill_in_its_last_write",)),
    Mutation("record: write_text_atomic a plain write_text", "src/modelwright/record.py",
             "    return write_atomic(path, lambda file: file.write(text.encode(\"utf-8\")))",
             "    Path(path).write_text(text, encoding=\"utf-8\")\n    return Path(path)",
             ("tests/test_record.py",)),
    Mutation("resume: a finished fit resumed again", "src/modelwright/train/checkpoints.py",
             "    if max_steps != -1 and steps >= max_steps:", "    if False:",
             (RESUME + "test_a_fit_is_complete_at_either_limit_as_lightning_counts_them",
              RESUME + "test_last_after_a_finished_run_is_complete_and_passes_over_a_run_without_checkpoint")),
    Mutation("resume: changed arguments taken silently", "src/modelwright/train/checkpoints.py",
             "    return differences\n", "    return []\n",
             (RESUME + "test_resume_refuses_changed_arguments_naming_each_unless_allowed",)),
    Mutation("resume: a checkpoint of another network loaded", "src/modelwright/train/checkpoints.py",
             "    require(name == model[\"model_name\"],", "    require(True,",
             ("tests/test_resume_rules.py", "tests/test_bad_inputs.py")),
    Mutation("resume: the DDP sampler's seed not restored", "src/modelwright/train/resume.py",
             "            distributed_seed = self.sampler.seed", "            distributed_seed = None",
             (RESUME + "test_ddp_resume_under_another_seed_keeps_the_interrupted_runs_order",)),
    # -- bad input (issue #26)
    Mutation("input: max_epochs 0 accepted", "src/modelwright/train/checks.py",
             "        require(max_epochs != 0,", "        require(True,", ("tests/test_bad_inputs.py",)),
    Mutation("input: a batch larger than the training set accepted", "src/modelwright/train/checks.py",
             "    require(batches > 0,", "    require(True,", ("tests/test_bad_inputs.py",)),
    Mutation("input: a validation interval past the epoch accepted", "src/modelwright/train/checks.py",
             "        require(interval <= limited,", "        require(True,", ("tests/test_bad_inputs.py",)),
    # -- predictions by category (issue #27)
    Mutation("predictions: FSDP2 without the prefetched block", "src/modelwright/planner/peak.py",
             "            buffers += self.blocks[block - 1].param_bytes * gathered",
             "            buffers += 0.0",
             ("tests/test_predict.py",)),
    Mutation("predictions: accumulation's gradients as after one micro-batch", "src/modelwright/planner/peak.py",
             "        if setup.accumulate > 1:  # after the first micro-batch every gradient exists",
             "        if False:",
             ("tests/test_predict.py",)),
    Mutation("predictions: autocast's 16-bit weight gradient at fp32 width", "src/modelwright/planner/peak.py",
             "        width = 0.5 if self.casts_weights(unit) or self.setup.state.weights == 2 else 1.0",
             "        width = 1.0",
             ("tests/test_predict.py",)),
    Mutation("predictions: checkpointing's recompute peak left out", "src/modelwright/planner/peak.py",
             "        points += [self.unit_point(unit, whole_segment=True) for unit in last_units]",
             "        points += []",
             ("tests/test_predict.py",)),
    Mutation("predictions: a signed tolerance (every under-prediction within)", "src/modelwright/report/predictions.py",
             "        return abs(self.predicted - self.measured) / tolerance_mib(self.measured)",
             "        return (self.predicted - self.measured) / tolerance_mib(self.measured)",
             ("tests/test_report.py", "tests/test_predict.py")),
    # -- the study (issue #28's survivors)
    Mutation("study: an ok record of a child that exited non-zero counted ok", "src/modelwright/study/runner.py",
             "        elif record is None or (child.returncode != 0 and record.get(\"status\") == \"ok\"):",
             "        elif record is None:",
             (STUDY + "test_an_ok_record_of_a_child_that_exited_non_zero_is_a_failure",)),
    Mutation("accelerate: the version counted, not the next free one", "src/modelwright/loops/accelerate.py",
             "        number = max(numbers, default=-1) + 1", "        number = len(numbers)",
             (ACCELERATE + "test_the_next_version_follows_the_highest_as_lightning_numbers_runs",
              ACCELERATE + "test_a_run_takes_the_next_free_version_and_never_writes_into_one")),
)


def copy_checkout(into: Path) -> None:
    """The tracked and the untracked-not-ignored files of the checkout, copied into ``into``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    for name in (entry.decode() for entry in listed if entry):
        source = REPO_ROOT / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def apply(copy: Path, mutation: Mutation) -> str:
    path = copy / mutation.path
    text = path.read_text(encoding="utf-8")
    found = text.count(mutation.old)
    if found != 1:
        raise SystemExit(f"{mutation.name}: {mutation.path} holds the original {found} times, not once")
    path.write_text(text.replace(mutation.old, mutation.new), encoding="utf-8")
    return text


def run_tests(copy: Path, tests: tuple[str, ...]) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy / "src"), str(copy), str(copy / "tests")]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=copy, env=env, capture_output=True, text=True)
    return proc.returncode, time.perf_counter() - started, proc.stdout[-2000:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="names (or parts of names) of mutations to run")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or any(part in m.name for part in args.only)]
    if args.list:
        print("\n".join(f"{m.name}: {m.path}" for m in chosen))
        return 0
    caught, survived = [], []
    with tempfile.TemporaryDirectory(prefix="modelwright-mutation-") as folder:
        copy = Path(folder)
        copy_checkout(copy)
        every_test = tuple(dict.fromkeys(test for mutation in chosen for test in mutation.tests))
        code, seconds, output = run_tests(copy, every_test)
        if code != 0:  # a bug caught by tests that fail anyway proves nothing
            raise SystemExit(f"{output}\nthe tests fail without any mutation (exit {code}): fix them first")
        print(f"unmutated: the {len(every_test)} test selections pass ({seconds:.0f} s)", flush=True)
        for mutation in chosen:
            original = apply(copy, mutation)
            try:
                code, seconds, _ = run_tests(copy, mutation.tests)
            finally:
                (copy / mutation.path).write_text(original, encoding="utf-8")
            (caught if code != 0 else survived).append(mutation.name)
            verdict = "caught" if code != 0 else "SURVIVED"
            print(f"{verdict:9} {mutation.name} ({seconds:.0f} s)", flush=True)
    print(f"\n{len(chosen)} mutations: {len(caught)} caught, {len(survived)} survived"
          + (f": {'; '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
