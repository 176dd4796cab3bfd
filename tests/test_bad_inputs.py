"""A corpus of bad inputs through every entry point: ``main.py fit`` (cli_main), ``python -m modelwright
study``, ``plan``, ``report`` and ``accelerate`` (modelwright.__main__.main), all in this process. Each must
exit with status 2 and one line on stderr that names the key or the file, print no traceback and nothing
else, and leave nothing behind: no version folder, no record, no partial file."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from cifar_fixture import trust_fixture, write_tiny_cifar10
from conftest import REPO_ROOT, fit_args
from modelwright.__main__ import main as tool_main
from modelwright.train.cli import cli_main

SMALL = ["--model.network", "SmallCNN", "--trainer.max_steps", "2"]

#: name → (extra fit arguments, what the one line must name). ``{tmp}`` is the test's folder.
FIT = {
    # files given as configs
    "missing config": (["--config", "{tmp}/nothing.yaml"], "nothing.yaml"),
    "mistyped config name": (["--config", "ampp"], "'ampp'"),
    "config is a folder": (["--config", "{tmp}/folder"], "folder"),
    "invalid YAML": (["--config", "{tmp}/broken.yaml"], "broken.yaml"),
    "duplicated key": (["--config", "{tmp}/duplicated.yaml"], "duplicated.yaml: key 'lr' appears twice"),
    "empty config": (["--config", "{tmp}/empty.yaml"], "empty.yaml is empty"),
    "a section left null": (["--config", "{tmp}/null_trainer.yaml"], "null_trainer.yaml: trainer: null"),
    "a list, not a mapping": (["--config", "{tmp}/list.yaml"], "list.yaml"),
    "unknown key in a file": (["--config", "{tmp}/typo.yaml"], "model_nam"),
    # values mistyped on the command line
    "unknown key": (["--model.learning_rate", "0.1"], "model.learning_rate"),
    "singular max_epoch": (["--trainer.max_epoch", "3"], "trainer.max_epoch"),
    "wrong type": (["--data.batch_size", "many"], "data.batch_size"),
    "fractional batch": (["--data.batch_size", "8.5"], "data.batch_size"),
    "unknown model": (["--model.model_name", "resnet"], "model.model_name"),
    "unknown precision": (["--trainer.precision", "17-mixed"], "trainer.precision"),
    "unknown malloc mode": (["--cpu_malloc", "fast"], "cpu_malloc"),
    "generic optimizer flag": (["--optimizer", "Adam"], "--model.lr"),
    "generic optimizer's argument": (["--optimizer.lr", "0.1"], "optimizer.lr: not used here; the learning rate "
                                     "is --model.lr"),
    "generic schedule's argument": (["--lr_scheduler.T_max", "4"], "lr_scheduler.T_max: not used here"),
    "negative lr": (["--model.lr", "-0.1"], "model.lr"),
    "infinite lr": (["--model.lr", "1e999"], "model.lr: must be a finite number, got inf"),
    "infinite noise": (["--data.noise", "1e999"], "data.noise: must be a finite number, got inf"),
    "infinite clip": (["--trainer.gradient_clip_val", "1e999"], "trainer.gradient_clip_val: must be a finite"),
    "NaN in a file": (["--config", "{tmp}/nan.yaml"], "model.weight_decay: must be a finite number, got nan"),
    "infinity in a callback": (["--config", "{tmp}/inf_callback.yaml"],
                               "trainer.callbacks[0].init_args.min_interval_s: must be a finite number"),
    "granularity the model lacks": (["--model.network", "SmallViT", "--model.gradient_checkpointing", "stage"],
                                    "model.gradient_checkpointing"),
    "zero validation size": (["--data.val_size", "0"], "data.val_size"),
    # values Lightning refuses, or accepts and then breaks on
    "accumulate 0": (["--trainer.accumulate_grad_batches", "0"], "trainer.accumulate_grad_batches"),
    "accumulate -1": (["--trainer.accumulate_grad_batches", "-1"], "trainer.accumulate_grad_batches"),
    "negative batch": (["--data.batch_size", "-8"], "data.batch_size"),
    "max_steps -2": (["--trainer.max_steps", "-2"], "trainer.max_steps"),
    "negative clip": (["--trainer.gradient_clip_val", "-1"], "trainer.gradient_clip_val"),
    "validation every 0 epochs": (["--trainer.check_val_every_n_epoch", "0"],
                                  "trainer.check_val_every_n_epoch"),
    "devices 0": (["--trainer.devices", "0"], "trainer.devices"),
    "num_nodes 0": (["--trainer.num_nodes", "0"], "trainer.num_nodes"),
    "limit_train_batches 1.5": (["--trainer.limit_train_batches", "1.5"], "trainer.limit_train_batches"),
    "max_epochs -2": (["--trainer.max_epochs", "-2"], "trainer.max_epochs"),
    "never ends": (["--trainer.max_epochs", "-1", "--trainer.max_steps", "-1"], "trainer.max_epochs"),
    "validation interval past the epoch": (["--trainer.val_check_interval", "1000"],
                                           "trainer.val_check_interval"),
    "validation interval past an accumulated epoch": (
        ["--trainer.accumulate_grad_batches", "2", "--trainer.val_check_interval", "5"],
        "trainer.val_check_interval"),
    "validation interval 0": (["--trainer.val_check_interval", "0"], "trainer.val_check_interval"),
    "fsdp on cpu": (["--trainer.strategy", "fsdp", "--trainer.accelerator", "cpu"], "trainer.strategy"),
    "two machines, no launcher": (["--trainer.num_nodes", "2"], "trainer.num_nodes"),
    # runs that would train nothing
    "max_epochs 0": (["--trainer.max_epochs", "0"], "trainer.max_epochs"),
    "max_steps 0": (["--trainer.max_steps", "0"], "trainer.max_steps"),
    "limit_train_batches 0": (["--trainer.limit_train_batches", "0"], "trainer.limit_train_batches"),
    "a fraction that leaves no batch": (["--trainer.limit_train_batches", "0.1"],
                                        "trainer.limit_train_batches"),
    "batch larger than the dataset": (["--data.batch_size", "64"], "data.train_size"),
    "train set smaller than one batch per process": (
        ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--data.train_size", "12"],
        "data.train_size"),
    # folders and files the run reads or writes
    "log folder under a file": (["--trainer.logger.init_args.save_dir", "{tmp}/a-file/logs"], "save_dir"),
    # the folder's parent passes the access check, but no folder can be made there
    "log folder name too long": (["--trainer.logger.init_args.save_dir", "{tmp}/" + "x" * 300 + "/logs"],
                                 "trainer.logger.init_args.save_dir: cannot create"),
    "no CIFAR-10 files": (["--data.dataset", "cifar10", "--data.data_dir", "{tmp}/folder"], "data.data_dir"),
    "corrupt CIFAR-10 batch": (["--data.dataset", "cifar10", "--data.data_dir", "{tmp}/cifar"],
                               "data_batch_3"),
    "CIFAR-10 download into a file": (["--data.dataset", "cifar10", "--data.download", "true",
                                       "--data.data_dir", "{tmp}/a-file"], "data.data_dir"),
    "missing checkpoint": (["--ckpt_path", "{tmp}/nothing.ckpt"], "nothing.ckpt"),
    "checkpoint is a folder": (["--ckpt_path", "{tmp}/folder"], "folder"),
    "empty checkpoint": (["--ckpt_path", "{tmp}/empty.ckpt"], "empty.ckpt"),
    "truncated checkpoint": (["--ckpt_path", "{tmp}/corrupt.ckpt"], "corrupt.ckpt"),
    "zip that is no checkpoint": (["--ckpt_path", "{tmp}/archive.ckpt"], "archive.ckpt"),
    "plain state_dict": (["--ckpt_path", "{tmp}/state_dict.ckpt"], "state_dict.ckpt"),
    "checkpoint of another architecture": (["--ckpt_path", "{tmp}/resnet18.ckpt"], "resnet18"),
}
if os.geteuid() == 0 and Path("/proc/self").is_dir():  # root passes the access check of /proc, then mkdir fails
    FIT["log folder under /proc"] = (["--trainer.logger.init_args.save_dir", "/proc/modelwright-logs"],
                                     "trainer.logger.init_args.save_dir: cannot create /proc/modelwright-logs")
if not torch.cuda.is_available():
    FIT["gpu on a machine without one"] = (["--trainer.accelerator", "gpu"], "trainer.accelerator: ")

#: name → (tool arguments, what the one line must name). The study gets results and work folders of the
#: test's (``STUDY``), the Accelerate loop an ``--out`` folder.
TOOLS = {
    "study: missing plan": (["study", "--plan", "{tmp}/nothing.yaml"], "nothing.yaml"),
    "study: plan is a folder": (["study", "--plan", "{tmp}/folder"], "folder"),
    "study: plan with a duplicated key": (["study", "--plan", "{tmp}/twice.yaml"],
                                          "twice.yaml: key 'runs' appears twice"),
    "study: empty plan": (["study", "--plan", "{tmp}/empty.yaml"], "empty.yaml is empty"),
    "study: results is a file": (["study", "--plan", "{tmp}/plan.yaml", "--results", "{tmp}/a-file"],
                                 "results"),
    "study: workdir under a file": (["study", "--plan", "{tmp}/plan.yaml", "--workdir", "{tmp}/a-file/work"],
                                    "workdir"),
    "study: missing readme": (["study", "--plan", "{tmp}/plan.yaml", "--readme", "{tmp}/README.md"],
                              "README.md"),
    "study: unknown run": (["study", "--plan", "{tmp}/plan.yaml", "--only", "[baselin]"], "baselin"),
    "study: batch 0 for every run": (["study", "--plan", "{tmp}/plan.yaml", "--overrides",
                                      '{"data.batch_size": 0}'], "data.batch_size"),
    "study: an override's unknown key": (["study", "--plan", "{tmp}/plan.yaml", "--overrides",
                                          '{"model.learning_rate": 0.1}'], "model.learning_rate"),
    "study: zero repeats": (["study", "--plan", "{tmp}/plan.yaml", "--repeats", "0"],
                            "repeats: invalid value '0'"),
    "study: a slug with a slash": (["study", "--plan", "{tmp}/plan.yaml", "--slug", "a/b"], "slug"),
    "study: an infinite budget": (["study", "--plan", "{tmp}/plan.yaml", "--budget_gib", "1e999"],
                                  "budget_gib: must be a finite number, got inf"),
    "study: an infinite lr for every run": (["study", "--plan", "{tmp}/plan.yaml", "--overrides",
                                             '{"model.lr": 1e999}'], "runs.baseline: model.lr: "),
    "report: missing results": (["report", "--results", "{tmp}/nothing"], "nothing"),
    "report: results is a file": (["report", "--results", "{tmp}/a-file"], "a-file"),
    "report: missing readme": (["report", "--results", "{tmp}/results", "--readme", "{tmp}/README.md"],
                               "README.md"),
    "report: readme is a folder": (["report", "--results", "{tmp}/results", "--readme", "{tmp}/folder"],
                                   "folder"),
    "plan: missing record": (["plan", "--record", "{tmp}/nothing.jsonl"], "nothing.jsonl"),
    "plan: record is a folder": (["plan", "--record", "{tmp}/folder"], "folder"),
    "plan: unknown device": (["plan", "--record", "{tmp}/results/cpu-x/records.jsonl", "--device", "H1000"],
                             "device"),
    "plan: negative budget": (["plan", "--budget_gib", "-1"], "budget_gib"),
    "accelerate: devices 0": (["accelerate", "--trainer.devices", "0"], "trainer.devices"),
    "accelerate: validation interval 0": (["accelerate", "--trainer.val_check_interval", "0"],
                                          "trainer.val_check_interval"),
    "accelerate: max_epochs 0": (["accelerate", "--trainer.max_epochs", "0"], "trainer.max_epochs"),
    "accelerate: batch larger than the dataset": (["accelerate", "--data.batch_size", "64"],
                                                  "data.train_size"),
    "accelerate: limit_train_batches 0": (["accelerate", "--trainer.limit_train_batches", "0"],
                                          "trainer.limit_train_batches"),
    "accelerate: two machines, no launcher": (["accelerate", "--trainer.num_nodes", "2"],
                                              "trainer.num_nodes"),
    "accelerate: duplicated key": (["accelerate", "--config", "{tmp}/duplicated.yaml"], "duplicated.yaml"),
    "accelerate: empty config": (["accelerate", "--config", "{tmp}/empty.yaml"], "empty.yaml"),
    "accelerate: out is a file": (["accelerate", "--out", "{tmp}/a-file"], "out"),
    "accelerate: never ends": (["accelerate", "--trainer.max_epochs", "-1", "--trainer.max_steps", "-1"],
                               "trainer.max_epochs"),
}
STUDY = ["--slug", "cpu-test", "--accelerator", "cpu", "--results", "{tmp}/results", "--workdir",
         "{tmp}/work", "--readme", "null", "--dry_run", "true"]
ACCELERATE = ["--model.network", "SmallCNN", "--data.batch_size", "8", "--data.train_size", "32",
              "--data.val_size", "16", "--trainer.max_steps", "2", "--out", "{tmp}/out"]


def _lightning_checkpoint(path: Path, model_name: str) -> None:
    """What a Lightning checkpoint of ImageClassifier carries, without its weights."""
    torch.save({"pytorch-lightning_version": "2.6.6", "epoch": 0, "global_step": 4, "state_dict": {},
                "hyper_parameters": {"model_name": model_name, "num_classes": 10}}, path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """The files and folders the corpus names."""
    root = tmp_path_factory.mktemp("inputs")
    texts = {"broken.yaml": "model: [unclosed\n", "duplicated.yaml": "model:\n  lr: 0.1\n  lr: 0.2\n",
             "empty.yaml": "", "null_trainer.yaml": "trainer: null\n", "list.yaml": "- model\n",
             "typo.yaml": "model:\n  model_nam: smallcnn\n", "nan.yaml": "model:\n  weight_decay: .nan\n",
             "inf_callback.yaml": "trainer:\n  callbacks:\n    - class_path: "
                                  "callbacks.progress_bar.ThrottledProgressBar\n"
                                  "      init_args: {min_interval_s: .inf}\n",
             "a-file": "a file where a folder should be\n",
             "plan.yaml": "model: smallcnn\nruns:\n  - {name: baseline, config: configs/baseline.yaml}\n",
             "twice.yaml": "runs:\n  - {name: a}\nruns:\n  - {name: b}\n"}
    for name, text in texts.items():
        (root / name).write_text(text)
    (root / "folder").mkdir()
    (root / "empty.ckpt").write_bytes(b"")
    (root / "corrupt.ckpt").write_bytes(b"PK\x03\x04 not really a checkpoint")
    with zipfile.ZipFile(root / "archive.ckpt", "w") as archive:
        archive.writestr("notes.txt", "a zip, not a checkpoint")
    torch.save({"weight": torch.zeros(2)}, root / "state_dict.ckpt")
    _lightning_checkpoint(root / "resnet18.ckpt", "resnet18")
    records = root / "results" / "cpu-x" / "records.jsonl"
    records.parent.mkdir(parents=True)
    records.write_text(json.dumps({"run_id": "x", "status": "ok"}) + "\n")
    return root


@pytest.fixture
def cifar(inputs, monkeypatch) -> None:
    """A CIFAR-10 folder whose third training batch is damaged (torchvision's MD5s are the fixture's)."""
    folder = inputs / "cifar"
    if not folder.exists():
        checksums = write_tiny_cifar10(folder, per_batch=8)
        (folder / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"\x80\x02 cut short")
        (inputs / "cifar-md5.json").write_text(json.dumps(checksums))
    trust_fixture(monkeypatch, json.loads((inputs / "cifar-md5.json").read_text()))


def _tree(root: Path) -> set[str]:
    return {path.relative_to(root).as_posix() for path in root.rglob("*")}


def _fill(args: list[str], folder: Path) -> list[str]:
    return [arg.replace("{tmp}", str(folder)) for arg in args]


def _check_refused(status: int, captured, needle: str) -> None:
    lines = captured.err.strip().splitlines()
    assert status == 2, captured.err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert needle in lines[0], lines[0]
    assert "Traceback" not in captured.out + captured.err
    assert captured.out == "", captured.out


@pytest.mark.parametrize("case", FIT, ids=list(FIT))
def test_fit_refuses_in_one_line_and_leaves_nothing(case, inputs, cifar, tmp_path, capfd):
    args, needle = FIT[case]
    before = _tree(inputs)
    status = cli_main(fit_args(tmp_path / "logs", *SMALL, *_fill(args, inputs)))
    _check_refused(status, capfd.readouterr(), needle)
    assert not (tmp_path / "logs").exists(), "a refused run leaves no log folder"
    assert _tree(inputs) == before


@pytest.mark.parametrize("case", TOOLS, ids=list(TOOLS))
def test_tools_refuse_in_one_line_and_leave_nothing(case, inputs, tmp_path, capfd, monkeypatch):
    args, needle = TOOLS[case]
    monkeypatch.chdir(tmp_path)  # a tool's default folders (results/, lightning_logs/) land here, if anywhere
    extra = {"study": STUDY, "accelerate": ACCELERATE}.get(args[0], [])
    before = _tree(inputs)
    status = tool_main(_fill([args[0], *extra, *args[1:]], inputs))
    _check_refused(status, capfd.readouterr(), needle)
    assert _tree(inputs) == before, "a refused tool writes nothing"
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_a_refused_run_prints_none_of_lightnings_startup_lines(tmp_path, subprocess_env):
    """As a user runs it (no pytest logging): Lightning's "Seed set to 0", "GPU available ..." and "TPU
    available ..." come only once the run is known to be valid, so a refusal by the Trainer is one line."""
    args = fit_args(tmp_path, *SMALL, "--trainer.limit_train_batches", "1.5")
    done = subprocess.run([sys.executable, "main.py", *args], cwd=REPO_ROOT, env=subprocess_env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: trainer.limit_train_batches: 1.5 is neither a fraction up to 1 nor a whole number of batches"]
    assert done.stdout == "" and not list(tmp_path.iterdir())


#: Every numeric key of a training config, at its bounds: (values just inside, accepted; values just outside,
#: refused naming the key). The keys come from the sections' own lists (the fields of ModelArgs, DataArgs and
#: TrainerArgs, RunMonitor's arguments), so a new one without bounds here fails the test.
BOUNDS = {
    "model.num_classes": ([2, None], [1, 0]),
    "model.lr": ([1e-9, 10.0], [0.0, -1e-9]),
    "model.momentum": ([0.0, 0.999], [-1e-9, 1.0]),
    "model.weight_decay": ([0.0, 1.0], [-1e-9]),
    "model.label_smoothing": ([0.0, 0.999], [-1e-9, 1.0]),
    "data.batch_size": ([1], [0]),
    "data.num_workers": ([0], [-1]),
    "data.train_size": ([1], [0]),
    "data.val_size": ([1], [0]),
    "data.noise": ([0.0], [-1e-9]),
    "data.seed": ([0, -1, 2**32], []),  # any integer: the synthetic set's generator seed
    "data.image_size": ([1], [0]),
    "data.channels": ([1], [0]),
    "trainer.accumulate_grad_batches": ([1], [0]),
    "trainer.max_epochs": ([None, -1, 1], [0, -2]),
    "trainer.max_steps": ([-1, 1], [0, -2]),
    "trainer.limit_train_batches": ([None, 1, 0.01, 1.0, 2.0], [0, 0.0, -1, 1.5]),
    "trainer.limit_val_batches": ([None, 0, 0.0, 1.0, 2], [-1, 1.5]),
    "trainer.check_val_every_n_epoch": ([None, 1], [0]),
    "trainer.val_check_interval": ([1, 0.01, 1.0, 2.0], [0, 0.0, -1, 1.5]),
    "trainer.log_every_n_steps": ([1], [0]),
    "trainer.gradient_clip_val": ([None, 0, 0.0], [-1e-9]),
    "trainer.devices": ([1, -1, "auto", [0], "0,"], [0, -2, [], "0"]),
    "trainer.num_nodes": ([1], [0]),
    "trainer.num_sanity_val_steps": ([None, -1, 0, 2], [-2]),  # -1: every validation batch
    "run_monitor.warmup_steps": ([0], [-1]),
    "run_monitor.measure_steps": ([None, 1], [0]),
    "run_monitor.anatomy_step": ([None, 0], [-1]),
    "run_monitor.peak_flops_per_s": ([None, 1e-9], [0.0, -1.0]),
    "run_monitor.max_skipped_steps": ([None, 0], [-1]),
    "run_monitor.log_every_n_steps": ([None, 1], [0]),
}
#: Numeric by type, but a name from a table (refused by name: "unknown precision" above).
NAMED = {"trainer.precision"}


def _numeric_keys() -> list[str]:
    import typing
    from dataclasses import fields

    from callbacks.run_monitor import RunMonitor
    from modelwright.train.args import DataArgs, ModelArgs, TrainerArgs

    def numeric(hint) -> bool:
        return bool({int, float} & set(typing.get_args(hint) or (hint,)))

    keys = []
    for section, cls in (("model", ModelArgs), ("data", DataArgs), ("trainer", TrainerArgs)):
        hints = typing.get_type_hints(cls)
        keys += [f"{section}.{field.name}" for field in fields(cls) if numeric(hints[field.name])]
    hints = typing.get_type_hints(RunMonitor.__init__)
    return keys + [f"run_monitor.{name}" for name, hint in hints.items() if name != "return" and numeric(hint)]


def _check_value(key: str, value) -> None:
    """``value`` for ``key`` through the check that ``main.py fit`` and the Accelerate loop run for it."""
    from dataclasses import asdict

    from callbacks.run_monitor import RunMonitor
    from modelwright.train.args import DataArgs, ModelArgs, TrainerArgs
    from modelwright.train.checks import check_trainer

    section, name = key.split(".", 1)
    if section == "model":
        ModelArgs(**{name: value})
    elif section == "data":
        DataArgs(**{name: value})
    elif section == "trainer":
        check_trainer({**asdict(TrainerArgs()), "max_steps": 10, name: value})
    else:
        RunMonitor(**{name: value})


@pytest.mark.parametrize("key", [key for key in _numeric_keys() if key not in NAMED])
def test_every_numeric_key_at_its_bounds(key):
    assert key in BOUNDS, f"{key}: a numeric key with no bounds in BOUNDS"
    valid, invalid = BOUNDS[key]
    for value in valid:
        _check_value(key, value)
    for value in invalid:
        with pytest.raises(ValueError) as refused:  # a ConfigError; RunMonitor's own are ValueErrors
            _check_value(key, value)
        assert key.removeprefix("run_monitor.") in str(refused.value), (value, str(refused.value))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_a_second_machine_that_never_comes_ends_the_run_in_bounded_time(tmp_path, subprocess_env):
    """Launched by hand as machine 0 of 2 (NODE_RANK, MASTER_ADDR set): the run waits for the other machine
    for the strategy's timeout (here 5 s), then ends with one line and status 1 instead of hanging."""
    env = {**subprocess_env, "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    args = fit_args(tmp_path, "--config", "configs/ddp.yaml", *SMALL, "--trainer.num_nodes", "2",
                    "--trainer.devices", "1", "--trainer.strategy.init_args.timeout", "0:00:05")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "main.py", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    took = time.monotonic() - started
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: trainer.num_nodes: "), errors
    assert "Traceback" not in done.stderr
    assert took < 120, f"ended after {took:.0f} s"


def test_the_tools_say_what_each_does_and_a_wrong_one_is_one_line(capsys):
    from modelwright.__main__ import SUMMARIES, TOOLS, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert set(SUMMARIES) == set(TOOLS) and all(f"  {name:<11} {text}" in out for name, text in SUMMARIES.items())
    for argv in ([], ["nope"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: python -m modelwright") and "study" in err


def test_a_tools_help_shows_its_whole_description(capsys):
    """jsonargparse shows a docstring's first line: the study's was cut off mid-sentence; the accelerate
    tool prints its own usage, whole."""
    from modelwright.__main__ import main

    with pytest.raises(SystemExit):
        main(["study", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "then write the table, plots and README section. Returns 0, or 1 if every run" in text
    assert main(["accelerate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "version_N/record.json, the next free N." in text and "(inputs, labels) batches." in text


