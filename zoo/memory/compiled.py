"""A training step compiled under ``activation_memory_budget``, measured exactly on the CPU: the
figures zoo.plan is compared with (docs/benchmarks/planner-vs-compile.md).

torch.compile fits a budget in AOTAutograd's partitioner (``min_cut_rematerialization_partition``:
a knapsack over the recomputable forward ops); inductor only generates kernels for the graphs it
returns. Here those partitioned graphs are replayed through ``torch.fx.Interpreter`` (each value
freed after its last use, as inductor's code frees them) under the planner's counter
(``zoo.memory.tracker.StepCounter``), op by op. Dynamo will not run compiled code under a
dispatch mode, so the graph's callable is replayed outside Dynamo on the inputs Dynamo gave it;
counters on the graphs prove they ran. Two things inductor does are done here too, so a
BatchNorm step is measured as inductor runs it: its decomposed BatchNorm backward takes no
running statistics in training (:func:`_batch_norm_backward`), and the new statistics are
written into the buffers as they are made (:func:`_mutations_in_place`).

``fake=True`` moves the model and batch to ``meta`` first, so a large model is measured in
seconds, to the CPU's byte and FLOP wherever it dispatches the same aten ops on meta as on the
CPU; :func:`check_meta_like_cpu` refuses one that does not (SDPA runs a fused kernel on the CPU
and its math path on meta)."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from zoo import _torch

from zoo.memory.host import OpCounter
from zoo.memory.tracker import StepCounter

__all__ = ["CompiledStep", "compile_step", "measure_compiled", "default_solver"]


def default_solver() -> str:
    """The knapsack solver torch's partitioner uses unless told otherwise (``"dp"`` in 2.15)."""
    return _torch.functorch_config().activation_memory_budget_solver


def _batch_norm_backward(grad: torch.Tensor, inp: torch.Tensor, weight: torch.Tensor | None,
                         running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                         *rest: Any) -> Any:
    """``native_batch_norm_backward`` as inductor's graphs run it: in training (``rest[2]``) it
    reads the batch's saved statistics only, so the running ones are not passed, and the
    partition keeps no copy of them for the backward (eager saves the buffers themselves).
    Same kernel, same gradients; NotImplemented (the op as traced) otherwise."""
    train = rest[2]
    if not train or (running_mean is None and running_var is None):
        return NotImplemented
    return torch.ops.aten.native_batch_norm_backward.default(grad, inp, weight, None, None,
                                                              *rest)


def _mutations_in_place(gm: torch.fx.GraphModule) -> None:
    """Move each ``copy_`` of a new value into a graph input (a BatchNorm's running statistics,
    its batch counter) to right after that value is made, so the functional copy is freed at
    once: inductor writes these updates straight into the buffers (its BatchNorm kernel stores
    the running statistics in place), where AOTAutograd's graph copies them at the forward's end.
    Moved only when nothing reads the input, or a view of it, after the value is made."""
    nodes = list(gm.graph.nodes)
    where = {n: i for i, n in enumerate(nodes)}
    for node in nodes:
        if node.target is not torch.ops.aten.copy_.default:
            continue
        dst, src = node.args[0], node.args[1]
        if dst.op != "placeholder" or not isinstance(src, torch.fx.Node) or node.users:
            continue
        readers = [u for u in _readers(dst) if u is not node]
        if where[src] < where[node] and all(where[u] <= where[src] for u in readers):
            src.append(node)
    gm.graph.lint()
    gm.recompile()


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The ops that read ``node``'s value: its users, and the users of a view of it."""
    out = []
    for user in node.users:
        out.append(user)
        schema = getattr(user.target, "_schema", None)
        if schema is not None and any(r.alias_info is not None for r in schema.returns):
            out += _readers(user)
    return out


