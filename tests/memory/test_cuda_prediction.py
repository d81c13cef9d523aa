"""A CUDA step's peak and time predicted on the CPU: the exact parts pinned (the recorded H100
rows, read by the prediction command, are tested with it: tests/scripts/test_prediction_rows.py)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from zoo.memory import predict_step, train_step
from zoo.memory.cards.step import run_on_card
from zoo.memory.cards import CARDS, Card, card, fit_host, op_seconds, step_time
from zoo.memory.cards.allocator import (CachingAllocator, SimulatedOutOfMemory, round_size,
                                       segment_size)
from zoo.memory.cards.kernels import EFFICIENT, FLASH, MATH, CudaKernels, sdpa_backend
from zoo.memory.cards.peak import HOPPER_WORKSPACE, CudaCounter, OpRecord, run_counted

MiB = 1 << 20


def test_round_size_is_512_byte_blocks():
    assert [round_size(n) for n in (1, 511, 512, 513, 4096 + 1)] == [512, 512, 512, 1024, 4608]


def test_segment_sizes_follow_the_pools():
    assert segment_size(512) == segment_size(MiB) == 2 * MiB           # small pool
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(10 * MiB + 512) == 12 * MiB                      # rounded to 2 MiB


def test_unsplit_block_counts_whole_and_split_block_does_not():
    alloc = CachingAllocator()
    alloc.free(alloc.malloc(12 * MiB))          # a cached 12 MiB segment
    whole = alloc.malloc(12 * MiB - MiB // 2)   # leaves 0.5 MiB: not split
    assert alloc.allocated == 12 * MiB and whole.size == 12 * MiB
    alloc.free(whole)
    part = alloc.malloc(10 * MiB)               # leaves 2 MiB: split
    assert alloc.allocated == 10 * MiB and alloc.reserved == 12 * MiB
    alloc.free(part)
    assert alloc.allocated == 0 and alloc.peak == 12 * MiB


def test_small_pool_splits_and_merges():
    alloc = CachingAllocator()
    blocks = [alloc.malloc(1000) for _ in range(4)]
    assert alloc.allocated == 4 * 1024 and alloc.reserved == 2 * MiB
    for b in blocks:
        alloc.free(b)
    assert alloc.malloc(2 * MiB - 512).size == 2 * MiB - 512  # one merged block holds it


def test_cap_gives_back_free_segments_then_fails():
    alloc = CachingAllocator(limit=40 * MiB)
    alloc.free(alloc.malloc(30 * MiB))
    alloc.malloc(36 * MiB)  # fits only once the free 30 MiB segment is given back
    assert alloc.reserved == 36 * MiB
    with pytest.raises(SimulatedOutOfMemory):
        alloc.malloc(8 * MiB)


def test_sdpa_backend_follows_torch_selection():
    q = torch.empty(2, 12, 128, 64)
    assert sdpa_backend(q, q, q) == EFFICIENT                            # float32
    assert sdpa_backend(q, q, q, dtype=torch.bfloat16) == FLASH
    mask = torch.ones(2, 1, 128, 128, dtype=torch.bool)
    assert sdpa_backend(q, q, q, mask, dtype=torch.bfloat16) == EFFICIENT  # flash takes no mask
    odd = torch.empty(2, 12, 128, 66)
    assert sdpa_backend(odd, odd, odd) == MATH                           # 66 % 4 != 0


def _saved_bytes(fn, *inputs) -> tuple[int, list[tuple[int, ...]]]:
    """Bytes of the distinct storages autograd saves for ``fn(*inputs)`` as the counter
    counts them (512-byte blocks; the host's RNG seed and offset left out), and the shapes."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        counter = CudaCounter(workspace=0)
        with counter:
            fn(*inputs)
    counted = {t.untyped_storage()._cdata for t in saved} & set(counter._live)
    storages = {t.untyped_storage()._cdata: round_size(t.untyped_storage().nbytes())
                for t in saved if t.untyped_storage()._cdata in counted}
    return sum(storages.values()) + sum(round_size(t.untyped_storage().nbytes())
                                        for t in inputs), [tuple(t.shape) for t in saved]


@pytest.mark.parametrize("dtype, lse_len", [(torch.float32, 160), (torch.bfloat16, 130)])
def test_fused_attention_saves_lse_not_probabilities(dtype, lse_len):
    """B=2, H=3, L=130, D=16 with dropout: q, k, v, the output and a float32 log-sum-exp
    (L rounded up to 32 by the memory-efficient kernel, float32; L by flash, bfloat16)."""
    b, h, length, d = 2, 3, 130, 16
    with FakeTensorMode(), CudaKernels():
        q, k, v = (torch.empty(b, h, length, d, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        total, shapes = _saved_bytes(
            lambda *t: F.scaled_dot_product_attention(*t, dropout_p=0.1), q, k, v)
    item = torch.finfo(dtype).bits // 8
    assert total == round_size(b * h * length * d * item) * 4 + round_size(b * h * lse_len * 4)
    assert (b, h, length, length) not in shapes


def test_cpu_math_path_would_save_probabilities():
    with FakeTensorMode():
        q = torch.empty(2, 3, 130, 16, requires_grad=True)
        total, shapes = _saved_bytes(
            lambda t: F.scaled_dot_product_attention(t, t, t, dropout_p=0.1), q)
    assert (2, 3, 130, 130) in shapes


def test_dropout_keeps_a_one_byte_mask():
    with FakeTensorMode(), CudaKernels():
        x = torch.empty(4, 1000, requires_grad=True)
        total, _ = _saved_bytes(lambda t: F.dropout(t, 0.1), x)
    assert total == round_size(4 * 1000 * 4) + round_size(4 * 1000)  # the input, a bool mask


def test_kernels_are_restored():
    sdpa, dropout = F.scaled_dot_product_attention, F.dropout
    with CudaKernels():
        assert F.dropout is not dropout
    assert F.scaled_dot_product_attention is sdpa and F.dropout is dropout


def test_two_cublas_workspaces_and_exact_linear_peak():
    """nn.Linear(1024, 1024) on a (512, 1024) input: parameters, input, a forward and a
    backward workspace, the output, its loss intermediates and the gradients, all in blocks."""
    with FakeTensorMode():
        model = nn.Linear(1024, 1024)
        x = torch.empty(512, 1024)
        counter = run_counted(train_step(model, x), (model, x))
    assert counter.peak >= 2 * HOPPER_WORKSPACE
    assert counter.allocator.allocated >= 2 * HOPPER_WORKSPACE  # kept after the step
    mats = sum(r.op is torch.ops.aten.addmm or r.op is torch.ops.aten.mm
               for r in counter.records)
    assert mats == 2  # addmm forward, mm for the weight gradient (no input gradient)


def test_roofline_picks_the_bound():
    h100 = card("H100")
    mm = OpRecord(torch.ops.aten.mm, int(66.9e12), 0, torch.float32, False)
    assert math.isclose(op_seconds(mm, h100), 1.0)   # float32 matmul on the CUDA cores
    conv = OpRecord(torch.ops.aten.convolution, int(494.7e12), 0, torch.float32, False)
    assert math.isclose(op_seconds(conv, h100), 1.0)  # TF32 convolution
    relu = OpRecord(torch.ops.aten.relu_, 0, int(3.35e12), torch.float32, False)
    assert math.isclose(op_seconds(relu, h100), 1.0)  # bandwidth
    view = OpRecord(torch.ops.aten.view, 0, 0, torch.float32, False)
    assert op_seconds(view, h100) == 0.0


def test_step_is_the_slower_of_device_and_host():
    from zoo.memory.cards import HostCost
    records = [OpRecord(torch.ops.aten.relu_, 0, int(3.35e9), torch.float32, False)] * 10 + \
        [OpRecord(torch.ops.aten.threshold_backward, 0, 0, torch.float32, True)] * 4 + \
        [OpRecord(torch.ops.aten.relu, 0, 0, torch.float32, True, recompute=True)] * 2 + \
        [OpRecord(torch.ops.aten.detach, 0, 0, torch.float32, True, copy=True)] * 3
    t = step_time(records, 2, "h100", HostCost(1e-3, 1e-4, 1e-2))
    assert math.isclose(t.device, 1e-2)  # the relu_ records at 3.35 GB each
    assert math.isclose(t.host, 12 * 1e-3 + 4 * 1e-4 + 2 * 1e-2) and t.step == t.host


def test_unknown_card_is_one_line():
    with pytest.raises(ValueError, match="unknown card 'v100'; expected one of h100"):
        card("v100")
    mine = Card("mine", 1e12, 2e12, 4e12, 1e11, 8 * 10**9, (7, 5))
    assert card(mine) is mine and mine.workspace < HOPPER_WORKSPACE
    assert set(CARDS) >= {"h100", "h200", "a100", "l4", "rtx4090"}


def test_the_h200_is_an_h100_with_more_and_faster_memory_and_every_card_a_host_link():
    h100, h200 = card("H100"), card("h-200")
    assert (h200.fp32, h200.tf32, h200.bf16, h200.capability) == \
        (h100.fp32, h100.tf32, h100.bf16, h100.capability)
    assert h200.memory == 141 * 10**9 and h200.bandwidth == 4.8e12
    assert h200.host_link == h100.host_link == 2 * card("a100").host_link == 64e9
    assert Card("mine", 1e12, 2e12, 4e12, 1e11, 8 * 10**9, (7, 5)).host_link == 32e9


def test_fit_host_recovers_its_constants():
    rows = [(ops, engine, regions, ops * 30e-6 + engine * 12e-6 + regions * 200e-6)
            for ops, engine, regions in ((600, 1400, 0), (900, 1400, 48), (300, 350, 0),
                                         (800, 700, 30))]
    fit = fit_host(rows)
    assert math.isclose(fit.per_op, 30e-6, rel_tol=1e-6)
    assert math.isclose(fit.per_engine_op, 12e-6, rel_tol=1e-6)
    assert math.isclose(fit.per_region, 200e-6, rel_tol=1e-6)


def test_predict_step_holds_the_workspaces_its_matmuls_need_from_the_start():
    """A step after the first finds the cuBLAS workspaces it made: predict_step holds them from
    the start, as zoo.plan's card steps do (so a plan's peak is predict_step's of the planned
    model), but only for the threads that run a matmul: a convolution-only step makes none."""
    import zoo
    from zoo.memory.cards.on_card import on_card
    from zoo.memory.step import measure_step

    torch.manual_seed(0)
    convs = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))
    x = torch.randn(4, 3, 16, 16)
    held = predict_step(convs, x, "h100").peak
    assert held < HOPPER_WORKSPACE  # none: no matmul ran
    model, images = zoo.create_model("resnet20"), torch.randn(16, 3, 32, 32)
    with on_card("h100"):
        planned = measure_step(model, images)[0]
    assert predict_step(model, images, "h100").peak == planned >= 2 * HOPPER_WORKSPACE


def test_predict_step_on_cards_leaves_the_model_alone():
    """A small MLP: the peak holds the parameters, gradients and workspaces on every card, a
    slower card takes longer, and the model's own tensors are untouched."""
    from zoo.memory import predict_step
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 10))
    before = [p.clone() for p in model.parameters()]
    x = torch.randn(64, 256)
    h100, l4 = predict_step(model, x, "h100"), predict_step(model, x, "l4")
    params = sum(p.numel() * 4 for p in model.parameters())
    assert h100.peak >= 2 * params + 2 * HOPPER_WORKSPACE
    assert l4.peak < h100.peak  # 8 MiB workspaces before compute capability 9
    assert l4.time.device > h100.time.device
    assert all(p.grad is None and torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_regions_and_recompute_ops_are_counted():
    """Three blocks, two under torch's non-reentrant checkpoint: two regions, and the
    recompute's ops flagged as issued from Python (a linear and a ReLU each: the recompute
    stops at the last tensor the backward needs, the ReLU's output)."""
    from torch.utils.checkpoint import checkpoint
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
                           for _ in range(3))
    x = torch.randn(4, 8, requires_grad=True)

    def step():
        h = x
        for i, block in enumerate(blocks):
            h = checkpoint(block, h, use_reentrant=False) if i else block(h)
        h.sum().backward()

    counter = run_counted(step, (blocks, x), workspace=0)
    assert counter.regions == 2
    recomputed = [r.op for r in counter.records if r.recompute]
    assert recomputed.count(torch.ops.aten.addmm) == 2
    assert recomputed.count(torch.ops.aten.relu) == 2
    assert not any(r.recompute for r in counter.records if not r.backward)


