"""Stopping, resuming and requeueing as people do (issue #25): ``--ckpt_path last`` after a finished run or
past a run that never wrote a checkpoint, resuming with changed arguments, a full disk (as torch really
reports it, and on a real small filesystem), and DDP's sampler seed on resume."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from conftest import fit_args
from modelwright import record
from modelwright.train.cli import cli_main
from modelwright.train.resume import ResumableDataLoader

SMALL = ["--model.network", "SmallCNN", "--model.scheduler", "none"]  # 4 steps an epoch (32 samples, 8)


def _versions(log_dir: Path) -> list[str]:
    return sorted(path.name for path in log_dir.glob("base/version_*"))


def _checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def test_last_after_a_finished_run_is_complete_and_passes_over_a_run_without_checkpoint(tmp_path, capfd,
                                                                                          caplog):
    """Before: a finished run resumed with `last` made an empty version_1 and said `ok`; a second `last`
    then exited 2 because that version had no checkpoint."""
    one_epoch = fit_args(tmp_path, *SMALL, "--trainer.max_epochs", "1")
    assert cli_main(one_epoch) == 0
    capfd.readouterr()
    for _ in range(2):  # a requeued job, twice
        assert cli_main([*one_epoch, "--ckpt_path", "last"]) == 0
        lines = capfd.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "of a finished fit (epoch 1 of trainer.max_epochs 1, step 4)" in lines[0]
        assert _versions(tmp_path) == ["version_0"], "a finished run resumed makes no version"
    (tmp_path / "base" / "version_1").mkdir()  # a run killed before its first checkpoint
    assert cli_main([*one_epoch, "--ckpt_path", "last"]) == 0
    line = capfd.readouterr().err.strip()
    assert "version_0/checkpoints/last.ckpt (version_1 of " in line and "wrote no checkpoint)" in line
    with caplog.at_level("WARNING", logger="modelwright"):
        assert cli_main([*one_epoch, "--ckpt_path", "last", "--trainer.max_epochs", "2"]) == 0
    assert "(version_1 of" in caplog.text and "wrote no checkpoint); resuming it" in caplog.text
    assert _versions(tmp_path) == ["version_0", "version_1"], "the resumed run goes on in its own folder"
    resumed = _checkpoint(tmp_path / "base" / "version_0" / "checkpoints" / "last.ckpt")
    assert resumed["global_step"] == 8, "resumed version_0's 4 steps and trained epoch 1"


def test_resume_refuses_changed_arguments_naming_each_unless_allowed(tmp_path, capfd):
    """Before: LightningCLI silently put the checkpoint's model arguments over the new ones (lr 0.002, not
    0.1) and took the new batch size; a smallcnn checkpoint resumed as `resnet18` trained a smallcnn."""
    one_epoch = fit_args(tmp_path, *SMALL, "--trainer.max_epochs", "1")
    assert cli_main(one_epoch) == 0
    capfd.readouterr()
    changed = [*one_epoch, "--ckpt_path", "last", "--trainer.max_epochs", "2", "--model.lr", "0.1",
               "--data.batch_size", "4"]
    assert cli_main(changed) == 2
    (line,) = capfd.readouterr().err.strip().splitlines()
    assert "data.batch_size: 8 -> 4; model.lr: 0.002 -> 0.1;" in line
    assert "--allow_resume_changes true" in line
    assert "max_epochs" not in line, "how long to train may change on resume"
    assert cli_main([*one_epoch, "--ckpt_path", "last", "--model.network", "ResNet18"]) == 2
    (line,) = capfd.readouterr().err.strip().splitlines()
    assert "holds modelwright.train.models.SmallCNN weights, but model.network is " \
        "modelwright.train.models.ResNet18" in line
    assert _versions(tmp_path) == ["version_0"], "a refused resume makes no version"
    assert cli_main([*changed, "--allow_resume_changes", "true"]) == 0
    resumed = _checkpoint(tmp_path / "base" / "version_0" / "checkpoints" / "last.ckpt")
    assert resumed["hyper_parameters"]["lr"] == 0.1, "the given arguments, not the checkpoint's"
    assert resumed["datamodule_hyper_parameters"]["batch_size"] == 4


class _FullDisk:
    """A file that takes ``room`` bytes, then fails as a full disk does (ENOSPC)."""

    def __init__(self, file, room: int) -> None:
        self._file = file
        self._room = room

    def write(self, data) -> int:
        if len(data) > self._room:
            raise OSError(28, os.strerror(28))
        self._room -= len(data)
        return self._file.write(data)

    def __getattr__(self, name: str):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()


#: 24 steps: base.yaml's step checkpoint at step 16 (last-step.ckpt), then last.ckpt at the end.
TWO_CHECKPOINTS = [*SMALL, "--data.train_size", "64", "--trainer.max_epochs", "3"]


def _check_full_disk_run(log_dir: Path, status: int, stderr: str) -> None:
    """One line naming the checkpoint and ENOSPC, status 1, the previous checkpoint whole, a failed
    record."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert status == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: [Errno 28] No space left on device: "), errors
    assert errors[0].endswith("/last.ckpt'"), errors
    folder = log_dir / "base" / "version_0" / "checkpoints"
    assert sorted(path.name for path in folder.iterdir()) == ["last-step.ckpt"], "no temporary file left"
    assert _checkpoint(folder / "last-step.ckpt")["global_step"] == 16, "step 16's checkpoint is whole"
    run = json.loads((log_dir / "base" / "version_0" / "record.json").read_text())
    assert run["status"] == "failed" and "No space left on device" in run["error"]


