"""The private members of Lightning that callbacks/_lightning.py relies on, checked against the installed release:
a Lightning upgrade that renames or changes one fails here, by name, before it breaks a run."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from torch.utils.flop_counter import FlopCounterMode

from callbacks import _lightning
from modelwright.train.data import ImageDataModule
from modelwright.train.models import SmallCNN
from modelwright.train.module import ImageClassifier


def test_the_members_exist_with_the_signatures_relied_on():
    for name in ("_should_skip_saving_checkpoint", "_monitor_candidates", "_save_topk_checkpoint",
                 "_save_last_checkpoint"):
        assert callable(getattr(ModelCheckpoint, name, None)), f"ModelCheckpoint.{name}"
    assert ModelCheckpoint(every_n_train_steps=7)._every_n_train_steps == 7
    assert list(inspect.signature(ModelSummary._summary).parameters) == ["self", "trainer", "pl_module"]
    table = inspect.signature(_lightning._format_summary_table).parameters
    assert list(table)[:5] == ["total_parameters", "trainable_parameters", "model_size", "total_training_modes",
                               "total_flops"]
    assert isinstance(torch.amp.GradScaler("cpu")._scale, torch.Tensor | None)


class _Probe(Callback):
    """Reads each private member at the point the callbacks read it."""

    def __init__(self) -> None:
        self.follows: list[bool] = []
        self.flop_counter = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.follows.append(_lightning.validation_follows(trainer))
        checkpoint = trainer.checkpoint_callback
        assert _lightning.every_n_train_steps(checkpoint) == 0
        assert _lightning.skips_saving(checkpoint, trainer) is False
        assert _lightning.grad_scale(trainer) is None  # fp32: no GradScaler
        if batch_idx == 1:
            _lightning.request_stop(trainer)
            assert trainer.received_sigterm


def test_the_members_behave_as_relied_on_in_a_fit(tmp_path):
    probe = _Probe()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, val_check_interval=2, limit_val_batches=1,
                         num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, callbacks=[probe, ModelCheckpoint(dirpath=tmp_path)])
    model = ImageClassifier(network=SmallCNN(), scheduler="none")
    stopped = None
    try:
        trainer.fit(model, ImageDataModule(batch_size=4, train_size=16, val_size=4))
    except SystemExit as stop:  # SIGTERMException: request_stop() worked
        stopped = stop
    assert stopped is not None and type(stopped).__name__ == "SIGTERMException"
    assert probe.follows == [False, True], "a validation follows the second batch (val_check_interval=2)"
    summary = Summary(model, max_depth=1)
    assert isinstance(_lightning.flop_counter(summary), FlopCounterMode)
