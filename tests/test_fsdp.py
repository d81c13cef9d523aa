"""FSDP2 (``fully_shard``) with zoo checkpointing: two real gloo processes on the CPU; zoo's
ResNet in each checkpoint mode; a user's network, timm's ResNet and ViT under
zoo.set_grad_checkpointing; and a timm ViT under bf16 autocast with ``casts_once``, against the
same sharded run with autocast's cache.

Each rank trains its half of the batch on a model whose blocks and root are sharded with
``fully_shard``; FSDP2 averages the gradients over the ranks. The reference is the plain,
un-checkpointed, unsharded model in one process: one copy per rank on that rank's half, the two
copies' gradients averaged by hand, the same SGD step on both. Gradients and parameters (gathered
from their shards) must match the reference, and each rank's BatchNorm buffers (FSDP2 does not
shard buffers) must equal its copy's: checkpointing under sharding counts every batch once.
"""
from __future__ import annotations

import os
import tempfile

from collections.abc import Callable

import pytest
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import zoo
from helpers import run_gloo
from zoo import _torch
from zoo.checkpoint import set_casts_once
from zoo.memory import default_loss
from zoo.memory.tracker import StepCounter

try:  # torch >= 2.6 exports FSDP2 publicly; 2.4/2.5 keep it under _composable
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - depends on the torch version
    try:
        from torch.distributed._composable.fsdp import fully_shard
    except ImportError:
        fully_shard = None

STEPS = 2
# torch 2.8's FSDP2 sums the ranks' gradients on gloo where it means to average them
# (pytorch/pytorch#162338; measured: every gradient twice the average, checkpointed or not;
# torch 2.9.1 averages): the reference reduces as that torch does.
GLOO_SUMS = _torch.VERSION < (2, 9)


class Net(nn.Module):
    """A user's network: BatchNorm blocks in a ModuleList, checkpointed by zoo."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1),
                                                  nn.BatchNorm2d(8), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x) + x
        return self.head(x.mean((2, 3)))


def resnet20(mode: str | bool) -> nn.Module:
    return zoo.create_model("resnet20", num_classes=5, efficient=mode)


def user_net(checkpointed: bool) -> nn.Module:
    net = Net()
    return zoo.set_grad_checkpointing(net) if checkpointed else net


def timm_model(name: str, **kwargs) -> Callable[[bool], nn.Module]:
    def build_timm(checkpointed: bool) -> nn.Module:
        model = timm.create_model(name, num_classes=5, **kwargs)
        return zoo.set_grad_checkpointing(model) if checkpointed else model
    return build_timm


tiny_vit = timm_model("vit_tiny_patch16_224", img_size=16, patch_size=4, depth=2, embed_dim=32,
                      num_heads=2)

# (name, build(checkpointed), FSDP units besides the root): every block of a zoo ResNet is its
# own unit in every mode (each block runs through its module call, so FSDP2's hooks unshard it).
CASES = [
    *[(f"resnet20-{mode}", lambda on, mode=mode: resnet20(mode if on else False),
       lambda m: m.blocks()) for mode in ("tapered", "halves", "bn_relu", "block")],
    ("user-net", user_net, lambda m: list(m.blocks)),
    ("timm-resnet10t", timm_model("resnet10t"),
     lambda m: [b for stage in (m.layer1, m.layer2, m.layer3, m.layer4) for b in stage]),
    ("timm-vit", tiny_vit, lambda m: list(m.blocks)),
]


def build(case: int, checkpointed: bool) -> nn.Module:
    torch.manual_seed(0)
    return CASES[case][1](checkpointed)


def data() -> torch.Tensor:
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(7))


def full(t: torch.Tensor) -> torch.Tensor:
    """A sharded DTensor gathered on every rank; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train_sharded(case: int, x: torch.Tensor) -> dict[str, list]:
    model = build(case, checkpointed=True)
    for unit in CASES[case][2](model):
        fully_shard(unit)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(STEPS):
        default_loss(model(x)).backward()
        grads.append([full(p.grad).detach().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"grads": grads,
            "params": [full(p).detach().clone() for p in model.parameters()],
            "buffers": [full(b).clone() for b in model.buffers()]}


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        half = data()[rank * 2:rank * 2 + 2]
        results = [_train_sharded(case, half) for case in range(len(CASES))]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def reference(case: int, x: torch.Tensor) -> dict[str, list]:
    """The plain model, one copy per rank's half, gradients averaged as FSDP2 averages them
    (summed where it sums them, :data:`GLOO_SUMS`)."""
    copies = [build(case, checkpointed=False), build(case, checkpointed=False)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in copies]
    grads = []
    for _ in range(STEPS):
        for rank, model in enumerate(copies):
            default_loss(model(x[rank * 2:rank * 2 + 2])).backward()
        for p0, p1 in zip(*(m.parameters() for m in copies)):
            p0.grad = p1.grad = (p0.grad + p1.grad) / (1 if GLOO_SUMS else 2)
        grads.append([p.grad.clone() for p in copies[0].parameters()])
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"grads": grads, "params": [p.detach().clone() for p in copies[0].parameters()],
            "buffers": [[b.clone() for b in m.buffers()] for m in copies]}


