"""zoo.checkpoint under real multi-process training: DistributedDataParallel on gloo, 2 processes.

The gradients of the DDP run (each rank sees half the batch) must equal a single-process run on
the whole batch, with and without find_unused_parameters and static_graph, also when one module is
checkpointed twice in a forward (reentrant checkpoint fails there: "marked ready twice"); and
under bf16 autocast without its cache of parameter casts (``casts_once``), as with the cache.
nn.DataParallel needs two GPUs: that test runs where they exist.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoo
from helpers import DDP_CONFIGS, run_gloo
from zoo.memory import default_loss


class SharedTwice(nn.Module):
    """A block checkpointed twice per forward (weights shared), plus an unused parameter."""

    def __init__(self, with_unused: bool):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(6, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU())
        self.head = nn.Linear(16, 3)
        self.unused = nn.Linear(2, 2) if with_unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = zoo.checkpoint(self.block, h)
        h = zoo.checkpoint(self.block, h) + h
        return self.head(h)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 2) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _worker(rank: int, world: int) -> dict[int, list[torch.Tensor]]:
    x, y = data()
    shard = slice(rank * 4, rank * 4 + 4)
    results = {}
    for i, cfg in enumerate(DDP_CONFIGS):
        model = DDP(SharedTwice(with_unused=cfg["find_unused_parameters"]), **cfg)
        results[i] = train(model, x[shard], y[shard])
    return results


def test_ddp_two_processes_match_single_process():
    ranks = run_gloo(_worker)
    x, y = data()
    for i, cfg in enumerate(DDP_CONFIGS):
        reference = train(SharedTwice(with_unused=cfg["find_unused_parameters"]), x, y)
        for rank in ranks:
            for step, (got, want) in enumerate(zip(rank[i], reference)):
                torch.testing.assert_close(got, want, msg=lambda m: f"{cfg} step {step}: {m}")


class Blocks(nn.Module):
    """Two checkpointed blocks between a stored stem and head, each parameter used once."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.head = nn.Linear(6, 16), nn.Linear(16, 3)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU())
                                      for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


class Bf16(nn.Module):
    """``model``'s forward under bf16 autocast (backward and the optimizer's step outside it,
    where its cache cannot hold a cast of weights the step has changed since)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(x).float()


def _bf16_worker(rank: int, world: int) -> dict[bool, list[torch.Tensor]]:
    x, y = data()
    shard = slice(rank * 4, rank * 4 + 4)
    results = {}
    for casts_once in (False, True):
        model = DDP(zoo.set_grad_checkpointing(Blocks(), casts_once=casts_once))
        results[casts_once] = train(Bf16(model), x[shard], y[shard])
    return results


def test_ddp_casts_once_trains_like_autocasts_cache_bit_for_bit():
    for rank in run_gloo(_bf16_worker):
        for got, want in zip(rank[True], rank[False]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="nn.DataParallel needs two CUDA devices; this machine has "
                           f"{torch.cuda.device_count()}")
def test_data_parallel_two_gpus_match_single_device():
    torch.manual_seed(0)
    bn_net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                           nn.Dropout(0.0), nn.Conv2d(8, 4, 3, padding=1)).cuda()

    class Wrapped(nn.Module):
        def __init__(self, net: nn.Module):
            super().__init__()
            self.net = net

        def forward(self, x):
            return zoo.checkpoint(self.net, x)

    import copy
    x = torch.randn(8, 3, 8, 8, device="cuda")
    plain = nn.DataParallel(copy.deepcopy(bn_net))
    ckpt = nn.DataParallel(Wrapped(copy.deepcopy(bn_net)))
    default_loss(plain(x)).backward()
    default_loss(ckpt(x)).backward()
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    for a, b in zip(plain.buffers(), ckpt.buffers()):
        torch.testing.assert_close(b, a)
