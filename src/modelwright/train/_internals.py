"""The one place where the training core leans on what torch and Lightning do not promise: a DataLoader's
index sampler, the layout of a Lightning checkpoint (and of a sharded one's folder), the keys LightningCLI
adds to saved hyperparameters, and the names of Lightning's loggers. ``tests/test_internals.py`` fails when a
library changes any of them."""

import contextlib
import functools
import itertools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch.utils.data import DataLoader

#: Keys LightningCLI puts into ``save_hyperparameters()`` beside a class's own arguments.
CLI_HPARAM_KEYS = ("_instantiator", "_class_path")
#: The file of a sharded (distributed) Lightning checkpoint folder that holds all but the tensors.
SHARDED_METADATA_FILE = _METADATA_FILENAME
#: The loggers Lightning writes its start-up lines to ("Seed set to 0", "GPU available: ...").
LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")
#: The same, and the project's own (its notes on the config).
STARTUP_LOGGERS = (*LIGHTNING_LOGGERS, "modelwright")


class _SkipFirst:
    """A loader's index sampler whose next pass can leave out its first ``skip`` items (once: a DataLoader
    with persistent workers re-iterates this same object every epoch)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.skip = 0

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        skip = self.skip
        self.skip = 0
        return itertools.islice(iter(self.sampler), skip, None)


class SkippingDataLoader(DataLoader):
    """A ``DataLoader`` whose next pass can start ``batches`` batches in, by index: no sample of the skipped
    batches is loaded. (``DataLoader._index_sampler`` is what every iterator, worker processes included, draws
    indices from.)"""

    @functools.cached_property
    def _index_sampler(self) -> _SkipFirst:
        return _SkipFirst(super()._index_sampler)

    def skip_next_pass(self, batches: int) -> None:
        self._index_sampler.skip = batches


def fit_progress(checkpoint: Mapping) -> tuple[int, int]:
    """``(epochs finished, optimizer steps)`` of the fit a Lightning checkpoint was saved in."""
    epochs = checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"]
    return int(epochs), int(checkpoint["global_step"])


def own_hyperparameters(saved: Mapping | None) -> dict:
    """A class's saved hyperparameters without the keys LightningCLI adds."""
    return {key: value for key, value in (saved or {}).items() if key not in CLI_HPARAM_KEYS}


class _Holding(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class HeldLogs:
    """The lines of ``loggers`` (default :data:`STARTUP_LOGGERS`), held back from :meth:`hold` until
    :meth:`release` (then written as they would have been) or :meth:`drop` (a refused run prints none of
    them)."""

    def __init__(self, loggers: tuple[str, ...] = STARTUP_LOGGERS) -> None:
        self.loggers = loggers
        self._holding: _Holding | None = None
        self._saved: list[tuple[logging.Logger, list[logging.Handler], bool]] = []

    def hold(self) -> None:
        if self._holding is not None:
            return
        self._holding = _Holding()
        for name in self.loggers:
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.handlers[:], logger.propagate))
            logger.handlers = [self._holding]
            logger.propagate = False

    def _restore(self) -> list[logging.LogRecord]:
        held = self._holding.records if self._holding is not None else []
        for logger, handlers, propagate in self._saved:
            logger.handlers = handlers
            logger.propagate = propagate
        self._saved = []
        self._holding = None
        return held

    def release(self) -> None:
        for record in self._restore():
            logging.getLogger(record.name).handle(record)

    def drop(self) -> None:
        self._restore()

    @contextlib.contextmanager
    def dropped_unless_released(self) -> Iterator["HeldLogs"]:
        try:
            yield self
        finally:
            self.drop()


@contextlib.contextmanager
def hyperparameters_given(hparams: dict) -> Iterator[None]:
    """``save_hyperparameters()`` inside takes ``hparams`` as LightningCLI hands them over (with
    LightningCLI's instantiator, which ``load_from_checkpoint`` uses to build the class again), not the
    calling frame's arguments
    (``lightning.pytorch.core.mixins.hparams_mixin._given_hyperparameters_context``)."""
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters_context

    with _given_hyperparameters_context(hparams, "lightning.pytorch.cli.instantiate_module"):
        yield


def given_hyperparameters() -> dict | None:
    """The hyperparameters LightningCLI hands the class it instantiates (the config as given, a network's
    ``class_path`` and ``init_args`` included), or None outside LightningCLI
    (``lightning.pytorch.core.mixins.hparams_mixin._given_hyperparameters``)."""
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters

    given = _given_hyperparameters.get()
    return None if given is None else dict(given)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A process group of ``world_size`` ranks in this one process, this process rank 0, whose collectives
    move no data (torch's test backend ``fake``, ``torch.testing._internal.distributed.fake_pg``): DDP's
    buckets and FSDP2's gathered and scattered blocks are allocated as on rank 0 of a real job."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def set_device_mesh(module: Any, mesh: Any) -> None:
    """What Lightning's ModelParallelStrategy does before ``configure_model``: the LightningModule's
    ``device_mesh`` (its private ``_device_mesh``)."""
    module._device_mesh = mesh


def fake_allreduce_hook(state, bucket):  # noqa: ANN001, ANN201 (DDP checks the annotations it finds)
    """DDP's default all-reduce of a gradient bucket (divided by the ranks, then summed over them) for the
    fake process group, whose work gives DDP no tensor back: the collective is dispatched (the memory tracker
    sees the bucket handed to it) and the bucket itself is the result."""
    import torch
    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    dist.all_reduce(buffer)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future
