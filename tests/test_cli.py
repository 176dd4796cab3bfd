"""The CLI end to end: every config trains, runs log what they should, config names resolve (the corpus of
bad inputs: tests/test_bad_inputs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, fit_args
from modelwright.record import read_record
from modelwright.train.cli import cli_main
from test_checkpoint_units import _zip

CONFIGS = sorted(path.name for path in (REPO_ROOT / "configs").glob("*.yaml"))
DISTRIBUTED = {"ddp.yaml", "fsdp2.yaml"}
GPU_ONLY = {"fsdp.yaml"}


def _versions(log_dir: Path) -> list[Path]:
    return sorted(log_dir.glob("*/version_*"))


#: What each experiment file applies, as the record states it (smallcnn: six conv blocks to checkpoint).
APPLIED = {
    "baseline.yaml": {"precision": "32-true", "accumulate_grad_batches": 1, "checkpointed_segments": 0},
    "amp.yaml": {"precision": "bf16-mixed", "accumulate_grad_batches": 1, "checkpointed_segments": 0},
    "accumulate.yaml": {"precision": "32-true", "accumulate_grad_batches": 4, "checkpointed_segments": 0},
    "checkpointing.yaml": {"precision": "32-true", "accumulate_grad_batches": 1, "checkpointed_segments": 6},
    "all.yaml": {"precision": "bf16-mixed", "accumulate_grad_batches": 4, "checkpointed_segments": 6},
}


@pytest.mark.parametrize("config", [name for name in CONFIGS if name not in DISTRIBUTED | GPU_ONLY])
def test_config_trains(config, tmp_path):
    """Each experiment file trains and checkpoints (the two-process ones: tests/test_distributed.py). The
    small CNN stands in for resnet18: the point is the file's techniques together, and bf16 is emulated on
    many CPUs."""
    rc = cli_main(fit_args(tmp_path, "--config", f"configs/{config}", "--trainer.max_steps", "2",
                           "--model.network", "SmallCNN"))
    assert rc == 0
    (version,) = _versions(tmp_path)
    assert (version / "config.yaml").is_file(), "the resolved config is saved beside the logs"
    assert list(version.glob("events.out.tfevents.*"))
    assert (version / "checkpoints" / "last.ckpt").is_file()
    # The file's techniques, as applied (read from the run, not the config).
    techniques = read_record(version / "record.json")["techniques"]
    expected = APPLIED.get(config, APPLIED["baseline.yaml"])
    applied = {key: techniques[key] for key in expected}
    assert applied == expected, f"{config}: {applied}"


def test_every_subcommand_is_listed_and_runs_though_a_run_builds_only_its_own(tmp_path, capsys):
    """A run builds the parser of the subcommand it names and no other (ModelwrightCLI.subcommands): ``--help``
    still lists all four, and ``validate`` still runs a validation."""
    with pytest.raises(SystemExit) as help_exit:
        cli_main(["--help"])
    assert help_exit.value.code == 0
    listed = capsys.readouterr().out
    assert all(f"    {name} " in listed for name in ("fit", "validate", "test", "predict")), listed
    args = fit_args(tmp_path, "--model.network", "SmallCNN")
    assert cli_main(["validate", *args[1:]]) == 0
    assert "val/acc" in capsys.readouterr().out


def test_checkpointing_switched_off_by_its_flag(tmp_path, caplog):
    """base.yaml lists ModelCheckpoint callbacks; `--trainer.enable_checkpointing false` alone switches them
    off."""
    rc = cli_main(fit_args(tmp_path, "--trainer.max_steps", "2", "--trainer.enable_checkpointing", "false"))
    assert rc == 0
    (version,) = _versions(tmp_path)
    assert not list(version.rglob("*.ckpt"))
    assert "ModelCheckpoint callback(s) of the config dropped" in caplog.text


def test_print_config_shows_the_merged_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", "configs/amp.yaml", "--print_config"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "precision: bf16-mixed" in out, "the delta file wins"
    assert "weight_decay: 0.05" in out and "class_path: modelwright.train.module.ImageClassifier" in out, \
        "base.yaml supplies the rest"


def test_precision_change_is_said_and_applied(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="modelwright"):
        rc = cli_main(fit_args(tmp_path, "--trainer.precision", "16-mixed", "--trainer.max_steps", "1",
                               "--model.network", "SmallCNN"))
    assert rc == 0
    assert "requested 16-mixed, running bf16-mixed" in caplog.text


def test_resume_from_last(tmp_path):
    # No schedule: a one-cycle schedule's length depends on max_epochs, which the resumed run changes.
    small = ["--model.network", "SmallCNN", "--model.scheduler", "none"]
    common = fit_args(tmp_path, *small, "--trainer.max_epochs", "1")
    assert cli_main(common) == 0
    # Another seed: a fresh start would initialise other weights and draw another data order.
    resume = [*common, "--trainer.max_epochs", "2", "--ckpt_path", "last", "--seed_everything", "7"]
    assert cli_main(resume) == 0
    (run,) = _versions(tmp_path)  # the resumed fit goes on in its run's folder
    resumed = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert resumed["global_step"] == 8, "resumed after epoch 0's 4 steps, ran 4"
    first_part = json.loads((run / "record.1.json").read_text())["history"]["train/loss"]
    history = json.loads((run / "record.json").read_text())["history"]["train/loss"]
    assert first_part[-1][0] < 4 < history[0][0], "the resumed part's history starts where the first stopped"
    uninterrupted = tmp_path / "whole"
    assert cli_main(fit_args(uninterrupted, *small, "--trainer.max_epochs", "2")) == 0
    (whole,) = _versions(uninterrupted)
    whole = torch.load(whole / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    for name, tensor in whole["state_dict"].items():
        same = torch.equal(tensor, resumed["state_dict"][name])
        assert same, f"{name}: the resume is not the uninterrupted run"


def test_bare_config_name_resolves_to_configs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", "amp.yaml", "--print_config"])
    assert exit_info.value.code == 0
    assert "precision: bf16-mixed" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", "accumulate", "--print_config"])
    assert "accumulate_grad_batches: 4" in capsys.readouterr().out


def test_unknown_config_name_lists_the_configs(capsys):
    assert cli_main(["fit", "--config", "ampp.yaml"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "'ampp.yaml'" in line and "amp.yaml" in line and "fsdp2.yaml" in line


@pytest.mark.parametrize("flag", ["--optimizer", "--lr_scheduler"])
def test_generic_optimizer_flags_point_to_the_model(flag, capsys):
    assert cli_main(["fit", flag, "Adam"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {flag[2:]}:") and "--model.optimizer" in line


def test_last_is_the_newest_loadable_checkpoint_of_the_latest_run_that_wrote_one(tmp_path):
    from modelwright.train.checkpoints import find_last_checkpoint

    nothing = find_last_checkpoint(tmp_path, {})
    assert nothing.path is None and nothing.skipped == [], "nothing to resume: `last` starts afresh"
    older = _zip(tmp_path / "version_0" / "checkpoints" / "last.ckpt")
    good = _zip(tmp_path / "version_1" / "checkpoints" / "last-step.ckpt")
    # a full disk left it empty, newer
    (tmp_path / "version_1" / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert find_last_checkpoint(tmp_path, {}) == (good, tmp_path / "version_1", [])
    (tmp_path / "version_2").mkdir()  # the latest run was killed before its first checkpoint
    (tmp_path / "version_10" / "checkpoints").mkdir(parents=True)  # and one after it too, numbered past 9
    passed_over = [tmp_path / "version_10", tmp_path / "version_2"]
    assert find_last_checkpoint(tmp_path, {}) == (good, tmp_path / "version_1", passed_over)
    assert older.is_file()


@pytest.mark.parametrize("name", sorted(path.stem for path in (REPO_ROOT / "configs").glob("*.yaml")
                                        if path.stem != "base"))
def test_each_experiment_logs_under_its_own_name(name):
    """Issue 39. Before: configs/baseline.yaml logged to lightning_logs/base/, beside every run of a config of
    one's own."""
    from modelwright.train.cli import resolved_config

    config = resolved_config(["fit", "--config", f"configs/{name}.yaml"])
    assert config["trainer"]["logger"]["init_args"]["name"] == name