def _interpreted(counts: dict[str, int], kind: str, gm: torch.fx.GraphModule,
                 _example: Any) -> Callable[[list], Any]:
    """An AOTAutograd graph compiler that runs ``gm`` op by op, freeing values after last use
    (input mutations moved to where inductor makes them: :func:`_mutations_in_place`)."""
    _mutations_in_place(gm)

    def run(args: list) -> Any:
        counts[kind] += 1
        return torch.fx.Interpreter(gm).boxed_run(args)

    run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd passes a list it may clear
    return run


@dataclasses.dataclass
class CompiledStep:
    """One compiled training step of ``model`` on ``x``: forward, loss, backward.

    ``fn`` is what the AOTAutograd backend returned for Dynamo's one graph and ``args`` the
    inputs Dynamo passed it (parameters, buffers, the batch); ``counts`` counts the forward and
    backward graphs' runs."""

    model: nn.Module
    fn: Callable[..., Any]
    args: tuple
    counts: dict[str, int]
    budget: float
    solver: str

    def __call__(self) -> None:
        """Run the step from fresh (``None``) gradients, outside Dynamo's frame evaluation."""
        self.model.zero_grad(set_to_none=True)
        out = self.fn(*self.args)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        loss.backward()


def compile_step(model: nn.Module, x: torch.Tensor, budget: float,
                 loss_fn: Callable[[Any], torch.Tensor], solver: str | None = None
                 ) -> CompiledStep:
    """Compile ``loss_fn(model(x))`` (model in train mode, one graph) with inductor's partitioner
    under ``activation_memory_budget=budget`` and eager interpreted graphs, and run one step (the
    one that compiles). Dynamo's caches are reset first, so each budget compiles afresh."""
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"activation_memory_budget must be in [0, 1], got {budget!r}")
    counts = {"forward": 0, "backward": 0, "graphs": 0}
    seen: dict[str, Any] = {}
    aot = _torch.aot_autograd()(
        fw_compiler=lambda g, e: _interpreted(counts, "forward", g, e),
        bw_compiler=lambda g, e: _interpreted(counts, "backward", g, e),
        partition_fn=_torch.min_cut_rematerialization_partition(),
        decompositions={torch.ops.aten.native_batch_norm_backward.default: _batch_norm_backward},
        keep_inference_input_mutations=True)

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        counts["graphs"] += 1
        fn = aot(gm, example_inputs)

        def first(*args: Any) -> Any:
            seen["fn"], seen["args"] = fn, args
            return fn(*args)
        return first

    solver = solver or default_solver()
    model.train()
    _torch.dynamo().reset()
    compiled = torch.compile(lambda inp: loss_fn(model(inp)), backend=backend, fullgraph=True)
    with _torch.functorch_config().patch(activation_memory_budget=budget,
                                       activation_memory_budget_solver=solver):
        model.zero_grad(set_to_none=True)
        compiled(x).backward()
    _check_replayable(model, x, seen.get("args", ()), counts)
    return CompiledStep(model, seen["fn"], seen["args"], counts, budget, solver)


def _check_replayable(model: nn.Module, x: torch.Tensor, args: tuple,
                      counts: dict[str, int]) -> None:
    """The recorded inputs must be the model's own tensors and the batch, and one graph ran."""
    if counts["graphs"] != 1 or counts["backward"] != 1:
        raise RuntimeError(f"expected one compiled graph with a backward, got {counts}")
    mine = {id(t) for t in [*model.parameters(), *model.buffers(), x]}
    strange = [type(a).__name__ for a in args
               if not (isinstance(a, torch.Tensor) and id(a) in mine)]
    if strange:
        raise RuntimeError(f"the compiled graph takes inputs other than the model's tensors and "
                           f"the batch ({strange}); it cannot be replayed as the same step")


