"""Lightning's model summary with the FLOPs this project measures: training FLOPs per micro-batch by layer."""

import warnings

import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.callbacks.model_summary import log  # where Lightning's summary is printed
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from callbacks import _lightning
from callbacks._glue import unwrap_net
from modelwright.fmt import flop_count
from modelwright.measure import first_tensor, meta_copy


class FlopsModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` (``max_depth`` as its) counts a forward of ``example_input_array`` on the
    device (``0 Total Flops`` without one); this counts a forward and backward of a meta-device copy of the
    network (nothing runs) on a micro-batch shaped like the data: the figure the step probe divides by step
    time for MFU. FLOPs print as FLOP counts (``426 GFLOP``), not in Lightning's units for parameters (``426
    B``)."""

    def _summary(self, trainer, pl_module) -> Summary:
        summary = Summary(pl_module, self._max_depth)  # Lightning's table, its FLOP counter filled here
        counter = _lightning.flop_counter(summary)
        counts = {}
        try:
            counts = self._layer_flops(trainer, pl_module, counter)
        except Exception as err:  # a sharded network (FSDP2 cannot be copied), no example: no FLOPs column
            warnings.warn(f"FlopsModelSummary: FLOPs not counted ({type(err).__name__}: {err})", stacklevel=2)
        counter.flop_counts.clear()
        counter.flop_counts.update(counts)
        return summary

    @staticmethod
    def _layer_flops(trainer, pl_module, counter) -> dict:
        example = pl_module.example_input_array
        if not isinstance(example, torch.Tensor):  # a micro-batch shaped like the first training sample
            datamodule = trainer.datamodule
            sample = first_tensor(datamodule.train_set[0])
            example = sample.expand(datamodule.hparams["batch_size"], *sample.shape)
        network = meta_copy(unwrap_net(pl_module)).train()
        with counter:  # entering it clears what an example_input_array forward counted
            network(example.to("meta")).float().sum().backward()
        # The summary names a layer "<LightningModule class>.net"; the counter saw the network as its root.
        root = type(network).__name__
        owner = f"{type(pl_module).__name__}.net"
        renamed = {}
        for name, ops in counter.flop_counts.items():
            inside = name == root or name.startswith(root + ".")
            renamed[owner + name[len(root):] if inside else name] = ops
        return renamed

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **summarize_kwargs) -> None:
        columns = [(name, [_as_flops(v) for v in values] if name == "FLOPs" else values)
                   for name, values in summary_data]
        table = _lightning.format_summary_table(total_parameters, trainable_parameters, model_size,
                                                total_training_modes, total_flops, *columns)
        total = get_human_readable_count(total_flops)
        flops = flop_count(total_flops)
        ours = f"{flops:<{max(10, len(flops) + 1)}}Training FLOPs per micro-batch (forward + backward)"
        table = table.replace(f"{total:<10}Total Flops", ours)
        log.info("\n" + table)


def _as_flops(text: str) -> str:
    """A FLOPs cell of Lightning's table (``426 B``, ``1.2 M``, ``0``) as a FLOP count (``426 GFLOP``)."""
    scales = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    number, _, unit = str(text).strip().partition(" ")
    try:
        return flop_count(float(number) * scales.get(unit, 1))
    except ValueError:
        return text