def test_a_global_batch_is_split_over_the_processes_and_kept_in_the_config():
    """Issue 39. Before: DDP by the strategy flag alone doubled the global batch (each process kept
    data.batch_size), with no way to say the batch is the step's, over all processes."""
    from modelwright.errors import ConfigError
    from modelwright.train.cli import resolved_config

    ddp = ["fit", "--trainer.strategy", "ddp", "--trainer.devices", "2"]
    per_device = resolved_config(ddp)
    assert per_device["data"]["init_args"]["batch_size"] == 128 and "global_batch_size" not in per_device
    split = resolved_config([*ddp, "--global_batch_size", "128"])
    assert split["data"]["init_args"]["batch_size"] == 64 and split["global_batch_size"] == 128
    assert resolved_config(["fit", "--global_batch_size", "96"])["data"]["init_args"]["batch_size"] == 96
    with pytest.raises(ConfigError, match=r"^global_batch_size: 128 is not a multiple of the 3 processes "
                                          r"\(trainer.devices 3 × trainer.num_nodes 1\)"):
        resolved_config(["fit", "--trainer.strategy", "ddp", "--trainer.devices", "3", "--global_batch_size", "128"])


def test_the_global_batch_is_recorded_in_the_run(tmp_path):
    assert cli_main(fit_args(tmp_path, "--model.network", "SmallCNN", "--trainer.max_steps", "1",
                             "--global_batch_size", "4")) == 0
    (version,) = _versions(tmp_path)
    record = read_record(version / "record.json")
    assert record["config"]["global_batch_size"] == 4 and record["techniques"]["micro_batch_size"] == 4
