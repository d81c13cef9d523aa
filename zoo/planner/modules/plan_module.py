"""``zoo.plan`` for a module whose spine leaves out its repeated blocks: which to checkpoint.

The blocks are those ``zoo.set_grad_checkpointing`` finds (``zoo.blocks.find_blocks``),
checkpointed with the same wrapper. One fake training step records per block the bytes autograd
saves inside it and its forward FLOPs; blocks are taken greedily by bytes freed per FLOP (the
greedy order of torch's ``activation_memory_budget`` knapsack), and the fewest whose step fits
is found by bisection on measured fake steps: the budget is met as measured. Below "every block
checkpointed", containers are checkpointed around them too (:mod:`.nesting`)."""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...blocks import NoBlocksError, checkpoint_module, find_blocks, is_checkpointed
from ...memory import format_bytes
from ..errors import BudgetTooSmallError
from ...memory.fake import fake_state
from ...memory.inputs import Batch
from ...memory.precision import step_precision
from ...memory.training import backward, forward_loss
from ...memory.fake_mode import PlannerFakeMode
from ...memory.step import measure_step
from ...memory.optimizer import Optimizers
from .nesting import clear_nested, nest, outer_candidates, restore_nested, set_nested

__all__ = ["ModulePlan", "plan_module", "plain_module", "block_costs"]


@dataclass
class ModulePlan:
    """Which blocks of a module to checkpoint, with the step's measured peak and recompute.

    ``nested`` are the outer regions checkpointed around the blocks (``"layer1"``, or
    ``"blocks[0:4]"`` for a slice of a plain ``nn.Sequential``); ``every_block_peak`` is the
    peak with every block checkpointed and no outer region; ``smallest_peak`` the least peak
    this planning measured (the nested floor when the budget needed nesting to the end)."""

    blocks: list[str]
    checkpointed: list[str]
    budget: int | float
    predicted_peak: int
    plain_peak: int
    smallest_peak: int
    recompute_flops: int
    step_flops: int
    saved: dict[str, int] = field(default_factory=dict)
    nested: list[str] = field(default_factory=list)
    every_block_peak: int | None = None
    step: str = ""
    offloaded: list[str] = field(default_factory=list)
    offloaded_bytes: int = 0
    predicted_time: float | None = None
    card: str | None = None

    @property
    def overhead(self) -> float:
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    def apply(self, model: nn.Module) -> None:
        """Checkpoint exactly ``checkpointed`` among ``blocks``, offload exactly ``offloaded``
        (``zoo.checkpoint(..., offload=True)``: priced on ``card``,
        ``zoo.planner.offload_choice``), run the others plainly and, around them, checkpoint
        exactly the outer regions ``nested``."""
        clear_nested(model, self.blocks)
        modules = dict(model.named_modules())
        for name in self.blocks:
            moved = name in self.offloaded
            checkpoint_module(modules[name], moved or name in self.checkpointed,
                              **({"offload": True} if moved else {}))
        set_nested(model, self.nested)

    def __str__(self) -> str:
        lines = ["| block | saves in a plain step | checkpointed |", "|---|---:|---|"]
        how = {**dict.fromkeys(self.offloaded, "offloaded"), **dict.fromkeys(self.checkpointed,
                                                                               "yes")}
        lines += [f"| {n} | {format_bytes(self.saved.get(n, 0))} | {how.get(n, '')} |"
                  for n in self.blocks]
        budget = "inf (no limit)" if self.budget == float("inf") else format_bytes(self.budget)
        every = self.smallest_peak if self.every_block_peak is None else self.every_block_peak
        lines += ["", *([self.step] if self.step else []),
                  f"budget {budget}: predicted peak {format_bytes(self.predicted_peak)} "
                  f"(plain {format_bytes(self.plain_peak)}, every block checkpointed "
                  f"{format_bytes(every)}, least reached {format_bytes(self.smallest_peak)})",
                  f"{len(self.checkpointed)} of {len(self.blocks)} blocks checkpointed: "
                  f"+{100 * self.overhead:.1f}% FLOPs recomputed"]
        if self.nested:
            lines.append(f"nested: {', '.join(self.nested)} checkpointed around their blocks")
        if self.predicted_time is not None:
            lines.append(f"on {self.card}: predicted step {1e3 * self.predicted_time:.2f} ms, "
                         f"{format_bytes(self.offloaded_bytes)} offloaded to host memory")
        return "\n".join(lines)


