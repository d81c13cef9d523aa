"""``torch.compile(mode="reduce-overhead")`` of every family's efficient model trains exactly like
the eager plain model.

On a GPU this mode records the compiled step in CUDA graphs, which replay every kernel of the
step without host work per region: the cure for a host-bound step of many small layers. On the
CPU it compiles with inductor and runs without graphs, which still checks that every efficient
model compiles in that mode (one graph, fullgraph=True) and matches eager plain: outputs,
gradients, parameters and BatchNorm buffers over three SGD steps, in float64. The same test runs
on CUDA, with the graphs, where there is a GPU.

Dropout is switched off: inductor draws dropout from its own random stream (eager's, with
``fallback_random``, only outside checkpointed regions), so no compiled model can match eager
plain's masks; that a compiled region's backward reuses its forward's mask is
test_compile.py's ``test_inductor_recompute_uses_the_forwards_dropout_mask``.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import assert_same_training
from zoo import _torch
from zoo.models._transformer import Attention
from test_compile import small_models

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: Before torch 2.13 inductor's CPU backward of a float64 attention fails for the plain compiled
#: model alike ("expected scalar type Double but found Float", pytorch/pytorch#185539; measured
#: on 2.8.0 to 2.12.1; 2.13.0 runs it).
CPU_FLOAT64_ATTENTION_SINCE = (2, 13)


def without_dropout(model: nn.Module) -> nn.Module:
    """Every dropout of a zoo model at p = 0 (modules, DenseNet's and attention's rates)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name in ("drop_rate", "attn_drop"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    return model


def efficient_models() -> list:
    """The first (recommended, ``efficient=True``) mode of each family in ``small_models``."""
    families: dict[str, object] = {}
    for param in small_models():
        families.setdefault(param.id.split("-")[0], param)
    return list(families.values())


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("build, mode", efficient_models())
def test_reduce_overhead_trains_like_eager_plain(build, mode, device):
    torch.manual_seed(0)
    plain = without_dropout(build()).double().to(device)
    if device == "cpu" and _torch.VERSION < CPU_FLOAT64_ATTENTION_SINCE and \
            any(isinstance(m, Attention) for m in plain.modules()):
        pytest.skip("this torch's inductor fails a float64 attention backward on the CPU, the "
                    "plain model's alike (needs torch >= 2.13)")
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(mode)
    x = plain.example_input(2).to(device)
    x = x.double() if x.is_floating_point() else x
    torch._dynamo.reset()
    compiled = torch.compile(ckpt, mode="reduce-overhead", fullgraph=True)

    def step(inputs: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()  # a new training step: outputs may be reused
        return compiled(inputs)

    assert_same_training(plain, plain, ckpt, step, x, steps=3)


def _hooks_entered(step) -> int:
    """Saved-tensor hooks entered while ``step()`` runs (an eager region enters one each)."""
    hooks = torch.autograd.graph.saved_tensors_hooks
    enter, count = hooks.__enter__, [0]

    def counted(self):
        count[0] += 1
        return enter(self)

    hooks.__enter__ = counted
    try:
        step()
    finally:
        hooks.__enter__ = enter
    return count[0]


def test_a_compiled_efficient_model_keeps_no_eager_region_at_run_time():
    """Compiled whole (fullgraph), the efficient DenseNet's regions are graph regions: its step
    enters no saved-tensor hook, so nothing outside the forward and backward graphs holds a
    graph's output between them. CUDA graph trees check exactly that on replay (an output seen
    to die while the backward graph was recorded must be dead again: pytorch/pytorch#154306
    fails it with torch's eager non-reentrant checkpoint around a graphed module); eager, the
    same model enters one hook per region."""
    from zoo.models.densenet import DenseNet

    torch.manual_seed(0)
    model = DenseNet(4, (2, 2, 2), 8, bn_size=4, compression=0.5, stem="cifar", num_classes=10,
                     efficient=True)
    x = torch.randn(2, 3, 32, 32)
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")

    def step(forward):
        return lambda: forward(x).float().square().mean().backward()

    step(compiled)()  # compiles
    assert _hooks_entered(step(compiled)) == 0
    assert _hooks_entered(step(model)) >= 6
