"""Exact resume's pieces (modelwright.train.resume) on hand-made loaders: 10 samples in batches of 3 (3, 3, 3, 1),
an interruption after a known number of batches, a resume in a process with another seed. Each resumed order is
compared with the uninterrupted run's, which the same loader gives (no fit runs; tests/test_reliability.py kills
real ones)."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler, TensorDataset

from modelwright.train.resume import ResumableDataLoader, ResumableRandomSampler, rng_states, set_rng_states

DATA = TensorDataset(torch.arange(10))


def _draws() -> list:
    """One draw from each global generator a training step may use (numpy's normal one is the cached half of
    a pair, kept in its state)."""
    return [torch.rand(2).tolist(), random.random(), float(np.random.standard_normal()), float(np.random.rand())]


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_the_random_states_survive_a_weights_only_checkpoint_and_restore_every_generator():
    _seed_all(0)
    np.random.standard_normal()  # numpy now holds the second normal of the pair
    states = rng_states()
    cuda_in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    assert set(states) == {"torch", "python", "numpy"} | ({"cuda"} if cuda_in_use else set())
    name, keys, position, has_gauss, gauss = states["numpy"]
    assert (name, len(keys), type(keys), type(position), has_gauss, type(gauss)) == ("MT19937", 624, list, int, 1,
                                                                                     float)
    expected = _draws()
    buffer = io.BytesIO()
    torch.save(states, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    _seed_all(123)
    set_rng_states(saved)
    assert _draws() == expected


class _FakeCuda:
    """torch.cuda's RNG functions on a machine that has (or has not) CUDA in use."""

    def __init__(self, monkeypatch, available: bool, initialized: bool) -> None:
        self.restored = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: "the cuda state")
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.restored.append)


@pytest.mark.parametrize(("available", "initialized", "saved"), [
    (True, True, "the cuda state"),
    (True, False, None),  # not initialized: reading its state would start CUDA for nothing
    (False, False, None),
])
def test_the_cuda_state_is_kept_only_where_cuda_is_in_use(monkeypatch, available, initialized, saved):
    _FakeCuda(monkeypatch, available, initialized)
    assert rng_states().get("cuda") == saved


@pytest.mark.parametrize(("available", "in_state", "restored"), [
    (True, True, ["the saved cuda state"]),
    (True, False, []),  # a checkpoint written without CUDA resumed with it
    (False, True, []),  # a GPU run's checkpoint resumed on a CPU
])
def test_the_cuda_state_is_restored_only_where_saved_and_cuda_is_there(monkeypatch, available, in_state, restored):
    _seed_all(0)
    states = rng_states()
    if in_state:
        states["cuda"] = "the saved cuda state"
    cuda = _FakeCuda(monkeypatch, available, available)
    set_rng_states(states)
    assert cuda.restored == restored


