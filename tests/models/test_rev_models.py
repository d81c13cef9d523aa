"""The reversible models: RevNet-38/110/164, Rev-ViT (CIFAR, S, B) and reversible BERT-base.

Each model with ``efficient=True`` (its ``"reversible"`` mode) trains bit for bit as with
``efficient=False`` (the same network storing its activations): outputs, parameter gradients and
every buffer, compared with ``torch.equal`` over two SGD steps in train mode, in float32, float64
and under autocast, with dropout and stochastic depth active. Memory and recompute are exact
(MemTracker under FakeTensorMode, FlopCounterMode) at batch 32. The registry-wide tests
(test_models.py, test_timm_interface.py) cover the rest of the interface.
"""
from __future__ import annotations

import pytest
import torch

import zoo
from helpers import assert_published_parameter_count, run_steps
from zoo.memory import count_flops, default_loss
from zoo.models.rev_bert import RevBert
from zoo.models.rev_vit import RevVisionTransformer
from zoo.models.revnet import RevNet
from zoo.planner import measure_step


@pytest.mark.parametrize("name, published", [
    ("revnet38", "0.46"), ("revnet110", "1.73"), ("revnet164", "1.75"),  # Gomez et al., Table 1
    ("rev_vit_cifar", "3.72"), ("rev_vit_small_patch16_224", "22.1"),
    ("rev_vit_base_patch16_224", "86.6"), ("rev_bert_base", "109.5")])
def test_published_parameter_counts(name, published):
    assert_published_parameter_count(name, published)


def small_revnet(**kw) -> RevNet:
    return RevNet((2, 1, 2), (8, 8, 16, 24), num_classes=3, **kw)


def small_bottleneck_revnet(**kw) -> RevNet:
    return RevNet((1, 2, 1), (8, 16, 32, 32), bottleneck=True, num_classes=3, **kw)


def small_rev_vit(**kw) -> RevVisionTransformer:
    return RevVisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=2,
                                num_classes=3, drop_rate=0.1, attn_drop_rate=0.1,
                                drop_path_rate=0.3, **kw)


def small_rev_bert(**kw) -> RevBert:
    return RevBert(vocab_size=50, max_positions=16, embed_dim=32, depth=2, num_heads=2,
                   num_classes=3, **kw)


def assert_bitwise_training(build, x: torch.Tensor, forward=None, dtype=torch.float32,
                            autocast: bool = False) -> None:
    """``build(efficient=...)`` twins from one state train alike, bit for bit, two steps."""
    torch.manual_seed(0)
    stored = build(efficient=False).to(dtype)
    rebuilt = build(efficient=True).to(dtype)
    assert rebuilt.grad_checkpointing == "reversible" and stored.grad_checkpointing is None
    rebuilt.load_state_dict(stored.state_dict())

    def runner(model):
        def run(inp):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                return model(inp) if forward is None else forward(model, inp)
        return run

    ref = run_steps(stored, runner(stored), x)
    got = run_steps(rebuilt, runner(rebuilt), x)
    for step, ((out_r, grads_r), (out_g, grads_g)) in enumerate(zip(ref, got)):
        assert torch.equal(out_g, out_r), f"step {step}: outputs differ"
        for i, (a, b) in enumerate(zip(grads_g, grads_r)):
            assert torch.equal(a, b), f"step {step}: gradient {i} differs"
    for (key, a), b in zip(stored.state_dict().items(), rebuilt.state_dict().values()):
        assert torch.equal(a, b), f"{key} differs after two steps"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("build", [small_revnet, small_bottleneck_revnet])
def test_revnet_rebuilt_equals_stored_bitwise(build, dtype):
    torch.manual_seed(1)
    assert_bitwise_training(build, torch.randn(4, 3, 16, 16, dtype=dtype), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rev_vit_rebuilt_equals_stored_bitwise_with_dropout_and_drop_path(dtype):
    torch.manual_seed(1)
    assert_bitwise_training(small_rev_vit, torch.randn(4, 3, 16, 16, dtype=dtype), dtype=dtype)


@pytest.mark.parametrize("build", [small_revnet, small_rev_vit])
def test_rebuilt_equals_stored_under_autocast(build):
    torch.manual_seed(1)
    assert_bitwise_training(build, torch.randn(4, 3, 16, 16), autocast=True)


def test_rev_bert_rebuilt_equals_stored_with_padding_and_segments():
    torch.manual_seed(1)
    ids = torch.randint(0, 50, (4, 12))
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, 8:] = 0
    types = (torch.arange(12) >= 6).long().expand(4, 12)

    def forward(model, x):
        return model(x, token_type_ids=types, attention_mask=mask)
    assert_bitwise_training(small_rev_bert, ids, forward)


def test_rev_bert_ignores_padding():
    torch.manual_seed(0)
    model = small_rev_bert().eval()
    ids = torch.randint(0, 50, (1, 12))
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, 8:] = 0
    other = ids.clone()
    other[0, 8:] = (other[0, 8:] + 1) % 50
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask),
                                   model(other, attention_mask=mask))


