"""Transformers (ViT, BERT, GPT-2): published sizes, timm compatibility, causality, and checkpoint
modes that train exactly like the plain model, dropout active, for less memory.

The generic suite (test_models.py) runs every registered model through the interface and the
mode-equivalence checks at default settings; here are the family's own promises, mostly on small
instances of the same classes (depth 2, width 64) so that every mode runs with every kind of
dropout on: outputs, gradients and parameters after two SGD steps equal the plain model's, the
``selective`` mode recomputes exactly the attention core and no matmul, and each mode lowers
the peak (exact CPU bytes, MemTracker).
"""
from __future__ import annotations

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer as TimmViT

import zoo
from helpers import assert_same_training, train_step_peak
from zoo.memory import count_flops, default_loss
from zoo.models._transformer import TransformerModel, run_blocks_in_mode
from zoo.models.bert import Bert
from zoo.models.gpt2 import GPT2
from zoo.models.vit import VisionTransformer
from zoo.planner import measure_step

MODES = TransformerModel.checkpoint_modes

# Exact parameter counts: timm's vit_small/base_patch16_224 (22.1M / 86.6M as published), Hugging
# Face's bert-base-uncased encoder + pooler (109.5M) and gpt2 (124.4M, tied embeddings counted
# once); ViT-Lite-7/4 is published as 3.72M (Hassani et al. 2021, Table 2).
PARAMS = {"vit_cifar": 3_722_250, "vit_small_patch16_224": 22_050_664,
          "vit_base_patch16_224": 86_567_656, "bert_base": 109_482_240 + 768 * 2 + 2,
          "gpt2_small": 124_439_808}
PUBLISHED_MILLIONS = {"vit_cifar": "3.72", "vit_small_patch16_224": "22.1",
                      "vit_base_patch16_224": "86.6", "gpt2_small": "124.4"}


def tiny(family: str, efficient: bool | str = False, drop: float = 0.1) -> TransformerModel:
    """A depth-2, width-64 instance of ``family`` with dropout ``drop`` everywhere it has it."""
    common = dict(embed_dim=64, depth=2, num_heads=4, drop_rate=drop, attn_drop_rate=drop,
                  efficient=efficient)
    if family == "vit":
        return VisionTransformer(img_size=32, patch_size=8, num_classes=5,
                                 drop_path_rate=drop, **common)
    if family == "bert":
        return Bert(vocab_size=100, max_positions=32, num_classes=3, **common)
    if family == "gpt2":
        return GPT2(num_classes=100, context_length=32, **common)
    raise ValueError(family)


FAMILIES = ["vit", "bert", "gpt2"]
CLASSES = {"vit": VisionTransformer, "bert": Bert, "gpt2": GPT2}
# every family with every mode it has (BERT, post-norm, has no pre-norm-only mode)
FAMILY_MODES = [(f, m) for f in FAMILIES for m in MODES if m in CLASSES[f].checkpoint_modes]


# -- sizes and shapes -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_counts(name):
    with torch.device("meta"):
        model = zoo.create_model(name)
    count = sum(p.numel() for p in model.parameters())
    assert count == PARAMS[name], f"{count:,} parameters"
    if name in PUBLISHED_MILLIONS:
        digits = len(PUBLISHED_MILLIONS[name].split(".")[1])
        assert f"{count / 1e6:.{digits}f}" == PUBLISHED_MILLIONS[name]


def test_bert_encoder_and_pooler_are_bert_base_sized():
    with torch.device("meta"):
        model = zoo.create_model("bert_base")
    head = sum(p.numel() for p in model.head.parameters())
    assert sum(p.numel() for p in model.parameters()) - head == 109_482_240  # 109.5M