@pytest.mark.skipif(fully_shard is None, reason="this torch has no FSDP2 (fully_shard)")
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp2_two_processes_match_plain_single_process():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    for case, (name, _, _) in enumerate(CASES):
        want = reference(case, data())
        for rank, got in enumerate(r[case] for r in ranks):
            where = f"{name}, rank {rank}"
            for step in range(STEPS):
                for i, (a, b) in enumerate(zip(got["grads"][step], want["grads"][step])):
                    torch.testing.assert_close(a, b, msg=lambda m: f"{where} step {step} grad "
                                                                   f"{i}: {m}")
            for i, (a, b) in enumerate(zip(got["params"], want["params"])):
                torch.testing.assert_close(a, b, msg=lambda m: f"{where} param {i}: {m}")
            for i, (a, b) in enumerate(zip(got["buffers"], want["buffers"][rank])):
                torch.testing.assert_close(a, b, msg=lambda m: f"{where} buffer {i}: {m}")


def _bf16_sharded_vit(casts_once: str, x: torch.Tensor) -> list[tuple[list, int]]:
    """Two SGD steps of a sharded timm ViT, the forward under bf16 autocast: each step's
    gathered gradients and the bytes the autocast block's exit freed (casts the cache held).
    ``casts_once``: "off", "on", or "on, then off" (turned off after sharding)."""
    torch.manual_seed(0)
    model = zoo.set_grad_checkpointing(tiny_vit(False), casts_once=casts_once != "off")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if casts_once == "on, then off":  # FSDP2's class is now a subclass of casts_once's
        set_casts_once(model, enable=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for _ in range(STEPS):
        counter = StepCounter()
        counter.track(model)
        with counter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = default_loss(model(x).float())
                held = counter.current
            freed = held - counter.current
            loss.backward()
        steps.append(([full(p.grad).clone() for p in model.parameters()], freed))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps


def _bf16_worker(rank: int, world: int) -> dict[str, list[tuple[list, int]]]:
    half = data()[rank * 2:rank * 2 + 2]
    return {once: _bf16_sharded_vit(once, half) for once in ("off", "on", "on, then off")}


@pytest.mark.skipif(fully_shard is None, reason="this torch has no FSDP2 (fully_shard)")
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp2_casts_once_is_the_cached_step_without_unsharded_casts_held_to_the_end():
    # autocast's cache keeps the bf16 copy of every parameter FSDP2 gathered for the forward
    # (unsharded) until the forward ends, after FSDP2 has let the gathered weights go
    ranks = run_gloo(_bf16_worker)
    model = tiny_vit(False)
    block_weights = sum(2 * p.numel() for p in model.blocks.parameters() if p.dim() > 1)
    for rank in ranks:
        for (cached, held), (once, freed), (off, held_again) in zip(*rank.values()):
            for a, b, c in zip(once, cached, off):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
                torch.testing.assert_close(c, b, rtol=0, atol=0)
            assert held > block_weights and freed == 0  # the whole blocks', not this rank's half
            assert held_again == held
