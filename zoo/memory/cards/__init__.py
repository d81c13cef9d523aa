"""What a CUDA card would do with a training step, predicted on a machine without one.

The rest of :mod:`zoo.memory` measures this machine; this package models a named card
(docs/benchmarks/prediction.md says what is modelled and how well it holds):

* ``timing.py``: the cards' published numbers (:data:`CARDS`, :class:`Card`) and a step's time
  on one (each op's roofline, the host's cost per op and region, the fitted fractions);
* ``kernels.py``: the ops CUDA's kernels run where a CPU step runs others (fused attention,
  dropout);
* ``allocator.py``: the CUDA caching allocator's arithmetic, replayed;
* ``peak.py``: a fake step counted through that allocator, op by op (``max_memory_allocated``);
* ``step.py``: one training step of a model on a card, its peak and time (``predict_step``);
* ``inductor.py`` and ``compiled_step.py``: the same step under ``torch.compile`` (and CUDA
  graphs): the graphs inductor receives, and the kernels its own scheduler makes of them for
  the card (``predict_compiled_step``);
* ``on_card.py``: ``with on_card("h100"):`` makes the fake steps measured inside count as the
  card's;
* ``autocast.py``: CUDA's autocast op lists on a step whose fake tensors live on the CPU;
* ``bound.py``: the least peak any keep/recompute/offload plan of a step can reach on a card.

It imports the measuring modules below it (the tracker, the fake step); they import only
``on_card`` (the step's counter and the tensors it holds) from here. ``zoo.memory`` re-exports
the public names.
"""
from __future__ import annotations

from .timing import *  # noqa: F403  (the names zoo.memory.cards has always had)
from .timing import __all__
