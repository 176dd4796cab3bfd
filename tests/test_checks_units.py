"""The checks of modelwright.train.checks on hand-made inputs: trainer sections as plain dicts, DataArgs of the
synthetic set, an image folder of empty files in tmp_path. Every refusal is asserted as the one line a user sees;
batch counts are worked out by hand in the comments. No fit runs (tests/test_bad_inputs.py runs main.py's)."""

from __future__ import annotations

import re
from dataclasses import asdict

import pytest

from modelwright.errors import ConfigError
from modelwright.train import checks
from modelwright.train.args import DataArgs, ImageFolderArgs, TrainerArgs
from modelwright.train.checks import (
    check_accelerate_run,
    check_finite,
    check_launch,
    check_run,
    check_trainer,
    epoch_batches,
    training_samples,
)

#: A trainer section that passes every check: the Accelerate loop's defaults, 10 steps.
BASE = {**asdict(TrainerArgs()), "max_steps": 10}
#: The smallest value of each key that still trains, written out here (not read from checks._LOWEST).
LOWEST = {"accumulate_grad_batches": 1, "check_val_every_n_epoch": 1, "log_every_n_steps": 1, "gradient_clip_val": 0,
          "min_epochs": 0, "num_nodes": 1, "num_sanity_val_steps": -1}
DEVICES_VALID = "a count >= 1, -1 (all), 'auto' or a list of device indices"
NO_LAUNCHER = ("machines, but no multi-node launcher started this process (torchrun, SLURM's srun) and NODE_RANK and "
               "MASTER_ADDR are not set: it would wait for machines that never come; docs/distributed.md shows the "
               "launch")
LAUNCH_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "LSB_JOBID", "NODE_RANK", "MASTER_ADDR", "WORLD_SIZE")


def _refused(message: str):
    return pytest.raises(ConfigError, match=f"^{re.escape(message)}$")


def _trainer_refusal(**values) -> str | None:
    """The line check_trainer refuses BASE with ``values`` in, or None where it passes."""
    try:
        check_trainer({**BASE, **values})
    except ConfigError as err:
        return str(err)
    return None


def _data(train_size: int, batch_size: int) -> DataArgs:
    return DataArgs(train_size=train_size, batch_size=batch_size)


# -- check_trainer: the trainer section alone -----------------------------------------------------------------------

def test_the_lowest_table_names_every_key_bounded_from_below():
    assert dict(checks._LOWEST) == LOWEST


@pytest.mark.parametrize("key", list(LOWEST))
def test_every_key_passes_at_its_lowest_value_and_unset_and_is_refused_one_below(key):
    low = LOWEST[key]
    assert _trainer_refusal(**{key: low}) is None
    assert _trainer_refusal(**{key: None}) is None
    assert _trainer_refusal(**{key: low - 1}) == f"trainer.{key}: must be >= {low}, got {low - 1}"


def test_a_trainer_section_that_sets_nothing_passes():
    check_trainer({})


NEVER_ENDS = "trainer.max_epochs: -1 with trainer.max_steps -1 never ends; set one of them"
#: (the keys BASE changes, the line check_trainer refuses it with, or None)
LENGTHS = [
    ({"max_epochs": 1}, None),
    ({"max_epochs": -1}, None),
    ({"max_epochs": 0}, "trainer.max_epochs: 0 trains nothing; at least 1, or -1 (no limit) beside trainer.max_steps"),
    ({"max_epochs": -2}, "trainer.max_epochs: must be >= 1 or -1 (no limit), got -2"),
    ({"max_steps": 1}, None),
    ({"max_steps": -1}, None),  # max_epochs unset: Lightning's 1000
    ({"max_steps": -1, "max_epochs": 3}, None),
    ({"max_steps": 0}, "trainer.max_steps: 0 trains nothing; at least 1, or -1 (no limit)"),
    ({"max_steps": -2}, "trainer.max_steps: must be >= 1 or -1 (no limit), got -2"),
    ({"max_steps": -1, "max_epochs": -1}, NEVER_ENDS),
    ({"max_steps": -1, "max_epochs": -1, "max_time": "00:01:00:00"}, None),
    ({"limit_train_batches": 0}, "trainer.limit_train_batches: 0 trains nothing"),
    ({"limit_train_batches": 0.0}, "trainer.limit_train_batches: 0.0 trains nothing"),
    ({"limit_train_batches": 1}, None),
    ({"limit_train_batches": 5}, None),
]


