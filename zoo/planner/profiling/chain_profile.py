"""The figures the planner knows about a model's chain on one input (:class:`ChainProfile`),
as ``profiling.profile`` measures them and ``search.one_level``, ``search.multi_level`` and
``search.front`` read them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ChainProfile", "Segments"]

Segments = list[tuple[int, int, bool]]


@dataclass
class ChainProfile:
    """What the planner knows about one model on one input (all bytes as MemTracker counts them).

    Units are runs of chain blocks the planner keeps together (a block whose output aliases its
    input joins the block before it). Per unit ``u`` (blocks ``units[u]``) and per boundary
    ``k`` (the input of unit ``k``; ``k = n`` is the chain's output):

    * ``act[k]``: bytes of boundary ``k``'s storage (``act[0] = 0``: the chain's input is part of
      ``base``); ``dgrad[k]``: bytes of its gradient;
    * ``saved[u]``: bytes the unit keeps for its backward beyond its input and output storages;
      ``keeps_input[u]`` / ``keeps_output[u]``: whether it keeps those too; ``opaque[u]``: part
      of what it keeps is out of the saved-tensor hooks' sight (a selective checkpoint's cache,
      or the inputs needing no gradient that a checkpoint of its own keeps itself when nested:
      a frozen block's output), so inside an outer checkpoint it would keep it all the same: it
      runs stored at the top level only;
    * ``fwd_rise[u]`` / ``fwd_rise_ckpt[u]``: peak above the level at the unit's start during its
      forward, stored / checkpointed; ``fwd_rise_stop[u]``: the same peak up to the unit's last
      saved tensor, where a recompute ending with the unit stops;
    * ``bwd_rise[u]``: peak above the level when its output's gradient is ready, during its
      backward, stored with its input held by the unit before as in a plain step
      (``keeps_output[u - 1]``); ``bwd_rise_alone[u]`` stored with nobody before holding its
      input; inside a checkpointed segment (its saved tensors recomputed, each freed as soon as
      its node has used it) ``bwd_rise_region[u]`` first in the region (which holds its input),
      ``bwd_rise_recomputed[u]`` after a stored unit that holds its input,
      ``bwd_rise_recomputed_alone[u]`` with nobody else holding it; ``grads[u]``: parameter
      gradients it allocates;
    * ``flops[u]``: forward FLOPs; ``recompute_flops[u]``: FLOPs of its recompute when it is the
      last unit of a checkpointed segment.

    Constants: ``base`` (memory when the chain starts: parameters, buffers, stem), ``pre_peak``
    and ``tail_peak`` (peaks before the chain and after its backward), ``head_rise`` (peak of the
    head, loss and head backward above the level at the chain's end), ``bwd_misc`` (what the
    head leaves during the chain's backward: its parameters' gradients), ``step_flops`` (a plain
    step's FLOPs), and the measured peak of the plain profiling run. With ``block_mode`` every
    block runs in that intra-block checkpoint mode; ``inner_flops`` is what the blocks' own
    checkpoints recompute whatever the schedule (``recompute_flops`` counts beyond it), per unit
    ``unit_inner_flops``. ``unit_step_flops[u]``: the unit's share of a step's FLOPs;
    ``repeats[u]``: the unit whose figures unit ``u`` copies (``zoo.planner.profiling.repeats``);
    ``joined``: units were joined beyond the chain's own to keep a long chain's search short
    (``repeats.joined``). The
    lists after ``unit_inner_flops`` may be empty (a hand-made profile): the plain figures
    stand in for them.
    """

    block_names: list[str]
    units: list[tuple[int, int]]
    act: list[int]
    dgrad: list[int]
    saved: list[int]
    keeps_input: list[bool]
    keeps_output: list[bool]
    fwd_rise: list[int]
    fwd_rise_ckpt: list[int]
    bwd_rise: list[int]
    grads: list[int]
    flops: list[int]
    recompute_flops: list[int]
    base: int = 0
    pre_peak: int = 0
    tail_peak: int = 0
    head_rise: int = 0
    bwd_misc: int = 0
    step_flops: int = 0
    measured_plain_peak: int = 0
    block_mode: str | None = None
    inner_flops: int = 0
    unit_inner_flops: list[int] = field(default_factory=list)
    fwd_rise_stop: list[int] = field(default_factory=list)
    bwd_rise_alone: list[int] = field(default_factory=list)
    bwd_rise_region: list[int] = field(default_factory=list)
    bwd_rise_recomputed: list[int] = field(default_factory=list)
    bwd_rise_recomputed_alone: list[int] = field(default_factory=list)
    opaque: list[bool] = field(default_factory=list)
    unit_step_flops: list[int] = field(default_factory=list)
    repeats: list[int] = field(default_factory=list)
    joined: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def n_units(self) -> int:
        return len(self.units)

    @property
    def n_blocks(self) -> int:
        return len(self.block_names)

    def rise_in_recompute(self, u: int, last: bool) -> int:
        """Unit ``u``'s forward rise inside a recompute; ``last``: the recompute ends with it,
        so it stops at the unit's last saved tensor."""
        return self.fwd_rise_stop[u] if last and self.fwd_rise_stop else self.fwd_rise[u]

    def rise_in_backward(self, u: int, recomputed: bool, held_by: int) -> int | None:
        """Unit ``u``'s backward rise; ``recomputed``: inside a checkpointed segment;
        ``held_by``: who holds its input besides itself (0: nobody, 1: the unit before it, 2:
        the enclosing region, as ``search.multi_level.STATES``). None: a context the profile
        never saw (the unit before holding the input, where in this profile's mode it does
        not)."""
        if not self.bwd_rise_region:
            return self.bwd_rise[u]
        if recomputed:
            return (self.bwd_rise_recomputed_alone, self.bwd_rise_recomputed,
                    self.bwd_rise_region)[held_by][u]
        if (held_by == 1) == self.held_in_plain(u):
            return self.bwd_rise[u]
        return self.bwd_rise_alone[u] if held_by != 1 else None

    def held_in_plain(self, u: int) -> bool:
        """Whether a plain step holds unit ``u``'s input in the unit before (its saved output)."""
        return u > 0 and self.keeps_output[u - 1]

    def is_opaque(self, u: int) -> bool:
        return bool(self.opaque) and self.opaque[u]

    def unit_segments(self, block_segments: Segments) -> Segments:
        """Block-level segments -> unit-level; every cut must fall between units."""
        starts = {a: u for u, (a, _) in enumerate(self.units)}
        starts[self.n_blocks] = self.n_units
        try:
            return [(starts[a], starts[b], ck) for a, b, ck in block_segments]
        except KeyError as e:
            raise ValueError(f"block {e.args[0]} is inside a unit {self.units}: its input and "
                             f"output share storage, so a segment cannot start there") from None

    def block_segments(self, unit_segments: Segments) -> Segments:
        """Unit-level segments -> the block-level plan ``set_checkpoint_plan`` takes."""
        bounds = [a for a, _ in self.units] + [self.n_blocks]
        return [(bounds[a], bounds[b], ck) for a, b, ck in unit_segments]
