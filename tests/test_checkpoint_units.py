"""The checkpoint rules of modelwright.train.checkpoints on hand-made inputs: run folders made in tmp_path, files
written with torch.save of small dicts, configs and hyperparameters written out here. No fit runs
(tests/test_resume_rules.py and tests/test_cli.py resume real ones)."""

from __future__ import annotations

import fractions
import locale
import os
import re
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from modelwright.errors import ConfigError
from modelwright.train._internals import SHARDED_METADATA_FILE
from modelwright.train.checkpoints import (
    CONFIG_KEY,
    check_architecture,
    completed,
    find_last_checkpoint,
    loadable,
    read_checkpoint,
    resume_differences,
    run_of,
    runs,
)

CLASSIFIER = "modelwright.train.module.Classifier"
DATAMODULE = "modelwright.train.data.CIFAR10DataModule"


def _refused(message: str):
    return pytest.raises(ConfigError, match=f"^{re.escape(message)}$")


def _zip(path: Path) -> Path:
    """A zip at ``path`` that reads as a whole checkpoint file to `loadable` (not to torch.load)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("data.pkl", b"x")
    return path


# -- the runs of a job and the checkpoint `last` takes -------------------------------------------------------------

def test_runs_are_the_version_folders_highest_number_first(tmp_path):
    for name in ("version_0", "version_2", "version_10", "version_x", "other", "version_1-old"):
        (tmp_path / name).mkdir()
    (tmp_path / "version_3").write_text("a file, not a run")
    assert runs(tmp_path) == [tmp_path / "version_10", tmp_path / "version_2", tmp_path / "version_0"]


def test_loadable_is_a_folder_or_a_whole_zip_archive(tmp_path):
    (tmp_path / "empty.ckpt").write_bytes(b"")
    (tmp_path / "text.ckpt").write_text("not an archive")
    cut_short = tmp_path / "cut.ckpt"
    cut_short.write_bytes(_zip(tmp_path / "whole.ckpt").read_bytes()[:-10])
    verdicts = {name: loadable(tmp_path / name) for name in
                ("whole.ckpt", "cut.ckpt", "empty.ckpt", "text.ckpt", "missing.ckpt", ".")}
    assert verdicts == {"whole.ckpt": True, "cut.ckpt": False, "empty.ckpt": False, "text.ckpt": False,
                        "missing.ckpt": False, ".": True}


#: The job's resolved config, as LightningCLI gives it (sections by class path where the project names one).
JOB = {
    "seed_everything": 0,
    "trainer": {"max_epochs": 1, "precision": "32-true"},
    "model": {"class_path": CLASSIFIER, "init_args": {"lr": 0.1, "network": "SmallCNN"}},
    "data": {"class_path": DATAMODULE, "init_args": {"batch_size": 8}},
}


def _run(root: Path, version: int, config: object = None, checkpoints: tuple[str, ...] = ()) -> Path:
    """A run folder: its config.yaml (``config``: a mapping dumped as YAML, a string written as it is) and
    zip archives at ``checkpoints/<name>``."""
    run = root / f"version_{version}"
    run.mkdir(parents=True)
    if config is not None:
        text = config if isinstance(config, str) else yaml.safe_dump(config, allow_unicode=True)  # as jsonargparse
        (run / "config.yaml").write_text(text, encoding="utf-8")
    for name in checkpoints:
        _zip(run / "checkpoints" / name)
    return run


def test_last_is_the_latest_run_of_this_job_passing_over_other_jobs_and_unreadable_configs(tmp_path):
    """The same job killed before its first checkpoint (its config.yaml equal up to the arguments a resume may
    change) is taken, with nothing to load; later runs of other jobs, with no config or an unreadable one, are
    passed over and named; an earlier run's checkpoint is never reached."""
    _run(tmp_path, 0, JOB, checkpoints=("last.ckpt",))
    own = _run(tmp_path, 1, {**JOB, "seed_everything": 7, "trainer": {**JOB["trainer"], "max_epochs": 5}})
    later = [
        _run(tmp_path, 2, {**JOB, "trainer": {**JOB["trainer"], "precision": "bf16-mixed"}}),  # another job
        _run(tmp_path, 3, {**JOB, "model": {"class_path": CLASSIFIER, "init_args": {"lr": 0.2}}}),
        _run(tmp_path, 4, ""),  # empty
        _run(tmp_path, 5, "- a list\n- not a config\n"),
        _run(tmp_path, 6, "trainer: [unclosed\n"),  # not YAML
        _run(tmp_path, 7),  # no config.yaml at all
    ]
    (later[-1] / "checkpoints").mkdir()
    (later[-1] / "checkpoints" / "last.ckpt").write_bytes(b"")  # a full disk's empty file
    (later[-1] / "last.ckpt").write_bytes(_zip(tmp_path / "a.zip").read_bytes())  # not in checkpoints/
    (later[-1] / "checkpoints" / "epoch=0-step=4.ckpt").write_bytes(_zip(tmp_path / "b.zip").read_bytes())
    assert find_last_checkpoint(tmp_path, JOB) == (None, own, list(reversed(later)))