@pytest.mark.parametrize(("values", "refusal"), LENGTHS, ids=[str(values) for values, _ in LENGTHS])
def test_how_long_to_train(values, refusal):
    assert _trainer_refusal(**values) == refusal


def test_max_steps_left_out_is_no_limit():
    check_trainer({"max_epochs": 2})
    with _refused(NEVER_ENDS):
        check_trainer({"max_epochs": -1})


def _neither(key: str, value: float) -> str:
    return f"trainer.{key}: {value} is neither a fraction up to 1 nor a whole number of batches"


#: key → (values that pass, (value, the line it is refused with) ...). val_check_interval must be positive; the
#: limits may be 0 (limit_train_batches 0 is refused as training nothing, above).
BATCH_KEYS = {
    "val_check_interval": (
        [1, 3, 0.5, 1.0, 2.0, "00:12:00:00", {"hours": 1}, None],
        [(0, "trainer.val_check_interval: must be positive, got 0"),
         (0.0, "trainer.val_check_interval: must be positive, got 0.0"),
         (-1, "trainer.val_check_interval: must be positive, got -1"),
         (1.5, _neither("val_check_interval", 1.5))]),
    "limit_train_batches": (
        [None, 1, 10, 0.5, 1.0, 2.0],
        [(-1, "trainer.limit_train_batches: must be >= 0, got -1"),
         (-0.5, "trainer.limit_train_batches: must be >= 0, got -0.5"),
         (1.5, _neither("limit_train_batches", 1.5))]),
    "limit_val_batches": (
        [None, 0, 0.0, 0.5, 1, 1.0, 2.0, 10],
        [(-1, "trainer.limit_val_batches: must be >= 0, got -1"),
         (-0.5, "trainer.limit_val_batches: must be >= 0, got -0.5"),
         (1.5, _neither("limit_val_batches", 1.5))]),
}


@pytest.mark.parametrize("key", list(BATCH_KEYS))
def test_every_batch_key_takes_a_count_a_fraction_or_a_whole_float(key):
    valid, refused = BATCH_KEYS[key]
    assert [_trainer_refusal(**{key: value}) for value in valid] == [None] * len(valid)
    assert [_trainer_refusal(**{key: value}) for value, _ in refused] == [line for _, line in refused]


DEVICES_PASS = [None, 1, 2, 8, -1, "auto", " auto ", "-1", "1", "2", " 4 ", "0,", "0,1", "1, 3", "3,", [0], [0, 1], [3]]
DEVICES_REFUSED = [0, -2, True, 2.5, "0", "", "a", "2X", "0,X", "-2", "1,-1", "0,,1", [], [-1], [True], [1.5], ["0"]]


def test_every_form_of_devices():
    assert [_trainer_refusal(devices=devices) for devices in DEVICES_PASS] == [None] * len(DEVICES_PASS)
    refusals = [_trainer_refusal(devices=devices) for devices in DEVICES_REFUSED]
    assert refusals == [f"trainer.devices: {devices!r} names no device; {DEVICES_VALID}" for devices in DEVICES_REFUSED]


# -- check_finite: every float of a section, named as the user writes it ----------------------------------------------

MODEL = {"class_path": "modelwright.train.module.ImageClassifier",
         "init_args": {"lr": 0.1, "scheduler": "cosine", "num_classes": None,
                       "network": {"class_path": "modelwright.models.SmallCNN", "init_args": {"width": 0.5}}}}


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_float_is_named_by_its_key(bad):
    check_finite("model", MODEL)
    model = {**MODEL, "init_args": {**MODEL["init_args"], "lr": bad}}
    with _refused(f"model.lr: must be a finite number, got {bad}"):
        check_finite("model", model)
    network = {**MODEL["init_args"]["network"], "init_args": {"width": bad}}
    model = {**MODEL, "init_args": {**MODEL["init_args"], "network": network}}
    with _refused(f"model.network.init_args.width: must be a finite number, got {bad}"):
        check_finite("model", model)
    trainer = {"max_steps": 10, "precision": "32-true", "logger": False, "gradient_clip_val": bad}
    with _refused(f"trainer.gradient_clip_val: must be a finite number, got {bad}"):
        check_finite("trainer", trainer)
    callback = {"class_path": "callbacks.run_monitor.RunMonitor", "init_args": {"min_interval_s": bad}}
    with _refused(f"trainer.callbacks[1].init_args.min_interval_s: must be a finite number, got {bad}"):
        check_finite("trainer", {"max_steps": 10, "callbacks": [{"class_path": "x.Y"}, callback]})
    with _refused(f"data.mean[2]: must be a finite number, got {bad}"):
        check_finite("data", {"class_path": "x.Data", "init_args": {"mean": [0.5, 0.5, bad], "batch_size": 8}})