def test_compiled_reversible_model_trains_like_eager_stored():
    """torch.compile: the stem, downsampling units and head compile, the reversible units run in
    eager mode (zoo.reversible's graph break). float64, compared as every compiled path is."""
    torch.manual_seed(0)
    stored = small_revnet().double()
    rebuilt = small_revnet(efficient=True).double()
    rebuilt.load_state_dict(stored.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(rebuilt, backend="aot_eager")
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    ref, got = run_steps(stored, stored, x), run_steps(rebuilt, compiled, x)
    for (out_r, grads_r), (out_g, grads_g) in zip(ref, got):
        torch.testing.assert_close(out_g, out_r)
        for a, b in zip(grads_g, grads_r):
            torch.testing.assert_close(a, b)
    for (key, a), b in zip(stored.state_dict().items(), rebuilt.state_dict().values()):
        torch.testing.assert_close(b, a, msg=key)


# -- memory and recompute, exact, batch 32 --------------------------------------------------------
def _activations(model: torch.nn.Module, x: torch.Tensor) -> int:
    """A training step's exact peak less parameters, their gradients and the buffers."""
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    return measure_step(model, x)[0] - state


@pytest.mark.slow
def test_revnet_activation_memory_does_not_grow_with_depth():
    rev38, rev110 = (zoo.create_model(n, efficient=True) for n in ("revnet38", "revnet110"))
    x = rev38.example_input(32)
    a38, a110 = _activations(rev38, x), _activations(rev110, x)
    assert abs(a110 - a38) <= 0.10 * a38
    rev110.set_grad_checkpointing(False)
    assert _activations(rev110, x) > 9 * a110


@pytest.mark.slow
@pytest.mark.parametrize("name, ratio", [("revnet110", 0.100), ("rev_vit_cifar", 0.250)])
def test_rebuilt_peak_against_its_stored_twin(name, ratio):
    """The CIFAR models' rebuilt peaks at most their goals (exact bytes, batch 32): RevNet-110
    0.10x (its second stage's downsampling unit's backward), Rev-ViT 0.25x (its attention
    backward writes the qkv gradient in place); what they hold: docs/benchmarks/reversible.md."""
    model = zoo.create_model(name)
    x = model.example_input(32)
    stored = measure_step(model, x)[0]
    model.set_grad_checkpointing(True)
    assert measure_step(model, x)[0] <= ratio * stored


@pytest.mark.slow
def test_rev_vit_small_at_224_peaks_at_most_a_fifth_of_its_stored_twin():
    model = zoo.create_model("rev_vit_small_patch16_224")
    x = model.example_input(32, 224)
    stored = measure_step(model, x)[0]
    model.set_grad_checkpointing(True)
    assert measure_step(model, x)[0] <= 0.20 * stored


@pytest.mark.parametrize("build", [small_revnet, small_bottleneck_revnet, small_rev_vit])
def test_recompute_is_one_forward_of_what_is_rebuilt_or_checkpointed(build):
    """RevNet: the units and the downsampling units run once more, the stem's convolution
    twice (its two nested regions: 3 input channels); Rev-ViT: the blocks. Nothing else
    (zoo.checkpoint's recompute of a downsampling unit stops before its last projection, whose
    output backward does not need)."""
    torch.manual_seed(0)
    model = build()
    x = model.example_input(2, 16)

    def step() -> None:
        default_loss(model(x)).backward()

    stored = count_flops(step)
    model.set_grad_checkpointing(True)
    extra = count_flops(step) - stored
    if isinstance(model, RevNet):
        stages = [model.conv1, *(getattr(model, n) for n in model._stage_names())]
        h = x
        with torch.no_grad():
            once = count_flops(lambda: model.conv1(x))  # the stem's inner region
            for stage in stages:
                once += count_flops(lambda: stage(h))
                h = stage(h)
    else:
        tokens = model.embed(x).detach()
        with torch.no_grad():
            once = count_flops(lambda: model.forward_blocks(tokens))
    assert 0.9 * once < extra <= once


@pytest.mark.slow
def test_zoo_plan_and_largest_batch_work_on_a_reversible_model():
    """zoo.plan measures the reversible mode beside the chain's schedules and picks what fits
    with the least recompute; the planner's largest batch profiles the reversible stages."""
    torch.manual_seed(0)
    model = small_revnet()
    x = model.example_input(8, 16)
    stored = measure_step(model, x)[0]
    plan = zoo.plan(model, x, int(0.7 * stored))
    assert measure_step(model, x)[0] <= plan.predicted_peak <= 0.7 * stored
    rebuilt = small_revnet(efficient=True)
    batch, _ = zoo.planner.largest_batch(rebuilt, lambda b: rebuilt.example_input(b, 16), stored)
    assert batch > 8


def test_revnet_relu_recomputed_writes_its_gradient_over_the_incoming_one():
    """RevNet's inner ReLU as a rebuild recomputes it: ReLU's gradient, bit for bit, in the
    memory of the gradient the convolution after it hands back (one map less live)."""
    from zoo.models.revnet import _ReLUGradInPlace

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 3, 3, padding=1)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    grads, memory = [], []
    for relu in (lambda t: torch.relu_(t), _ReLUGradInPlace.apply):
        pre = x * 1.0
        pre.register_hook(lambda g: memory.append(g.data_ptr()))  # the ReLU's input gradient
        out = relu(pre)
        out.register_hook(lambda g: memory.append(g.data_ptr()))  # the gradient it receives
        conv(out).square().sum().backward()
        grads.append(x.grad)
        x.grad = None
    assert torch.equal(grads[0], grads[1])
    assert memory[0] != memory[1] and memory[2] == memory[3]
