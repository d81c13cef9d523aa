"""Every private torch name the library uses, in one place, with what each torch version has.

The checkpoint's exactness rests on torch internals (the autograd engine's view of the backward
call, the global forward pre-hook table, dispatch modes, the partitioner's policies, FakeTensor's
cache). Any release can move them; this module is where a new torch shows it. Each name below is
listed in :data:`NAMES` with the first torch that has it and what the library does without it:

* a fallback that stays exact (the name is ``None`` here, and its user takes a slower or more
  conservative path), or
* a one-line error naming the torch it needs, raised by :func:`require` when the feature is
  called, never at ``import zoo``.

tests/test_torch_compat.py resolves every entry on the installed torch and fails loudly when a
name the table promises is missing or has changed kind.

To check that nothing else reaches a private torch name (the project's rule)::

    grep -rnE "torch\\.([a-z_]+\\.)*_[a-zA-Z]|from torch[a-z_.]* import _|torch\\._C" zoo/ \\
        | grep -v "^zoo/_torch.py"

must print nothing.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import operator
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch._subclasses.fake_tensor as _fake
import torch.nn.modules.batchnorm
import torch.nn.modules.instancenorm
import torch.nn.modules.module
import torch.nn.utils.stateless
import torch.utils._python_dispatch
import torch.utils._pytree
import torch.utils.checkpoint

__all__ = ["VERSION", "NAMES", "Name", "require", "resolve"]


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


#: The installed torch as (major, minor).
VERSION = _version(torch.__version__)


class Name(NamedTuple):
    """One private (or version-dependent) torch name: since which release, and without it."""
    since: tuple[int, int]
    without: str


OLDEST = (2, 4)  # the oldest torch `import zoo` is checked on (supported: pyproject.toml)

#: dotted path -> since when torch has it, and what the library does on a torch without it.
NAMES: dict[str, Name] = {
    # autograd engine: the backward call running now
    "torch._C._current_graph_task_id": Name(OLDEST, "required"),
    "torch._C._get_graph_exec_group": Name((2, 10), "exact: graph task ids only"),
    "torch._C._autograd._get_current_graph_task_keep_graph": Name(
        (2, 6), "exact: a region keeps its inputs until its last node ran; CPU attention "
        "runs SDPA's own backward"),
    "torch._C._current_autograd_node": Name(OLDEST, "exact: inputs kept longer"),
    "torch._C._will_engine_execute_node": Name(OLDEST, "exact: inputs kept longer"),
    "torch._C._autograd._get_sequence_nr": Name(OLDEST, "exact: inputs kept longer"),
    "torch._C._autograd._top_saved_tensors_default_hooks": Name(
        OLDEST, "error: a zoo region inside torch's inside a zoo region fails in backward; "
        "save_on_cpu does not get a region's inputs"),
    "torch.autograd.Variable._execution_engine": Name(OLDEST, "required"),
    "torch._C._is_any_autocast_enabled": Name(OLDEST, "exact: autocast read per device"),
    "torch._C._dispatch_tls_is_dispatch_key_excluded": Name(OLDEST, "required (op counter)"),
    "torch._C.DispatchKey": Name(OLDEST, "required"),
    "torch._C._dispatch_get_all_op_names": Name(OLDEST, "required (a card's autocast)"),
    "torch._C._dispatch_has_kernel_for_dispatch_key": Name(
        OLDEST, "required (a card's autocast)"),
    # modules and their hooks
    "torch.nn.modules.module._global_forward_pre_hooks": Name(OLDEST, "required (BN guard)"),
    "torch.nn.modules.batchnorm._NormBase": Name(OLDEST, "required (BN guard)"),
    "torch.nn.modules.batchnorm._BatchNorm": Name(OLDEST, "required (BN guard)"),
    "torch.nn.modules.instancenorm._InstanceNorm": Name(OLDEST, "required (BN guard)"),
    "torch.nn.utils.stateless._reparametrize_module": Name(OLDEST, "required (planner)"),
    "torch.nn.utils.parametrizations._SpectralNorm": Name(OLDEST, "required (spectral norm)"),
    # dispatch modes and pytrees
    "torch.utils._python_dispatch.TorchDispatchMode": Name(OLDEST, "required"),
    "torch.utils._python_dispatch._get_current_dispatch_mode": Name(OLDEST, "required"),
    "torch.utils._python_dispatch._pop_mode_temporarily": Name(OLDEST, "required"),
    "torch.utils._python_dispatch._disable_current_modes": Name(
        OLDEST, "required (a card's autocast)"),
    "torch.utils._pytree.tree_map_only": Name(OLDEST, "required"),
    "torch.utils._pytree.tree_flatten": Name(OLDEST, "required"),
    "torch.utils._pytree.tree_leaves": Name(OLDEST, "required"),
    "torch._ops.OpOverload": Name(OLDEST, "required"),
    "torch._ops.HigherOrderOperator": Name(OLDEST, "required (memory tracker)"),
    "torch._fused_sdp_choice": Name(OLDEST, "required (CPU attention)"),
    "torch.autograd._unsafe_preserve_version_counter": Name(
        OLDEST, "exact: offload catches in-place changes only of saved tensors still held"),
    # torch.utils.checkpoint's selective checkpoint (compiled regions, save_ops under compile)
    "torch.utils.checkpoint.create_selective_checkpoint_contexts": Name(
        (2, 5), "error: compiled regions (which need 2.8)"),
    "torch.utils.checkpoint.CheckpointPolicy": Name(
        (2, 5), "error: compiled regions (which need 2.8)"),
    "torch.utils.checkpoint._CachedTorchDispatchMode": Name(
        OLDEST, "exact: no torch replay mode to step outside"),
    # Dynamo, AOTAutograd and the partitioner
    "torch._dynamo.disable": Name(OLDEST, "required"),
    "torch._dynamo.reset": Name(OLDEST, "required (compiled memory)"),
    "torch._dynamo.list_backends": Name(OLDEST, "required (zoo-train --compile)"),
    "torch._dynamo.eval_frame.skip_code": Name(OLDEST, "required"),
    "torch._dynamo.eval_frame.OptimizedModule": Name(
        OLDEST, "required (a compiled model given to set_grad_checkpointing)"),
    "torch._dynamo.assume_constant_result": Name(
        OLDEST, "the plan's compile warning is not given"),
    "torch._dynamo.backends.common.aot_autograd": Name(OLDEST, "required (compiled memory)"),
    "torch._functorch.config.activation_memory_budget": Name(
        OLDEST, "required (compiled memory)"),
    "torch._functorch.config.activation_memory_budget_solver": Name(
        OLDEST, "required (compiled memory)"),
    "torch._functorch.partitioners.get_default_op_list": Name(OLDEST, "exact: torch's rule"),
    "torch._functorch.partitioners.min_cut_rematerialization_partition": Name(
        OLDEST, "required (compiled memory)"),
    "torch._prims.rng_prims": Name(OLDEST, "required (compiled memory on meta)"),
    "torch._inductor.inductor_prims.force_stride_order": Name(
        OLDEST, "exact: a compiled DenseNet keeps each stand-in's gradient as an expression"),
    "torch._inductor.compile_fx.compile_fx": Name(OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.compile_fx.fake_tensor_prop": Name(
        OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.compile_fx.record_original_output_strides": Name(
        OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.graph.GraphLowering": Name(OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.scheduler.Scheduler": Name(OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.scheduler.NopKernelSchedulerNode": Name(
        OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.ir.MultiOutput": Name(OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.ir.IRNode": Name(OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.ir.Buffer": Name(OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.ir.Layout": Name(OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.ir.MutableBox": Name(OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.ir.BaseView": Name(OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.ir.NonOwningLayout": Name(OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.ir.MutationLayoutSHOULDREMOVE": Name(
        OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.virtualized.V": Name(OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.debug.DebugContext": Name(OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.fx_passes.post_grad.post_grad_passes": Name(
        OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.fx_passes.post_grad.view_to_reshape": Name(
        OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.runtime.hints.DeviceProperties": Name(
        OLDEST, "required (a compiled step on a card)"),
    "torch._inductor.utils.is_big_gpu": Name(OLDEST, "required (a compiled step on a card)"),
    "torch.utils._triton.has_triton": Name(OLDEST, "required (a compiled step on a card)"),
    "torch._dynamo.device_interface.CudaInterface": Name(
        OLDEST, "required (a compiled step on a card)"),
    "torch._dynamo.device_interface.device_interfaces": Name(
        OLDEST, "required (a compiled step on a card)"),
    "torch._dynamo.device_interface.caching_worker_device_properties": Name(
        OLDEST, "required (a compiled step on a card)"),
    "torch._dynamo.device_interface.caching_worker_current_devices": Name(
        OLDEST, "required (a compiled step on a card)"),
    "torch.fx.experimental.proxy_tensor.get_proxy_mode": Name((2, 5), "exact: torch's rule"),
    "torch._guards.detect_fake_mode": Name(OLDEST, "required"),
    # FakeTensor and the memory tracker
    "torch._subclasses.fake_tensor.FakeTensor": Name(OLDEST, "required (planner)"),
    "torch._subclasses.fake_tensor.FakeTensorMode": Name(OLDEST, "required (planner)"),
    "torch._subclasses.fake_tensor.is_fake": Name(OLDEST, "required"),
    "torch._subclasses.fake_tensor.in_kernel_invocation_manager": Name(OLDEST, "required"),
    "torch._subclasses.fake_tensor._DispatchCacheKey": Name(OLDEST, "exact: torch's keys"),
    "torch._subclasses.fake_tensor.DataDependentOutputException": Name(OLDEST, "required"),
    "torch._subclasses.fake_tensor.FakeTensorDeviceMismatchError": Name(
        (2, 14), "planning: a batch on another device is told by torch's older message"),
    "torch.distributed._tools.mem_tracker.MemTracker": Name(
        (2, 5), "error: exact CPU peaks (zoo.memory, zoo.plan) need torch 2.5"),
}


#: Private attributes of torch objects the library reads (tensors, modules, autograd nodes); each
#: is reached through the accessor named beside it.
ATTRIBUTES = {
    "_version": "tensor_version",
    "_sequence_nr": "sequence_nr",
    "_buffers": "module_buffers",
    "_parameters": "module_parameters",
    "_forward_pre_hooks": "module_forward_pre_hooks",
    "_destroy": "library_destroy",
    "_schema": "mutates_an_input",
    "_orig_mod": "compiled_original",
}


@functools.cache
def resolve(path: str) -> Any:
    """The object at dotted ``path`` (importing its module if needed), or ``None``."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def require(obj: Any, feature: str, path: str) -> Any:
    """``obj`` if this torch has it, else a one-line RuntimeError naming the torch ``feature``
    needs (from :data:`NAMES`)."""
    if obj is None:
        since = ".".join(map(str, NAMES[path].since))
        raise RuntimeError(f"zoo: {feature} needs torch >= {since} (this is torch "
                           f"{torch.__version__}); upgrade torch, or do without {feature}")
    return obj