@pytest.mark.parametrize("family", FAMILIES)
def test_feature_and_output_shapes(family):
    torch.manual_seed(0)
    model = tiny(family).eval()
    x = model.example_input(3)
    with torch.no_grad():
        features = model.forward_features(x)
        pooled = model.forward_head(features, pre_logits=True)
        out = model(x)
    tokens = 1 + (32 // 8) ** 2 if family == "vit" else 16
    assert features.shape == (3, tokens, 64)
    if family == "gpt2":
        assert pooled.shape == (3, 16, 64) and out.shape == (3, 16, 100)
    else:
        assert pooled.shape == (3, 64) and out.shape == (3, model.num_classes)


def test_registered_models_shapes_at_tiny_inputs():
    torch.manual_seed(0)
    vit = zoo.create_model("vit_cifar").eval()
    with torch.no_grad():
        assert vit.forward_features(vit.example_input(2)).shape == (2, 65, 256)
        assert vit(vit.example_input(2)).shape == (2, 10)
    assert vit.example_input(2).shape == (2, 3, 32, 32)
    with torch.device("meta"):
        gpt2, bert = zoo.create_model("gpt2_small"), zoo.create_model("bert_base")
    assert gpt2.num_classes == 50257 and gpt2.num_features == 768
    assert bert.num_classes == 2 and bert.num_features == 768
    ids = gpt2.example_input(2, 8)
    assert ids.shape == (2, 8) and ids.dtype == torch.int64
    assert gpt2(ids).shape == (2, 8, 50257)
    assert bert(bert.example_input(2, 8)).shape == (2, 2)


def test_text_models_refuse_bad_inputs():
    bert, gpt2 = tiny("bert"), tiny("gpt2")
    with pytest.raises(TypeError, match="token ids"):
        bert(torch.randn(2, 8))
    with pytest.raises(TypeError, match="token ids"):
        gpt2(torch.randn(2, 8))
    with pytest.raises(ValueError, match="longer than"):
        bert(bert.example_input(1, 33))
    with pytest.raises(ValueError, match="longer than the context"):
        gpt2(gpt2.example_input(1, 33))
    with pytest.raises(ValueError, match="attention_mask"):
        bert(bert.example_input(2, 8), attention_mask=torch.ones(2, 9))


def test_bert_reads_a_1_0_mask_of_any_dtype_as_the_boolean_mask():
    bert = tiny("bert").eval()
    ids = bert.example_input(2, 8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        expected = bert(ids, attention_mask=mask.bool())
        for same in (mask, mask.int(), mask.float()):
            assert torch.equal(bert(ids, attention_mask=same), expected)
        assert not torch.equal(bert(ids), expected)  # the mask is read


# -- timm -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["vit_small_patch16_224", "vit_base_patch16_224"])
def test_vit_state_dict_has_timms_keys_and_shapes(name):
    with torch.device("meta"):
        ours = zoo.create_model(name).state_dict()
        theirs = timm.create_model(name, pretrained=False).state_dict()
    assert list(ours) == list(theirs)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}


@pytest.mark.parametrize("mode", [False, *MODES])
@pytest.mark.parametrize("size", [32, 64])
def test_timm_vit_weights_load_strictly_and_train_the_same(mode, size):
    """timm's weights give the same outputs and gradients, in every mode; at 64 px the position
    embeddings are resampled exactly as timm's ``dynamic_img_size`` does."""
    torch.manual_seed(0)
    theirs = TimmViT(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4,
                     num_classes=5, dynamic_img_size=size != 32)
    ours = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4,
                             num_classes=5, efficient=mode)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, size, size)
    out_ours, out_theirs = ours.train()(x), theirs.train()(x)
    torch.testing.assert_close(out_ours, out_theirs)
    default_loss(out_ours).backward()
    default_loss(out_theirs).backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}.grad: {m}")


# -- checkpoint modes against the plain model, train mode, dropout active -------------------------
def test_dropout_is_active_in_train_mode():
    """The equivalence tests below would be vacuous if dropout did nothing."""
    for family in FAMILIES:
        torch.manual_seed(0)
        model = tiny(family)
        x = model.example_input(2)
        with torch.no_grad():
            torch.manual_seed(1)
            a = model.train()(x)
            torch.manual_seed(2)
            b = model(x)
            assert not torch.allclose(a, b), f"{family}: two train forwards gave the same output"


