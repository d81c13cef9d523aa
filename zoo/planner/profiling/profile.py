"""Profile a model's chain of blocks for the planner: bytes, FLOPs, and when memory rises.

Training steps run under ``FakeTensorMode`` (:mod:`.trace`), every tensor counted as
``MemTracker`` counts it and every FLOP as ``FlopCounterMode``:

1. the chain stored plainly: per block, the storages autograd saves (``saved_tensors_hooks``,
   parameters excluded; what a block keeps out of the hooks' sight, as a selective checkpoint's
   cache, read off the memory level), the bytes at each boundary, the forward FLOPs, and how far
   memory rises in forward and backward;
2. up to four runs of a nested pattern (:mod:`.contexts`) showing every unit in every context a
   schedule can put it in, for the rises and recompute FLOPs of each.

Outside the chain (stem, head, loss) the levels of the first run enter as constants. A block
whose output shares its input's storage (an in-place ReLU) joins the block before into one
*unit*: cutting there saves nothing. The memory model is rotor's (Beaumont et al. 2019,
arXiv:1911.13214); a block's own checkpoints are counted through
``zoo.checkpoint.region.observers``. Design: docs/planner.md ("How a zoo model is planned")."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from .chain_profile import ChainProfile
from .contexts import blocks_of, fill_gaps, nested_pattern, read_pattern, unit_peak
from ...memory.fake import FakeStep
from ...memory.training import default_loss
from .repeats import PER_UNIT, expand, joined, kept_blocks, repeats, whole_block
from ..search.savesets import is_save_set, save_set_applied, targets
from .trace import Trace, traced_step

__all__ = ["ChainProfile", "profile_chain", "default_loss"]

def _block_name(block: Any) -> str:
    name = getattr(block, "name", None)
    if isinstance(block, nn.Module):
        return f"{type(block).__name__}({name})" if isinstance(name, str) else type(block).__name__
    if isinstance(name, str):  # a spine step: its module's dotted name
        return name
    func = getattr(block, "func", block)  # functools.partial
    owner = getattr(func, "__self__", None)
    return type(owner).__name__ if isinstance(owner, nn.Module) else getattr(
        func, "__name__", type(block).__name__)


def profile_chain(model: nn.Module, example_input: torch.Tensor,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  block_mode: str | None = None, *, like: ChainProfile | None = None,
                  whole: bool = True, fake: FakeStep | None = None,
                  max_units: int | None = None) -> ChainProfile | None:
    """Profile ``model``'s chain (``checkpoint_chain``) on ``example_input`` for the planner.

    Runs up to five fake training steps, leaving ``model`` (parameters, buffers, checkpoint
    plan) as it was: a plain one of the whole chain, then up to four of its kept units only
    (``repeats``: a run of identical units is profiled on its first three). ``block_mode``:
    every block runs in that intra-block mode (``model.run_chain_block``) or, for a save set
    (``search.savesets``), checkpointed with it, stored at the top level only. ``like``: the
    plain profile of the same chain, whose kept units then serve for the plain step too.
    ``whole=False``: None for a mode that checkpoints each unit whole and nothing else (a
    one-unit checkpointed segment does that). ``fake``: the fake state to run on (made here when
    not given). ``max_units``: a chain of more units has runs of identical units joined into at
    most half as many (``repeats.joined``, ``ChainProfile.joined``), so that the nested search,
    cubic in the units, stays within seconds.
    """
    chain = list(model.checkpoint_chain())
    if not chain:
        raise ValueError(f"{type(model).__name__}.checkpoint_chain() is empty")
    if is_save_set(block_mode):  # an op-level choice: the blocks' own modules wrapped
        wrapped = targets(model, chain, block_mode)
        if not any(t is not None for t in wrapped):
            return None
        with save_set_applied(model, chain, block_mode):
            prof = _profile(model, example_input, loss_fn, None, like, whole, fake, max_units,
                            stored_only=[t is not None for t in wrapped])
        if prof is not None:  # torch's selective checkpoint keeps its cache even inside an
            # outer region's forward: stored at the top only
            selective = [any(wrapped[j] is not None for j in range(a, b)) for a, b in prof.units]
            prof.opaque = [o or c for o, c in zip(prof.opaque, selective)]
            prof.keeps_input = [k or c for k, c in zip(prof.keeps_input, selective)]
            prof.block_mode = block_mode
        return prof
    return _profile(model, example_input, loss_fn, block_mode, like, whole, fake, max_units)


def _profile(model: nn.Module, example_input: torch.Tensor,
             loss_fn: Callable[[Any], torch.Tensor] | None, block_mode: str | None,
             like: ChainProfile | None, whole: bool, fake: FakeStep | None,
             max_units: int | None = None, stored_only: Sequence[bool] = ()
             ) -> ChainProfile | None:
    """``stored_only``: per chain block, whether it is checkpointed with a save set (whose
    region keeps its ops' outputs beside its input, so never a whole-block checkpoint's double,
    and whose cache torch keeps even inside an outer recompute: its unit runs stored at the top
    level only)."""
    loss_fn = loss_fn or default_loss
    fake = fake or FakeStep(model, example_input)
    chain = list(model.checkpoint_chain())
    n = len(chain)
    names = [_block_name(b) for b in chain]
    # a mode that may turn out to checkpoint each unit whole is told by its forward alone
    stop = None if whole or stored_only else _checkpoints_units_whole
    if like is not None and like.repeats and like.n_blocks == n:
        order, sub_units = kept_blocks(like.units, like.repeats)
        plain, _, step_flops = traced_step(model, example_input, loss_fn,
                                           [(0, len(order), False)], block_mode, order, fake,
                                           stop)
        natural = _units_of(plain, len(order))
        if not _fits(sub_units, natural, like.joined):
            like = None  # the mode joins blocks differently: profile the whole chain
    if like is None or not like.repeats or like.n_blocks != n:
        plain, plain_peak, step_flops = traced_step(model, example_input, loss_fn,
                                                    [(0, n, False)], block_mode, fake=fake,
                                                    stop=stop)
        if plain.length != n:
            raise ValueError(f"run_chain ran {plain.length} blocks, checkpoint_chain() has {n}")
        if plain.stopped:
            return _whole_or_error(plain, block_mode)
        units = natural = _units_of(plain, n)
        many = max_units is not None and len(units) > max_units
        if many:
            units = joined(chain, units, plain.meta, max_units // 2)
        prof = _from_plain(plain, units, names)
        prof.joined = many
        prof.measured_plain_peak = plain_peak
        prof.repeats = repeats(chain, units, plain.meta)
        order, sub_units = kept_blocks(units, prof.repeats)
        sub = _select(prof, sub_units)
    else:
        if plain.stopped:
            return _whole_or_error(plain, block_mode)
        sub = _from_plain(plain, sub_units, [names[j] for j in order])
        prof = None
    sub.step_flops = step_flops - sub.inner_flops
    kept_stored_only = [bool(stored_only) and any(stored_only[order[j]] for j in range(a, b))
                        for a, b in sub.units]
    _read_patterns(sub, _pattern_runs(sub, kept_stored_only),
                   partial(traced_step, model, example_input, loss_fn, block_mode=block_mode,
                           order=order, fake=fake, saves=False))
    if prof is None:  # everything from the kept units
        prof = expand(sub, like.repeats, like.units, names)
        prof.repeats, prof.joined = like.repeats, like.joined
    else:  # the whole plain step, and what the other runs saw
        full = expand(sub, prof.repeats, prof.units, names)
        for name in CONTEXTS:
            setattr(prof, name, getattr(full, name))
        prof.step_flops = step_flops - prof.inner_flops
    prof.block_mode = block_mode
    return prof


def _read_patterns(sub: ChainProfile, runs: int, step: Callable[..., tuple]) -> None:
    """Fill ``sub``'s per-unit costs from ``runs`` nested-pattern steps (each unit seen stored,
    checkpointed and recomputed in one of them), ``step(segments)`` a traced step of them."""
    for shift in range(runs):
        segments, roles = nested_pattern(sub.n_units, shift, held=runs == 4)
        trace = step(blocks_of(sub.units, segments))[0]  # read_pattern: its levels
        read_pattern(sub, trace, segments, roles)
    fill_gaps(sub)


def _pattern_runs(sub: ChainProfile, stored_only: Sequence[bool]) -> int:
    """How many pattern runs show every context a schedule may put a unit of ``sub`` in: four
    where a unit holds its input in the unit before in the plain step (a schedule may
    checkpoint that one), two where none does (:func:`.contexts.nested_pattern`), none where
    every unit runs stored at the top level only (a unit keeping part of its tensors out of
    the hooks' sight, or with a save set: ``stored_only``) in the context of its plain step."""
    if any(sub.held_in_plain(u) for u in range(sub.n_units)):
        return 4
    return 0 if all(sub.is_opaque(u) or stored_only[u] for u in range(sub.n_units)) else 2


def _checkpoints_units_whole(plain: Trace) -> bool:
    """Whether a forward's mode checkpoints each unit whole and nothing else (then the profile
    is not wanted: a one-unit checkpointed segment does the same)."""
    return whole_block(plain.regions, plain.in_key, _units_of(plain, plain.length))


def _whole_or_error(plain: Trace, block_mode: str | None) -> None:
    """None for a mode that checkpoints each unit whole; an error when a block keeps more than
    its one region (then the mode is measured whole, as a hand mode)."""
    natural = _units_of(plain, plain.length)
    if any(set(plain.saved.get(j, {})) - {plain.in_key[a]}
           for a, b in natural for j in range(a, b) if plain.regions.get(j)):
        raise ValueError(f"block mode {block_mode!r}: a block keeps more than its one "
                         f"checkpoint region describes (a reversible stage's streams); "
                         f"measured as a hand mode")
    return None


def _fits(units: list[tuple[int, int]], natural: list[tuple[int, int]], joined: bool) -> bool:
    """Whether a profile's ``units`` serve a mode whose own units are ``natural``: the same, or
    for joined units, each a run of whole ``natural`` units."""
    if not joined:
        return units == natural
    return {a for a, _ in units} <= {a for a, _ in natural}


def _units_of(plain: Trace, n: int) -> list[tuple[int, int]]:
    """Blocks joined into units: a block joins the one before when its input is that block's
    output's storage, or when that output needs no gradient (a frozen stem: such blocks save
    nothing, so they join the first block that does)."""
    starts = [j for j in range(n) if j == 0 or not plain.alias[j] and plain.out_dgrad[j - 1]]
    return [(a, b) for a, b in zip(starts, starts[1:] + [n])]


# what the pattern runs add to a plain step's figures (``opaque``: a unit that keeps more in a
# checkpointed segment's forward than its output, ``contexts._kept_in_region``)
CONTEXTS = ("fwd_rise_ckpt", "recompute_flops", "bwd_rise_alone", "bwd_rise_region",
            "bwd_rise_recomputed", "bwd_rise_recomputed_alone", "opaque")


def _select(prof: ChainProfile, sub_units: list[tuple[int, int]]) -> ChainProfile:
    """The kept units' part of a whole chain's profile (positions in the shorter chain)."""
    kept = [u for u in range(prof.n_units) if prof.repeats[u] == u]
    fields = {name: [getattr(prof, name)[u] for u in kept] for name in PER_UNIT
              if getattr(prof, name)}
    return dataclasses.replace(prof, units=sub_units, act=[0, *(prof.act[u + 1] for u in kept)],
                               dgrad=[0, *(prof.dgrad[u + 1] for u in kept)], **fields)


def _from_plain(plain: Trace, units: list[tuple[int, int]], names: list[str]) -> ChainProfile:
    """Every figure a plain step gives: sizes, what is kept, forward rises, stored backward."""
    n_units = len(units)
    prof = ChainProfile(names, units, [0], [0], [], [], [], [], [], [], [], [], [0] * n_units)
    for a, b in units:
        blocks = range(a, b)
        in_key, out_key = plain.in_key[a], plain.out_key[b - 1]
        saved: dict[int, int] = {}
        for j in blocks:
            saved.update(plain.saved.get(j, {}))
        prof.keeps_input.append(in_key in saved)
        prof.keeps_output.append(out_key in saved)
        kept = sum(v for k, v in saved.items() if k not in (in_key, out_key))
        new_output = 0 if out_key == in_key else plain.out_bytes[b - 1]
        grown = plain.mark[("G", b - 1) if ("G", b - 1) in plain.mark else ("head",)] \
            - plain.mark[("F", a)]
        # what the level grew by beyond the output is what the unit keeps: more than the hooks
        # saw is kept out of their sight; less, the hooks saw storages older than the unit.
        # Autocast's cache of parameter casts is out of their sight too, but it keeps them
        # whether or not the unit is checkpointed: it does not make the unit opaque.
        cached = sum(plain.cached.get(j, 0) for j in blocks)
        prof.opaque.append(grown - new_output - cached > kept)
        prof.saved.append(max(0, grown - new_output))
        if prof.opaque[-1]:  # torch's checkpoint keeps its inputs too, out of the hooks' sight
            prof.keeps_input[-1] = True
        prof.act.append(plain.out_bytes[b - 1])
        prof.dgrad.append(plain.out_dgrad[b - 1])
        prof.fwd_rise.append(unit_peak(plain, "FG", blocks) - plain.mark[("F", a)])
        prof.fwd_rise_stop.append(_rise_to_last_pack(plain, blocks, prof.fwd_rise[-1]))
        start = plain.mark.get(("B", b - 1))
        prof.bwd_rise.append(0 if start is None else unit_peak(plain, "B", blocks, start) - start)
        prof.grads.append(sum(plain.grads.get(("B", j), 0) for j in blocks))
        prof.flops.append(sum(plain.flops.get(("F", j), 0) for j in blocks))
        prof.unit_inner_flops.append(sum(plain.rflops.get(("B", j), 0) for j in blocks))
        prof.unit_step_flops.append(prof.flops[-1] - prof.unit_inner_flops[-1]
                                    + sum(plain.flops.get(("B", j), 0) for j in blocks))
    prof.act[0] = 0  # the chain's input lives in ``base`` for the whole step
    prof.dgrad[0] = 0
    prof.base = plain.mark[("F", 0)]
    prof.pre_peak = plain.peak.get(("pre",), 0)
    prof.tail_peak = plain.peak.get(("tail",), 0)
    prof.head_rise = plain.peak[("head",)] - plain.mark[("head",)]
    prof.inner_flops = sum(plain.rflops.values())
    n = len(names)
    for name in ("fwd_rise_ckpt", "bwd_rise_alone", "bwd_rise_region", "bwd_rise_recomputed",
                 "bwd_rise_recomputed_alone"):
        setattr(prof, name, [None] * n_units)
    if ("B", n - 1) in plain.mark:
        prof.bwd_misc = plain.mark[("B", n - 1)] - prof.base - _plain_held(prof) - prof.dgrad[-1]
    else:
        prof.notes.append("the chain's output gets no gradient: nothing to plan")
    return prof


def _rise_to_last_pack(trace: Trace, blocks: range, whole: int) -> int:
    """How far a unit's forward rises until its last saved tensor (``whole``: the whole forward's
    rise, for a unit that saves nothing: its recompute is not cut short by its own tensors)."""
    packed = [j for j in blocks if j in trace.at_last_pack]
    if not packed:
        return whole
    last = packed[-1]
    before = [trace.peak[(k, j)] for j in blocks if j < last for k in "FG" if (k, j) in trace.peak]
    return max([trace.at_last_pack[last], *before]) - trace.mark[("F", blocks[0])]


def _plain_held(p: ChainProfile) -> int:
    """Bytes the chain holds at the end of a plain forward (saved tensors and kept boundaries)."""
    n = p.n_units
    kept = {k for k in range(1, n + 1)
            if p.keeps_output[k - 1] or (k < n and p.keeps_input[k])}
    return sum(p.saved) + sum(p.act[k] for k in kept)