def test_last_without_a_run_of_this_job_starts_afresh_naming_each_run_passed_over(tmp_path):
    others = [_run(tmp_path, 0, {**JOB, "data": {"class_path": DATAMODULE, "init_args": {"batch_size": 16}}}),
              _run(tmp_path, 1)]
    assert find_last_checkpoint(tmp_path, JOB) == (None, None, [others[1], others[0]])


def test_a_config_not_in_utf8_is_passed_over_and_one_in_utf8_is_read_as_such_whatever_the_locale(tmp_path):
    """Before: a config.yaml that is not UTF-8 text ended `last` with a UnicodeDecodeError's traceback."""
    job = {**JOB, "data": {"class_path": DATAMODULE, "init_args": {"batch_size": 8, "data_dir": "/données"}}}
    own = _run(tmp_path, 0, job)
    garbled = _run(tmp_path, 1)
    (garbled / "config.yaml").write_bytes(b"trainer: \xff\xfe\n")
    locale_before = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")  # a process whose locale reads files as ASCII
    try:
        last = find_last_checkpoint(tmp_path, job)
    finally:
        locale.setlocale(locale.LC_CTYPE, locale_before)
    assert last == (None, own, [garbled])


@pytest.mark.parametrize("newest", ["last.ckpt", "last-v1.ckpt", "last-step.ckpt"])
def test_last_is_the_newest_last_checkpoint_by_time_whatever_its_name(tmp_path, newest):
    names = ("last.ckpt", "last-v1.ckpt", "last-step.ckpt")
    run = _run(tmp_path, 0, checkpoints=names)
    for age, name in enumerate(sorted(names, key=lambda name: name == newest)):
        os.utime(run / "checkpoints" / name, (1_000_000 + age, 1_000_000 + age))
    assert find_last_checkpoint(tmp_path, {}) == (run / "checkpoints" / newest, run, [])


def test_run_of_a_checkpoint_is_its_version_folder_under_the_log_root(tmp_path):
    run = _run(tmp_path / "base", 3, checkpoints=("last.ckpt",))
    _zip(tmp_path / "kept" / "checkpoints" / "last.ckpt")  # a checkpoints folder of no run
    _zip(tmp_path / "base" / "version_3" / "last.ckpt")  # beside the run, not in its checkpoints/
    found = {name: run_of(tmp_path / name, tmp_path / "base") for name in
             ("base/version_3/checkpoints/last.ckpt", "kept/checkpoints/last.ckpt", "base/version_3/last.ckpt")}
    assert found == {"base/version_3/checkpoints/last.ckpt": run.resolve(), "kept/checkpoints/last.ckpt": None,
                     "base/version_3/last.ckpt": None}


# -- reading a checkpoint ------------------------------------------------------------------------------------------

LIGHTNING = {"pytorch-lightning_version": "2.5.0", "global_step": 4, "state_dict": {"weight": torch.arange(4.0)}}