@pytest.mark.parametrize("family, mode", FAMILY_MODES)
def test_modes_train_exactly_like_plain_with_dropout(family, mode):
    torch.manual_seed(0)
    plain = tiny(family)
    ckpt = tiny(family, efficient=mode)
    assert ckpt.grad_checkpointing == mode
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert_same_training(plain, plain, ckpt, ckpt, plain.example_input(2))


@pytest.mark.parametrize("mode", Bert.checkpoint_modes)
def test_bert_with_padding_and_segments_trains_exactly_like_plain(mode):
    torch.manual_seed(0)
    plain, ckpt = tiny("bert"), tiny("bert", efficient=mode)
    ids = plain.example_input(2, 12)
    segments = torch.cat([torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long)], 1)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    assert_same_training(plain, lambda x: plain(x, segments, mask),
                         ckpt, lambda x: ckpt(x, segments, mask), ids)


@pytest.mark.parametrize("mode", [m if m in ("block", "sublayer", "selective") else
                                  pytest.param(m, marks=pytest.mark.slow) for m in MODES])
def test_registered_vit_cifar_trains_exactly_like_plain(mode):
    torch.manual_seed(0)
    plain = zoo.create_model("vit_cifar", drop_rate=0.1, attn_drop_rate=0.1, drop_path_rate=0.1)
    ckpt = zoo.create_model("vit_cifar", drop_rate=0.1, attn_drop_rate=0.1, drop_path_rate=0.1,
                            efficient=mode)
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert_same_training(plain, plain, ckpt, ckpt, plain.example_input(2))


@pytest.mark.parametrize("family", FAMILIES)
def test_planner_chain_trains_exactly_like_plain(family):
    torch.manual_seed(0)
    plain, planned = tiny(family), tiny(family)
    chain = planned.checkpoint_chain()
    # embedding, blocks, norm; ViT's embedding is one element with its first block
    assert len(chain) == 3 + (family == "gpt2")
    n = len(chain)
    planned.set_checkpoint_plan([(0, 1, False), (1, 2, True), (2, n, True)])
    assert_same_training(plain, plain, planned, planned, plain.example_input(2))


@pytest.mark.parametrize("mode", VisionTransformer.checkpoint_modes)
def test_vit_embedding_with_first_block_in_each_mode_trains_exactly(mode):
    """The chain's first element (embedding and first block; ``selective_stream`` makes the
    embedding inside the block's region) in each mode, stored and inside a checkpointed
    segment, with the other blocks in the same mode: the plain model's training."""
    for plan in ([(0, 3, False)], [(0, 2, True), (2, 3, False)]):
        torch.manual_seed(0)
        plain, planned = tiny("vit"), tiny("vit")
        planned.set_checkpoint_plan(plan)
        planned.set_checkpoint_block_modes([mode, mode, None])
        assert_same_training(plain, plain, planned, planned, plain.example_input(2))


def test_gpt2_embeddings_stay_tied_through_checkpointed_training():
    torch.manual_seed(0)
    plain, ckpt = tiny("gpt2"), tiny("gpt2", efficient=True)
    assert ckpt.head.weight is ckpt.wte.weight
    assert_same_training(plain, plain, ckpt, ckpt, plain.example_input(2))
    assert ckpt.head.weight is ckpt.wte.weight
    torch.testing.assert_close(ckpt.state_dict()["head.weight"], ckpt.state_dict()["wte.weight"])


