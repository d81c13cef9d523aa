"""Any module's *spine*: the longest run of submodule calls that hand one tensor straight on,
planned as a zoo model's chain (every module of it a candidate region: the stem too).

:func:`find_spine` finds that run in one fake forward (torchvision's ResNet: ``conv1`` ...
``layer1.0`` ... ``avgpool``), opening containers whose children run the same way, and accepts
a link only when it sees, op by op, that nothing else happens between two calls and nothing else
reads the first one's output. :class:`Spine` presents the model to the planner as a zoo model
whose chain is that run; :func:`apply_spine` leaves it running a plan (the run's first module
runs the whole run by the plan, the others pass their input on, their forward hooks not run)
and :func:`clear_spine` undoes it. Design: docs/planner.md ("Any other module")."""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from ..._torch import TorchDispatchMode, tree_flatten

from ...blocks import checkpoint_module, is_checkpointed
from ...checkpoint import run_plan
from ...memory.fake import fake_state
from ...memory.fake_mode import PlannerFakeMode
from ...memory.inputs import Batch
from ...memory.precision import forward_precision
from .nesting import clear_nested
from ...memory.tracker import storage_key

__all__ = ["find_spine", "Spine", "SpineStep", "spine_steps", "apply_spine", "clear_spine",
           "spine_of"]


@dataclass
class _Call:
    """One submodule call seen in the fake forward."""

    name: str
    parent: str
    args: tuple
    n_kwargs: int
    ops_before: int
    ops_after: int = -1
    out: Any = None
    children: list[_Call] = field(default_factory=list)


class _Ops(TorchDispatchMode):
    """Counts ops and notes, per storage, the last op that read it (forward only)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.last_read: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self.last_read[storage_key(t)] = self.count
        self.count += 1
        return out


def _trace_calls(model: nn.Module, example_input: Any) -> tuple[_Call, dict[str, int], _Ops]:
    """One fake forward: the tree of submodule calls, how often each module ran, the ops."""
    from ..._torch import reparametrize_module as _reparametrize_module

    fake = PlannerFakeMode()
    state = fake_state(model, fake)
    x = Batch.of(example_input).map(fake.from_tensor)
    ops = _Ops()
    root = _Call("", "", x.args, len(x.kwargs), 0)
    stack, counts, handles = [root], {}, []

    def pre(name: str) -> Callable:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            call = _Call(name, stack[-1].name, args, len(kwargs), ops.count)
            stack[-1].children.append(call)
            stack.append(call)
            counts[name] = counts.get(name, 0) + 1
        return hook

    def post(_m: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> None:
        call = stack.pop()
        call.ops_after, call.out = ops.count, out

    for name, m in model.named_modules():
        if name:
            handles.append(m.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        with fake, warnings.catch_warnings(), _reparametrize_module(model, state), ops:
            warnings.simplefilter("ignore")
            with forward_precision():
                root.out = x.call(model)
    finally:
        for h in handles:
            h.remove()
    root.ops_after = ops.count
    return root, counts, ops


def _links(a: _Call, b: _Call, counts: dict[str, int], ops: _Ops) -> bool:
    """Whether call ``b`` takes call ``a``'s output and nothing else does (module docstring)."""
    if counts[a.name] != 1 or counts[b.name] != 1 or b.n_kwargs or len(b.args) != 1:
        return False
    if not isinstance(a.out, torch.Tensor) or b.args[0] is not a.out:
        return False
    if a.ops_after != b.ops_before:
        return False
    key = storage_key(a.out)
    later = isinstance(b.out, torch.Tensor) and storage_key(b.out) == key  # in place
    return later or ops.last_read.get(key, -1) < b.ops_after