def test_finite_values_of_every_kind_pass():
    check_finite("trainer", {**BASE, "gradient_clip_val": 1.5, "callbacks": [{"class_path": "x.Y", "init_args": {}}]})
    check_finite("data", {"class_path": "x.Data", "init_args": {"mean": [0.5, 0.25], "noise": 6.0, "augment": True}})
    check_finite("model", 0.5)


# -- check_launch: more than one machine needs a launcher -------------------------------------------------------------

#: (num_nodes, the environment, whether it may start)
LAUNCHES = [
    (None, {}, True),
    (1, {}, True),
    (2, {}, False),
    (8, {"NODE_RANK": "0"}, False),
    (2, {"MASTER_ADDR": "10.0.0.1"}, False),
    (2, {"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}, True),
    (2, {"TORCHELASTIC_RUN_ID": "job"}, True),
    (2, {"SLURM_NTASKS": "8"}, True),
    (4, {"LSB_JOBID": "17"}, True),
    (2, {"WORLD_SIZE": "2", "MASTER_PORT": "29500"}, False),
]


@pytest.mark.parametrize(("num_nodes", "environ", "starts"), LAUNCHES)
def test_a_multi_node_run_needs_a_launcher(num_nodes, environ, starts):
    if starts:
        check_launch(num_nodes, environ)
    else:
        with _refused(f"trainer.num_nodes: {num_nodes} {NO_LAUNCHER}"):
            check_launch(num_nodes, environ)


# -- training_samples and epoch_batches, worked out by hand -----------------------------------------------------------

#: (train_size, batch_size, processes, Lightning's batches, Accelerate's). Lightning: ceil(samples / processes) //
#: batch; Accelerate: ceil((samples // batch) / processes).
EPOCHS = [
    (100, 8, 1, 12, 12),  # 100 // 8
    (10, 4, 1, 2, 2),  # 10 // 4: the partial batch dropped
    (7, 8, 1, 0, 0),
    (8, 8, 1, 1, 1),
    (100, 8, 3, 4, 4),  # 34 // 8; ceil(12 / 3)
    (100, 8, 5, 2, 3),  # 20 // 8; ceil(12 / 5)
    (12, 4, 2, 1, 2),  # 6 // 4; ceil(3 / 2)
    (16, 8, 4, 0, 1),  # 4 // 8; ceil(2 / 4): Accelerate repeats the first batch
]


@pytest.mark.parametrize(("samples", "batch", "processes", "lightning", "accelerate"), EPOCHS)
def test_the_batches_of_one_epoch_per_process(samples, batch, processes, lightning, accelerate):
    data = _data(samples, batch)
    assert training_samples(data) == (samples, "data.train_size")
    assert epoch_batches(data, processes, "lightning") == lightning
    assert epoch_batches(data, processes, "accelerate") == accelerate
    assert type(epoch_batches(data, processes, "lightning")) is int


def test_cifar10_has_50000_training_images_and_the_synthetic_set_what_it_is_told(tmp_path):
    cifar = DataArgs(dataset="cifar10", download=True, data_dir=str(tmp_path / "cifar"), train_size=60_000,
                     batch_size=100)
    assert training_samples(cifar) == (50_000, "data.train_size")
    assert epoch_batches(cifar, 1, "lightning") == 500
    small = DataArgs(dataset="cifar10", download=True, data_dir=str(tmp_path / "cifar"), train_size=4096)
    assert training_samples(small) == (4096, "data.train_size")
    assert training_samples(_data(60_000, 100)) == (60_000, "data.train_size")


def _image_folder(root, files: dict[str, list[str]]) -> ImageFolderArgs:
    for folder, names in files.items():
        (root / folder).mkdir(parents=True)
        for name in names:
            (root / folder / name).write_bytes(b"")
    return ImageFolderArgs(root=str(root), batch_size=2)


def test_an_image_folder_counts_the_images_of_train_only(tmp_path):
    """Upper-case suffixes are images (torchvision reads them); hidden files and val/ are not counted."""
    root = tmp_path / "images"
    data = _image_folder(root, {"train/cat": ["a.png", "b.PNG", "c.jpeg", ".DS_Store"],
                                "train/dog": ["d.JpEg", "e.webp", ".notes.txt"],
                                "val/cat": ["v.png"], "val/dog": ["w.png", "x.png"]})
    assert training_samples(data) == (5, f"data.root ({root / 'train'})")
    assert epoch_batches(data, 1, "lightning") == 2  # 5 // 2
    assert epoch_batches(data, 2, "lightning") == 1  # 3 // 2
    data.batch_size = 8
    with _refused(f"data.root ({root / 'train'}): 5 samples make no whole batch of data.batch_size 8 (a partial "
                  "batch is dropped): the run would train nothing"):
        check_run(BASE, data, 1, "lightning")


# -- check_run: runs that would train nothing, intervals the epoch never reaches --------------------------------------

def _no_batch(samples: int, batch: int, per_process: str = "") -> str:
    return (f"data.train_size: {samples} samples make no whole batch of data.batch_size {batch}{per_process} "
            "(a partial batch is dropped): the run would train nothing")


def test_a_run_with_no_whole_batch_is_refused_and_one_batch_is_enough():
    with _refused(_no_batch(32, 64)):
        check_run(BASE, _data(32, 64), 1, "lightning")
    with _refused(_no_batch(32, 64)):
        check_run(BASE, _data(32, 64), 1, "accelerate")
    check_run(BASE, _data(8, 8), 1, "lightning")
    check_run(BASE, _data(8, 8), 1, "accelerate")


def test_the_number_of_processes_changes_the_answer():
    """32 samples, batches of 8: 4 batches on one process; 8 processes get 4 samples each under Lightning's
    sampler (no whole batch), one batch each under Accelerate's (it repeats batches to even them out)."""
    check_run(BASE, _data(32, 8), 1, "lightning")
    with _refused(_no_batch(32, 8, " per process of 8")):
        check_run(BASE, _data(32, 8), 8, "lightning")
    check_run(BASE, _data(32, 8), 8, "accelerate")
    with _refused(_no_batch(12, 8, " per process of 2")):
        check_run(BASE, _data(12, 8), 2, "lightning")


def _past_epoch(interval, batches: int, samples: int, batch: int, per_process: str = "") -> str:
    return (f"trainer.val_check_interval: {interval} batches, but an epoch has {batches} ({samples} samples, "
            f"data.batch_size {batch}{per_process}); at most {batches}, a fraction, or check_val_every_n_epoch: null")


def test_limit_train_batches_that_leaves_no_batch():
    data = _data(32, 8)  # 4 batches
    with _refused("trainer.limit_train_batches: 0.1 of an epoch's 4 batches leaves none: the run would train nothing"):
        check_run({**BASE, "limit_train_batches": 0.1}, data, 1, "lightning")
    check_run({**BASE, "limit_train_batches": 0.25}, data, 1, "lightning")  # int(4 * 0.25): one batch
    check_run({**BASE, "limit_train_batches": 1}, data, 1, "lightning")


#: (trainer keys beside BASE, the line check_run refuses 32 samples in batches of 8 with (4 batches), or None)
INTERVALS = [
    ({"val_check_interval": 4}, None),
    ({"val_check_interval": 5}, _past_epoch(5, 4, 32, 8)),
    ({"val_check_interval": 1.0}, None),
    ({"val_check_interval": 0.5}, None),
    ({"val_check_interval": "00:00:10:00"}, None),
    ({"val_check_interval": 5, "check_val_every_n_epoch": None}, None),
    ({"val_check_interval": 5, "limit_val_batches": 0}, None),
    ({"val_check_interval": 5, "limit_val_batches": 0.0}, None),
    ({"val_check_interval": 5, "limit_val_batches": 1}, _past_epoch(5, 4, 32, 8)),
    ({"val_check_interval": 5, "limit_val_batches": 0.5}, _past_epoch(5, 4, 32, 8)),
    ({"val_check_interval": 3, "limit_train_batches": 2}, _past_epoch(3, 2, 32, 8)),
    ({"val_check_interval": 2, "limit_train_batches": 1}, _past_epoch(2, 1, 32, 8)),
    ({"val_check_interval": 2, "limit_train_batches": 0.5}, None),
    ({"val_check_interval": 3, "limit_train_batches": 0.5}, _past_epoch(3, 2, 32, 8)),
    # Lightning reads a whole float above 1 as a count of batches: 5.0 is 5, a limit of 2.0 leaves 2
    ({"val_check_interval": 4.0}, None),
    ({"val_check_interval": 5.0}, _past_epoch(5.0, 4, 32, 8)),
    ({"val_check_interval": 5.0, "check_val_every_n_epoch": None}, None),
    ({"val_check_interval": 2, "limit_train_batches": 2.0}, None),
    ({"val_check_interval": 3, "limit_train_batches": 2.0}, _past_epoch(3, 2, 32, 8)),
]


@pytest.mark.parametrize(("values", "refusal"), INTERVALS, ids=[str(values) for values, _ in INTERVALS])
def test_a_validation_interval_the_epoch_never_reaches(values, refusal):
    trainer = {**BASE, **values}
    if refusal is None:
        check_run(trainer, _data(32, 8), 1, "lightning")
    else:
        with _refused(refusal):
            check_run(trainer, _data(32, 8), 1, "lightning")


def test_the_interval_counts_the_batches_of_each_process_of_each_loop():
    """100 samples in batches of 8 on 5 processes: Lightning's 2 batches each, Accelerate's 3."""
    with _refused(_past_epoch(3, 2, 100, 8, " per process of 5")):
        check_run({**BASE, "val_check_interval": 3}, _data(100, 8), 5, "lightning")
    check_run({**BASE, "val_check_interval": 3}, _data(100, 8), 5, "accelerate")
    with _refused(_past_epoch(4, 3, 100, 8, " per process of 5")):
        check_run({**BASE, "val_check_interval": 4}, _data(100, 8), 5, "accelerate")


# -- check_accelerate_run: the Accelerate loop's arguments, its launcher's processes, the output folder -------------

@pytest.fixture
def plain_environ(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_accelerate_loop_checks_everything_and_leaves_no_folder(tmp_path, plain_environ):
    out = tmp_path / "runs" / "out"
    check_accelerate_run(_data(32, 8), TrainerArgs(max_steps=10), str(out))
    check_accelerate_run(None, TrainerArgs(max_steps=10), str(out))  # a data module of the user's
    assert not (tmp_path / "runs").exists()
    with _refused("trainer.max_steps: 0 trains nothing; at least 1, or -1 (no limit)"):
        check_accelerate_run(_data(32, 8), TrainerArgs(max_steps=0), str(out))
    with _refused(f"trainer.num_nodes: 2 {NO_LAUNCHER}"):
        check_accelerate_run(_data(32, 8), TrainerArgs(max_steps=10, num_nodes=2), str(out))
    with _refused(_no_batch(32, 64)):
        check_accelerate_run(_data(32, 64), TrainerArgs(max_steps=10), str(out))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with _refused(f"out: {a_file} is a file, not a folder"):
        check_accelerate_run(_data(32, 8), TrainerArgs(max_steps=10), str(a_file))


def test_the_accelerate_loop_counts_the_processes_its_launcher_started(tmp_path, plain_environ):
    """100 samples in batches of 8: 12 batches on one process, ceil(12 / 5) = 3 on each of 5."""
    out = str(tmp_path / "out")
    check_accelerate_run(_data(100, 8), TrainerArgs(max_steps=10, val_check_interval=12), out)
    plain_environ.setenv("WORLD_SIZE", "5")
    check_accelerate_run(_data(100, 8), TrainerArgs(max_steps=10, val_check_interval=3), out)
    with _refused(_past_epoch(4, 3, 100, 8, " per process of 5")):
        check_accelerate_run(_data(100, 8), TrainerArgs(max_steps=10, val_check_interval=4), out)