def block_costs(model: nn.Module, blocks: list[tuple[str, nn.Module]], example_input: Any,
                loss_fn: Callable[[Any], torch.Tensor] | None = None
                ) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes autograd saves inside each block, forward FLOPs of each block) in one plain fake
    training step; parameters are not counted (checkpointing does not free them)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from ..._torch import reparametrize_module as _reparametrize_module
    from torch.utils.flop_counter import FlopCounterMode

    fake = PlannerFakeMode()
    state = fake_state(model, fake)
    params = {StorageWeakRef(t.untyped_storage()).cdata for t in state.values()}
    x = Batch.of(example_input).map(lambda t: fake.from_tensor(t.detach()))
    current: list[str] = []
    saved: dict[str, dict[int, int]] = {name: {} for name, _ in blocks}
    flops: dict[str, int] = dict.fromkeys(saved, 0)
    counter = FlopCounterMode(display=False)
    start: dict[str, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(t.untyped_storage()).cdata
        if current and key not in params:
            saved[current[-1]][key] = t.untyped_storage().nbytes()
        return t

    def enter(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            current.append(name)
            start[name] = int(counter.get_total_flops())
        return hook

    def leave(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            current.pop()
            flops[name] += int(counter.get_total_flops()) - start[name]
        return hook

    handles = [h for name, m in blocks for h in (m.register_forward_pre_hook(enter(name)),
                                                 m.register_forward_hook(leave(name)))]
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(fake)
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
            stack.enter_context(counter)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            stack.enter_context(step_precision())
            stack.enter_context(_reparametrize_module(model, state))
            backward(forward_loss(model, x, loss_fn))
    finally:
        for h in handles:
            h.remove()
    _check_called(model, blocks, start)
    return {n: sum(v.values()) for n, v in saved.items()}, flops


def _check_called(model: nn.Module, blocks: list[tuple[str, nn.Module]], called: dict) -> None:
    """Refuse blocks the model's step never calls (a reversible tower runs its blocks' ``f``
    and ``g``, not their ``forward``): checkpointing them would change nothing while the plan
    said it did. Some blocks left uncalled are kept (a layer drop skips layers at random)."""
    if not called:
        kinds = sorted({type(m).__name__ for _, m in blocks})
        raise NoBlocksError(f"{type(model).__name__}'s training step calls none of the "
                            f"{len(blocks)} modules to checkpoint ({', '.join(kinds)}): "
                            f"checkpointing them would change nothing; name modules whose "
                            f"forward the model calls (modules=...)")


def plan_module(model: nn.Module, example_input: Any, budget: int | float,
                loss_fn: Callable[[Any], torch.Tensor] | None = None,
                modules: Any = None, optimizer: Optimizers = None,
                accumulate: int = 1) -> ModulePlan:
    """The fewest of ``model``'s blocks (``find_blocks(model, modules)``), taken in order of
    bytes saved per forward FLOP, whose checkpointing makes a fake step fit ``budget``; when
    even every block does not fit, outer regions around them (``zoo.planner.modules.nesting``) added
    greedily. Raises ``BudgetTooSmallError`` (from the package) naming the least peak reached
    (the nested floor) when nothing fits. The model is left as it was; call
    :meth:`ModulePlan.apply`. ``optimizer``: its state and step are part of every measured
    step (``zoo.memory.step.measure_step``), as are ``accumulate`` micro-batches per
    optimizer step (its peak and FLOPs are the whole accumulating step's)."""
    with plain_module(model):
        return _plan_plain(model, Batch.of(example_input), budget, loss_fn, modules, optimizer,
                           accumulate)


@contextlib.contextmanager
def plain_module(model: nn.Module) -> Iterator[None]:
    """``model`` without its checkpointed blocks and outer regions for the duration (planning
    starts from the plain model: wrapping changes types), put back as they were after."""
    segmented = clear_nested(model, [])
    wrapped = {m: dict(m._zoo_checkpoint_options) for m in model.modules() if is_checkpointed(m)}
    for m in wrapped:
        checkpoint_module(m, False)
    try:
        yield
    finally:
        for m, options in wrapped.items():
            checkpoint_module(m, True, **options)
        restore_nested(segmented)


Step = Callable[..., tuple[int, int]]


def _fewest(step: Step, n: int, measured: dict[int, tuple[int, int]], budget: int | float
            ) -> int:
    """The fewest blocks (in the planner's order) whose step fits, by bisection: step(0) does
    not fit and step(n) does."""
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        measured[mid] = step(mid)
        lo, hi = (lo, mid) if measured[mid][0] <= budget else (mid, hi)
    return hi


def _plan_plain(model: nn.Module, example_input: Batch, budget: int | float,
                loss_fn: Callable[[Any], torch.Tensor] | None, modules: Any,
                optimizer: Optimizers, accumulate: int = 1) -> ModulePlan:
    blocks = find_blocks(model, modules)
    names = [n for n, _ in blocks]
    saved, flops = block_costs(model, blocks, example_input, loss_fn)
    order = sorted(names, key=lambda n: (-saved[n] / max(flops[n], 1), names.index(n)))

    def step(k: int, regions: list[str] | None = None) -> tuple[int, int]:
        chosen = set(order[:k])
        clear_nested(model, names)
        for n, m in blocks:
            checkpoint_module(m, n in chosen)
        set_nested(model, regions or [])
        return measure_step(model, example_input, loss_fn, optimizer=optimizer,
                            accumulate=accumulate)

    k, nested = len(order), []
    try:
        measured = {0: step(0), k: step(k)}
        plain_peak, plain_flops = measured[0]
        every = measured[k][0]
        if budget >= plain_peak:
            k = 0
        elif every <= budget:
            k = _fewest(step, k, measured, budget)
        else:
            nested, measured[k] = nest(outer_candidates(model, names),
                                       lambda regions: step(k, regions), measured[k], budget)
            if measured[k][0] > budget:
                raise BudgetTooSmallError(budget, measured[k][0], plain_peak)
        smallest = min(peak for peak, _ in measured.values())
    finally:
        clear_nested(model, names)
        for _, m in blocks:
            checkpoint_module(m, False)
    peak, step_flops = measured[k]
    return ModulePlan(names, [n for n in names if n in set(order[:k])], budget, peak,
                      plain_peak, smallest, step_flops - plain_flops, plain_flops, saved,
                      nested, every)