def test_a_full_disk_as_torch_reports_it_is_one_line(tmp_path, capfd, monkeypatch):
    """torch.save on a full disk raises `RuntimeError: [enforce fail at inline_container.cc:...] . unexpected
    pos ...`, ENOSPC only in its context. Before: cli_main caught OSError alone, and the run ended in two
    tracebacks."""
    opened = []
    real_fdopen = os.fdopen

    def fdopen(fd, *args, **kwargs):
        file = real_fdopen(fd, *args, **kwargs)
        if ".ckpt." not in os.readlink(f"/proc/self/fd/{fd}"):
            return file
        opened.append(fd)
        return file if len(opened) == 1 else _FullDisk(file, room=4096)  # the second checkpoint fills it

    monkeypatch.setattr(record.os, "fdopen", fdopen)
    status = cli_main(fit_args(tmp_path, *TWO_CHECKPOINTS))
    _check_full_disk_run(tmp_path, status, capfd.readouterr().err)


@pytest.fixture
def small_filesystem(tmp_path):
    """A 10 MiB tmpfs: room for one smallcnn checkpoint (7 MB), not for the next beside it."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(mount_point)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"cannot mount a tmpfs here ({type(err).__name__}; CI runs as root)")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False, capture_output=True, timeout=30)


def test_a_real_full_disk_is_one_line_and_keeps_the_previous_checkpoint(small_filesystem, capfd):
    """Before: 87 lines of two tracebacks."""
    status = cli_main(fit_args(small_filesystem, *TWO_CHECKPOINTS))
    _check_full_disk_run(small_filesystem, status, capfd.readouterr().err)


def _loader(seed: int, rank: int) -> ResumableDataLoader:
    """Rank ``rank``'s loader of two, as Lightning builds it under DDP: a DistributedSampler seeded by the
    process's PL_GLOBAL_SEED."""
    data = TensorDataset(torch.arange(32))
    sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=seed)
    return ResumableDataLoader(data, batch_size=4, sampler=sampler, drop_last=True)


@pytest.mark.parametrize("rank", [0, 1])
def test_ddp_resume_under_another_seed_keeps_the_interrupted_runs_order(rank):
    """Before: the resumed process's DistributedSampler drew its permutation from the new seed, so the rest
    of the epoch and every later epoch differed from the uninterrupted run's."""
    whole = _loader(seed=0, rank=rank)
    epochs = []
    for epoch in (0, 1):
        whole.sampler.set_epoch(epoch)
        epochs.append([batch[0].tolist() for batch in whole])
    interrupted = _loader(seed=0, rank=rank)
    interrupted.sampler.set_epoch(0)
    batches = iter(interrupted)
    seen = [next(batches)[0].tolist(), next(batches)[0].tolist()]
    state = interrupted.state_dict()
    resumed = _loader(seed=7, rank=rank)  # seed_everything: true gave this launch another seed
    resumed.sampler.set_epoch(0)
    resumed.load_state_dict(state)
    rest = [batch[0].tolist() for batch in resumed]
    assert seen + rest == epochs[0]
    resumed.sampler.set_epoch(1)
    assert [batch[0].tolist() for batch in resumed] == epochs[1]


def _fit_checkpoint(epochs: int, steps: int) -> dict:
    return {"global_step": steps, "loops": {"fit_loop": {"epoch_progress": {"current": {"processed": epochs}}}}}


