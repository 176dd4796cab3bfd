"""The Accelerate loop: Lightning's losses step by step, exact accumulation, DDP under torchrun, bad input.

The Lightning comparisons run ``main.py fit`` in-process and the loop on the same arguments, and compare the
``history`` of their run records step by step: fp32 on one CPU process runs the same kernels in the same
order from the same seed, so the tolerance is tight (relative 1e-5).

Run as a script under ``torchrun`` (``python tests/test_accelerate_loop.py OUT_DIR ARGS...``), this file trains
with the loop and has every rank save its final weights to ``OUT_DIR/rank<N>.pt``.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modelwright.train.models import SmallViT

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--model.network", "SmallCNN", "--data.batch_size", "4", "--data.val_size", "8",
    "--trainer.log_every_n_steps", "1", "--trainer.limit_val_batches", "1",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
]
# The DDP job (as tests/test_distributed.py's): the ViT (LayerNorm, no batch statistics), plain SGD, every step
# over the whole training set, so two ranks' micro-batches together are the one process's batch.
JOB = [
    "--model.network", "SmallViT", "--model.optimizer", "sgd", "--model.momentum", "0.0", "--model.scheduler", "none",
    "--model.lr", "0.05", "--data.train_size", "16", "--data.val_size", "8", "--trainer.max_steps", "3",
    "--trainer.limit_val_batches", "0",
]


def run(args: list[str]):
    """The loop on command-line ``args`` (base.yaml first): its unwrapped network and run record."""
    from modelwright.loops import accelerate as al

    return al.accelerate(args)


@pytest.fixture(autouse=True)
def one_thread(tmp_path, monkeypatch):
    """One intra-op thread (two threads per process on a shared 2-core machine wait on each other); a private
    peak-FLOP cache."""
    monkeypatch.setenv("MODELWRIGHT_CACHE_DIR", str(tmp_path / "cache"))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_both(tmp_path: Path, *extra: str) -> tuple[dict, dict]:
    """The Lightning and the Accelerate record of the same arguments."""
    from modelwright.loops.accelerate import main
    from modelwright.record import read_record
    from modelwright.train.cli import cli_main

    assert cli_main(["fit", *SMALL, *extra, "--trainer.logger.init_args.save_dir", str(tmp_path)]) == 0
    assert main([*SMALL, *extra, "--out", str(tmp_path)]) == 0
    (lightning_record,) = tmp_path.glob("base/version_*/record.json")
    (version,) = tmp_path.glob("base/accelerate/version_*")  # beside the Lightning runs of the same config
    assert "class_path: modelwright.train.models.SmallCNN" in (version / "config.yaml").read_text(), \
        "the resolved config is saved"
    assert list(version.glob("events.out.tfevents.*")), "TensorBoard events beside the record"
    return read_record(lightning_record), read_record(version / "record.json")


def assert_same_history(lightning: dict, accelerate: dict, key: str, rel: float) -> None:
    ours, theirs = accelerate["history"][key], lightning["history"][key]
    assert [s for s, _ in ours] == [s for s, _ in theirs], f"{key}: logged at different steps"
    for (step, a), (_, b) in zip(ours, theirs, strict=True):
        assert math.isclose(a, b, rel_tol=rel), f"{key} at step {step}: accelerate {a} vs lightning {b}"


def test_fp32_losses_match_lightning_step_by_step(tmp_path):
    lightning, accelerate = run_both(tmp_path, "--data.train_size", "12", "--trainer.max_epochs", "2")
    assert accelerate["loop"] == "accelerate" and lightning["loop"] == "lightning"
    assert len(accelerate["history"]["train/loss"]) == 6, "2 epochs of 12 samples in batches of 4"
    for key in ("train/loss", "train/acc", "val/loss"):
        assert_same_history(lightning, accelerate, key, rel=1e-5)
    for key in ("precision", "micro_batch_size", "effective_batch_size", "world_size", "optimizer_impl"):
        assert accelerate["techniques"][key] == lightning["techniques"][key], key
    assert accelerate["timing"]["steps_per_epoch"] == lightning["timing"]["steps_per_epoch"] == 3
    assert accelerate["timing"]["measured_steps"] == 3, "6 steps less 2 warm-up, less the anatomy step"
    # The same flops section from the same probe: the counts and the peak alike, MFU from each loop's own steps.
    for key in ("flops_per_step", "flops_per_micro_batch", "peak_flops_per_s", "peak_flops_source",
                "peak_flops_dtype"):
        assert accelerate["flops"][key] == lightning["flops"][key], key
    for record in (accelerate, lightning):
        flops, median_s = record["flops"], record["timing"]["step_time_median_ms"] / 1e3
        assert flops["mfu"] == pytest.approx(flops["flops_per_step"] / median_s / flops["peak_flops_per_s"])
        assert flops["achieved_flops_per_s"] == pytest.approx(flops["flops_per_step"] / median_s)
    assert set(accelerate["timing"]) == set(lightning["timing"]) and set(accelerate["memory"]) == set(
        lightning["memory"]), "both loops fill the same sections"
    # smallcnn: 576,170 fp32 parameters; Adam keeps two moments of each.
    anatomy = accelerate["memory"]["anatomy_mib"]
    assert anatomy["parameters"] == pytest.approx(576_170 * 4 / 2**20, rel=1e-3)
    assert anatomy["optimizer_state"] == pytest.approx(2 * 576_170 * 4 / 2**20, rel=1e-3)


def test_accumulation_and_checkpointing_match_lightning_including_a_short_last_cycle(tmp_path):
    # 10 samples in batches of 2: 5 micro-batches per epoch, stepped as 2 + 2 + 1; blocks recomputed in backward.
    lightning, accelerate = run_both(
        tmp_path, "--trainer.accumulate_grad_batches", "2", "--data.batch_size", "2", "--data.train_size", "10",
        "--trainer.max_epochs", "2", "--model.gradient_checkpointing", "block",
    )
    assert [s for s, _ in accelerate["history"]["train/loss"]] == [0, 1, 2, 3, 4, 5]
    assert_same_history(lightning, accelerate, "train/loss", rel=1e-5)
    assert accelerate["techniques"]["checkpointed_segments"] == 6, "smallcnn: six conv blocks"
    assert accelerate["techniques"]["effective_batch_size"] == 4
    assert accelerate["flops"]["flops_per_step"] == 2 * accelerate["flops"]["flops_per_micro_batch"]


def test_a_validation_inside_the_captured_step_stays_out_of_the_capture(tmp_path):
    """As in the Lightning run (tests/test_callbacks.py): a validation after micro-batch 2, the first of the
    captured step 1, leaves the anatomy as without it, and a step it falls inside is not timed."""
    common = [*SMALL, "--trainer.accumulate_grad_batches", "2", "--data.train_size", "48", "--warmup_steps", "1",
              "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "2"]
    _, inside = run([*common, "--trainer.val_check_interval", "3", "--out", str(tmp_path / "inside")])
    _, after = run([*common, "--out", str(tmp_path / "after")])
    assert inside["status"] == "ok" and inside["memory"]["anatomy_step"] == 1
    step_memory = {k: v for k, v in inside["memory"]["anatomy_mib"].items() if k != "inputs"}
    assert step_memory == {k: after["memory"]["anatomy_mib"][k] for k in step_memory}, "an evaluation entered it"
    assert inside["timing"]["measured_steps"] == 3 and after["timing"]["measured_steps"] == 4
    assert [s for s, _ in inside["history"]["val/loss"]] == [1, 2, 4, 5]
    assert torch._C._len_torch_dispatch_stack() == 0


def test_a_run_takes_the_next_free_version_and_never_writes_into_one(tmp_path):
    """Before, the loop named its run version_<number of existing folders>: beside a lone version_1 it wrote
    into version_1."""
    earlier = tmp_path / "base" / "accelerate" / "version_1"
    earlier.mkdir(parents=True)
    (earlier / "record.json").write_text("an earlier run's record\n")
    _, record = run([*SMALL, "--data.train_size", "8", "--trainer.max_steps", "1", "--out", str(tmp_path)])
    assert (earlier / "record.json").read_text() == "an earlier run's record\n"
    assert (tmp_path / "base" / "accelerate" / "version_2" / "record.json").is_file()
    assert record["status"] == "ok"


def test_the_loop_prints_progress_and_the_summary(tmp_path, capsys):
    run([*SMALL, "--data.train_size", "16", "--trainer.max_steps", "4", "--out", str(tmp_path),
         "--trainer.enable_progress_bar", "true"])
    captured = capsys.readouterr()
    assert "train:" in captured.err and "/4 [" in captured.err, "tqdm's bar over the 4 optimizer steps"
    assert "step time   median " in captured.out and "record      " in captured.out


def test_accumulated_steps_equal_one_large_batch_with_plain_sgd(tmp_path):
    # Plain SGD moves the weights by lr × gradient: a loss scaled by k (or 1/k) too many moves them k times as far.
    common = [*JOB, "--out", str(tmp_path), "--data.train_size", "8", "--trainer.max_steps", "2"]
    large, _ = run([*common, "--data.batch_size", "8"])
    accumulated, record = run([*common, "--data.batch_size", "2", "--trainer.accumulate_grad_batches", "4"])
    assert record["techniques"]["effective_batch_size"] == 8
    torch.manual_seed(0)  # base.yaml's seed_everything, before the network is built
    start = SmallViT().state_dict()
    moved = max((large.state_dict()[k] - v).abs().max().item() for k, v in start.items())
    assert moved > 1e-3, "two steps must move the weights far beyond the tolerance"
    for key, value in large.state_dict().items():
        torch.testing.assert_close(accumulated.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.timeout(400)
def test_two_cpu_processes_with_torchrun_average_gradients(tmp_path, subprocess_env):
    """Each rank ends with the same weights as one process on the whole batch; a loop that never all-reduces
    (every micro-batch inside ``no_sync``) leaves each rank with its own half's update and fails here."""
    # Two ranks × 2 micro-batches of 4 per step against one process with one batch of 16.
    args = [*JOB, "--config", str(REPO_ROOT / "configs/ddp.yaml"), "--data.batch_size", "4",
            "--trainer.accumulate_grad_batches", "2", "--out", str(tmp_path / "ddp")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__, str(tmp_path), *args]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    single, _ = run([*JOB, "--data.batch_size", "16", "--out", str(tmp_path / "one")])
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for key, value in single.state_dict().items():
        torch.testing.assert_close(ranks[1][key], ranks[0][key], rtol=0, atol=0, msg=f"ranks differ: {key}")
        torch.testing.assert_close(ranks[0][key], value, rtol=1e-5, atol=1e-6, msg=f"DDP vs one process: {key}")
    from modelwright.record import read_record

    (path,) = tmp_path.glob("ddp/ddp/accelerate/version_*/record.json")  # rank 0 alone writes
    tech = read_record(path)["techniques"]
    assert (tech["world_size"], tech["strategy"], tech["effective_batch_size"]) == (2, "ddp", 16)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--model.no_such_key", "1"], "no_such_key"),
        (["--trainer.precision", "8-mixed"], "trainer.precision"),
        (["--trainer.accumulate_grad_batches", "0"], "trainer.accumulate_grad_batches"),
        (["--config", "configs/fsdp2.yaml"], "trainer.strategy"),
        (["--model.lr", "-1"], "model.lr"),
        (["--trainer.overfit_batches", "2"], "trainer.overfit_batches"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, names, tmp_path, capsys, monkeypatch):
    from modelwright.loops.accelerate import main

    monkeypatch.chdir(REPO_ROOT)
    assert main([*args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err, err
    assert not list(tmp_path.rglob("record.json")), "a configuration error is not a run"


def test_unknown_key_in_a_config_file_is_named(tmp_path, capsys):
    from modelwright.loops.accelerate import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  model_nam: smallcnn\n")
    assert main(["--config", str(bad)]) == 2
    assert "model_nam" in capsys.readouterr().err


def test_the_loop_trains_without_lightnings_trainer(tmp_path, monkeypatch):
    """The job is read by LightningCLI's parser (the user's classes are Lightning's types), but the loop is
    Accelerate's: Trainer.fit or the LightningModule's training hooks called would fail the run."""
    from lightning.pytorch import Trainer

    from modelwright.train.module import ImageClassifier

    def refuse(*args, **kwargs):
        raise AssertionError("the accelerate loop used Lightning's training machinery")

    monkeypatch.setattr(Trainer, "fit", refuse)
    monkeypatch.setattr(ImageClassifier, "training_step", refuse)
    monkeypatch.setattr(ImageClassifier, "configure_optimizers", refuse)
    net, record = run([*SMALL, "--data.train_size", "16", "--trainer.max_steps", "4", "--out", str(tmp_path)])
    assert record["status"] == "ok" and record["loop"] == "accelerate"
    assert (record["timing"]["warmup_steps"], record["timing"]["measured_steps"]) == (2, 1), "2 + anatomy + 1"


if __name__ == "__main__":  # a rank under torchrun: train, then save this rank's final weights
    import os

    net, _ = run(sys.argv[2:])
    torch.save(net.state_dict(), Path(sys.argv[1]) / f"rank{os.environ['RANK']}.pt")


def test_the_next_version_follows_the_highest_as_lightning_numbers_runs(tmp_path):
    """After a lone version_3 (the others deleted), the next run is version_4, not the first number unused."""
    from types import SimpleNamespace

    from modelwright.loops.accelerate import next_version

    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, init_trackers=lambda name: None)
    (tmp_path / "version_3").mkdir()
    (tmp_path / "version_notes").mkdir()  # not a run's folder
    assert next_version(accelerator, tmp_path) == tmp_path / "version_4"
    assert next_version(accelerator, tmp_path) == tmp_path / "version_5"
    assert next_version(accelerator, tmp_path / "new") == tmp_path / "new" / "version_0"


@pytest.mark.parametrize(("interval", "val_every"), [(3, 3), (3.0, 3), (1.0, 10), (0.25, 2), (0.01, 1)])
def test_a_whole_float_validation_interval_counts_batches_as_lightning_reads_it(interval, val_every):
    """Lightning takes a whole float above 1 as a count of batches (3.0 is every 3 batches) and a fraction up to
    1 of the epoch's 10 batches (0.25: every 2; never under 1)."""
    from modelwright.loops.accelerate import _lengths
    from modelwright.train.args import TrainerArgs

    lengths = _lengths(TrainerArgs(max_epochs=1, val_check_interval=interval), train_length=10, val_length=4)
    assert lengths["val_every"] == val_every and lengths["train_batches"] == 10
