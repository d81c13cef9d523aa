"""The planner's fake mode answers every op as ``FakeTensorMode`` does: its short cache keys
tell apart every call torch's keys tell apart (strides, a view's offset, dtypes, ``1`` from
``1.0``, ``requires_grad``), on a planning of ResNet-20 as on small ops run twice
(the second time from the cache), and a call it does not describe gets torch's own key. The step
counter's own detach of a fake tensor is torch's: same storage, sizes, strides and offset.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import zoo
from zoo.planner import Planner
from zoo.memory.fake_mode import PlannerFakeMode
from zoo.memory.tracker import StepCounter


def _ops(mode: FakeTensorMode) -> list[tuple]:
    """Output metadata of ops that differ only in what a cache key must tell apart."""
    x = mode.from_tensor(torch.randn(4, 6, 5, 5))
    i = mode.from_tensor(torch.arange(12).view(3, 4))
    w = mode.from_tensor(torch.randn(8, 6, 3, 3)).requires_grad_()
    outs = []
    with mode:
        for _ in range(2):  # the second round is answered from the cache
            cl = x.contiguous(memory_format=torch.channels_last)
            for y in (x, x[:2], x[2:], x.transpose(2, 3), cl, x[:, ::2]):
                outs += [y.relu(), y * 2, torch.cat([y, y]), torch.cat((y, y), 1), y.sum(1),
                         y[:, 1:], y.transpose(0, 1)]
            outs += [i + 1, i + 1.0, i * True, i.float().mean(), torch.conv2d(x, w),
                     torch.conv2d(cl, w), torch.conv2d(x, w.detach()), x.to(torch.float64)]
    return [(o.shape, o.stride(), o.storage_offset(), o.dtype, o.requires_grad) for o in outs]


def test_the_fake_mode_answers_every_op_as_torchs_does():
    assert _ops(PlannerFakeMode()) == _ops(FakeTensorMode())


def test_its_keys_tell_apart_what_torchs_do_on_a_planning():
    """Over a whole planning, short key -> torch's key is one to one, and every call was short."""
    torch.manual_seed(0)
    model = zoo.create_model("resnet20")
    short: dict = {}
    fast = PlannerFakeMode._cache_key

    def both(self, state, func, args, kwargs):  # noqa: ANN001
        key = fast(self, state, func, args, kwargs)
        short.setdefault(key, set()).add(FakeTensorMode._cache_key(self, state, func, args,
                                                                   kwargs))
        return key
    PlannerFakeMode._cache_key = both
    try:
        Planner(model, model.example_input(2))
    finally:
        PlannerFakeMode._cache_key = fast
    torchs = [k for keys in short.values() for k in keys]
    assert len(short) > 50 and all(len(keys) == 1 for keys in short.values())
    assert len(set(torchs)) == len(torchs)
    assert all(k.key[0] == "zoo.memory.fake_mode" for k in short)


def _key_kind(mode: PlannerFakeMode, args: tuple) -> str:
    from torch._subclasses.fake_tensor import _BypassDispatchCache, _CacheKeyState
    try:
        key = mode._cache_key(_CacheKeyState(), torch.ops.aten.mul.Tensor, args, {})
    except _BypassDispatchCache:
        return "torch's refusal"
    return "short" if key.key[0] == "zoo.memory.fake_mode" else "torch's"


def test_a_call_the_short_key_does_not_describe_gets_torchs_key():
    mode = PlannerFakeMode()
    x = mode.from_tensor(torch.randn(1))
    with mode:
        c = torch.tensor([2.0])  # a fake tensor that holds its value
    assert c.constant is not None
    assert _key_kind(mode, (x, 2)) == "short"
    assert _key_kind(mode, (c, 2)) == "torch's refusal"  # torch caches no constant
    assert _key_kind(mode, (x, object())) == "torch's"


def test_the_counters_detach_is_torchs():
    mode = PlannerFakeMode()
    x = mode.from_tensor(torch.randn(4, 6, 5)).requires_grad_()
    counter = StepCounter()
    counter.track(x)
    with mode:
        for y in (x, x[1:, 2:].transpose(0, 1)):
            want = torch.ops.aten.detach.default(y)
            with counter:
                got = torch.ops.aten.detach.default(y)
            assert type(got) is type(want) and got.fake_device == want.fake_device
            assert got.untyped_storage()._cdata == y.untyped_storage()._cdata
            assert (got.shape, got.stride(), got.storage_offset(), got.requires_grad) == \
                (want.shape, want.stride(), want.storage_offset(), False)
    assert counter.current == counter.peak == 4 * 6 * 5 * 4  # a detach makes no storage
