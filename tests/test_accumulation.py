"""Lightning's stepping: accumulation equals one large batch (the ViT: no BatchNorm); gradients freed after a step."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from modelwright.train.data import ImageDataModule
from modelwright.train.models import SmallCNN, SmallViT
from modelwright.train.module import ImageClassifier


class GradientCapture(pl.Callback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}


def _first_step_gradient(tmp_path, batch_size: int, accumulate: int) -> dict[str, torch.Tensor]:
    pl.seed_everything(0)
    model = ImageClassifier(network=SmallViT(), optimizer="sgd", momentum=0.0, weight_decay=0.0, scheduler="none")
    data = ImageDataModule(batch_size=batch_size, train_size=16, val_size=8)
    capture = GradientCapture()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, accumulate_grad_batches=accumulate, callbacks=[capture], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, data)
    return capture.grads


def test_accumulated_gradient_equals_large_batch(tmp_path):
    large = _first_step_gradient(tmp_path, batch_size=8, accumulate=1)
    micro = _first_step_gradient(tmp_path, batch_size=2, accumulate=4)
    assert large.keys() == micro.keys() and large
    num = sum(((large[n] - micro[n]) ** 2).sum() for n in large).sqrt()
    den = sum((g**2).sum() for g in large.values()).sqrt()
    assert num / den < 1e-5, f"relative error {float(num / den):.2e}"
    # And the check can fail: a different batch gives a different gradient.
    other = _first_step_gradient(tmp_path, batch_size=4, accumulate=1)
    num_other = sum(((large[n] - other[n]) ** 2).sum() for n in large).sqrt()
    assert num_other / den > 1e-3


def _fit_anatomy(tmp_path, monkeypatch, free_after_step: bool):
    """A 2-step smallcnn fit whose second step's memory is captured by the RunMonitor."""
    from callbacks.run_monitor import RunMonitor

    if not free_after_step:  # Lightning's own order: gradients freed only after the next forward
        monkeypatch.setattr(ImageClassifier, "optimizer_step", pl.LightningModule.optimizer_step)
    pl.seed_everything(0)
    model = ImageClassifier(network=SmallCNN(), scheduler="none")
    monitor = RunMonitor(warmup_steps=1, summary=False, record_path=str(tmp_path / 'record.json'))
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, callbacks=[monitor], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
    )
    trainer.fit(model, ImageDataModule(batch_size=8, train_size=16, val_size=8))
    return monitor.probe.anatomy_mib, model


def test_gradients_are_freed_after_the_optimizer_step(tmp_path, monkeypatch):
    freed, model = _fit_anatomy(tmp_path, monkeypatch, free_after_step=True)
    kept, reference = _fit_anatomy(tmp_path, monkeypatch, free_after_step=False)
    gradient_mib = 576_170 * 4 / 2**20  # smallcnn's fp32 parameters
    # Lightning's order holds the previous step's full gradients at the peak (the end of the forward); freed
    # after the step, the peak moves into backward, where only part of the new gradients exist yet.
    assert kept["gradients"] == pytest.approx(gradient_mib, rel=1e-3)
    assert freed["gradients"] < 0.9 * gradient_mib
    assert 0.4 * gradient_mib < kept["total"] - freed["total"] <= gradient_mib + 1e-3
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), "freeing the gradients earlier must not change the training"