def test_card_autocast_follows_cudas_op_lists_not_the_cpus():
    """Under CudaAutocast, CPU autocast casts as CUDA's would: LayerNorm, softmax and the loss
    in float32, matmuls in bfloat16, cat to the widest input; without it (and after it) CPU
    autocast keeps LayerNorm in bfloat16."""
    from zoo.memory.cards.autocast import CudaAutocast

    with FakeTensorMode():
        x = torch.randn(4, 8, requires_grad=True)
        w = torch.randn(8, 8, requires_grad=True)
        with CudaAutocast() as cuda, torch.autocast("cpu", dtype=torch.bfloat16):
            y = F.linear(x, w)
            norm = F.layer_norm(y, (8,))
            loss = F.cross_entropy(y, torch.zeros(4, dtype=torch.long))
            dtypes = (y.dtype, norm.dtype, y.softmax(-1).dtype, torch.cat([y, norm]).dtype,
                      loss.dtype)
        loss.backward()
        assert dtypes == (torch.bfloat16, torch.float32, torch.float32, torch.float32,
                          torch.float32)
        assert w.grad.dtype == torch.float32 and cuda.casts
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert F.layer_norm(F.linear(x, w), (8,)).dtype == torch.bfloat16


def test_card_autocast_casts_convolutions_as_cuda_does():
    """A convolution under CudaAutocast runs in bfloat16, its gradients float32, on every torch
    (the probe of CUDA's kernel needs no CUDA driver, even where the fake convolution asks cuDNN
    for its backend)."""
    from zoo.memory.cards.autocast import CudaAutocast

    with FakeTensorMode():
        x = torch.randn(2, 3, 8, 8)
        conv = nn.Conv2d(3, 4, 3)
        with CudaAutocast() as cuda, torch.autocast("cpu", dtype=torch.bfloat16):
            y = conv(x)
        y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and conv.weight.grad.dtype == torch.float32
    assert torch.bfloat16 in cuda.casts.values()


