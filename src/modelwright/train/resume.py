"""Exact resume from a checkpoint written mid-epoch: a training DataLoader that knows its place.

Lightning restores weights, optimizer, scheduler and loop counters and continues after the checkpointed
batch, but a plain DataLoader starts the epoch over with a new shuffle from the global RNG, which is not
restored either. A loader's ``state_dict()`` is saved in every checkpoint, yet never loaded when
``configure_optimizers`` reads ``trainer.estimated_stepping_batches`` (Lightning issue #20550, open), so the
state also travels through the LightningDataModule's (restored first) to :class:`ResumableDataLoader`'s
``resume`` argument, which survives Lightning re-creating the loader to insert a DistributedSampler. A state
delivered both ways is applied once.

At the pass's first batch, mid-pass: the same permutation with its first ``batches`` batches skipped by index
(no sample loaded) and the RNG states restored just before the first fetch, so dropout and augmentation
continue the same stream; at a pass boundary: the RNG states restored and a new pass drawn from them. Under
DDP the DistributedSampler keeps the interrupted run's seed, whatever seed the resumed processes were given.
Not exact: a checkpoint written while a batch is in flight, one ending an epoch shortened by
``limit_train_batches``, RNG draws between the checkpoint and the next training batch (a validation after a
step checkpoint), DataLoader worker processes.
"""

import random
from collections.abc import Callable, Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler, RandomSampler

from modelwright.train._internals import SkippingDataLoader


def rng_states() -> dict[str, Any]:
    """The global RNG states a training step may draw from: torch (CPU, current CUDA device), numpy,
    Python."""
    # numpy's as plain lists: Lightning loads checkpoints with torch.load(weights_only=True)
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` returned."""
    torch.set_rng_state(states["torch"])
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


class ResumableRandomSampler(RandomSampler):
    """``RandomSampler`` (without replacement) that remembers the seed of its current permutation.

    Each pass draws its seed from the global torch RNG as ``RandomSampler`` does, so the order is that of
    ``DataLoader(shuffle=True)``; :meth:`load_state_dict` makes the next pass reuse a saved seed.
    """

    def __init__(self, data_source: Sized) -> None:
        super().__init__(data_source)
        self.seed: int | None = None
        self._pending_seed: int | None = None

    def __iter__(self) -> Iterator[int]:
        self.seed = self._pending_seed
        self._pending_seed = None
        if self.seed is None:
            self.seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator().manual_seed(self.seed)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending_seed = state.get("seed")


class ResumableDataLoader(SkippingDataLoader):
    """A ``DataLoader`` whose place in the current pass (batches yielded, sampler seed and epoch, RNG states)
    is part of the training checkpoint; ``resume`` is called at each pass's first batch and a state it returns
    is applied there. A :class:`ResumableRandomSampler` (or one with ``set_epoch``) repeats the interrupted
    order."""

    def __init__(self, *args: Any, resume: Callable[[], dict | None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume = resume
        # batches yielded in the current pass (Lightning does not prefetch from a sized loader)
        self._batches = 0
        self._pending: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        return self._pass(self._new_iterator())  # the iterator now, as DataLoader does (same RNG draws)

    def _pass(self, iterator: Iterator[Any]) -> Iterator[Any]:
        state = self._pending
        self._pending = None
        delivered = None
        if self.resume is not None:
            delivered = self.resume()  # taken either way: applied once
        if state is None:
            state = delivered
        if state is not None:
            iterator = self._resumed_iterator(state)
        for batch in iterator:
            self._batches += 1
            yield batch

    def _new_iterator(self) -> Iterator[Any]:
        self._batches = 0
        return super().__iter__()

    def _resumed_iterator(self, state: dict[str, Any]) -> Iterator[Any]:
        if state.get("distributed_seed") is not None and isinstance(self.sampler, DistributedSampler):
            # Lightning seeds the DistributedSampler it inserts with this process's seed (PL_GLOBAL_SEED);
            # the interrupted run's permutation, this epoch's and the next ones', came from its own.
            self.sampler.seed = state["distributed_seed"]
        batches = state["batches"]
        if not 0 < batches < len(self):  # the checkpoint ended a pass: this one starts from its RNG states
            set_rng_states(state["rng"])
            return self._new_iterator()
        if state["sampler"] is not None and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(state["sampler"])
        if state["epoch"] is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(state["epoch"])
        self.skip_next_pass(batches)
        iterator = self._new_iterator()
        self._batches = batches
        set_rng_states(state["rng"])  # after building the iterator: the interrupted run built its own earlier
        return iterator

    def state_dict(self) -> dict[str, Any]:
        sampler_state = None
        if hasattr(self.sampler, "state_dict"):
            sampler_state = self.sampler.state_dict()
        distributed_seed = None
        if isinstance(self.sampler, DistributedSampler):
            distributed_seed = self.sampler.seed
        return {
            "batches": self._batches,
            "sampler": sampler_state,
            "epoch": getattr(self.sampler, "epoch", None),
            "distributed_seed": distributed_seed,
            "rng": rng_states(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply ``state`` at the first batch of the next pass (or of the current one, if it has none
        yet)."""
        self._pending = dict(state)
