"""The private members of PyTorch's MemTracker that measure/memtracker.py relies on, and what the extension adds
(the pause for evaluations): a torch upgrade that changes them fails here first, by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modelwright.measure import MIB, MemoryAnatomy
from modelwright.measure.memtracker import TRACKER_TYPES, tracker_class


def test_the_members_exist():
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

    tracker = MemTracker()
    for name in ("_WINFO", "_curr_mem_snap", "_peak_mem_snap", "_ref_class", "_mod_tracker", "_in_opt",
                 "memory_tracking"):
        assert hasattr(tracker, name), f"MemTracker.{name}"
    for name in ("_track", "_update_peak_stats", "_update_and_maybe_create_winfos", "_pre_fw_hook",
                 "get_tracker_snapshot", "reset_mod_stats", "track_external"):
        assert callable(getattr(MemTracker, name, None)), f"MemTracker.{name}"
    assert callable(tracker._mod_tracker.__enter__) and callable(tracker._mod_tracker.__exit__)
    assert {"is_bw", "parents"} <= set(dir(tracker._mod_tracker))
    assert _ModState.PEAK_BW
    names = {member.value for member in _MemRefType}
    assert set(TRACKER_TYPES) - {"Inputs", "CommBuffers"} <= names, "MemTracker's reference type names"
    assert issubclass(tracker_class(), MemTracker)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))


def _step(net: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    net(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _captured(evaluate: bool) -> dict[str, float]:
    net = _net()
    optimizer = torch.optim.AdamW(net.parameters())
    x = torch.randn(256, 64)
    _step(net, optimizer, x)  # the optimizer state exists from here
    anatomy = MemoryAnatomy("cpu")
    with anatomy.capture(net, [optimizer]):
        out = net(x)
        if evaluate:  # an evaluation between the forward and the backward of the captured step
            with anatomy.paused(), torch.no_grad():
                net.eval()
                big = net(torch.randn(4096, 64))  # 4096 x 512 floats of hidden activations: 8 MiB
                net.train()
            del big
        out.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return anatomy.peak_mib()


def test_an_evaluation_inside_a_paused_capture_is_not_tracked():
    assert _captured(evaluate=True) == _captured(evaluate=False)


def test_without_the_pause_the_second_call_of_the_root_module_is_refused():
    net = _net()
    anatomy = MemoryAnatomy("cpu")
    with pytest.raises(NotImplementedError, match="multiple iterative calls"), anatomy.capture(net):
        net(torch.randn(8, 64))
        with torch.no_grad():
            net(torch.randn(8, 64))
    assert torch._C._len_torch_dispatch_stack() == 0


def test_the_captured_step_holds_its_activations():
    assert _captured(evaluate=False)["activations"] * MIB >= 256 * 512 * 4  # the hidden layer of the batch


def test_a_metric_updated_between_two_captures_is_tracked_by_both():
    """torchmetrics hashes a metric by its state: a second capture in the process once lost it (KeyError in
    the tracker's module names) after the first had updated it."""
    from torchmetrics.classification import MulticlassAccuracy

    from modelwright.measure.memtracker import tracker_class

    class WithMetric(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 3)
            self.accuracy = MulticlassAccuracy(num_classes=3)

        def forward(self, x):
            logits = self.layer(x)
            self.accuracy(logits, torch.zeros(len(x), dtype=torch.long))
            return logits

    module = WithMetric()
    for _ in range(3):
        tracker = tracker_class()()
        tracker.track_external(module)
        with tracker:
            module(torch.randn(2, 4)).sum().backward()
        module.accuracy(torch.randn(2, 3), torch.ones(2, dtype=torch.long))  # its state, and its hash, change
