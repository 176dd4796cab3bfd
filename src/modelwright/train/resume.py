"""Exact resume from a checkpoint written in the middle of an epoch: a training DataLoader that knows its place.

Lightning 2.6 restores weights, optimizer, scheduler and loop counters on ``fit(ckpt_path=...)`` and continues at
the batch after the checkpointed one, but a plain DataLoader starts the epoch over with a new shuffle from the
global RNG, which is not restored either. A loader with ``state_dict()`` is saved in every checkpoint, yet its
state is never loaded when ``configure_optimizers`` reads ``trainer.estimated_stepping_batches`` (OneCycleLR and
cosine do): the loader is iterated before the loop state is restored (Lightning issue #20550, open).

So the position also travels through the LightningDataModule, whose state Lightning restores first:
:class:`TrainLoaderResume` saves the position of the loader in use and hands it, on resume, to the loader's first
pass through the ``resume`` argument of :class:`ResumableDataLoader` (an ``__init__`` argument survives Lightning
re-creating the loader to insert a DistributedSampler). A state delivered both ways is applied once.

The state is ``{"batches": batches yielded in the pass, "sampler": the shuffle's seed, "epoch": the sampler's
epoch (DistributedSampler), "rng": torch (CPU, current CUDA device), numpy and Python RNG states}``, applied at
the pass's first batch: mid-pass, the same permutation with its first ``batches`` batches skipped by index (no
sample loaded) and the RNG states restored just before the first fetch, so dropout and augmentation continue the
same stream; at a pass boundary, the RNG states restored and a new pass drawn from them. An uninterrupted run
draws the same permutations as ``DataLoader(shuffle=True)``.

Counting is by batches *yielded* (Lightning does not prefetch from a loader with a length). Not exact, and said
here: a checkpoint written while a batch is in flight (by an exception handler other than SIGTERM's), one ending
an epoch shortened by ``limit_train_batches``, RNG draws between the checkpoint and the next training batch that
the resumed run does not repeat (a validation after a step checkpoint, ``on_train_epoch_start`` hooks), and the
RNG of DataLoader worker processes (``num_workers > 0``: reseeded on resume).
"""

from __future__ import annotations

import collections
import itertools
import random
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

try:
    import numpy as np
except ImportError:  # numpy is optional for torch
    np = None

ResumeSource = Callable[[], "dict[str, Any] | None"]


def rng_states() -> dict[str, Any]:
    """The global RNG states a training step may draw from: torch (CPU, current CUDA device), numpy, Python."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if np is not None:  # as plain lists: Lightning loads checkpoints with torch.load(weights_only=True)
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        states["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` returned (keys it lacks are left alone)."""
    torch.set_rng_state(states["torch"])
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    if np is not None and "numpy" in states:
        name, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


class ResumableRandomSampler(RandomSampler):
    """``RandomSampler`` (without replacement) that remembers the seed of its current permutation.

    Each pass draws its seed from the global torch RNG exactly as ``RandomSampler`` does, so the order is
    the same as ``DataLoader(shuffle=True)``; :meth:`load_state_dict` makes the next pass reuse a saved seed.
    Lightning replaces it, as any ``RandomSampler``, with a ``DistributedSampler`` under DDP.
    """

    def __init__(self, data_source: Sized) -> None:
        super().__init__(data_source)
        self.seed: int | None = None
        self._pending_seed: int | None = None

    def __iter__(self) -> Iterator[int]:
        if self._pending_seed is not None:
            self.seed, self._pending_seed = self._pending_seed, None
        else:
            self.seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(self.seed)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending_seed = state.get("seed")


