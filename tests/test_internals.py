"""modelwright.train._internals: what the training core relies on that torch and Lightning do not promise.
Each test fails when the library changes under the wrapper."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset, TensorDataset

from modelwright.train._internals import (
    CLI_HPARAM_KEYS,
    LIGHTNING_LOGGERS,
    HeldLogs,
    SkippingDataLoader,
    fit_progress,
    own_hyperparameters,
)


class _Counted(Dataset):
    """Ten samples that count how often each is loaded."""

    def __init__(self) -> None:
        self.loads: list[int] = []

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        self.loads.append(index)
        return torch.tensor(index)


def test_a_skipped_pass_starts_later_without_loading_what_it_skips():
    dataset = _Counted()
    loader = SkippingDataLoader(dataset, batch_size=2)
    loader.skip_next_pass(3)
    assert [batch.tolist() for batch in loader] == [[6, 7], [8, 9]]
    assert dataset.loads == [6, 7, 8, 9], "the skipped batches' samples were loaded"
    assert len(list(loader)) == 5, "only the next pass is shortened"


class _Tiny(LightningModule):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(6, self.hparams.width)), batch_size=2)


def test_a_lightning_checkpoint_says_how_far_its_fit_got_and_carries_the_clis_keys(tmp_path):
    args = ["--trainer.max_epochs=2", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={tmp_path}", "--model.width=4"]
    cli = LightningCLI(_Tiny, run=False, args=args, save_config_callback=None)
    cli.trainer.fit(cli.model)
    cli.trainer.save_checkpoint(tmp_path / "done.ckpt")
    checkpoint = torch.load(tmp_path / "done.ckpt", weights_only=True, map_location="cpu")
    assert fit_progress(checkpoint) == (2, 6), "2 epochs of 3 steps"
    saved = checkpoint["hyper_parameters"]
    assert set(saved) & set(CLI_HPARAM_KEYS), "LightningCLI no longer adds its keys: CLI_HPARAM_KEYS is stale"
    assert own_hyperparameters(saved) == {"width": 4}


@pytest.fixture
def listener():
    """A handler on each of Lightning's loggers, as a user's logging setup would add."""
    heard: list[str] = []

    class _Listen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record.getMessage())

    handler = _Listen()
    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    yield heard
    for logger in loggers:
        logger.removeHandler(handler)


def test_lightnings_startup_lines_are_held_then_released_or_dropped(listener):
    held = HeldLogs(LIGHTNING_LOGGERS)
    held.hold()
    seed_everything(3)
    assert listener == [], "Lightning logs 'Seed set to' elsewhere: LIGHTNING_LOGGERS is stale"
    held.release()
    assert listener == ["Seed set to 3"]
    held.hold()
    seed_everything(4)
    held.drop()
    seed_everything(5)
    assert listener == ["Seed set to 3", "Seed set to 5"], "a dropped line stays dropped; logging is back"
