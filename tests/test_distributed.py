"""Distributed training on CPU: DDP and FSDP2 against one process, per-rank memory, two "nodes" over loopback.

One job runs three ways, each over the 16 samples of the training set per optimizer step: one process with
batch 16; ``configs/ddp.yaml`` as a two-machine job (two torchrun launchers with ``--nnodes 2`` meeting on
127.0.0.1, one process each, batch 8); ``configs/fsdp2.yaml`` with 2 processes started by Lightning,
batch 8. Because every step sees the whole set, the union of the two ranks' micro-batches is the single
process's batch whatever order the samplers draw, and with a mean-reduced loss the averaged gradients are
the same sum. The network is the ViT (LayerNorm): BatchNorm's batch statistics would differ between one
batch of 16 and two of 8, and SyncBatchNorm, which would make them agree, runs on GPUs only. The optimizer
is SGD with momentum, linear in the gradient, so the comparison measures the gradients rather than Adam's
``g / sqrt(v)`` near zero.

Every distributed run is a subprocess. Each rank saves its network's full weights through
:class:`SaveRankState`, which the subprocesses import from this file (``tests/`` is on their ``PYTHONPATH``).
Lightning's own launch of ``configs/ddp.yaml`` (``devices: 2`` on one machine) is exercised in
``tests/test_reliability.py`` (a failing rank ends the job).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from modelwright.measure import hardware_peak
from modelwright.record import read_record, read_records
from modelwright.train.cli import cli_main

REPO_ROOT = Path(__file__).resolve().parents[1]

# Final weights of two runs of the same job agree within |a - b| <= ATOL + RTOL * |b| (torch.testing.assert_close).
# Float sums in another order (per-rank means, then the all-reduce) differ in the last bits only.
ATOL = 1e-6
RTOL = 1e-5
# The 3 optimizer steps must move the weights far more than the tolerance, or agreeing would prove nothing.
MIN_TRAINED_CHANGE = 1e-3
# FSDP2 pads each parameter's first dimension to a multiple of the world size, and rank 0 holds the
# remainder of odd-sized ones (the ViT's class token and position embedding): its half is a little more.
HALF_MIN, HALF_MAX = 0.47, 0.53
STATE_KEYS = ("parameters", "gradients", "optimizer_state")
RUN_TIMEOUT_S = 420

JOB = [
    "--model.network", "SmallViT",
    "--model.optimizer", "sgd",
    "--model.scheduler", "none",
    "--model.lr", "0.05",
    "--data.train_size", "16",
    "--data.val_size", "16",
    "--trainer.max_steps", "3",
    "--trainer.max_epochs", "3",
    "--trainer.limit_val_batches", "0",
    "--trainer.log_every_n_steps", "1",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]


class SaveRankState(Callback):
    """Test helper: every rank writes ``<out_dir>/rank<global_rank>.pt`` at the end of ``fit``.

    The file holds the network's full (unsharded) weights at the start and at the end of training, and
    what the rank knew of the job: global rank, world size, node rank and number of nodes.

    Args:
        out_dir: folder for the files.
    """

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.initial: dict[str, torch.Tensor] = {}

    @staticmethod
    def _full_state(pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
        state = {}
        for key, value in pl_module.net.state_dict().items():
            # FSDP2 holds DTensor shards: full_tensor() all-gathers, so every rank runs it, in the same order.
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            state[key] = full.detach().cpu().clone()
        return state

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.initial = self._full_state(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        out = Path(self.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "global_rank": trainer.global_rank,
                "world_size": trainer.world_size,
                "node_rank": trainer.node_rank,
                "num_nodes": trainer.num_nodes,
                "initial": self.initial,
                "final": self._full_state(pl_module),
            },
            out / f"rank{trainer.global_rank}.pt",
        )


def _job_args(out_dir: Path, *config: str, batch_size: int, ranks_dir: Path | None = None) -> list[str]:
    """``fit`` arguments of the job; logs under ``out_dir/logs``, each rank's weights in ``ranks_dir``, and the
    job's ``records.jsonl`` beside that folder (one file for the two nodes of a job)."""
    ranks_dir = ranks_dir or out_dir / "ranks"
    # base.yaml's callbacks replaced: memory anatomy on step 1, the run record, each rank's weights, and the
    # last.ckpt a distributed run writes through base.yaml's checkpoint plugin (a folder of shards under FSDP2).
    callbacks = [
        {"class_path": "callbacks.run_monitor.RunMonitor",
         "init_args": {"warmup_steps": 1, "records_jsonl": str(ranks_dir.parent / "records.jsonl")}},
        {"class_path": "test_distributed.SaveRankState", "init_args": {"out_dir": str(ranks_dir)}},
        {"class_path": "callbacks.checkpoint.ModelCheckpoint", "init_args": {"save_last": True, "save_top_k": 0}},
    ]
    return [
        "fit", *config, *JOB, "--data.batch_size", str(batch_size),
        "--trainer.logger.init_args.save_dir", str(out_dir / "logs"), "--trainer.callbacks", json.dumps(callbacks),
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"  # two ranks share the cores
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("MODELWRIGHT_RUN_ID", None)
    return env


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        # A session of its own, so that a hung run's spawned ranks can be stopped with it.
        return subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _finish(procs: dict[Path, subprocess.Popen], timeout_s: float) -> None:
    """Wait for every process; on the first failure or at the timeout stop them all and fail with a log's tail."""
    deadline = time.monotonic() + timeout_s
    failed: Path | None = None
    while failed is None and any(proc.poll() is None for proc in procs.values()):
        failed = next((log for log, proc in procs.items() if proc.poll() not in (None, 0)), None)
        if time.monotonic() > deadline:
            failed = next(log for log, proc in procs.items() if proc.poll() is None)
        time.sleep(0.5)
    failed = failed or next((log for log, proc in procs.items() if proc.returncode != 0), None)
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session holds the ranks it spawned
            proc.wait()
    if failed is not None:
        pytest.fail(f"{failed} failed (exit {procs[failed].returncode}):\n{failed.read_text()[-3000:]}")


@functools.cache
def _ranks(ranks_dir: Path) -> list[dict]:
    files = sorted(ranks_dir.glob("rank*.pt"))
    return [torch.load(f, weights_only=True) for f in files]


@functools.cache
def _record(out_dir: Path) -> dict:
    (path,) = (out_dir / "logs").glob("*/version_*/record.json")
    return json.loads(path.read_text())


def _assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=ATOL, rtol=RTOL, msg=lambda m, k=key: f"{k}: {m}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_node(node_rank: int, port: int) -> list[str]:
    """One machine's launcher of a 2-machine job with one process per machine, meeting at 127.0.0.1:``port``."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node_rank),
        "--master_addr", "127.0.0.1", "--master_port", str(port),
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The job run three ways, side by side; each entry is a folder with ``ranks/`` and ``logs/``.

    * ``single``: one process, batch 16 (in this process);
    * ``ddp``: ``configs/ddp.yaml`` on two "nodes" of one process each, batch 8: two torchrun launchers
      with ``--nnodes 2`` on this machine, the way a multi-machine job starts (``node0/logs``, ``node1/logs``);
    * ``fsdp2``: ``configs/fsdp2.yaml``, 2 processes started by Lightning, batch 8.
    """
    root = tmp_path_factory.mktemp("distributed")
    dirs = {name: root / name for name in ("single", "ddp", "fsdp2")}
    procs = {}
    port = _free_port()
    for node_rank in (0, 1):
        node_dir = dirs["ddp"] / f"node{node_rank}"
        # Each node logs on its own; both write their weights to one folder, by global rank.
        args = _job_args(node_dir, "--config", "configs/ddp.yaml", batch_size=8, ranks_dir=dirs["ddp"] / "ranks")
        args += ["--trainer.num_nodes", "2", "--trainer.devices", "1"]
        procs[node_dir / "run.log"] = _start([*_torchrun_node(node_rank, port), "main.py", *args], node_dir / "run.log")
    fsdp2 = [sys.executable, "main.py", *_job_args(dirs["fsdp2"], "--config", "configs/fsdp2.yaml", batch_size=8)]
    procs[dirs["fsdp2"] / "run.log"] = _start(fsdp2, dirs["fsdp2"] / "run.log")
    try:
        assert cli_main(_job_args(dirs["single"], batch_size=16)) == 0
    finally:
        _finish(procs, RUN_TIMEOUT_S)
    return dirs


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_of_half_the_batch_reach_the_weights_of_one_process(runs, strategy):
    (single,) = _ranks(runs["single"] / "ranks")
    ranks = _ranks(runs[strategy] / "ranks")
    assert [(r["global_rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]
    reference = single["final"]
    trained = max((reference[k] - single["initial"][k]).abs().max().item() for k in reference)
    assert trained > MIN_TRAINED_CHANGE
    for rank in ranks:
        _assert_same_weights(rank["initial"], single["initial"])
        _assert_same_weights(rank["final"], reference)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_per_rank_state_memory_halves_under_fsdp2_and_stays_flat_under_ddp(runs):
    single, ddp, fsdp2 = (_record(path) for path in (runs["single"], runs["ddp"] / "node0", runs["fsdp2"]))
    assert (ddp["techniques"]["strategy"], ddp["techniques"]["world_size"]) == ("ddp", 2)
    assert (fsdp2["techniques"]["strategy"], fsdp2["techniques"]["world_size"]) == ("model_parallel", 2)
    # base.yaml asks for channels_last; fully_shard takes contiguous parameters only, so FSDP2 runs NCHW and says so
    assert single["techniques"]["channels_last"] is True and fsdp2["techniques"]["channels_last"] is False
    # Rank 0's tensors once the captured step is over: what a rank keeps between steps.
    base = single["memory"]["anatomy_end_mib"]
    kept = [key for key in STATE_KEYS if key != "gradients"]
    assert all(base[key] > 0 for key in kept)
    # Gradients are freed right after the optimizer step, on every rank under every strategy.
    assert all(r["memory"]["anatomy_end_mib"]["gradients"] < 0.01 for r in (single, ddp, fsdp2))
    for key in kept:
        assert ddp["memory"]["anatomy_end_mib"][key] == pytest.approx(base[key], rel=0.01), key
        assert HALF_MIN <= fsdp2["memory"]["anatomy_end_mib"][key] / base[key] <= HALF_MAX, key
    # At the step's peak: optimizer state stays sharded; parameters also count the block(s)
    # FSDP2 has all-gathered for their forward or backward, so they exceed the shard.
    peak, ddp_peak, fsdp2_peak = (r["memory"]["anatomy_mib"] for r in (single, ddp, fsdp2))
    # (Gradients at the peak are a few KiB: with gradients freed after each step, the peak comes before backward
    # has made more than the first.)
    for key in ("optimizer_state",):
        assert ddp_peak[key] == pytest.approx(peak[key], rel=0.01), key
        assert HALF_MIN <= fsdp2_peak[key] / peak[key] <= HALF_MAX, key
    assert fsdp2_peak["parameters"] > fsdp2["memory"]["anatomy_end_mib"]["parameters"]
    # DDP's gradient buckets (4 B a parameter, kept between steps) are communication buffers, not activations or
    # temporaries: a rank's activations are exactly half the one process's (half the batch), its temporaries small.
    params = base["parameters"]
    assert peak["comm_buffers"] == 0
    for view in (ddp_peak, ddp["memory"]["anatomy_end_mib"]):
        assert view["comm_buffers"] == pytest.approx(params, rel=0.01)
    assert ddp_peak["activations"] == pytest.approx(peak["activations"] / 2, rel=0.01)
    assert ddp_peak["temporaries"] < 0.5 * params
    assert ddp["memory"]["anatomy_end_mib"]["activations"] + ddp["memory"]["anatomy_end_mib"]["temporaries"] < 1


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_global_rank_zero_alone_writes_the_record(runs, strategy):
    """One line in the job's records.jsonl, whether torchrun started the ranks on two "nodes" (DDP) or Lightning
    started them (FSDP2), and a whole record: the job's batch, the timed steps, the memory, the peak, TensorBoard."""
    records = read_records(runs[strategy] / "records.jsonl", validate=True)
    assert len(records) == 1
    (path,) = runs[strategy].glob("**/logs/*/version_*/record.json")
    record = read_record(path)
    assert record["run_id"] == records[0]["run_id"]
    tech = record["techniques"]
    assert (tech["world_size"], tech["micro_batch_size"], tech["effective_batch_size"]) == (2, 8, 16)
    assert record["timing"]["measured_steps"] == 1  # 3 steps: 1 warm-up, then the memory anatomy's (not timed)
    assert record["memory"]["anatomy_mib"]["activations"] > 0
    assert record["flops"]["peak_flops_source"] == hardware_peak("cpu", torch.float32).source
    events = EventAccumulator(str(path.parent))
    events.Reload()
    assert "perf/step_time_ms" in events.Tags()["scalars"]


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_flops_are_counted_under_every_strategy(runs):
    """A rank's step is half the batch: half the FLOPs of one process's, FSDP2's sharded network included."""
    single, ddp, fsdp2 = (_record(path)["flops"] for path in (runs["single"], runs["ddp"] / "node0", runs["fsdp2"]))
    assert single["flops_per_step"] > 0
    for flops in (ddp, fsdp2):
        assert flops["flops_per_step"] * 2 == single["flops_per_step"]
        assert flops["mfu"] is not None and 0 < flops["mfu"] < 1


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_two_nodes_over_loopback_train_as_one_job(runs):
    """The two torchrun launchers (``--nnodes 2``) met on 127.0.0.1 and trained one job of world size 2."""
    ranks = _ranks(runs["ddp"] / "ranks")
    assert [(r["global_rank"], r["node_rank"], r["world_size"], r["num_nodes"]) for r in ranks] == [
        (0, 0, 2, 2),
        (1, 1, 2, 2),
    ]
    for key, value in ranks[0]["final"].items():
        assert torch.equal(ranks[1]["final"][key], value), key
    record = _record(runs["ddp"] / "node0")  # global rank 0 alone writes the record
    assert (record["techniques"]["world_size"], record["techniques"]["num_nodes"]) == (2, 2)
    assert not list((runs["ddp"] / "node1" / "logs").glob("*/version_*/record.json"))
    # Identical weights alone would not prove one job (two separate jobs with one seed agree too): the world
    # size above does, and so do the weights matching the one-process batch-16 run (the "ddp" case above),
    # which a separate batch-8 job, taking 2 steps per epoch on half the set each, would miss.


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_distributed_runs_checkpoint_once(runs):
    """configs/ddp.yaml writes one last.ckpt file (global rank 0); configs/fsdp2.yaml a folder of shards."""
    (ddp,) = (runs["ddp"] / "node0" / "logs").glob("*/version_*/checkpoints/last.ckpt")
    assert ddp.is_file() and torch.load(ddp, weights_only=False)["global_step"] == 3
    assert not list((runs["ddp"] / "node1" / "logs").glob("*/version_*/checkpoints/*"))
    (fsdp2,) = (runs["fsdp2"] / "logs").glob("*/version_*/checkpoints/last.ckpt")
    assert fsdp2.is_dir() and len(list(fsdp2.glob("*.distcp"))) == 2


def test_fsdp_config_carries_per_block_wrapping_and_checkpointing(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", "configs/fsdp.yaml", "--print_config"])
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning.pytorch.strategies.FSDPStrategy"
    blocks = {
        "torchvision.models.resnet.BasicBlock",
        "torchvision.models.vision_transformer.EncoderBlock",
        "modelwright.train.models.ConvBlock",
    }
    assert set(strategy["init_args"]["auto_wrap_policy"]) == blocks
    assert set(strategy["init_args"]["activation_checkpointing_policy"]) == blocks
    assert config["trainer"]["devices"] == 2


def test_fsdp_on_cpu_is_one_line_pointing_to_fsdp2(capsys):
    code = cli_main(["fit", "--config", "configs/fsdp.yaml", "--trainer.accelerator", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert "trainer.strategy" in err and "configs/fsdp2.yaml" in err


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_fsdp_config_trains_on_two_gpus(tmp_path):
    args = [
        "fit", "--config", "configs/fsdp.yaml", "--model.network", "ResNet18", "--data.batch_size", "8",
        "--data.train_size", "64", "--data.val_size", "16", "--trainer.max_steps", "3",
        "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_checkpointing", "false", "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
    ]
    _finish({tmp_path / "run.log": _start([sys.executable, "main.py", *args], tmp_path / "run.log")}, RUN_TIMEOUT_S)
    record = _record(tmp_path)
    assert record["status"] == "ok"
    assert (record["techniques"]["strategy"], record["techniques"]["world_size"]) == ("fsdp", 2)
