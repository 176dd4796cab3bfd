"""Lightning's model summary with the FLOPs this project measures: training FLOPs per micro-batch, per layer."""

import warnings

import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.callbacks.model_summary import log  # where Lightning's summary is printed
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

from callbacks._glue import first_tensor, unwrap_net
from modelwright.measure import meta_copy


class FlopsModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` (``max_depth`` as its) counts a forward of ``example_input_array`` on the device
    (``0 Total Flops`` without one); this counts a forward and backward of a meta-device copy of the network (nothing
    runs) on a micro-batch shaped like the data: the figure the step timer divides by step time for MFU."""

    def _summary(self, trainer, pl_module) -> Summary:
        summary = Summary(pl_module, self._max_depth)  # Lightning's table, its FLOP counter filled here
        counter, counts = summary._flop_counter, {}
        try:
            x = pl_module.example_input_array
            if not isinstance(x, torch.Tensor):  # a micro-batch of the first training sample: its shape is all
                dm = trainer.datamodule
                sample = first_tensor(dm.train_set[0])
                x = sample.expand(dm.hparams["batch_size"], *sample.shape)
            net = meta_copy(unwrap_net(pl_module)).train()
            with counter:  # entering it clears what an example_input_array forward counted
                net(x.to("meta")).float().sum().backward()
            # The summary names a layer "<LightningModule class>.net"; the counter saw the network as its root.
            root, owner = type(net).__name__, f"{type(pl_module).__name__}.net"
            counts = {(owner + name[len(root):] if name == root or name.startswith(root + ".") else name): ops
                      for name, ops in counter.flop_counts.items()}
        except Exception as err:  # a sharded network (FSDP2 cannot be copied), no example: a table without FLOPs
            warnings.warn(f"FlopsModelSummary: FLOPs not counted ({type(err).__name__}: {err})", stacklevel=2)
        counter.flop_counts.clear()
        counter.flop_counts.update(counts)
        return summary

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **summarize_kwargs) -> None:
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *summary_data)
        log.info("\n" + table.replace("Total Flops", "Training FLOPs per micro-batch (forward + backward)"))