def test_a_fit_is_complete_at_either_limit_as_lightning_counts_them():
    """Complete at max_steps or at max_epochs, whichever the run set; an unset max_epochs is Lightning's 1000
    only when nothing else limits the fit."""
    from modelwright.train.checkpoints import completed

    assert completed(_fit_checkpoint(1, 20), {"max_steps": 20, "max_epochs": -1}) == "step 20 of trainer.max_steps 20"
    assert completed(_fit_checkpoint(1, 19), {"max_steps": 20, "max_epochs": -1}) is None
    assert completed(_fit_checkpoint(2, 64), {"max_steps": -1, "max_epochs": 2}).startswith("epoch 2 of")
    assert completed(_fit_checkpoint(1, 32), {"max_steps": -1, "max_epochs": 2}) is None
    assert completed(_fit_checkpoint(5, 160), {"max_steps": 200, "max_epochs": None}) is None  # epochs unlimited
    assert completed(_fit_checkpoint(999, 9), {"max_steps": -1, "max_epochs": None}) is None
    assert completed(_fit_checkpoint(1000, 9), {"max_steps": -1, "max_epochs": None}).startswith("epoch 1000 of")


def test_last_after_a_killed_run_of_the_same_job_starts_it_afresh_in_its_folder(tmp_path, caplog):
    """Issue 39. Before: version_0 finished, the same command was killed before its first checkpoint
    (version_1: its config.yaml, no checkpoint); `last` took version_0's checkpoint, said "nothing to resume"
    and exited 0: a requeued job reported success and its run was never done."""
    one_epoch = fit_args(tmp_path, *SMALL, "--trainer.max_epochs", "1")
    assert cli_main(one_epoch) == 0
    killed = tmp_path / "base" / "version_1"
    killed.mkdir()
    (killed / "config.yaml").write_bytes((tmp_path / "base" / "version_0" / "config.yaml").read_bytes())
    (killed / "record.json").write_text('{"status": "running"}')
    with caplog.at_level("WARNING", logger="modelwright"):
        assert cli_main([*one_epoch, "--ckpt_path", "last"]) == 0
    assert f"ckpt_path: 'last' is {killed}, a run of this job that wrote no checkpoint; starting it afresh " \
        "there" in caplog.text
    assert _versions(tmp_path) == ["version_0", "version_1"], "the killed run's folder, not a new one"
    assert _checkpoint(killed / "checkpoints" / "last.ckpt")["global_step"] == 4
    assert json.loads((killed / "record.json").read_text())["status"] == "ok"


def test_a_resume_continues_the_runs_own_folder_without_lightnings_dirpath_warning(tmp_path, recwarn):
    """Issue 39. Before: each resume was a new version folder (TensorBoard showed two runs), and Lightning
    warned "The dirpath has changed ... won't be reloaded" on every resume."""
    assert cli_main(fit_args(tmp_path, *SMALL, "--trainer.max_epochs", "1")) == 0
    run = tmp_path / "base" / "version_0"
    first_record = json.loads((run / "record.json").read_text())
    recwarn.clear()
    assert cli_main(fit_args(tmp_path, *SMALL, "--trainer.max_epochs", "2", "--ckpt_path", "last")) == 0
    about_checkpoints = [str(warning.message) for warning in recwarn if "irectory" in str(warning.message)
                         or "dirpath" in str(warning.message)]
    assert about_checkpoints == []
    assert _versions(tmp_path) == ["version_0"]
    assert _checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 8
    assert json.loads((run / "record.1.json").read_text()) == first_record, "the first part's record kept"
    assert json.loads((run / "record.json").read_text())["status"] == "ok"


def test_a_checkpoint_copied_out_of_its_run_still_refuses_other_trainer_arguments(tmp_path, capfd):
    """Issue 37. Before: the arguments were compared with the config.yaml beside the checkpoint, so a
    bf16-mixed checkpoint copied elsewhere resumed under 32-true without a word."""
    assert cli_main(fit_args(tmp_path, *SMALL, "--trainer.max_epochs", "1", "--trainer.precision",
                             "bf16-mixed")) == 0
    copied = tmp_path / "kept" / "model.ckpt"
    copied.parent.mkdir()
    copied.write_bytes((tmp_path / "base" / "version_0" / "checkpoints" / "last.ckpt").read_bytes())
    capfd.readouterr()
    resumed = fit_args(tmp_path, *SMALL, "--trainer.max_epochs", "2", "--ckpt_path", str(copied))
    assert cli_main(resumed) == 2
    (line,) = capfd.readouterr().err.strip().splitlines()
    assert "trainer.precision: 'bf16-mixed' -> '32-true'" in line
    assert _versions(tmp_path) == ["version_0"]


def test_last_without_a_logger_says_it_needs_the_loggers_folder(tmp_path, capfd):
    """Issue 37. Before: "ckpt_path: no checkpoint at last"."""
    assert cli_main(fit_args(tmp_path, *SMALL, "--trainer.logger", "false", "--ckpt_path", "last")) == 2
    (line,) = capfd.readouterr().err.strip().splitlines()
    assert line == ("error: ckpt_path: 'last' is the newest checkpoint of the logger's runs "
                    "(<save_dir>/<name>/version_N); with trainer.logger false there are none: name a "
                    "checkpoint file")
