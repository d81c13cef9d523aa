"""The profiler's pattern runs take no saved-tensor hook: what they read (levels at each phase's
start, peaks, FLOPs and recompute FLOPs) is the same as in a run with the hook, byte for byte,
on a conv-BN chain, a concatenating chain and with blocks in their own checkpoint modes. A
storage is known by a key no later storage of the step shares (its address is reused once it is
freed).
"""
from __future__ import annotations

import pytest
import torch

import zoo
from zoo.planner.contexts import blocks_of, nested_pattern
from zoo.planner.fake import FakeStep, default_loss
from zoo.planner.trace import traced_step
from zoo.planner.tracker import StepCounter, storage_key


@pytest.mark.parametrize("name,mode", [("resnet20", None), ("resnet20", "halves"),
                                       ("densenet40", None), ("densenet40", "bottleneck")])
def test_a_pattern_run_reads_the_same_without_the_saved_tensor_hook(name, mode):
    torch.manual_seed(0)
    model = zoo.create_model(name)
    x = model.example_input(2)
    fake = FakeStep(model, x)
    n = len(model.checkpoint_chain())
    units = [(j, j + 1) for j in range(n)]
    for shift in range(4):
        segments = blocks_of(units, nested_pattern(n, shift)[0])
        hooked, peak, flops = traced_step(model, x, default_loss, segments, mode, fake=fake)
        bare, bare_peak, bare_flops = traced_step(model, x, default_loss, segments, mode,
                                                  fake=fake, saves=False)
        assert (bare_peak, bare_flops) == (peak, flops)
        assert bare.mark == hooked.mark and bare.peak == hooked.peak
        assert bare.flops == hooked.flops and bare.rflops == hooked.rflops
        assert hooked.saved  # the hook saw what the blocks saved; without it only the
        assert bool(bare.saved) == (mode is not None)  # blocks' own regions' inputs are seen


def test_a_storage_made_after_another_is_freed_never_takes_its_key():
    """What a block saved is matched with later blocks' inputs and outputs by key: an address
    reused by a later storage made a frozen stem's output look kept in some runs only."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    counter = StepCounter()
    with FakeTensorMode(), counter:
        keys, addresses = [], []
        for _ in range(50):
            t = torch.empty(1000) * 2
            keys.append(counter.key(t))
            addresses.append(storage_key(t))
            del t
    assert counter.current == 0
    assert len(set(keys)) == 50
    assert len(set(addresses)) < 50  # the addresses were reused: what the keys guard against
