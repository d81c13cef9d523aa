"""The step's lower bound: below every plan's predicted peak, above its fixed parts."""
from __future__ import annotations

import torch

import zoo
from zoo.memory.cards.bound import step_lower_bound
from zoo.memory import predict_step


def test_lower_bound_sits_below_plain_and_checkpointed_peaks_on_h100():
    x = torch.randn(16, 3, 32, 32)
    bound = step_lower_bound(zoo.create_model("resnet20"), x, "h100")
    plain = predict_step(zoo.create_model("resnet20"), x, "h100").peak
    efficient = predict_step(zoo.create_model("resnet20", efficient=True), x, "h100").peak
    assert bound.bytes <= efficient < plain
    assert bound.workspaces == 2 * (32 << 20)  # cuBLAS, forward and backward threads
    assert bound.gradients > 0 and bound.parameters >= bound.gradients
    assert bound.bytes >= bound.parameters + bound.workspaces + bound.gradients
    assert bound.largest_op[1] > bound.gradients  # an activation-sized op, not the gradients


def test_engine_held_bound_is_tighter_and_still_below_every_plan():
    """The gradients the autograd engine holds beside a backward op (a skip connection's) are
    the same for every plan: counting them tightens the bound, which stays below the peaks of
    plain, recompute and offload plans alike."""
    x = torch.randn(16, 3, 32, 32)
    model = zoo.create_model("resnet20")
    bound = step_lower_bound(model, x, "h100")
    assert bound.largest_held[1] > bound.largest_op[1] - bound.gradients
    assert bound.bytes < bound.with_engine
    n = len(model.checkpoint_chain())
    plans = [None, [(i, i + 1, True) for i in range(n)], [(0, n, "offload")],
             [(i, i + 1, "offload") for i in range(n)]]
    for segments in plans:
        model.set_checkpoint_plan(segments)
        assert bound.with_engine <= predict_step(model, x, "h100").peak, segments