def _opened(call: _Call, counts: dict[str, int], ops: _Ops) -> list[str] | None:
    """``call`` as the run of its children (recursively), when they are its whole work."""
    kids = call.children
    if not kids or kids[0].ops_before != call.ops_before or kids[-1].ops_after != call.ops_after:
        return None
    if len(call.args) != 1 or kids[0].args[:1] != call.args[:1] or kids[-1].out is not call.out:
        return None
    if kids[0].n_kwargs or len(kids[0].args) != 1 or counts[kids[0].name] != 1:
        return None
    if any(not _links(a, b, counts, ops) for a, b in zip(kids, kids[1:])):
        return None
    return [n for k in kids for n in (_opened(k, counts, ops) or [k.name])]


def _runs(call: _Call, counts: dict[str, int], ops: _Ops) -> list[list[str]]:
    """The maximal linked runs among ``call``'s children, and those inside each child."""
    out: list[list[str]] = []
    run: list[_Call] = []
    for k in call.children:
        if run and _links(run[-1], k, counts, ops):
            run.append(k)
        else:
            if run:
                out.append(run)
            run = [k] if counts[k.name] == 1 and len(k.args) == 1 and not k.n_kwargs else []
    if run:
        out.append(run)
    names = [[n for k in r for n in (_opened(k, counts, ops) or [k.name])] for r in out]
    for k in call.children:
        names += _runs(k, counts, ops)
    return names


def find_spine(model: nn.Module, example_input: Any) -> list[str]:
    """The dotted names of ``model``'s longest spine (module docstring) that starts on the
    model's input (the planner counts the chain's input as held all step, which a tensor the
    forward made first need not be); [] when there is none of two modules or more."""
    root, counts, ops = _trace_calls(model, example_input)
    first = {c.name: c for c in _calls(root)}
    runs = [r for r in _runs(root, counts, ops)
            if root.args and first[r[0]].args and first[r[0]].args[0] is root.args[0]]
    best = max(runs, key=len, default=[])
    return best if len(best) >= 2 else []


def _calls(call: _Call) -> list[_Call]:
    return [call, *(c for k in call.children for c in _calls(k))]


# ---- Running a plan over the spine.
class SpineStep:
    """One spine module, called as a module (its hooks run, the checkpoint's normalisation
    guard among them) but past the pass-through the plan puts on it; ``name``: its dotted name,
    for the planner's table. An in-place activation (a bool ``inplace``, no randomness) runs out
    of place, to the same values and gradients, so the planner may cut between its input and
    output (docs/planner.md, "Any other module"); ``out_of_place=False`` keeps it in place, for
    ``torch.compile``, whose partitioner does not keep a region ending just before it."""

    def __init__(self, module: nn.Module, name: str, out_of_place: bool = True) -> None:
        self.module, self.name = module, name
        self.out_of_place = out_of_place and _in_place_activation(module)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if torch.compiler.is_compiling():  # no state may change inside a compiled checkpoint;
            return _own_forward(m, x)  # nor is the normalisation guard traced (docs above)
        m.__dict__["_zoo_spine_call"] = m.__dict__.get("_zoo_spine_call", 0) + 1
        if self.out_of_place:
            m.inplace = False
        try:
            return m(x)
        finally:
            m.__dict__["_zoo_spine_call"] -= 1
            if self.out_of_place:
                m.inplace = True


def _in_place_activation(m: nn.Module) -> bool:
    """Whether ``m`` is set to overwrite its input and would give the same values out of place
    (not so for dropout's or RReLU's random draws, which may differ between the two kernels)."""
    return getattr(m, "inplace", None) is True and not isinstance(
        m, (nn.modules.dropout._DropoutNd, nn.RReLU))


def _own_forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(m).forward(m, x)  # checkpointed when a save set wraps it


def _spine_forward(m: nn.Module, first: Callable | None, x: torch.Tensor) -> torch.Tensor:
    """A spine module's forward while a plan runs: its own when a :class:`SpineStep` calls it;
    otherwise the whole spine by the plan (the first module) or its input passed on."""
    if m.__dict__.get("_zoo_spine_call"):
        return _own_forward(m, x)
    return x if first is None else first(x)