def lazy(path: str, feature: str) -> Callable[[], Any]:
    """A function that imports ``path`` when first called (for names whose module is heavy to
    import), raising :func:`require`'s one-line error where this torch lacks it."""
    def get() -> Any:
        return require(resolve(path), feature, path)
    get.__name__ = path.rsplit(".", 1)[-1]
    return get


_C = torch._C
_autograd = torch._C._autograd
_checkpoint = torch.utils.checkpoint

# autograd engine
current_graph_task_id = _C._current_graph_task_id
get_graph_exec_group = getattr(_C, "_get_graph_exec_group", None)
get_current_graph_task_keep_graph = getattr(_autograd, "_get_current_graph_task_keep_graph", None)
current_autograd_node = getattr(_C, "_current_autograd_node", None)
will_engine_execute_node = getattr(_C, "_will_engine_execute_node", None)
get_sequence_nr = getattr(_autograd, "_get_sequence_nr", None)
execution_engine = torch.autograd.Variable._execution_engine
is_any_autocast_enabled = getattr(_C, "_is_any_autocast_enabled", None)
dispatch_tls_is_dispatch_key_excluded = _C._dispatch_tls_is_dispatch_key_excluded
DispatchKey = _C.DispatchKey
dispatch_get_all_op_names = _C._dispatch_get_all_op_names
dispatch_has_kernel_for_dispatch_key = _C._dispatch_has_kernel_for_dispatch_key
#: ``library._destroy()``: takes a ``torch.library.Library``'s registrations back out.
library_destroy = operator.methodcaller("_destroy")


