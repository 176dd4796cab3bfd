"""Gradient accumulation through Lightning equals one large batch (a model free of BatchNorm: the ViT)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from modelwright.train.data import ImageDataModule
from modelwright.train.module import ImageClassifier


class GradientCapture(pl.Callback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}


def _first_step_gradient(tmp_path, batch_size: int, accumulate: int) -> dict[str, torch.Tensor]:
    pl.seed_everything(0)
    model = ImageClassifier(model_name="vit", optimizer="sgd", momentum=0.0, weight_decay=0.0, scheduler="none")
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
