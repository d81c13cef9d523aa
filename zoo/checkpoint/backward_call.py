"""What the autograd engine says about the backward call running now, for the region of
:mod:`zoo.checkpoint.region`: which call it is (the region's Rule 2, one recompute per backward
call) and whether it runs every node still holding one of the region's slots without keeping the
graph (Rule 6, letting go early)."""
from __future__ import annotations

import weakref
from typing import Any

from .. import _torch

_exec_group = _torch.get_graph_exec_group  # torch >= 2.10
_current_task = _torch.current_graph_task_id
# What the engine says about the backward call running now; without any of them (older torch) a
# region keeps its inputs until its last node has run.
_keep_graph = _torch.get_current_graph_task_keep_graph
_node_now = _torch.current_autograd_node
_will_run = _torch.will_engine_execute_node
_CAN_LET_GO = None not in (_keep_graph, _node_now, _will_run, _torch.get_sequence_nr)


def _backward_call() -> Any:
    """The backward call running now: a GraphExecGroup, a graph task id, or -1 (none)."""
    if _exec_group is not None:
        group = _exec_group()
        if group is not None:
            return group
    return _current_task()


def _last_recompute(slots: list[weakref.ref[Any] | None], first: int) -> bool:
    """Whether the backward call running now runs every node that still holds one of ``slots``
    and keeps no graph (so none of them will ask for a recompute again).

    The nodes are found below the node running now, among the region's own (sequence numbers
    from ``first``, the region's first): a node made before the region ends a path, since
    nothing made before the region leads back into it. A slot whose node is not found (a
    branch beside the running node's, a node the engine runs under another name) keeps the
    region as it is, and so does anything the engine cannot answer (no backward call of its own:
    compiled autograd).
    """
    needed = set()
    for ref in slots:
        slot = None if ref is None else ref()
        if slot is not None:
            needed.add(slot.node)
    try:
        if _keep_graph():
            return False
        stack, seen = [_node_now()], set()
        while stack and stack[-1] is not None:
            node = stack.pop()
            nr = _torch.sequence_nr(node)
            if nr < first or nr in seen:
                continue
            seen.add(nr)
            below = [f for f, _ in node.next_functions if f is not None]
            if nr in needed:
                if not (_will_run(node) and any(map(_runs, below))):
                    return False
                needed.discard(nr)
                if not needed:
                    return True
            stack += below
    except RuntimeError:
        return False
    return not needed


def _runs(node: Any) -> bool:
    """Whether the engine runs ``node`` in this backward call or takes a gradient there.

    A node whose gradient ``torch.autograd.grad`` only takes counts too, so a holder of a slot
    runs if one of the nodes below it counts as well (the engine's own rule for running a node
    when told which gradients to compute); a leaf whose gradient is taken is the engine's error.
    """
    try:
        return _will_run(node)
    except RuntimeError:
        return True