_top_saved_tensors_hooks = getattr(_autograd, "_top_saved_tensors_default_hooks", None)


def foreign_saved_tensors_hooks() -> bool:
    """Whether the innermost saved-tensor hooks in force are another library's or the user's
    (torch's checkpoint, ``save_on_cpu``), not zoo's own nor a measurement's that only watches
    (its pack function marked ``zoo_observes``): one call, as a region asks it."""
    top = None if _top_saved_tensors_hooks is None else _top_saved_tensors_hooks(False)
    if top is None:
        return False
    pack = top[0]
    return not (getattr(pack, "__module__", "zoo.").startswith("zoo.")
                or getattr(pack, "zoo_observes", False))


#: ``t._version``: a tensor's in-place version counter, which autograd checks saved tensors with
#: (an attrgetter: no Python frame per call, on the region's hot path).
tensor_version = operator.attrgetter("_version")
#: Keeps a tensor's version counter unchanged across an in-place op: offload uses it to make an
#: empty alias that shares a saved tensor's counter but not its storage.
preserve_version_counter = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)


_force_stride_order = resolve("torch._inductor.inductor_prims.force_stride_order")


def stored_when_compiled(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, which inductor then writes to memory where it is made, in its own
    dtype, instead of keeping it an expression that each reader recomputes from the buffers it
    reads (inductor's ``inductor_force_stride_order`` with the strides the tensor has: a copy
    only where inductor laid the value out otherwise; the identity in eager and under any other
    backend). ``tensor`` where torch lacks it."""
    if _force_stride_order is None:
        return tensor
    return _force_stride_order(tensor, tensor.stride())


def storage_id(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage, shared by its views, on every device (a fake
    tensor's ``data_ptr`` is refused; ``storage._cdata`` is the storage object's address)."""
    return tensor.untyped_storage()._cdata


#: ``node._sequence_nr()``: an autograd node's sequence number.
sequence_nr = operator.methodcaller("_sequence_nr")


# modules
global_forward_pre_hooks = torch.nn.modules.module._global_forward_pre_hooks
NormBase = torch.nn.modules.batchnorm._NormBase
BatchNormBase = torch.nn.modules.batchnorm._BatchNorm
InstanceNormBase = torch.nn.modules.instancenorm._InstanceNorm
reparametrize_module = torch.nn.utils.stateless._reparametrize_module
#: spectral norm's parametrization, and the forward pre-hook of the older hook-based one
SpectralNormParametrization = torch.nn.utils.parametrizations._SpectralNorm
SpectralNormPreHook = importlib.import_module("torch.nn.utils.spectral_norm").SpectralNorm


#: ``module._buffers``: a module's own buffer table (a ``None`` entry is skipped by ``buffers()``
#: and by BatchNorm's forward).
module_buffers = operator.attrgetter("_buffers")
#: ``module._parameters``: a module's own parameter table (swapped for aliases).
module_parameters = operator.attrgetter("_parameters")
#: ``module._forward_pre_hooks``: a module's own forward pre-hooks (spectral norm's older hook).
module_forward_pre_hooks = operator.attrgetter("_forward_pre_hooks")


# dispatch modes, ops and pytrees
TorchDispatchMode = torch.utils._python_dispatch.TorchDispatchMode
get_current_dispatch_mode = torch.utils._python_dispatch._get_current_dispatch_mode
pop_mode_temporarily = torch.utils._python_dispatch._pop_mode_temporarily
disable_current_modes = torch.utils._python_dispatch._disable_current_modes
tree_map_only = torch.utils._pytree.tree_map_only
tree_flatten = torch.utils._pytree.tree_flatten
tree_leaves = torch.utils._pytree.tree_leaves
OpOverload = torch._ops.OpOverload
HigherOrderOperator = torch._ops.HigherOrderOperator
fused_sdp_choice = torch._fused_sdp_choice
#: ``aten._to_copy``: the op every dtype cast dispatches (autocast's casts among them).
to_copy_op = torch.ops.aten._to_copy.default

# torch.utils.checkpoint's selective checkpoint (torch >= 2.5)
create_selective_checkpoint_contexts = getattr(_checkpoint, "create_selective_checkpoint_contexts",
                                               None)
CheckpointPolicy = getattr(_checkpoint, "CheckpointPolicy", None)
CachedTorchDispatchMode = getattr(_checkpoint, "_CachedTorchDispatchMode", None)


def checkpoint_early_stop() -> bool | None:
    """``torch.utils.checkpoint.set_checkpoint_early_stop``'s switch, or ``None`` where it is
    not set. torch 2.8 has no ``early_stop`` keyword and its switch starts at ``True``, which
    there means "not set" (a region's own ``early_stop`` decides); from 2.9 it starts at None."""
    stop = getattr(_checkpoint, "_enable_checkpoint_early_stop", None)  # None-valued: no NAMES
    return None if VERSION < (2, 9) and stop is True else stop


#: The oldest torch zoo compiles regions on: the floor of the supported range (compiled regions
#: rest on torch's selective checkpoint, 2.5, and are tested from 2.8 up).
COMPILED_REGIONS_SINCE = (2, 8)

#: torch 2.8's partitioner replays a compiled region's buffer updates in backward where it
#: recomputes their source (BatchNorm's running statistics and ``num_batches_tracked`` written
#: twice per step, torch's own ``checkpoint(..., use_reentrant=False)`` under ``torch.compile``
#: included); from 2.9 the updates stay in the forward graph. On such a torch a compiled region
#: saves the output of every op that mutates an input instead of recomputing it, so the replayed
#: update writes the forward's value again (zoo/checkpoint/compiled.py).
#: tests/test_torch_compat.py checks torch's behaviour on either side.
COMPILED_RECOMPUTE_REPLAYS_UPDATES = VERSION < (2, 9)


def require_compiled_plan() -> None:
    """The one-line error where no plan keeps its peak compiled: on a torch whose compiled
    regions keep what each in-place op writes (a BatchNorm's output,
    :data:`COMPILED_RECOMPUTE_REPLAYS_UPDATES`), a checkpointed step compiled peaks above its
    eager plan (measured on torch 2.8.0: ResNet-20 b8's least plan, 8,711,216 B compiled
    against 6,337,584 B planned, tests/planner/test_planner_compile.py)."""
    if COMPILED_RECOMPUTE_REPLAYS_UPDATES:
        raise RuntimeError(f"zoo: zoo.plan(..., compiled=True) needs torch >= 2.9 (this is "
                           f"torch {torch.__version__}, whose compiled regions keep each "
                           "BatchNorm's output, so a compiled step peaks above any plan); "
                           "upgrade torch, or plan and run the step eagerly")


#: torch 2.11.0 compiles the stored reversible network (zoo/reversible/stored.py's autograd
#: Functions, ``efficient=False``) into a backward whose gradients differ from eager's (measured:
#: float64, ``aot_eager``, one coupling without BatchNorm or dropout: the input's and every
#: parameter's gradient, while the outputs agree; 2.10.0 and 2.12.1 are exact), so it is refused
#: there under ``torch.compile``.
COMPILED_STORED_REVERSIBLE_WRONG = VERSION == (2, 11)


#: The oldest torch on which a compiled step is predicted on a card
#: (``zoo.memory.predict_compiled_step``): before 2.11 ``torch.compile`` asserts that the fake
#: tensors it is handed belong to the fake mode it makes itself, and a prediction's model state
#: is fake copies of another mode (measured: tests/memory/test_compiled_card_step.py fails on
#: 2.8.0, 2.9.1 and 2.10.0 with "fake mode ... doesn't match mode", passes from 2.11.0).
COMPILED_CARD_STEP_SINCE = (2, 11)


def require_compiled_card_step() -> None:
    """The one-line error where this torch cannot predict a compiled step on a card
    (:data:`COMPILED_CARD_STEP_SINCE`)."""
    if VERSION < COMPILED_CARD_STEP_SINCE:
        since = ".".join(map(str, COMPILED_CARD_STEP_SINCE))
        raise RuntimeError(f"zoo: predict_compiled_step needs torch >= {since} (this is torch "
                           f"{torch.__version__}, whose torch.compile refuses a model held in "
                           "another fake mode's tensors); upgrade torch, or predict the eager "
                           "step with predict_step")


def refused() -> list[str]:
    """What zoo refuses on this torch (in one line, when used), a few words each, with why:
    the "refused here" column of docs/torch-versions.md's table."""
    out = []
    if COMPILED_RECOMPUTE_REPLAYS_UPDATES:
        out.append("under torch.compile, a user's context_fn and a set of save_ops; "
                   "zoo.plan(..., compiled=True) (needs 2.9: this torch's partitioner replays "
                   "BatchNorm updates, so compiled regions keep each BatchNorm's output; its "
                   "Dynamo cannot trace a set of ops)")
    if COMPILED_STORED_REVERSIBLE_WRONG:
        out.append("under torch.compile, the reversible network storing its activations (this "
                   "torch's compiled backward gives it wrong gradients)")
    if VERSION < COMPILED_CARD_STEP_SINCE:
        out.append("a compiled step predicted on a card, predict_compiled_step (needs 2.11: "
                   "this torch.compile refuses a model held in fake tensors)")
    return out


def compiled_checkpoint_policy() -> Any:
    """torch's ``CheckpointPolicy``, or the one-line error naming the torch compiled regions
    need (:data:`COMPILED_REGIONS_SINCE`)."""
    if VERSION < COMPILED_REGIONS_SINCE:
        since = ".".join(map(str, COMPILED_REGIONS_SINCE))
        raise RuntimeError(f"zoo: zoo.checkpoint under torch.compile needs torch >= {since} "
                           f"(this is torch {torch.__version__}, whose compiled checkpoint is "
                           "not tested); upgrade torch, or run the model eagerly")
    return require(CheckpointPolicy, "zoo.checkpoint under torch.compile",
                   "torch.utils.checkpoint.CheckpointPolicy")


def mutates_an_input(op: Any) -> bool:
    """Whether the ATen op ``op`` writes into one of its arguments (``add_``, BatchNorm's
    running statistics): its schema says so (a higher-order op has none, and does not)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and schema.is_mutable


# Dynamo, AOTAutograd, the partitioner (imported on first use: heavy)
def dynamo() -> Any:
    """``torch._dynamo`` (disable, reset, list_backends)."""
    import torch._dynamo
    return torch._dynamo


def compiled_original(module: Any) -> Any:
    """The module that ``torch.compile(module)`` wrapped (``OptimizedModule._orig_mod``), or
    ``None`` when ``module`` is no such wrapper (Dynamo not imported: it cannot be one)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return module._orig_mod if optimized and isinstance(module, optimized) else None


def quiet_context_fn_warning(own: Callable[[Any], bool]) -> None:
    """Hold back torch's "Detected that context_fn is passed to torch.utils.checkpoint under
    torch.compile ... in-place ops" log line for the regions whose ``context_fn`` ``own`` says
    is the zoo's (their exactness with in-place ops is tested); a user's own ``context_fn``
    still gets it, also after a zoo region compiled first. torch logs the line through
    ``warning_once`` (once per process), called by ``torch/_higher_order_ops/wrap.py`` while
    AOTAutograd traces a region (``tag_activation_checkpoint_impl``;
    ``TagActivationCheckpoint.__call__`` on torch 2.8), whose local ``gmod`` carries the
    region's ``context_fn`` in its meta. The module's ``warning_once`` is wrapped so that a zoo
    region's call never reaches it: a filter on the log record would come after the once."""
    import sys

    from torch._higher_order_ops import wrap

    once = wrap.warning_once
    if getattr(once, "zoo_quiet", False):
        return

    def warning_once(logger: Any, *args: Any, **kwargs: Any) -> None:
        gmod = sys._getframe(1).f_locals.get("gmod")
        if gmod is not None and "context_fn is passed" in str(args[:1]) \
                and own(getattr(gmod, "meta", {}).get("_checkpoint_context_fn")):
            return None
        return once(logger, *args, **kwargs)

    warning_once.zoo_quiet = True  # type: ignore[attr-defined]
    wrap.warning_once = warning_once


def run_while_tracing(fn: Callable[[str], Any]) -> Callable[[str], Any]:
    """``fn`` as Dynamo calls it for real while it traces a caller, its result taken as a
    constant (``torch._dynamo.assume_constant_result``): no graph break, ``fullgraph=True``
    keeps working, in the top frame or inlined (a reorderable logging function inside an
    inlined frame is dropped). ``fn`` itself where Dynamo has no such decorator."""
    assume = getattr(dynamo(), "assume_constant_result", None)
    return fn if assume is None else assume(fn)


def skip_code(code: Any) -> None:
    """Dynamo compiles no frame of ``code`` (it still inlines it while tracing its caller)."""
    resolve("torch._dynamo.eval_frame.skip_code")(code)


def functorch_config() -> Any:
    """``torch._functorch.config`` (activation_memory_budget and its solver)."""
    import torch._functorch.config
    return torch._functorch.config


aot_autograd = lazy("torch._dynamo.backends.common.aot_autograd", "the compiled-memory peer")
min_cut_rematerialization_partition = lazy(
    "torch._functorch.partitioners.min_cut_rematerialization_partition",
    "the compiled-memory peer")
rng_prims = lazy("torch._prims.rng_prims", "the compiled-memory peer on meta, the card model")


class Inductor(NamedTuple):
    """Inductor's modules that :mod:`zoo.memory.cards.inductor` runs: its front end
    (``compile_fx``), post-grad passes (``post_grad``), lowering (``graph``), IR (``ir``),
    ``scheduler``, ``V`` (its virtualized handlers) and ``debug``."""
    compile_fx: Any
    post_grad: Any
    graph: Any
    ir: Any
    scheduler: Any
    V: Any
    debug: Any


def inductor() -> Inductor:
    """Inductor's modules (imported on first use); a one-line error where this torch lacks a
    name of :data:`NAMES` that the card's compiled step uses."""
    for path in NAMES:
        if path.startswith("torch._inductor."):
            lazy(path, "a compiled step predicted on a card")()
    names = ("compile_fx", "fx_passes.post_grad", "graph", "ir", "scheduler", "virtualized",
             "debug")
    modules = [importlib.import_module(f"torch._inductor.{name}") for name in names]
    modules[5] = modules[5].V
    return Inductor(*modules)


@contextlib.contextmanager
def cuda_device_as(props: Any, capability: int) -> Iterator[None]:
    """While active, Dynamo's and inductor's CUDA device interface answers with ``props``
    (``torch.cuda.get_device_properties``'s fields: ``multi_processor_count``, ``major``, ...)
    and compute ``capability`` (90 for 9.0) as CUDA device 0, which is available and runs
    Triton: inductor lowers and schedules a graph for a card this machine does not have. Its
    random-number generator's state (``torch.cuda.get_rng_state``: 16 bytes, Philox's seed and
    offset) is read and set without a driver, as the random ops of a checkpointed region under
    compile are (``run_and_save_rng_state``, ``run_with_rng_state``). The registry, the compile
    workers' cached properties, the cached answers read from them (device properties, Triton's
    presence) and the state functions are as before afterwards (process-wide for the duration:
    not thread-safe)."""
    feature = "a compiled step predicted on a card"
    base = lazy("torch._dynamo.device_interface.CudaInterface", feature)()
    module = importlib.import_module(base.__module__)
    module.get_interface_for_device("cpu")  # the registry is filled before it is changed
    tables = [lazy(f"torch._dynamo.device_interface.{name}", feature)() for name in (
        "device_interfaces", "caching_worker_device_properties",
        "caching_worker_current_devices")]
    saved = [dict(t) for t in tables]
    caches = (lazy("torch._inductor.runtime.hints.DeviceProperties", feature)().create,
              lazy("torch._inductor.utils.is_big_gpu", feature)(),
              lazy("torch.utils._triton.has_triton", feature)())

    def const(value: Any) -> Any:
        return staticmethod(lambda *args, **kwargs: value)

    card = type("CardInterface", (base,), {
        "get_device_properties": const(props), "get_compute_capability": const(capability),
        "current_device": const(0), "device_count": const(1), "is_available": const(True),
        "is_triton_capable": const(True), "raise_if_triton_unavailable": const(None)})
    interfaces, worker_props, worker_device = tables
    interfaces.update({"cuda": card, "cuda:0": card})
    worker_props["cuda"], worker_device["cuda"] = [props], 0
    for cache in caches:
        cache.cache_clear()
    rng = torch.cuda.get_rng_state, torch.cuda.set_rng_state
    torch.cuda.get_rng_state = lambda device="cuda": torch.zeros(16, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda new_state, device="cuda": None
    try:
        yield
    finally:
        torch.cuda.get_rng_state, torch.cuda.set_rng_state = rng
        for table, before in zip(tables, saved):
            table.clear()
            table.update(before)
        for cache in caches:
            cache.cache_clear()


def default_view_ops() -> Any:
    """The ops AOTAutograd's partitioner treats as views, or ``None`` where it has no such list."""
    get = getattr(resolve("torch._functorch.partitioners"), "get_default_op_list", None)
    return None if get is None else get().view_ops


def proxy_mode() -> Any:
    """The proxy mode tracing now (AOTAutograd's tracer), or ``None``."""
    get = getattr(resolve("torch.fx.experimental.proxy_tensor"), "get_proxy_mode", None)
    return None if get is None else get()


def tracing() -> bool:
    """Whether torch is tracing now rather than running: Dynamo compiling, or a fake mode
    active (AOTAutograd's tracer, a backend's fake propagation of Dynamo's graph)."""
    return torch.compiler.is_compiling() or resolve("torch._guards.detect_fake_mode")() \
        is not None


# FakeTensor and the memory tracker
FakeTensor = _fake.FakeTensor
FakeTensorMode = _fake.FakeTensorMode
is_fake = _fake.is_fake
in_kernel_invocation_manager = _fake.in_kernel_invocation_manager
DispatchCacheKey = getattr(_fake, "_DispatchCacheKey", None)  # FakeTensorMode's cache key
ValueReadOnFake = _fake.DataDependentOutputException  # a fake tensor's value was asked for
# an op's tensors on two devices (older torch: a plain RuntimeError, see zoo.memory.quiet)
DevicesMixedOnFake = getattr(_fake, "FakeTensorDeviceMismatchError", ())


mem_tracker = lazy("torch.distributed._tools.mem_tracker.MemTracker",
                   "exact CPU memory (zoo.memory, zoo.plan)")
