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
