"""Subclasses the zoo gives a module in place, and how they pickle.

Where the zoo changes what a module's forward does (a checkpointed block, a recompute-safe
BatchNorm, a forward without autocast's cache), it swaps the module's class for a subclass made
once per original class and named as it. A class swap, not an instance attribute, keeps deepcopy,
state_dict, hooks and parameter identity, and holds for ``nn.DataParallel``'s replicas (made by
class, each running its own ``self``) and for wrappers of ``model.forward`` made later
(Accelerate's autocast wraps the class's forward). The generated class cannot be found by name,
so ``torch.save(model)`` pickles the module as its original class plus the function that makes
the swap again.
"""
from __future__ import annotations

import copyreg
from collections.abc import Callable
from typing import Any

__all__ = ["reduce_as_original"]


def _new_swapped(make: Callable[[type], type], original: type, *args: Any) -> Any:
    """Unpickling: the swapped class made again from the original, which pickles by name."""
    swapped = make(original)
    return swapped.__new__(swapped, *args)


def reduce_as_original(module: Any, protocol: int, make: Callable[[type], type],
                       original: type) -> Any:
    """``module.__reduce_ex__`` for a swapped class: ``original`` and ``make`` (a module-level
    function, ``make(original)`` the swapped class) in place of the generated class."""
    reduced = super(type(module), module).__reduce_ex__(protocol)
    if not isinstance(reduced, tuple) or reduced[0] is not copyreg.__newobj__:
        return reduced
    return (_new_swapped, (make, original, *reduced[1][1:]), *reduced[2:])
