"""A compiled step on a card, predicted from inductor's own scheduler run for the card: which
storages are written, which kernels launch, the peak and the time
(zoo.memory.cards.inductor, zoo.memory.cards.compiled_step)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from zoo import _torch
from zoo.memory import predict_step
from zoo.memory.cards import card
from zoo.memory.cards.allocator import round_size
from zoo.memory.cards.compiled_step import capture_graphs, predict_compiled_step
from zoo.memory.cards.inductor import schedule
from zoo.memory.quiet import BatchError
from helpers import needs_compiled_card_step

pytestmark = needs_compiled_card_step

WIDTH, BATCH = 256, 512


class Pointwise(nn.Module):
    """Two matmuls with three pointwise ops between them: one fused kernel on a card."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x) * 2 + 1))


class Attention(nn.Module):
    """Self-attention through ``F.scaled_dot_product_attention``, with attention dropout."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, width = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        return self.out(y.transpose(1, 2).reshape(b, length, width))


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                         nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, bias=False),
                         nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 8 * 8, 10)).train()


def _scheduled(model: nn.Module, x: torch.Tensor, on: str = "h100", **kwargs):
    forward, backward, fake = capture_graphs(model, x, **kwargs)
    saved = [n.name for n in backward.graph.nodes if n.op == "placeholder"]
    return schedule(forward, card(on), False), schedule(backward, card(on), True), saved, fake


def test_pointwise_ops_between_matmuls_fuse_into_one_kernel_that_stores_one_buffer():
    model, x = Pointwise().train(), torch.randn(BATCH, WIDTH)
    forward, _, _, _ = _scheduled(model, x)
    launched = [k for k in forward.kernels if k.launches]
    assert [k.extern for k in launched] == [True, False, True]
    assert len(launched[1].writes) == 1  # mul, add and relu: one kernel, one stored value
    assert all(k.matmul for k in launched if k.extern)
    # the eager step stores every intermediate; compiled, the relu's output alone
    compiled = predict_compiled_step(model, x, "h100")
    eager = predict_step(model, x, "h100")
    assert compiled.peak < eager.peak
    assert compiled.kernels[0] == 3


def test_the_scheduler_reads_the_cards_sms_to_split_batchnorms_reduction():
    """A BatchNorm over 16,384 values per channel: on a card of 132 SMs inductor splits the
    statistics into a partial and a final reduction before the normalizing kernel; on a card
    of 4 SMs one kernel reduces and normalizes, as it does over 256 values (batch 4) on
    either card."""
    net = _conv_net()
    small = dataclasses.replace(card("h100"), name="four SMs", sms=4)
    counts = {}
    for batch in (4, 256):
        for on in (card("h100"), small):
            forward, _, _ = capture_graphs(net, torch.randn(batch, 8, 8, 8))
            counts[batch, on.sms] = schedule(forward, on, False).launched()
    assert counts[256, 132] == counts[256, 4] + 2 * 2  # two BatchNorms, two more kernels each
    assert counts[4, 132] == counts[4, 4] == counts[256, 4]


def test_a_card_without_sms_is_refused_in_one_line():
    unknown = dataclasses.replace(card("h100"), sms=0)
    with pytest.raises(ValueError, match="has no SM count"):
        predict_compiled_step(_conv_net(), torch.randn(4, 8, 8, 8), unknown)


def test_the_card_is_answered_only_while_inductor_schedules():
    """The CUDA device interface (and CUDA's generator state) answers as the card while a graph
    is scheduled, and as this machine before and after: torch still sees no GPU here and
    Triton no CUDA device."""
    interfaces = _torch.resolve("torch._dynamo.device_interface.device_interfaces")
    _torch.resolve("torch._dynamo.device_interface.get_interface_for_device")("cpu")  # filled
    has_triton = _torch.resolve("torch.utils._triton.has_triton")
    before = (dict(interfaces), has_triton(), torch.cuda.is_available(),
              torch.cuda.get_rng_state, torch.cuda.set_rng_state)
    predict_compiled_step(_conv_net(), torch.randn(4, 8, 8, 8), "h100")
    assert (dict(interfaces), has_triton(), torch.cuda.is_available(),
            torch.cuda.get_rng_state, torch.cuda.set_rng_state) == before


def test_the_extern_kernels_carry_the_eager_steps_flops():
    model, x = _conv_net(), torch.randn(4, 8, 8, 8)
    forward, backward, _, _ = _scheduled(model, x)
    flops = sum(k.record.flops for g in (forward, backward) for k in g.kernels)
    with FlopCounterMode(display=False) as counted:
        model(x).float().square().mean().backward()
    assert flops == counted.get_total_flops() > 0


def test_what_the_forward_saves_lives_until_the_backward_reads_it():
    model, x = _conv_net(), torch.randn(4, 8, 8, 8)
    forward, backward, saved, fake = _scheduled(model, x)
    fw_gm, _, _ = capture_graphs(model, x)
    names = [a.name for a in list(fw_gm.graph.nodes)[-1].args[0]]
    stored = {b for k in forward.kernels for b in k.writes}
    kept = {o for name, o in zip(names, forward.outputs) if name in saved and o in stored}
    assert len(kept) >= 2  # the convolutions' outputs (and what the BatchNorms save)
    held = sum(t.untyped_storage().nbytes() for t in fake.tensors + fake.input.tensors())
    step = predict_compiled_step(model, x, "h100")
    assert step.peak >= held + sum(round_size(forward.nbytes[b]) for b in kept)
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
    forward, _, _, _ = _scheduled(model, x, autocast=torch.bfloat16)
    convs = [k for k in forward.kernels if k.extern and k.record.op is torch.ops.aten.convolution]
    assert len(convs) == 2 and all(k.record.dtype == torch.bfloat16 for k in convs)
    fp32 = predict_compiled_step(model, x, "h100")
    bf16 = predict_compiled_step(model, x, "h100", autocast=torch.bfloat16)
    assert bf16.time.device < fp32.time.device


def test_attention_is_captured_with_cudas_fused_kernels_not_the_cpus_math_path():
    """fp32 takes the memory-efficient kernel, bf16 flash, as a CUDA build selects them: the
    peak is the eager card step's within less than one T x T float32 matrix (the CPU's math
    path, which the dropout forces there, keeps the probabilities and their dropped copy)."""
    torch.manual_seed(0)
    model, x = Attention().train(), torch.randn(8, 256, 64)
    scores = 8 * model.heads * 256 * 256 * 4
    aten = torch.ops.aten
    for dtype, kernel, grad in ((None, aten._scaled_dot_product_efficient_attention,
                                 aten._scaled_dot_product_efficient_attention_backward),
                                (torch.bfloat16, aten._scaled_dot_product_flash_attention,
                                 aten._scaled_dot_product_flash_attention_backward)):
        forward, backward, _ = capture_graphs(model, x, autocast=dtype)
        ops = {n.target for g in (forward, backward) for n in g.graph.nodes}
        assert {kernel.default, grad.default} <= ops
        compiled = predict_compiled_step(model, x, "h100", autocast=dtype)
        eager = predict_step(model, x, "h100", autocast=dtype)
        assert abs(compiled.peak - eager.peak) < scores


def test_a_checkpointed_regions_attention_dropout_keeps_its_generator_state_on_the_host():
    """A checkpointed transformer block with attention dropout: under compile the partitioner
    saves CUDA's generator state before the fused kernel and replays it in backward (no mask is
    stored). Predicted without a driver, fp32 and bf16, the state held in host memory: the peak
    and the kernels are those of the same model without attention dropout."""
    import zoo

    predicted, replayed = {}, {}
    for rate in (0.1, 0.0):
        torch.manual_seed(0)
        model = zoo.create_model("bert_base", efficient=True, vocab_size=64, max_positions=32,
                                 embed_dim=32, depth=2, num_heads=2, drop_rate=0.0,
                                 attn_drop_rate=rate).train()
        x = model.example_input(4, 32)
        _, backward, _ = capture_graphs(model, x)
        replayed[rate] = any(n.target is _torch.rng_prims().run_with_rng_state
                             for n in backward.graph.nodes)
        for dtype in (None, torch.bfloat16):
            step = predict_compiled_step(model, x, "h100", autocast=dtype)
            predicted[rate, dtype] = step.peak, step.kernels
    assert replayed == {0.1: True, 0.0: False}
    for dtype in (None, torch.bfloat16):
        assert predicted[0.1, dtype] == predicted[0.0, dtype]


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
