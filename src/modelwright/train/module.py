"""The LightningModule ("the system") around any network: loss, metrics, optimizer and the model's
techniques, each one line of YAML under ``model:``; the network itself by class path under
``model.network``."""

import dataclasses
import inspect
import logging
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch import nn
from torch.nn import functional
from torchmetrics.classification import MulticlassAccuracy

from modelwright import techniques
from modelwright.errors import require
from modelwright.train._internals import given_hyperparameters, hyperparameters_given
from modelwright.train.args import ModelArgs
from modelwright.train.models import ResNet18
from modelwright.train.optim import build_scheduler

__all__ = ["ImageClassifier", "network_spec"]

#: What applying a technique says (a new head, a dropped format): one line on rank 0, as the CLI's own lines.
say = rank_zero_only(logging.getLogger("modelwright").warning)


def network_spec(network: nn.Module) -> dict[str, Any]:
    """A network's ``class_path`` (its ``init_args`` are known only where LightningCLI built it)."""
    return {"class_path": f"{type(network).__module__}.{type(network).__qualname__}", "init_args": {}}


def output_width(network: nn.Module, input_shape: tuple[int, ...]) -> int | None:
    """The logits a network gives for one input of ``input_shape``, counted on the meta device (no memory,
    no compute); None where its forward cannot run there."""
    from modelwright.measure.flops import meta_copy

    try:
        with torch.no_grad():
            out = meta_copy(network).eval()(torch.empty(1, *input_shape, device="meta"))
    except Exception:
        return None
    return int(out.shape[-1]) if isinstance(out, torch.Tensor) and out.ndim == 2 else None


class ImageClassifier(LightningModule):
    """Classifies images with ``network``: cross-entropy, accuracy, the optimizer and schedule, and the
    techniques of :class:`~modelwright.techniques.TechniqueArgs` applied to the network by
    :func:`~modelwright.techniques.prepare_network`. Its arguments are ``network`` and
    :class:`~modelwright.train.args.ModelArgs`' fields (the signature below is built from them: one
    declaration of each)."""

    def __init__(self, network: nn.Module | None = None, **arguments: Any) -> None:
        super().__init__()
        self.args = ModelArgs(**arguments)  # checks the values
        self.net: nn.Module = network if network is not None else ResNet18()
        # Under LightningCLI: the config as given, the network's class_path and init_args among it; else the
        # arguments, the network by its class. (The signature, built from ModelArgs, is not this frame's.)
        hparams = given_hyperparameters()
        if hparams is None:
            hparams = {"network": network_spec(self.net), **dataclasses.asdict(self.args)}
        with hyperparameters_given(hparams):
            self.save_hyperparameters()
        self.num_classes = self.args.num_classes
        self.train_acc: MulticlassAccuracy | None = None
        self.val_acc: MulticlassAccuracy | None = None
        self._configured = False

    def check_data(self, num_classes: int | None, input_shape: tuple[int, ...] | None) -> None:
        """The classes the data have (``num_classes`` of the data module), checked against the network's
        logits where both are known, and what the techniques need of the network; called before any work by
        ``main.py fit`` and the Accelerate loop."""
        techniques.check_network(self.net, self.args)
        width = output_width(self.net, input_shape) if input_shape else None
        classes = self.args.num_classes or num_classes or width
        name = type(self.net).__name__
        if width is not None and classes is not None:
            require(width == classes, f"model.network: {name} gives {width} logits, but the data have "
                    f"{classes} classes; set model.network.init_args.num_classes: {classes} (or the width of "
                    "its last layer)")
        self.num_classes = classes

    def setup(self, stage: str) -> None:
        if self.num_classes is None:
            datamodule = getattr(self.trainer, "datamodule", None)
            self.check_data(getattr(datamodule, "num_classes", None),
                            getattr(datamodule, "input_shape", None))
        require(self.num_classes is not None, f"model.num_classes: the data module says no num_classes and "
                f"{type(self.net).__name__}'s logits could not be counted; set model.num_classes")
        self.train_acc = MulticlassAccuracy(num_classes=self.num_classes).to(self.device)
        self.val_acc = MulticlassAccuracy(num_classes=self.num_classes).to(self.device)

    def configure_model(self) -> None:
        # Runs once, after the strategy has set up devices and before the optimizer is built.
        if self._configured:
            return
        self._configured = True
        shard = None
        if self.device_mesh is not None:  # ModelParallelStrategy: FSDP2 over the data-parallel mesh
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]

            def shard(unit: nn.Module) -> None:
                fully_shard(unit, mesh=mesh)

            if self.args.channels_last:
                # fully_shard refuses non-contiguous parameters (NHWC conv weights): under FSDP2 the run is
                # NCHW, and the record says so (techniques.channels_last false).
                rank_zero_warn("model.channels_last: FSDP2 shards contiguous parameters only; this run uses "
                               "NCHW")
                self.args.channels_last = False
        self.prepared = techniques.prepare_network(self.net, self.args, shard=shard, say=say)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.args.channels_last and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)

    def _shared_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(batch[0])
        loss = functional.cross_entropy(logits, batch[1], label_smoothing=self.args.label_smoothing)
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
        args = self.args
        trained = [param for param in self.parameters() if param.requires_grad]
        optimizer = techniques.build_optimizer(trained, args, lr=args.lr, momentum=args.momentum,
                                               weight_decay=args.weight_decay)
        total_steps = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1
        scheduler = build_scheduler(optimizer, args.scheduler, lr=args.lr, total_steps=total_steps)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _signature() -> inspect.Signature:
    """``network``, then every field of :class:`ModelArgs` with its type and default, keyword arguments as
    LightningCLI's parser reads them."""
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                  inspect.Parameter("network", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    default=None, annotation=nn.Module | None)]
    for argument in dataclasses.fields(ModelArgs):
        default = argument.default
        if argument.default_factory is not dataclasses.MISSING:
            default = argument.default_factory()
        parameters.append(inspect.Parameter(argument.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=argument.type))
    return inspect.Signature(parameters)


def _docstring() -> str:
    """The arguments' help, from the dataclasses' own ``Args:`` sections."""
    network = ("        network: any ``torch.nn.Module`` by class name (ResNet18, SmallCNN, SmallViT) or "
               "class path, with its ``init_args``; null: ResNet18 with 10 classes.")
    sections = [inspect.getdoc(cls).split("Args:\n", 1)[1] for cls in (techniques.TechniqueArgs, ModelArgs)]
    body = "\n".join("\n".join("    " + line for line in section.splitlines()) for section in sections)
    return f"{ImageClassifier.__doc__}\n\n    Args:\n{network}\n{body}\n"


ImageClassifier.__init__.__signature__ = _signature()
ImageClassifier.__init__.__doc__ = _docstring()