def measure_compiled(model: nn.Module, x: torch.Tensor, budget: float,
                     loss_fn: Callable[[Any], torch.Tensor], solver: str | None = None,
                     fake: bool = False) -> dict[str, Any]:
    """Exact CPU peak bytes (model state tracked, counted as ``zoo.planner.measure_step`` counts
    them) and FLOPs of the second step of ``model`` compiled under ``budget``; gradients left as
    that step set them. ``fake``: move ``model`` (in place) and ``x`` to the ``meta`` device
    first, so no kernel runs (same bytes and FLOPs)."""
    if fake:
        model, x = model.to("meta"), x.to("meta")
    with _meta_rng() if fake else contextlib.nullcontext():
        step = compile_step(model, x, budget, loss_fn, solver)
        runs = step.counts["forward"]
        counter = StepCounter()  # bytes and FLOPs in one step (a recomputed dropout's RNG
        counter.track(model)  # wrapper is a higher-order op FlopCounterMode does not take)
        with counter:
            step()
    if step.counts["forward"] != runs + 1 or step.counts["backward"] != runs + 1:
        raise RuntimeError(f"the measured step did not run the compiled graphs: {step.counts}")
    return {"budget": budget, "solver": step.solver, "peak_bytes": counter.peak,
            "flops": counter.flops}


def check_meta_like_cpu(model: nn.Module, x: torch.Tensor) -> None:
    """Raise ValueError when one training-mode forward of ``model`` dispatches other aten ops on
    the meta device than on (fake) CPU tensors: then a ``fake=True`` measurement would not be
    the CPU's. ``model`` is not changed."""
    from zoo._torch import FakeTensorMode
    from zoo._torch import reparametrize_module as _reparametrize_module

    from zoo.memory.fake import fake_state

    counts = []
    for device in ("cpu", "meta"):
        mode = FakeTensorMode()
        state, inp = fake_state(model, mode), mode.from_tensor(x.detach())
        with mode:
            if device == "meta":
                state = {k: v.to("meta") for k, v in state.items()}
                inp = inp.to("meta")
        with _reparametrize_module(model, state), mode, OpCounter() as ops, torch.no_grad():
            model(inp)
        # the kernels by name: prim's metadata queries (prim.device) run none
        counts.append(collections.Counter({name: n for name, n in ops.ops.items()
                                           if not name.startswith("prim.")}))
    if counts[0] != counts[1]:
        differ = sorted(k for k in counts[0] | counts[1] if counts[0][k] != counts[1][k])[:3]
        raise ValueError(f"--fake cannot measure {type(model).__name__}: on the meta device it "
                         f"runs other ops than on the CPU ({', '.join(differ)}); measure it "
                         f"without --fake")


@contextlib.contextmanager
def _meta_rng() -> Iterator[None]:
    """Let torch's RNG wrappers of a compiled checkpoint (``run_and_save_rng_state``,
    ``run_with_rng_state``: a dropout inside a region) run on meta tensors as on CPU ones: they
    save and restore the CPU generator's state around the op, which runs on meta (no kernel).
    Their backend choice knows no meta device; put back on exit."""
    from zoo._torch import DispatchKey
    rng_prims = _torch.rng_prims()

    hops = [getattr(rng_prims, n, None) for n in ("run_and_save_rng_state", "run_with_rng_state")]
    hops = [h for h in hops if h is not None and DispatchKey.BackendSelect in h.py_kernels]
    old = {h: h.py_kernels[DispatchKey.BackendSelect] for h in hops}

    def select(hop: Any) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            flat = _torch.tree_leaves((args, kwargs))
            if any(isinstance(t, torch.Tensor) and t.is_meta for t in flat):
                return hop.py_kernels[DispatchKey.CPU](*args, **kwargs)
            return old[hop](*args, **kwargs)
        return run

    try:
        for h in hops:
            h.py_kernels[DispatchKey.BackendSelect] = select(h)
            getattr(h, "_dispatch_cache", {}).clear()  # a CPU step may have cached the old one
        yield
    finally:
        for h in hops:
            h.py_kernels[DispatchKey.BackendSelect] = old[h]
            getattr(h, "_dispatch_cache", {}).clear()