def test_bf16_on_the_card_halves_what_a_step_keeps_and_runs_on_the_tensor_cores():
    """A transformer block in bfloat16 autocast on the H100: a lower peak than float32, its
    matmuls timed at the BF16 tensor peak (records in bfloat16), and the float32 step as
    before (the probes of CUDA's kernels count no op and no byte)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                          nn.LayerNorm(1024), nn.Linear(1024, 256))
    x = torch.randn(4096, 256)
    fp32 = predict_step(model, x, "h100")
    bf16 = predict_step(model, x, "h100", autocast=torch.bfloat16)
    again = predict_step(model, x, "h100")
    assert (again.peak, again.time) == (fp32.peak, fp32.time)
    assert bf16.peak < fp32.peak and bf16.time.device < fp32.time.device
    counter = run_on_card(model, x, "h100", autocast=torch.bfloat16)
    mms = [r for r in counter.records if r.op in (torch.ops.aten.addmm, torch.ops.aten.mm)]
    assert mms and all(r.dtype == torch.bfloat16 for r in mms)
    norms = [r for r in counter.records if r.op is torch.ops.aten.native_layer_norm]
    assert norms and all(r.dtype == torch.float32 for r in norms)


def test_a_card_plan_of_a_step_without_matmuls_holds_no_workspace():
    """zoo.plan's whole-step check on a card holds only the workspaces the step's matmuls make,
    as predict_step does: a convolution-only model's plan is predicted to the byte."""
    import zoo
    torch.manual_seed(0)
    convs = nn.Sequential(*(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
                                          nn.ReLU()) for _ in range(4)))
    x = torch.randn(8, 8, 32, 32)
    plain = predict_step(convs, x, "h100").peak
    plan = zoo.plan(convs, x, plain - 1, device="h100")
    assert predict_step(convs, x, "h100").peak == plan.predicted_peak < HOPPER_WORKSPACE
