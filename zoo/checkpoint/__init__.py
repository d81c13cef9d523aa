"""The zoo's one checkpoint primitive: activation checkpointing that is exactly the plain model.

Activation (gradient) checkpointing keeps only a region's inputs during the forward pass and runs
the region a second time during backward to rebuild what backward needs (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174). Done naively the second run
is not the first one, and users pay for that (reports on the PyTorch forum and issue tracker):

* reentrant ``torch.utils.checkpoint`` gives parameters no gradient when no input requires grad
  (a frozen model that "trains 3x faster");
* BatchNorm updates its running statistics once per forward *and once per recompute*, so
  ``num_batches_tracked`` counts twice and ``running_mean``/``running_var`` drift from the plain
  model's (pytorch/pytorch#96136, still open);
* dropout must see the same random numbers on recompute, on every device it draws from;
* reentrant checkpoint runs a nested backward per region, which made nn.DataParallel 5x slower.

:func:`checkpoint` works like PyTorch's non-reentrant checkpoint (saved-tensor hooks, so gradients
reach parameters through the ordinary graph, once, with no nested backward), in its own lean
implementation (``_Region`` below: about a third less extra time per region than torch's, which
matters on models made of many small layers), and adds:

* a recompute guard that keeps every normalisation layer from updating its running statistics a
  second time in the recomputed forward (BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm with
  tracked statistics, ``momentum=None`` included), so the buffers end exactly as one plain
  forward leaves them;
* RNG stashing for the CPU, for every CUDA device holding an input or the region's parameters,
  and for the current CUDA device (torch only stashes the devices of the positional inputs);
* :func:`is_recomputing`, so layers can tell a recompute from a forward (``zoo.nn.cp_BatchNorm2d``
  uses it, together with a backward-pass check, to be exact under anyone's checkpoint);
* optional selective recompute (``save_ops``): the outputs of the named ops are kept and only the
  cheap rest is recomputed (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", Megatron-LM), in the same region (:mod:`zoo.checkpoint.selective`), with
  no op dispatched beyond what the recompute reruns;
* ``torch.compile`` support with no graph break (``fullgraph=True``): while Dynamo traces, each
  region becomes torch's ``tag_activation_checkpoint`` subgraph and AOTAutograd's partitioner
  does the recompute inside the backward graph, where the contract holds by construction
  (BatchNorm statistics are written once, by the forward graph; dropout masks are kept, not
  redrawn; ``save_ops`` become torch's selective-checkpoint policy).
  tests/checkpoint/test_compile.py
  checks it against the eager plain model;
* errors that name the cause and the fix: an input changed in place before the recompute, a
  region that saves different tensors when recomputed.

It is a drop-in for ``torch.utils.checkpoint.checkpoint``: it takes torch's keywords (their
meaning for a zoo region: :mod:`zoo.checkpoint.keywords`) and passes PyTorch's own
non-reentrant checkpoint tests (ported in tests/checkpoint/test_checkpoint_torch_*.py), except for
the deliberate differences listed in :func:`checkpoint`.

Under ``torch.no_grad()`` / ``inference_mode`` it simply calls ``fn``: nothing is saved and
nothing is recomputed, so there is nothing to pay.

Files: this one names the public calls; :mod:`~zoo.checkpoint.primitive` holds
:func:`checkpoint` itself; :mod:`~zoo.checkpoint.region` the saved-tensor region and its rules;
:mod:`~zoo.checkpoint.backward_call` what the engine says about the backward call running now;
:mod:`~zoo.checkpoint.recompute` the recompute flag, normalisation guard and RNG/autocast
contexts; :mod:`~zoo.checkpoint.casts` forwards without autocast's cache of parameter casts;
:mod:`~zoo.checkpoint.selective` what ``save_ops`` keeps and serves;
:mod:`~zoo.checkpoint.compiled` the region under ``torch.compile``;
:mod:`~zoo.checkpoint.sequential` chains of blocks and the planner's plans;
:mod:`~zoo.checkpoint.keywords` torch's keywords; :mod:`~zoo.checkpoint.offload` saved
tensors moved to host memory instead of recomputed, and :mod:`~zoo.checkpoint.offload_cost` when
that pays; :mod:`~zoo.checkpoint.policies` finer
``save_ops``.
"""
from __future__ import annotations

from .casts import CastTwiceError, set_casts_once
from .compiled import _keep_bases  # noqa: F401  (tests reach the compiled policy here)
from .offload import host_copies, offload, offloaded_bytes, reset_offloaded_bytes
from .primitive import checkpoint
from .recompute import is_recomputing, state_bookkeeping
from .sequential import (checkpoint_sequential, in_place_groups, run_blocks, run_plan,
                         split_segments)

__all__ = ["checkpoint", "checkpoint_sequential", "is_recomputing", "split_segments",
           "in_place_groups", "state_bookkeeping", "run_blocks", "run_plan", "offload",
           "offloaded_bytes", "host_copies", "reset_offloaded_bytes", "set_casts_once",
           "CastTwiceError"]