def _run_spine(steps: Sequence[SpineStep], plan: Any, runner: Callable | None,
               x: torch.Tensor) -> torch.Tensor:
    if runner is not None:
        return runner(steps, x)
    return run_plan(steps, plan, x)


def _install(modules: Sequence[nn.Module], steps: list[SpineStep], plan: Any,
             runner: Callable | None = None) -> None:
    first = partial(_run_spine, steps, plan, runner)
    for i, m in enumerate(modules):
        m.forward = partial(_spine_forward, m, first if i == 0 else None)
        m._zoo_spine = True


def clear_spine(model: nn.Module) -> bool:
    """Undo :func:`apply_spine` (and a planner's transient one); whether anything was undone."""
    undone = False
    for m in model.modules():
        if m.__dict__.pop("_zoo_spine", False):
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_zoo_spine_call", None)
            undone = True
    return undone


def apply_spine(model: nn.Module, names: Sequence[str], plan: Any,
                out_of_place: bool = True) -> None:
    """Make ``model`` run ``plan`` (block-level segments, nested allowed) over its spine
    ``names`` in place of any checkpointing it had; ``plan=None`` (or one that checkpoints
    nothing) only clears. ``out_of_place``: in-place activations run out of place
    (:class:`SpineStep`), as the plan was made."""
    clear_spine(model)
    clear_nested(model, [])
    for m in model.modules():
        if is_checkpointed(m):
            checkpoint_module(m, False)
    if plan is None or all(ck is False for *_, ck in plan):
        return
    modules = [model.get_submodule(n) for n in names]
    _install(modules, spine_steps(model, names, out_of_place), plan)


def spine_steps(model: nn.Module, names: Sequence[str], out_of_place: bool = True
                ) -> list[SpineStep]:
    """The :class:`SpineStep` of each of ``model``'s spine modules ``names``."""
    return [SpineStep(model.get_submodule(n), n, out_of_place) for n in names]


class Spine(nn.Module):
    """``model`` seen by the planner as a zoo model whose chain is its spine ``names``
    (``out_of_place``: as :class:`SpineStep` runs its in-place activations)."""

    checkpoint_modes: tuple[str, ...] = ()
    checkpoint_block_modes = None
    grad_checkpointing = None

    def __init__(self, model: nn.Module, names: Sequence[str], out_of_place: bool = True
                 ) -> None:
        super().__init__()
        self.inner = model
        self.names = list(names)
        self.out_of_place = out_of_place
        self.checkpoint_plan: Any = None

    def checkpoint_chain(self) -> list[SpineStep]:
        return spine_steps(self.inner, self.names, self.out_of_place)

    def set_checkpoint_plan(self, plan: Any) -> None:
        self.checkpoint_plan = plan

    def set_checkpoint_block_modes(self, modes: Any) -> None:
        if modes is not None and any(modes):
            raise ValueError("a module's spine has no block modes")

    def set_grad_checkpointing(self, enable: Any = True) -> None:
        if enable:
            raise ValueError("a module's spine has no checkpoint modes")

    def run_chain_block(self, block: Callable, x: torch.Tensor, mode: str | None = None
                        ) -> torch.Tensor:
        return block(x)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.checkpoint_plan is None:
            return self.inner(*args, **kwargs)
        modules = [self.inner.get_submodule(n) for n in self.names]
        runner = self.__dict__.get("run_chain")  # the profiler's, while it traces a step
        _install(modules, self.checkpoint_chain(), self.checkpoint_plan, runner)
        try:
            return self.inner(*args, **kwargs)
        finally:
            clear_spine(self.inner)

    def run_chain(self, blocks: Sequence[Callable], x: torch.Tensor) -> torch.Tensor:
        return run_plan(blocks, self.checkpoint_plan, x)


def spine_of(model: nn.Module, example_input: Any) -> Spine | None:
    """``model`` as a :class:`Spine` on its longest spine, or None when it has none."""
    names = find_spine(model, example_input)
    return Spine(model, names) if names else None
