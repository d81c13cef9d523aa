"""Shared test helpers: train a model a few steps and compare it with its plain twin."""
from __future__ import annotations

import functools
import os
import tempfile
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zoo
from zoo import _torch
from zoo.train.config import TrainConfig
from zoo.memory import cpu_peak_bytes, default_loss, train_step
from zoo.memory.tracker import StepCounter

#: A compiled step predicted on a card needs COMPILED_CARD_STEP_SINCE (older torch refuses it
#: in one line, tests/test_torch_compat.py).
needs_compiled_card_step = pytest.mark.skipif(
    _torch.VERSION < _torch.COMPILED_CARD_STEP_SINCE,
    reason="this torch cannot predict a compiled step on a card (needs torch >= 2.11)")

#: Plans kept under torch.compile need torch >= 2.9 (2.8 refuses them in one line,
#: tests/test_torch_compat.py: its compiled regions keep each BatchNorm's output).
needs_plans_for_compile = pytest.mark.skipif(
    _torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES,
    reason="this torch refuses plans for compile (needs torch >= 2.9)")


def grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [p.grad for p in model.parameters()]


def buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in model.buffers()]


def run_steps(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
              steps: int = 2, seed: int = 100) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """``steps`` SGD steps in train mode, reseeding before each forward (so dropout can match).

    Returns each step's output and parameter gradients.
    """
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history = []
    for step in range(steps):
        torch.manual_seed(seed + step)
        out = forward(x)
        default_loss(out).backward()
        history.append((out.detach().clone(), [None if g is None else g.clone()
                                               for g in grads(model)]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return history


def assert_same_training(plain: nn.Module, plain_forward: Callable, ckpt: nn.Module,
                         ckpt_forward: Callable, x: torch.Tensor, steps: int = 2,
                         exact: bool = False) -> None:
    """Same outputs, gradients, parameters and buffers (BatchNorm statistics) after ``steps``;
    ``exact``: bit for bit (no tolerance)."""
    close = dict(rtol=0, atol=0) if exact else {}
    ckpt.load_state_dict(plain.state_dict())
    ref = run_steps(plain, plain_forward, x, steps)
    got = run_steps(ckpt, ckpt_forward, x, steps)
    for step, ((out_r, g_r), (out_g, g_g)) in enumerate(zip(ref, got)):
        torch.testing.assert_close(out_g, out_r, **close,
                                   msg=lambda m: f"step {step} output: {m}")
        for i, (a, b) in enumerate(zip(g_g, g_r)):
            assert (a is None) == (b is None), f"step {step}: parameter {i} gradient presence differs"
            if a is not None:
                torch.testing.assert_close(a, b, **close,
                                           msg=lambda m: f"step {step} grad {i}: {m}")
    for (name, a), b in zip(ckpt.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, **close,
                                   msg=lambda m: f"{name} after {steps} steps: {m}")


class GraphRecorder:
    """A torch.compile backend that keeps the graphs it sees: ``aot_eager`` (AOTAutograd with
    inductor's partitioner, eager kernels) with the forward and backward graphs recorded."""

    def __init__(self) -> None:
        self.dynamo: list[torch.fx.GraphModule] = []
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        self.dynamo.append(gm)

        def keep(graphs: list, g: torch.fx.GraphModule, _: list) -> Callable:
            graphs.append(g)
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=functools.partial(keep, self.forward),
                            bw_compiler=functools.partial(keep, self.backward),
                            partition_fn=min_cut_rematerialization_partition,  # as inductor
                            keep_inference_input_mutations=True)(gm, example_inputs)

    def count(self, which: str, target: object) -> int:
        graphs = {"dynamo": self.dynamo, "forward": self.forward, "backward": self.backward}[which]
        return sum(node.target is target for g in graphs for node in g.graph.nodes)


def assert_compiled_matches_eager_plain(plain: nn.Module, ckpt: nn.Module, x: torch.Tensor,
                                        backend: object = "aot_eager", steps: int = 3,
                                        exact: bool = False) -> None:
    """``ckpt`` compiled (fullgraph) trains as eager ``plain`` (same initial state);
    ``exact``: bit for bit."""
    torch._dynamo.reset()
    compiled = torch.compile(ckpt, fullgraph=True, backend=backend)
    assert_same_training(plain, plain, ckpt, compiled, x, steps, exact)


def train_step_peak(model: nn.Module, x: torch.Tensor) -> int:
    """Exact CPU peak (MemTracker) of one training step (``zoo.memory.train_step``: train mode,
    fresh gradients), parameters counted."""
    model.zero_grad(set_to_none=True)  # the last step's gradients are not this one's
    return cpu_peak_bytes(train_step(model, x), track=(model,))


def tiny_cnn() -> nn.Sequential:
    """conv-bn-relu twice, pooled into a linear head: activations outweigh the parameters."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def assert_published_parameter_count(name: str, published: str) -> None:
    """``name``'s parameter count in millions, rounded to ``published``'s digits, equals it."""
    with torch.device("meta"):
        model = zoo.create_model(name)
    count = sum(p.numel() for p in model.parameters())
    digits = len(published.split(".")[1])
    assert f"{count / 1e6:.{digits}f}" == published, f"{count:,} parameters"


def tiny_run(path: object, **kw) -> TrainConfig:
    """A tiny training run into ``path`` (None: no out_dir, as when resuming)."""
    base = dict(model="cifar_cnn", dataset="shapes", train_size=16, test_size=8, batch_size=8,
                epochs=1, lr=0.05, seed=4, schedule="constant",
                out_dir=None if path is None else str(path))
    return TrainConfig(**{**base, **kw})


def quiet(_msg: str) -> None:
    """A training log that prints nothing."""


class TensorsAlive(TorchDispatchMode):
    """Weak references to every tensor created under it (e.g. a recompute, entered through
    ``context_fn``); ``alive()`` counts those still held somewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.refs.append(weakref.ref(out))
        return out

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)


def call_command(main: Callable[..., None], capsys, **flags) -> tuple[int, str, str]:
    """A training command's ``main(**flags)`` in this process, as Fire calls it: (exit status,
    stdout, stderr)."""
    code = 0
    try:
        main(**flags)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# DistributedDataParallel's settings a multi-process test goes through
DDP_CONFIGS = [{"find_unused_parameters": False, "static_graph": False},
               {"find_unused_parameters": True, "static_graph": False},
               {"find_unused_parameters": False, "static_graph": True}]


def run_gloo(worker: Callable[[int, int], Any], world: int = 2) -> list[Any]:
    """Run ``worker(rank, world)`` in ``world`` processes joined in one gloo process group (as
    DistributedDataParallel on CPUs needs); returns each rank's result. ``worker`` must be a
    module-level function (it is pickled into the spawned processes)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gloo_rank, args=(worker, world, tmp), nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]


def _gloo_rank(rank: int, worker: Callable[[int, int], Any], world: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}",
                            rank=rank, world_size=world)
    try:
        torch.save(worker(rank, world), os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def freed_at_autocast_exit(model: nn.Module, forward: Callable[[], Any]) -> int:
    """Bytes the exit of the bf16 autocast block around ``forward()`` (a training step's
    forward, its backward after) frees: the casts autocast's cache held and no saved tensor
    did. ``model``'s parameters and gradients are counted from the start."""
    counter = StepCounter()
    counter.track(model)
    with counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = default_loss(forward())
            before = counter.current
        freed = before - counter.current
        loss.backward()
    model.zero_grad(set_to_none=True)
    return freed
