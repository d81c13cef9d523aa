"""A compiled step on a card, predicted from the graphs inductor would receive: which values are
stored, which kernels are launched, the peak and the time (zoo.memory.cards.compiled_step)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from zoo.memory import predict_step
from zoo.memory.quiet import BatchError
from zoo.memory.cards.allocator import round_size
from zoo.memory.cards.compiled_step import capture_graphs, predict_compiled_step
from zoo.memory.cards.inductor import kernel_record, kernels, nbytes, value

WIDTH, BATCH = 256, 512


class Pointwise(nn.Module):
    """Two matmuls with three pointwise ops between them: one fused kernel on a card."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x) * 2 + 1))


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                         nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, bias=False),
                         nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 8 * 8, 10)).train()


def test_pointwise_ops_between_matmuls_fuse_into_one_kernel_that_stores_one_buffer():
    model, x = Pointwise().train(), torch.randn(BATCH, WIDTH)
    forward, _, _ = capture_graphs(model, x)
    ks = kernels(forward)
    assert [k.extern for k in ks] == [True, False, True]
    fused = ks[1]
    assert len(fused.nodes) == 1 and len(fused.writes) == 1  # mul and add inlined into relu
    assert [forward.kind[n] for n in forward.nodes].count("pointwise") == 3
    # the eager step stores every intermediate; compiled, the relu's output alone
    compiled = predict_compiled_step(model, x, "h100")
    eager = predict_step(model, x, "h100")
    assert compiled.peak < eager.peak
    assert compiled.kernels[0] == 3


def test_batchnorm_fuses_as_inductor_splits_it_on_cuda():
    """Forward: a reduction kernel with the inverse deviation as its epilogue, then one
    normalizing kernel (ReLU, and the ReLU's backward mask, inside); backward: the two sums with
    the weight's gradient as their epilogue (a node later in the graph, moved back), then the
    input's gradient."""
    forward, backward, _ = capture_graphs(_conv_net(), torch.randn(4, 8, 8, 8))

    def shapes(graph, k):
        return [(graph.kind[n], tuple(value(n).shape) if graph.kind[n] == "pointwise" else None)
                for n in k.nodes]

    fk = [shapes(forward, k) for k in kernels(forward) if not k.extern]
    assert fk[0] == [("reduction", None), ("pointwise", (1, 16, 1, 1))]
    assert fk[1] == [("pointwise", (4, 16, 8, 8))]
    assert fk[3] == [("pointwise", (4, 16, 8, 8))] * 2  # relu and its mask
    bk = [shapes(backward, k) for k in kernels(backward) if not k.extern]
    assert [("reduction", None), ("reduction", None), ("pointwise", (16,))] in bk
    assert sum(1 for k in bk if k == [("pointwise", (4, 16, 8, 8))]) == 2


def test_the_extern_kernels_carry_the_eager_steps_flops():
    model, x = _conv_net(), torch.randn(4, 8, 8, 8)
    forward, backward, _ = capture_graphs(model, x)
    flops = sum(kernel_record(g, k, g is backward).flops
                for g in (forward, backward) for k in kernels(g))
    with FlopCounterMode(display=False) as counted:
        model(x).float().square().mean().backward()
    assert flops == counted.get_total_flops() > 0


def test_what_the_forward_saves_lives_until_the_backward_reads_it():
    model, x = _conv_net(), torch.randn(4, 8, 8, 8)
    forward, backward, fake = capture_graphs(model, x)
    saved = {n.name for n in backward.nodes if n.op == "placeholder"}
    stored = {b.name for k in kernels(forward) for b in k.writes}
    assert {"convolution", "relu"} <= saved & stored  # a conv's output and a ReLU's, kept
    held = sum(t.untyped_storage().nbytes() for t in fake.tensors + fake.input.tensors())
    step = predict_compiled_step(model, x, "h100")
    kept = sum(round_size(nbytes(n)) for n in forward.nodes if n.name in saved & stored)
    assert step.peak >= held + kept
    assert model[0].weight.grad is None  # the model itself untouched


def test_cuda_graphs_add_the_static_batch_and_launch_two_graphs():
    model, x = _conv_net(), torch.randn(4, 8, 8, 8)
    compiled = predict_compiled_step(model, x, "h100")
    graphed = predict_compiled_step(model, x, "h100", graphs=True)
    assert graphed.peak - compiled.peak >= round_size(x.numel() * x.element_size())
    assert graphed.time.device == compiled.time.device
    assert graphed.time.host < compiled.time.host and graphed.graphs
    assert sum(compiled.kernels) > 2


def test_bf16_autocast_runs_cudas_casts_in_the_compiled_graphs():
    model, x = _conv_net(), torch.randn(64, 8, 8, 8)
    forward, _, _ = capture_graphs(model, x, autocast=torch.bfloat16)
    convs = [k for k in kernels(forward) if k.extern and "convolution" in k.nodes[0].name]
    assert convs and all(kernel_record(forward, k, False).dtype == torch.bfloat16 for k in convs)
    fp32 = predict_compiled_step(model, x, "h100")
    bf16 = predict_compiled_step(model, x, "h100", autocast=torch.bfloat16)
    assert bf16.time.device < fp32.time.device


def test_a_hugging_face_batch_dict_with_labels_is_predicted_with_the_models_own_loss():
    """A BERT classifier's dict with a mask and labels, fp32 and bf16 autocast: the loss is
    the model's own, inside the compiled graph; the peak lands within 1% of the eager step's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=64, num_labels=3,
                                     attn_implementation="eager")
    model = transformers.BertForSequenceClassification(config).train()
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "labels": torch.tensor([0, 1, 2, 1])}
    for dtype in (None, torch.bfloat16):
        compiled = predict_compiled_step(model, batch, "h100", autocast=dtype)
        eager = predict_step(model, batch, "h100", autocast=dtype)
        assert abs(compiled.peak / eager.peak - 1) < 0.01
        assert min(compiled.kernels) > 0


def test_a_step_without_a_backward_is_refused():
    frozen = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(BatchError, match="does not require grad"):
        predict_compiled_step(frozen, torch.randn(2, 4), "h100")
