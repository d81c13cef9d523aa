"""The profiler's pattern runs take no saved-tensor hook: what they read (levels at each phase's
start, peaks, FLOPs and recompute FLOPs) is the same as in a run with the hook, byte for byte,
on a conv-BN chain, a concatenating chain and with blocks in their own checkpoint modes. They
run only as many times as the contexts a schedule reads need: two where no unit holds its input
in the unit before, none where every unit runs stored at the top level only (a save set), with
the same plans as four runs give. A storage is known by a key no later storage of the step
shares (its address is reused once it is freed), and no figure depends on when Python's cyclic
collector runs (the planner pauses it).
"""
from __future__ import annotations

import contextlib
import gc

import pytest
import torch

import zoo
import zoo.planner.choose as planner
import zoo.planner.profiling.profile as profile
from test_planner_modes import small
from zoo.models.densenet import DenseNet
from zoo.planner import Planner
from zoo.planner.profiling.contexts import blocks_of, nested_pattern
from zoo.memory import default_loss
from zoo.memory.fake import FakeStep
from zoo.planner.profiling.trace import traced_step
from zoo.memory.tracker import StepCounter, storage_key


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


def _model(family: str) -> tuple[torch.nn.Module, torch.Tensor]:
    if family != "densenet40-like":
        return small(family)
    torch.manual_seed(0)  # BN-ReLU-conv3x3 layers, no bottleneck, 3 x 3 layers
    model = DenseNet(growth_rate=12, block_config=(3, 3, 3), num_init_features=24,
                     num_classes=10, stem="cifar", bn_size=None, compression=1.0)
    return model, model.example_input(4)


@pytest.mark.parametrize("family,plain_steps,set_steps", [
    ("densenet40-like", 3, 1), ("densenet", 3, 1), ("resnet", 5, 5)])
def test_the_pattern_runs_only_where_a_schedule_reads_what_they_show(
        family, plain_steps, set_steps, monkeypatch):
    """No DenseNet layer keeps its output in a plain step (the next one reads the
    concatenation), so two pattern runs show every context; with ``ops:matmul`` every layer
    runs stored at the top level only, in its plain step's context: no pattern run. A ResNet
    block holds its input in the block before (the next conv saves the ReLU's output), and its
    in-place ReLU blocks take no save set: four runs each. The plans are the ones all four
    runs give, and most of a DenseNet's take the save set."""
    model, x = _model(family)
    calls = []
    traced = profile.traced_step
    monkeypatch.setattr(profile, "traced_step", lambda *a, **k: calls.append(1) or traced(*a, **k))
    plain = profile.profile_chain(model, x)
    assert (len(calls), plain.n_units > 4) == (plain_steps, True)
    calls.clear()
    matmul = profile.profile_chain(model, x, block_mode="ops:matmul")
    assert len(calls) == set_steps
    assert any(matmul.opaque) and all(matmul.opaque) == family.startswith("densenet")
    lean = Planner(model, x, modes=False).choices
    monkeypatch.setattr(profile, "_pattern_runs", lambda *a: 4)
    full = Planner(model, x, modes=False).choices
    assert [(c.predicted_peak, c.recompute_flops, c.segments, c.block_modes) for c in lean] == \
        [(c.predicted_peak, c.recompute_flops, c.segments, c.block_modes) for c in full]
    with_set = [c for c in lean if "ops:matmul" in (c.block_modes or ())]
    assert len(with_set) > len(lean) // 2 or family != "densenet40-like"


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


def test_no_plan_depends_on_when_the_cyclic_collector_runs(monkeypatch):
    """The planner pauses Python's cyclic collector while its fake steps run and lets it run
    again after; with it running all through, every ten allocations, every plan and figure is
    the same (no fake storage lives in a reference cycle)."""
    model, x = small("densenet")
    seen = []
    traced = profile.traced_step
    monkeypatch.setattr(profile, "traced_step",
                        lambda *a, **k: seen.append(gc.isenabled()) or traced(*a, **k))
    assert gc.isenabled()
    paused = [(c.predicted_peak, c.recompute_flops, c.segments, c.block_modes, c.mode)
              for c in Planner(model, x).choices]
    assert seen and not any(seen) and gc.isenabled()
    seen.clear()
    monkeypatch.setattr(planner, "collector_paused", contextlib.nullcontext)
    threshold = gc.get_threshold()
    gc.set_threshold(10, 1, 1)
    try:
        running = [(c.predicted_peak, c.recompute_flops, c.segments, c.block_modes, c.mode)
                   for c in Planner(model, x).choices]
    finally:
        gc.set_threshold(*threshold)
    assert all(seen) and running == paused