def test_read_checkpoint_returns_the_lightning_checkpoint_with_its_tensors_on_the_cpu_still_on_disk(tmp_path):
    path = tmp_path / "last.ckpt"
    torch.save(LIGHTNING, path)
    checkpoint = read_checkpoint(str(path))
    assert checkpoint.keys() == LIGHTNING.keys() and checkpoint["global_step"] == 4
    weight = checkpoint["state_dict"]["weight"]
    assert torch.equal(weight, torch.arange(4.0)) and weight.device == torch.device("cpu")
    if Path("/proc/self/maps").is_file():  # memory-mapped: the weights stay in the file, not in the heap
        address = weight.data_ptr()
        mapped = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                  if int(line.split("-")[0], 16) <= address < int(line.split()[0].split("-")[1], 16)]
        assert mapped == [str(path.resolve())]


def test_a_checkpoint_written_on_a_gpu_is_read_onto_the_cpu(tmp_path, monkeypatch):
    """Its tensors are tagged cuda:0 (written here by tagging them so): read onto the CPU all the same."""
    path = tmp_path / "gpu.ckpt"
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    torch.save(LIGHTNING, path)
    monkeypatch.undo()
    assert read_checkpoint(path)["state_dict"]["weight"].device == torch.device("cpu")


def test_a_sharded_checkpoint_folder_is_read_from_its_metadata_file(tmp_path):
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    torch.save(LIGHTNING, folder / SHARDED_METADATA_FILE)
    assert read_checkpoint(folder)["global_step"] == 4


def test_each_checkpoint_that_cannot_be_resumed_is_refused_naming_the_path(tmp_path):
    folder = tmp_path / "folder.ckpt"
    folder.mkdir()
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(b"PK\x03\x04 cut short")
    state_dict = tmp_path / "state_dict.pt"
    torch.save({"weight": torch.zeros(2)}, state_dict)
    a_list = tmp_path / "list.pt"
    torch.save(["pytorch-lightning_version"], a_list)
    refusals = {
        tmp_path / "missing.ckpt": f"ckpt_path: no checkpoint at {tmp_path / 'missing.ckpt'}",
        folder: f"ckpt_path: {folder} is a folder but no sharded Lightning checkpoint (no {SHARDED_METADATA_FILE} "
                "in it)",
        truncated: f"ckpt_path: {truncated} is not a PyTorch checkpoint (truncated or corrupted?)",
        state_dict: f"ckpt_path: {state_dict} is a PyTorch file but not a Lightning checkpoint (a plain "
                    "state_dict?); resume from a run's checkpoints/last*.ckpt",
        a_list: f"ckpt_path: {a_list} is a PyTorch file but not a Lightning checkpoint (a plain state_dict?); "
                "resume from a run's checkpoints/last*.ckpt",
    }
    for path, message in refusals.items():
        with _refused(message):
            read_checkpoint(path)


