"""The chain of regions that the per-region commands (``checkpoint``, ``overhead``, ``host-cost``)
measure: every checkpoint trains its own copy of it as no checkpoint does, from the same weights,
so what they compare is each checkpoint's own work on the same step."""
from __future__ import annotations

import pytest
import torch

from zoo.memory import train_step

from bench.region_chain import BLOCKS, CHECKPOINTS, chain_input, make_chain, with_checkpoint


def _grads(chain: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(0)  # the same dropout masks
    x.grad = None
    train_step(chain, x)()
    return [x.grad, *(p.grad for p in chain.parameters())]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("checkpoint", [c for c in CHECKPOINTS if c != "none"])
def test_every_checkpoint_trains_the_chain_as_none_does(block: str, checkpoint: str) -> None:
    plain = make_chain(3, 4, block=block)
    twin = with_checkpoint(plain, checkpoint)
    assert twin.checkpoint == checkpoint and plain.checkpoint == "none"
    assert all(a is not b and torch.equal(a, b)
               for a, b in zip(plain.state_dict().values(), twin.state_dict().values()))
    x = chain_input(block, batch_size=2, width=4, size=5)
    for mine, ref in zip(_grads(twin, x), _grads(plain, x), strict=True):
        torch.testing.assert_close(mine, ref, rtol=0, atol=0)


def test_one_seed_one_chain_and_unknown_checkpoint_is_one_line() -> None:
    a, b = make_chain(2, 4, block="linear", seed=1), make_chain(2, 4, block="linear", seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError, match="unknown checkpoint 'torch'; expected one of none,"):
        with_checkpoint(a, "torch")