# -- what each mode recomputes and saves ----------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_selective_recomputes_the_attention_core_and_no_linear(family):
    """With attention dropout on, CPU SDPA runs its math path (two bmm per block, counted by
    FlopCounterMode): ``selective`` adds exactly those, 4 * B * T^2 * dim per block, no matmul."""
    torch.manual_seed(0)
    model = tiny(family)
    x = model.example_input(2)
    tokens = model.forward_features(x).shape[1]

    def flops(mode: str | bool) -> int:
        model.set_grad_checkpointing(mode)
        return count_flops(lambda: default_loss(model(x)).backward())

    plain = flops(False)
    assert flops("selective") - plain == 2 * 4 * 2 * tokens * tokens * 64
    block = flops("block")
    assert plain < block < plain * 4 / 3  # at most one more forward


def _counts_fused_attention() -> bool:
    """Whether FlopCounterMode counts the CPU's fused attention kernel (torch 2.14.1 counts it as
    0 FLOPs; the test passed before on a torch that counts it): without dropout, SDPA on the
    CPU runs that kernel."""
    q = torch.randn(1, 1, 4, 8)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    return counter.get_total_flops() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_selective_sublayer_recomputes_what_selective_does_and_keeps_less(family):
    """Without dropout after the last linears, ``selective_sublayer`` reruns no linear more than
    ``selective`` (exact FLOPs) and its step peaks lower (exact bytes, fake step). What both
    rerun beyond plain is the attention core, counted only where torch counts its fused kernel."""
    torch.manual_seed(0)
    model = tiny(family, drop=0.0)
    x = model.example_input(4) if family == "vit" else model.example_input(4, 32)
    steps = {}
    for mode in (False, "selective", "selective_sublayer"):
        model.set_grad_checkpointing(mode)
        steps[mode] = measure_step(model, x)
    assert steps["selective_sublayer"][1] == steps["selective"][1]
    if _counts_fused_attention():
        assert steps["selective"][1] > steps[False][1]
    else:
        assert steps["selective"][1] == steps[False][1]
    assert steps["selective_sublayer"][0] < steps["selective"][0] < steps[False][0]


def test_selective_keeps_no_more_than_plain_and_block_least():
    torch.manual_seed(0)
    model = tiny("bert")
    x = model.example_input(4, 32)
    peaks = {}
    for mode in (False, *Bert.checkpoint_modes):
        model.set_grad_checkpointing(mode)
        peaks[mode] = train_step_peak(model, x)
    assert peaks["selective"] < peaks[False]
    assert peaks["block"] < peaks["selective"] and peaks["sublayer"] < peaks["selective"]


@pytest.mark.parametrize("family, mode", FAMILY_MODES)
def test_modes_lower_peak_memory(family, mode):
    torch.manual_seed(0)
    model = tiny(family)
    x = model.example_input(4, 64 if family == "vit" else 32)
    plain = train_step_peak(model, x)
    model.set_grad_checkpointing(mode)
    assert train_step_peak(model, x) < plain


# -- causality and masking ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [False, "block"])
def test_gpt2_future_tokens_do_not_change_past_logits(mode):
    torch.manual_seed(0)
    model = tiny("gpt2", efficient=mode).eval()
    ids = model.example_input(2, 12)
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % model.num_classes
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])  # the changed positions do see their tokens


def test_bert_padding_is_not_attended():
    torch.manual_seed(0)
    model = tiny("bert").eval()
    ids = model.example_input(2, 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[:, 9:] = 0
    changed = ids.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 100
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask),
                                   model(changed, attention_mask=mask))
        assert not torch.allclose(model(ids), model(changed))  # without the mask they count


@pytest.mark.parametrize("mode", ["selective_mlp", "selective_stream"])
def test_a_post_norm_block_refuses_the_pre_norm_modes(mode):
    """A post-norm block's norms need the stream between its sublayers and its last linears'
    outputs: the modes that recompute them are pre-norm only, each refused in one line."""
    with pytest.raises(ValueError, match=mode):
        tiny("bert").set_grad_checkpointing(mode)
    block = tiny("bert").blocks[0]
    with pytest.raises(ValueError, match="pre-norm"):
        run_blocks_in_mode([block], torch.randn(2, 4, 64), mode)
