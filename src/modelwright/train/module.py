"""The LightningModule ("the system") around a plain network: loss, metrics, optimizer and technique switches,
each technique one typed argument and so one line of YAML under ``model:``."""

from typing import Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.nn import functional
from torchmetrics.classification import MulticlassAccuracy

from modelwright.train.args import ModelArgs, from_hparams
from modelwright.train.models import apply_gradient_checkpointing, build_model, checkpoint_segments
from modelwright.train.optim import build_optimizer, build_scheduler

__all__ = ["ImageClassifier", "build_optimizer", "build_scheduler"]


class ImageClassifier(LightningModule):
    """Classifies 3×32×32 images with a network chosen by name.

    Args:
        model_name: ``resnet18`` (32×32 stem), ``smallcnn`` or ``vit``.
        num_classes: number of output classes.
        optimizer: ``sgd`` (with Nesterov momentum) or ``adamw``.
        lr: peak learning rate.
        momentum: SGD momentum (ignored by AdamW).
        weight_decay: decoupled for AdamW, L2 for SGD.
        optimizer_impl: ``auto`` lets PyTorch choose; ``for-loop``, ``foreach`` or ``fused`` force one.
        scheduler: learning-rate schedule over the whole fit, stepped per optimizer step.
        gradient_checkpointing: ``off``, ``stage`` or ``block``: which segments recompute in backward.
        channels_last: keep weights and inputs in NHWC memory format.
        compile: compile the network with ``torch.compile``.
        label_smoothing: cross-entropy label smoothing.
    """

    def __init__(
        self,
        model_name: Literal["resnet18", "smallcnn", "vit"] = "resnet18",
        num_classes: int = 10,
        optimizer: Literal["sgd", "adamw"] = "adamw",
        lr: float = 2e-3,
        momentum: float = 0.9,
        weight_decay: float = 5e-2,
        optimizer_impl: Literal["auto", "for-loop", "foreach", "fused"] = "auto",
        scheduler: Literal["none", "cosine", "onecycle"] = "onecycle",
        gradient_checkpointing: Literal["off", "stage", "block"] = "off",
        channels_last: bool = False,
        compile: bool = False,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        from_hparams(ModelArgs, self.hparams)  # checks the values
        self.net: nn.Module = build_model(model_name, num_classes)
        # Raises a ConfigError now, at instantiation, for a granularity this network lacks.
        checkpoint_segments(self.net, gradient_checkpointing)
        self.train_acc = MulticlassAccuracy(num_classes=num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes)
        self._configured = False

    def configure_model(self) -> None:
        # Runs once, after the strategy has set up devices and before the optimizer is built.
        if self._configured:
            return
        self._configured = True
        apply_gradient_checkpointing(self.net, self.hparams.gradient_checkpointing)
        if self.hparams.channels_last and self.device_mesh is not None:
            # fully_shard refuses non-contiguous parameters (NHWC conv weights): under FSDP2 the run is NCHW,
            # and the record says so (techniques.channels_last false).
            rank_zero_warn("model.channels_last: FSDP2 shards contiguous parameters only; this run uses NCHW")
            self.hparams.channels_last = False
        if self.hparams.channels_last:
            self.net.to(memory_format=torch.channels_last)
        # ModelParallelStrategy: FSDP2 over the data-parallel mesh, per block
        if self.device_mesh is not None:
            from torch.distributed.fsdp import fully_shard

            for part in [*checkpoint_segments(self.net, "block"), self.net]:
                fully_shard(part, mesh=self.device_mesh["data_parallel"])
        if self.hparams.compile:
            self.net.compile()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hparams.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)

    def _shared_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(batch[0])
        loss = functional.cross_entropy(logits, batch[1], label_smoothing=self.hparams.label_smoothing)
        return loss, logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, logits = self._shared_step(batch)
        self.train_acc(logits, batch[1])
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, logits = self._shared_step(batch)
        self.val_acc(logits, batch[1])
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # Free the gradients now, as a raw loop does: Lightning zeroes them only after the next forward, which
        # keeps 4 bytes per parameter alive through that forward's activation peak. Lightning calls this once
        # per optimizer step, after the last micro-batch, so accumulation is untouched.
        optimizer.zero_grad(set_to_none=True)

    def configure_optimizers(self):
        hparams = self.hparams
        trained = [param for param in self.parameters() if param.requires_grad]
        optimizer = build_optimizer(trained, optimizer=hparams.optimizer, lr=hparams.lr,
                                    momentum=hparams.momentum, weight_decay=hparams.weight_decay,
                                    optimizer_impl=hparams.optimizer_impl)
        total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = build_scheduler(optimizer, hparams.scheduler, lr=hparams.lr, total_steps=total_steps)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