class _SkipFirst:
    """The loader's index sampler, whose next pass can leave out its first ``skip`` items (once: a DataLoader
    with persistent workers re-iterates this same object every epoch)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.skip = 0

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.sampler)
        skip, self.skip = self.skip, 0
        collections.deque(itertools.islice(it, skip), maxlen=0)
        yield from it


class _Pass:
    """One pass over the loader: applies a delivered state at the first batch, counts the batches it yields."""

    def __init__(self, loader: ResumableDataLoader) -> None:
        self._loader = loader
        self._iterator: Iterator[Any] = loader._new_iterator()  # now, as DataLoader does (same RNG draws)
        self._started = False

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> Any:
        if not self._started:
            self._started = True
            state = self._loader._take_resume()
            if state is not None:
                self._iterator = self._loader._resumed_iterator(state)
        batch = next(self._iterator)
        self._loader._batches += 1
        return batch

    def __len__(self) -> int:
        return len(self._loader)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose position in the current pass is part of the training checkpoint.

    Args:
        *args: ``DataLoader``'s; give it a :class:`ResumableRandomSampler` (or a sampler with ``set_epoch``,
            such as ``DistributedSampler``) for a resumed pass to repeat the interrupted one's order.
        resume: called at the first batch of each pass; a state it returns (from :meth:`state_dict`) is
            applied there. :class:`TrainLoaderResume` provides one.
        **kwargs: ``DataLoader``'s.
    """

    def __init__(self, *args: Any, resume: ResumeSource | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume = resume
        self._batches = 0  # batches yielded in the current pass
        self._skipper: _SkipFirst | None = None
        self._pending: dict[str, Any] | None = None

    @property
    def _index_sampler(self) -> _SkipFirst:
        if self._skipper is None:
            self._skipper = _SkipFirst(super()._index_sampler)
        return self._skipper

    def __iter__(self) -> _Pass:
        return _Pass(self)

    def _new_iterator(self) -> Iterator[Any]:
        self._batches = 0
        return super().__iter__()

    def _take_resume(self) -> dict[str, Any] | None:
        state, self._pending = self._pending, None
        delivered = self.resume() if self.resume is not None else None
        return state if state is not None else delivered

    def _resumed_iterator(self, state: dict[str, Any]) -> Iterator[Any]:
        batches = int(state.get("batches") or 0)
        if not 0 < batches < len(self):  # the checkpoint ended a pass: this one starts from its RNG states
            if state.get("rng") is not None:
                set_rng_states(state["rng"])
            return self._new_iterator()
        if state.get("sampler") is not None and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(state["sampler"])
        if state.get("epoch") is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(state["epoch"])
        self._index_sampler.skip = batches
        iterator = self._new_iterator()
        self._batches = batches
        if state.get("rng") is not None:  # after building the iterator: the interrupted run built its own earlier
            set_rng_states(state["rng"])
        return iterator

    def state_dict(self) -> dict[str, Any]:
        sampler_state = self.sampler.state_dict() if hasattr(self.sampler, "state_dict") else None
        return {
            "batches": self._batches,
            "sampler": sampler_state,
            "epoch": getattr(self.sampler, "epoch", None),
            "rng": rng_states(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply ``state`` at the first batch of the next pass (or of the current one, if it has none yet)."""
        self._pending = dict(state)


class TrainLoaderResume:
    """Carries the training loader's position from a checkpoint to the resumed fit's loader, through the
    LightningDataModule's ``state_dict``/``load_state_dict`` (see the module docstring for why).

    The datamodule returns :meth:`state_dict` from its own ``state_dict``, passes its ``load_state_dict``
    argument to :meth:`load_state_dict`, and builds its training loader with ``resume=self.<this>.take``.
    """

    def __init__(self) -> None:
        self.pending: dict[str, Any] | None = None

    @staticmethod
    def state_dict(trainer: Any) -> dict[str, Any]:
        """``{"train_loader": state}`` of the loader ``trainer`` trains from, if it is resumable."""
        loader = getattr(trainer, "train_dataloader", None) if trainer is not None else None
        return {"train_loader": loader.state_dict()} if isinstance(loader, ResumableDataLoader) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = state.get("train_loader")

    def take(self) -> dict[str, Any] | None:
        """The pending state, once."""
        state, self.pending = self.pending, None
        return state