@pytest.mark.parametrize("forced", [None, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"])
def test_a_pickle_of_other_objects_is_never_unpickled_and_its_error_is_one_line(tmp_path, monkeypatch, forced):
    """Not even where the environment makes torch.load unpickle anything by default."""
    if forced:
        monkeypatch.setenv(forced, "1")
    path = tmp_path / "objects.ckpt"
    torch.save({"pytorch-lightning_version": "2.5.0", "ratio": fractions.Fraction(1, 3)}, path)
    with pytest.raises(ConfigError) as refused:
        read_checkpoint(path)
    prefix = f"ckpt_path: {path} is not a PyTorch checkpoint (UnpicklingError: "
    message = str(refused.value)
    assert message.startswith(prefix + "Weights only load failed. This file can still be loaded")
    reason = message.removeprefix(prefix).removesuffix(")")
    assert message.endswith(")") and len(reason) == 200 and "\n" not in reason and "  " not in reason
    assert "\x1b" not in message  # torch's terminal bold left out, and only that
    assert "you have two options, do those steps only if you trust the source of the checkpoint." in message


# -- the architecture a checkpoint holds ---------------------------------------------------------------------------

def _hyperparameters(**saved: object) -> dict:
    """A checkpoint's hyperparameters as LightningCLI saves them: with its own keys beside the model's."""
    return {"hyper_parameters": {"_instantiator": "lightning.pytorch.cli.instantiate_module",
                                 "_class_path": CLASSIFIER, **saved}}


def _model(network: object, **init_args: object) -> dict:
    return {"class_path": CLASSIFIER, "init_args": {"network": network, **init_args}}


SMALL_CNN = {"class_path": "SmallCNN", "init_args": {"num_classes": 10, "width": 16}}


@pytest.mark.parametrize(("checkpoint", "model"), [
    (_hyperparameters(network=SMALL_CNN, lr=0.1), _model(SMALL_CNN, lr=0.5)),  # other training arguments
    (_hyperparameters(network="SmallCNN"), _model({"class_path": "SmallCNN"})),  # a name is its class path
    (_hyperparameters(network={"class_path": "SmallCNN", "init_args": None}), _model("SmallCNN")),
    ({"hyper_parameters": {"network": "SmallCNN"}}, _model("SmallCNN")),  # no class saved: Lightning's check
    ({}, {"class_path": CLASSIFIER, "init_args": None}),  # no network asked for: Lightning's state_dict check
    ({"hyper_parameters": {"_class_path": "my.Module", "depth": 3}}, {"class_path": "my.Module",
                                                                      "init_args": {"depth": 4}}),
])
def test_a_checkpoint_of_the_same_module_and_network_passes(checkpoint, model):
    assert check_architecture(checkpoint, model, "run.ckpt") is None


@pytest.mark.parametrize(("checkpoint", "model", "message"), [
    (_hyperparameters(network="SmallCNN"), {"class_path": "my.Module", "init_args": {}},
     f"ckpt_path: run.ckpt is a checkpoint of {CLASSIFIER}, but model.class_path is my.Module: it cannot load "
     "into it"),
    ({"hyper_parameters": {"_class_path": CLASSIFIER, "lr": 0.1}}, _model("SmallCNN"),
     "ckpt_path: run.ckpt was written by an earlier version of the project (no network among its "
     "hyperparameters); start the run afresh"),
    (_hyperparameters(network="SmallCNN"), _model("ResNet18"),
     "ckpt_path: run.ckpt holds SmallCNN weights, but model.network is ResNet18: they cannot load into it"),
    (_hyperparameters(network=SMALL_CNN), _model({"class_path": "ResNet18", "init_args": SMALL_CNN["init_args"]}),
     "ckpt_path: run.ckpt holds SmallCNN weights, but model.network is ResNet18: they cannot load into it"),
    (_hyperparameters(network=SMALL_CNN), _model({"class_path": "SmallCNN", "init_args": {"num_classes": 100}}),
     "ckpt_path: run.ckpt holds SmallCNN weights with num_classes 10, but model.network.init_args.num_classes is "
     "100: they cannot load into it"),
    (_hyperparameters(network=SMALL_CNN), _model({"class_path": "SmallCNN", "init_args": {"num_classes": 10}}),
     "ckpt_path: run.ckpt holds SmallCNN weights with width 16, but model.network.init_args.width is None: they "
     "cannot load into it"),
    (_hyperparameters(network="SmallCNN"), _model({"class_path": "SmallCNN", "init_args": {"width": 32}}),
     "ckpt_path: run.ckpt holds SmallCNN weights with width None, but model.network.init_args.width is 32: they "
     "cannot load into it"),
])
def test_a_checkpoint_of_another_module_or_network_is_refused_naming_what_differs(checkpoint, model, message):
    with _refused(message):
        check_architecture(checkpoint, model, "run.ckpt")


# -- a finished fit ------------------------------------------------------------------------------------------------

def _fit(epochs: int, steps: int) -> dict:
    return {"global_step": steps, "loops": {"fit_loop": {"epoch_progress": {"current": {"processed": epochs}}}}}


@pytest.mark.parametrize(("progress", "trainer", "verdict"), [
    ((1, 9), {"max_epochs": 2}, None),  # no max_steps: Lightning's -1, no step limit
    ((2, 9), {"max_epochs": 2}, "epoch 2 of trainer.max_epochs 2, step 9"),
    ((3, 9), {"max_epochs": 2, "max_steps": -1}, "epoch 3 of trainer.max_epochs 2, step 9"),
    ((1000, 9), {}, "epoch 1000 of trainer.max_epochs 1000, step 9"),  # nothing set: Lightning's 1000 epochs
    ((1000, 160), {"max_steps": 200}, None),  # max_steps set: epochs are unlimited
    ((1000, 200), {"max_steps": 200}, "step 200 of trainer.max_steps 200"),
    ((1000, 9), {"max_time": "00:01:00:00"}, None),  # max_time set: epochs are unlimited
    ((1000, 9), {"max_epochs": None, "max_time": None}, "epoch 1000 of trainer.max_epochs 1000, step 9"),
    ((5, 20), {"max_epochs": 2, "max_steps": 20}, "step 20 of trainer.max_steps 20"),  # the step limit first
    ((5, 19), {"max_epochs": -1, "max_steps": 20}, None),
])
def test_a_fit_is_complete_at_the_limit_this_run_sets(progress, trainer, verdict):
    assert completed(_fit(*progress), trainer) == verdict


# -- the arguments a resume may not change -------------------------------------------------------------------------

#: The run a checkpoint was written in: its config (as the checkpoint holds it) and the model's and data's
#: hyperparameters. The hyperparameters win over the config: they are what the module and data were built with.
BEFORE = {
    "seed_everything": 0,
    "ckpt_path": None,
    "global_batch_size": 8,
    "extras": {"note": "a"},  # a top-level mapping other than a section: compared whole
    "trainer": {"max_epochs": 1, "precision": "bf16-mixed", "callbacks": ["a"]},
    "model": {"class_path": CLASSIFIER, "init_args": {"lr": 0.1, "network": "SmallCNN"}},
    "data": {"class_path": DATAMODULE, "init_args": {"batch_size": 8, "num_workers": 2}},
}
HYPERPARAMETERS = {
    "hyper_parameters": {"_class_path": CLASSIFIER, "_instantiator": "cli", "lr": 0.05, "network": "SmallCNN"},
    "datamodule_hyper_parameters": {"_instantiator": "cli", "batch_size": 4, "num_workers": 2},
}
#: The run about to resume: each kind of change once.
NOW = {
    "seed_everything": 7,  # may change
    "ckpt_path": "last",  # may change
    "global_batch_size": 16,
    "extras": {"note": "b"},
    "trainer": {"max_epochs": 2, "precision": "32-true", "callbacks": ["b"], "accumulate_grad_batches": 2},
    "model": {"class_path": CLASSIFIER, "init_args": {"lr": 0.2, "network": "SmallCNN"}},
    "data": {"class_path": "my.DataModule", "init_args": {"batch_size": 16, "num_workers": 8}},
}
#: Neither max_epochs, callbacks, seed_everything, ckpt_path nor num_workers; nor accumulate_grad_batches, which the
#: checkpoint's run did not have; the model's and data's values are the hyperparameters'.
CHANGED = [
    "data.batch_size: 4 -> 16",
    f"data.class_path: '{DATAMODULE}' -> 'my.DataModule'",
    "extras: {'note': 'a'} -> {'note': 'b'}",
    "global_batch_size: 8 -> 16",
    "model.lr: 0.05 -> 0.2",
    "trainer.precision: 'bf16-mixed' -> '32-true'",
]


def test_each_argument_changed_on_resume_is_named_with_its_values_unless_it_may_change():
    checkpoint = {CONFIG_KEY: BEFORE, **HYPERPARAMETERS}
    assert resume_differences(checkpoint, NOW, "anywhere/last.ckpt") == CHANGED


def test_a_checkpoint_without_its_config_is_compared_with_the_config_its_run_saved(tmp_path):
    run = _run(tmp_path, 0, BEFORE, checkpoints=("last.ckpt",))
    assert resume_differences(HYPERPARAMETERS, NOW, run / "checkpoints" / "last.ckpt") == CHANGED
    assert resume_differences({CONFIG_KEY: "not a config", **HYPERPARAMETERS}, NOW,
                              str(run / "checkpoints" / "last.ckpt")) == CHANGED
    assert resume_differences(HYPERPARAMETERS, NOW, tmp_path / "kept" / "last.ckpt") == [
        "data.batch_size: 4 -> 16", "model.lr: 0.05 -> 0.2"], "no config beside it: the hyperparameters only"