def _random_sampler_pass(seed: int) -> list[int]:
    """The order ``RandomSampler`` (``DataLoader(shuffle=True)``) gives after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return list(RandomSampler(range(10)))


def test_the_sampler_shuffles_as_random_sampler_and_a_loaded_seed_repeats_that_order_once():
    sampler = ResumableRandomSampler(range(10))
    assert sampler.state_dict() == {"seed": None}, "no pass yet"
    expected = _random_sampler_pass(0)
    torch.manual_seed(0)
    order = list(sampler)
    assert order == expected and sorted(order) == list(range(10))
    state = sampler.state_dict()
    assert state == {"seed": sampler.seed} and isinstance(sampler.seed, int)
    assert order == torch.randperm(10, generator=torch.Generator().manual_seed(sampler.seed)).tolist()
    resumed = ResumableRandomSampler(range(10))
    resumed.load_state_dict(state)
    torch.manual_seed(99)  # another process's generator: the loaded seed, not it, orders the pass
    assert list(resumed) == order and resumed.state_dict() == state
    next_pass = _random_sampler_pass(99)
    torch.manual_seed(99)
    assert list(resumed) == next_pass != order, "the next pass draws its own seed again"
    resumed.load_state_dict({})  # a state without a seed: drawn as ever
    torch.manual_seed(99)
    assert list(resumed) == next_pass


def _shuffled(**kwargs) -> ResumableDataLoader:
    return ResumableDataLoader(DATA, batch_size=3, sampler=ResumableRandomSampler(DATA), **kwargs)


def _distributed(seed: int, epoch: int) -> ResumableDataLoader:
    """Rank 0's loader of two, as Lightning builds it under DDP (5 samples, batches of 2, 2 and 1)."""
    sampler = DistributedSampler(DATA, num_replicas=2, rank=0, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return ResumableDataLoader(DATA, batch_size=2, sampler=sampler)


def _values(batches) -> list[list[int]]:
    return [batch[0].tolist() for batch in batches]


def test_the_state_holds_the_batches_of_the_pass_and_the_samplers_place():
    torch.manual_seed(0)
    loader = _shuffled()
    fresh = loader.state_dict()
    assert set(fresh) == {"batches", "sampler", "epoch", "distributed_seed", "rng"}
    assert (fresh["batches"], fresh["sampler"], fresh["epoch"], fresh["distributed_seed"]) == (0, {"seed": None},
                                                                                            None, None)
    batches = iter(loader)
    next(batches)
    next(batches)
    state = loader.state_dict()
    assert (state["batches"], state["sampler"]) == (2, {"seed": loader.sampler.seed})
    assert torch.equal(state["rng"]["torch"], torch.get_rng_state())
    list(batches)
    assert loader.state_dict()["batches"] == 4
    iter(loader)
    assert loader.state_dict()["batches"] == 0, "a new pass counts from 0 as soon as it is asked for"
    plain = ResumableDataLoader(DATA, batch_size=3)
    next(iter(plain))
    assert {key: plain.state_dict()[key] for key in ("batches", "sampler", "epoch", "distributed_seed")} == {
        "batches": 1, "sampler": None, "epoch": None, "distributed_seed": None}
    distributed = _distributed(seed=5, epoch=3)
    next(iter(distributed))
    assert {key: distributed.state_dict()[key] for key in ("batches", "sampler", "epoch", "distributed_seed")} == {
        "batches": 1, "sampler": None, "epoch": 3, "distributed_seed": 5}


@pytest.mark.parametrize("batches", [1, 2, 3])
def test_a_pass_resumed_mid_way_is_the_rest_of_the_interrupted_one_and_continues_its_random_stream(batches):
    torch.manual_seed(0)
    interrupted = _shuffled()
    pass_ = iter(interrupted)
    seen = _values(next(pass_) for _ in range(batches))
    state = interrupted.state_dict()
    after = torch.rand(2)  # what the step after the checkpoint draws (dropout, ...)
    rest = _values(pass_)
    assert len(seen + rest) == 4 and sorted(sum(seen + rest, [])) == list(range(10))
    torch.manual_seed(123)  # a fresh process
    resumed = _shuffled()
    resumed.load_state_dict(state)
    resumed_pass = iter(resumed)
    first = next(resumed_pass)
    assert torch.equal(torch.rand(2), after), "the global generator goes on from the checkpoint"
    assert _values([first, *resumed_pass]) == rest, "the rest of the interrupted pass, nothing repeated"
    assert resumed.state_dict()["batches"] == 4


@pytest.mark.parametrize("at_end", [False, True])
def test_a_state_at_a_pass_boundary_draws_the_next_pass_from_its_random_state(at_end):
    """At the end of a pass (or before the first): the pass the uninterrupted run went on to."""
    torch.manual_seed(0)
    interrupted = _shuffled()
    if at_end:
        list(interrupted)
    state = interrupted.state_dict()
    assert state["batches"] == (4 if at_end else 0)
    next_pass = _values(interrupted)
    torch.manual_seed(123)
    resumed = _shuffled()
    resumed.load_state_dict(state)
    assert _values(resumed) == next_pass


def _interrupted_after_one_batch() -> tuple[dict, list[list[int]], list[list[int]]]:
    """A state taken after the first batch, the rest of that pass, and the next pass."""
    torch.manual_seed(0)
    interrupted = _shuffled()
    pass_ = iter(interrupted)
    next(pass_)
    state = interrupted.state_dict()
    return state, _values(pass_), _values(interrupted)


def test_the_state_is_applied_once_at_the_first_batch_whichever_way_it_came():
    state, rest, _ = _interrupted_after_one_batch()
    deliveries = []

    def resume() -> dict | None:  # the datamodule's: the state once, then nothing
        deliveries.append(len(deliveries))
        return state if len(deliveries) == 1 else None

    torch.manual_seed(123)
    by_datamodule = _shuffled(resume=resume)
    assert (_values(by_datamodule), deliveries) == (rest, [0])
    assert len(_values(by_datamodule)) == 4 and deliveries == [0, 1], "the next pass is whole"
    torch.manual_seed(123)
    both_ways = _shuffled(resume=resume)  # loaded, and the datamodule's delivery (nothing now) taken
    both_ways.load_state_dict(state)
    assert _values(both_ways) == rest
    assert len(_values(both_ways)) == 4 and deliveries == [0, 1, 2, 3]


def test_a_distributed_samplers_place_is_restored_with_the_interrupted_runs_seed_and_epoch():
    """Lightning gives the resumed process's DistributedSampler that process's seed, and epoch 0 until the
    loop sets it."""
    uninterrupted = _values(_distributed(seed=5, epoch=3))
    assert len(uninterrupted) == 3
    interrupted = _distributed(seed=5, epoch=3)
    next(iter(interrupted))
    resumed = _distributed(seed=9, epoch=0)
    resumed.load_state_dict(interrupted.state_dict())
    assert _values(resumed) == uninterrupted[1:]
    assert (resumed.sampler.seed, resumed.sampler.epoch) == (5, 3), "the next epochs keep the run's seed"


def test_a_state_naming_no_distributed_seed_or_epoch_keeps_the_samplers_own():
    """As a checkpoint written before the state held them, or by one process."""
    uninterrupted = _values(_distributed(seed=5, epoch=3))
    interrupted = _distributed(seed=5, epoch=3)
    next(iter(interrupted))
    state = interrupted.state_dict()
    del state["distributed_seed"]
    state["epoch"] = None
    resumed = _distributed(seed=5, epoch=3)
    resumed.load_state_dict(state)
    assert _values(resumed) == uninterrupted[1:]


def test_a_shuffled_runs_state_resumed_by_a_loader_that_does_not_shuffle_skips_as_many_batches_in_order():
    state, _, _ = _interrupted_after_one_batch()
    in_order = ResumableDataLoader(DATA, batch_size=3)
    in_order.load_state_dict(state)
    assert _values(in_order) == [[3, 4, 5], [6, 7, 8], [9]]
