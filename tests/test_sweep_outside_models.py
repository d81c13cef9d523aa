"""The standing sweep: ``zoo.set_grad_checkpointing`` on timm, torchvision and Hugging Face models
of every kind, each built small, in float64, with dropout (and drop-path) on.

For every model, against its plain copy (``assert_exact_lighter_and_undone``): three SGD steps
with outputs, every gradient and every buffer equal bit for bit; the recompute run by
``zoo.checkpoint``; a lower exact peak (``zoo.memory.cpu_peak_bytes``, MemTracker) for one
training step; and ``enable=False`` giving back the plain classes, forwards and outputs.
Hugging Face models are called with ``use_cache=False``: their checkpointing path forces it (the
cache is an output of the forward a recompute would build twice), so it is the plain model to
compare with. timm models that refuse timm's own switch take the repeated-block route
(``via="blocks"``); the rest go through timm's switch (``via="timm"``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import timm
import torch
import torchvision
from torch import nn

from test_integrations import assert_exact_lighter_and_undone, forward_peak

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

DROP = dict(drop_rate=0.1, drop_path_rate=0.1)
VIT = dict(img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=3, **DROP)


@dataclasses.dataclass(frozen=True)
class Case:
    """One model of the sweep: how to build it and feed it, and which route it takes."""

    build: Callable[[], nn.Module]
    via: str
    size: int = 32  # image side (timm, torchvision)
    make_input: Callable[[], Any] | None = None
    call: Callable[[nn.Module, Any], torch.Tensor] = lambda m, x: m(x)


def images(size: int) -> torch.Tensor:
    return torch.randn(2, 3, size, size, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1))


def run_case(case: Case) -> None:
    torch.manual_seed(0)
    model = case.build().double()
    x = case.make_input() if case.make_input else images(case.size)
    assert_exact_lighter_and_undone(model, x, call=case.call, via=case.via, exact=True,
                                    peak=forward_peak)


# --------------------------------------------------------------------------------------------
# timm: 44 architectures.
# --------------------------------------------------------------------------------------------
def timm_model(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: timm.create_model(name, pretrained=False, num_classes=5, **kwargs)


def maxvit() -> nn.Module:
    from timm.models import maxxvit
    cfg = dataclasses.replace(maxxvit.model_cfgs["maxvit_rmlp_pico_rw"], depths=(1, 1, 1, 1),
                              embed_dim=(32, 64, 96, 128), stem_width=(8, 16))
    return maxxvit.MaxxVit(cfg, img_size=32, num_classes=5, **DROP)


def nfnet() -> nn.Module:
    from timm.models import nfnet as nf
    cfg = dataclasses.replace(nf.model_cfgs["nfnet_l0"], depths=(1, 1, 1, 1),
                              channels=(64, 128, 192, 256), stem_chs=16, group_size=16)
    return nf.NormFreeNet(cfg, num_classes=5, **DROP)


def mixer() -> nn.Module:
    from timm.models.mlp_mixer import MlpMixer
    return MlpMixer(num_classes=5, img_size=32, patch_size=8, num_blocks=2, embed_dim=48,
                    **DROP)


ONE = (1, 1, 1, 1)
TIMM = {
    # ResNets and relatives
    "resnet10t": Case(timm_model("resnet10t", drop_rate=0.1), "timm"),
    "resnet18": Case(timm_model("resnet18", layers=ONE, **DROP), "timm"),
    "resnet50d": Case(timm_model("resnet50d", layers=ONE, **DROP), "timm"),
    "seresnext26t": Case(timm_model("seresnext26t_32x4d", layers=ONE, **DROP), "timm"),
    "resnetv2_50": Case(timm_model("resnetv2_50", layers=ONE, **DROP), "timm"),
    "res2net50": Case(timm_model("res2net50_14w_8s", layers=ONE, **DROP), "timm"),
    "nf_regnet_b0": Case(timm_model("nf_regnet_b0", **DROP), "timm"),
    "nfnet": Case(nfnet, "timm"),
    # EfficientNets and MobileNets
    "tinynet_e": Case(timm_model("tinynet_e", **DROP), "timm"),
    "mixnet_s": Case(timm_model("mixnet_s", **DROP), "timm"),
    "efficientnet_lite0": Case(timm_model("efficientnet_lite0", **DROP), "timm"),
    "mobilenetv2_050": Case(timm_model("mobilenetv2_050", **DROP), "timm"),
    "mobilenetv3_small_050": Case(timm_model("mobilenetv3_small_050", **DROP), "timm"),
    "mobilenetv4_conv_small": Case(timm_model("mobilenetv4_conv_small_035", **DROP), "timm"),
    "ghostnet_050": Case(timm_model("ghostnet_050", drop_rate=0.1), "timm"),
    "lcnet_050": Case(timm_model("lcnet_050", drop_rate=0.1), "timm"),
    "rexnet_100": Case(timm_model("rexnet_100", **DROP), "timm"),
    # RegNets, DenseNet, VoVNet, HGNet, DPN, RepVGG
    "regnetx_002": Case(timm_model("regnetx_002", **DROP), "timm"),
    "regnety_002": Case(timm_model("regnety_002", **DROP), "timm"),
    "densenet": Case(timm_model("densenet121", growth_rate=8, block_config=(2, 2, 2, 2),
                                drop_rate=0.1), "timm"),
    "vovnet": Case(timm_model("ese_vovnet19b_slim_dw", **DROP), "timm"),
    "hgnetv2_b0": Case(timm_model("hgnetv2_b0", **DROP), "timm"),
    "repvgg_a0": Case(timm_model("repvgg_a0", **DROP), "timm"),
    # ConvNeXts and other modern CNNs
    "convnext_atto": Case(timm_model("convnext_atto", depths=ONE, **DROP), "timm"),
    "convnextv2_atto": Case(timm_model("convnextv2_atto", depths=ONE, **DROP), "timm"),
    "inception_next": Case(timm_model("inception_next_tiny", depths=ONE, **DROP), "timm"),
    "edgenext_xx_small": Case(timm_model("edgenext_xx_small", **DROP), "timm"),
    "fastvit_t8": Case(timm_model("fastvit_t8", **DROP), "timm"),
    "mobilevit_xxs": Case(timm_model("mobilevit_xxs", **DROP), "timm", size=64),
    # transformers and MLPs
    "vit": Case(timm_model("vit_tiny_patch16_224", proj_drop_rate=0.1, attn_drop_rate=0.1,
                           **VIT), "timm"),
    "deit_distilled": Case(timm_model("deit_tiny_distilled_patch16_224", **VIT), "timm"),
    "beit": Case(timm_model("beit_base_patch16_224", **VIT), "timm"),
    "cait": Case(timm_model("cait_xxs24_224", **VIT), "timm"),
    "eva02": Case(timm_model("eva02_tiny_patch14_224", img_size=28, depth=2, **DROP), "timm",
                  size=28),
    "swin": Case(timm_model("swin_tiny_patch4_window7_224", img_size=32, window_size=2,
                            embed_dim=24, depths=ONE, num_heads=(1, 1, 2, 2), **DROP), "timm"),
    "levit_128s": Case(timm_model("levit_128s", img_size=32, drop_path_rate=0.1), "timm"),
    "maxvit": Case(maxvit, "timm"),
    "xcit_nano": Case(timm_model("xcit_nano_12_p16_224", img_size=32, depth=2, **DROP),
                      "timm"),
    "davit": Case(timm_model("davit_tiny", depths=ONE, embed_dims=(16, 32, 64, 128),
                             num_heads=(1, 2, 4, 8), **DROP), "timm"),
    "mixer": Case(mixer, "timm"),
    # timm refuses its own switch: the repeated-block route
    "cs3darknet_s": Case(timm_model("cs3darknet_s", **DROP), "blocks"),
    "dla46_c": Case(timm_model("dla46_c", drop_rate=0.1), "blocks"),
    "hrnet_w18_small": Case(timm_model("hrnet_w18_small", drop_rate=0.1), "blocks"),
    "pit_ti": Case(timm_model("pit_ti_224", img_size=32, depth=[1, 1, 1], drop_rate=0.1),
                   "blocks"),
    "convit_tiny": Case(timm_model("convit_tiny", img_size=32, depth=2, embed_dim=48,
                                   num_heads=3, local_up_to_layer=1, **DROP), "blocks"),
    "coat_lite_tiny": Case(timm_model("coat_lite_tiny", img_size=32, serial_depths=ONE,
                                      **DROP), "blocks"),
    "twins_pcpvt": Case(timm_model("twins_pcpvt_small", img_size=32, depths=ONE, **DROP),
                        "blocks"),
}


@pytest.mark.parametrize("name", TIMM)
def test_timm_model_is_exact_lighter_and_undone(name):
    run_case(TIMM[name])


# --------------------------------------------------------------------------------------------
# torchvision: no switch of its own, so the repeated blocks are checkpointed.
# --------------------------------------------------------------------------------------------
def tv_convnext() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    return ConvNeXt([CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 2)],
                    stochastic_depth_prob=0.1, num_classes=5)


def tv_swin() -> nn.Module:
    return torchvision.models.SwinTransformer([4, 4], 16, [2, 2], [1, 2], [2, 2], dropout=0.1,
                                              stochastic_depth_prob=0.1, num_classes=5)


def tv_vit() -> nn.Module:
    return torchvision.models.VisionTransformer(32, 8, num_layers=2, num_heads=2,
                                                hidden_dim=32, mlp_dim=64, dropout=0.1,
                                                attention_dropout=0.1, num_classes=5)


TV = torchvision.models
TORCHVISION = {
    "resnet18": Case(lambda: TV.resnet18(num_classes=5), "blocks"),
    "resnext": Case(lambda: TV.ResNet(TV.resnet.Bottleneck, [1, 1, 1, 1], groups=4,
                                      width_per_group=8, num_classes=5), "blocks"),
    "densenet": Case(lambda: TV.DenseNet(8, (2, 2, 2), 16, drop_rate=0.1, num_classes=5),
                     "blocks"),
    "mobilenet_v2": Case(lambda: TV.mobilenet_v2(width_mult=0.5, num_classes=5), "blocks"),
    "mobilenet_v3_small": Case(lambda: TV.mobilenet_v3_small(num_classes=5), "blocks"),
    "efficientnet_b0": Case(lambda: TV.efficientnet_b0(num_classes=5), "blocks"),
    "mnasnet0_5": Case(lambda: TV.mnasnet0_5(num_classes=5), "blocks"),
    "shufflenet_v2": Case(lambda: TV.shufflenet_v2_x0_5(num_classes=5), "blocks"),
    "squeezenet1_1": Case(lambda: TV.squeezenet1_1(num_classes=5), "blocks", size=48),
    "regnet_y_400mf": Case(lambda: TV.regnet_y_400mf(num_classes=5), "blocks"),
    "convnext": Case(tv_convnext, "blocks"),
    "swin": Case(tv_swin, "blocks"),
    "vit": Case(tv_vit, "blocks"),
}


@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_model_is_exact_lighter_and_undone(name):
    run_case(TORCHVISION[name])


# --------------------------------------------------------------------------------------------
# Hugging Face, from small configs, offline; use_cache=False where the model has a cache.
# --------------------------------------------------------------------------------------------
def tokens(length: int = 48, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(3))


def hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).last_hidden_state


def hidden_no_cache(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).last_hidden_state


def seq2seq(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, decoder_input_ids=ids[:, :16], use_cache=False).last_hidden_state


def whisper(model: nn.Module, features: torch.Tensor) -> torch.Tensor:
    start = torch.zeros(features.shape[0], 8, dtype=torch.long)
    return model(input_features=features, decoder_input_ids=start,
                 use_cache=False).last_hidden_state


def pixels(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(pixel_values=x).last_hidden_state


def hf(config_name: str, model_name: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers
        return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))
    return build


SMALL = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64)
DECODER = dict(SMALL, vocab_size=64, max_position_embeddings=64, num_key_value_heads=1,
               attention_dropout=0.1)
HF = {
    "bert": Case(hf("BertConfig", "BertModel", vocab_size=64, max_position_embeddings=64,
                    **SMALL), "hf", make_input=tokens, call=hidden),
    "roberta": Case(hf("RobertaConfig", "RobertaModel", vocab_size=64, pad_token_id=1,
                       max_position_embeddings=70, **SMALL), "hf", make_input=tokens,
                    call=hidden),
    "distilbert": Case(hf("DistilBertConfig", "DistilBertModel", vocab_size=64, dim=32,
                          n_layers=3, n_heads=2, hidden_dim=64, max_position_embeddings=64),
                       "hf", make_input=tokens, call=hidden),
    "gpt2": Case(hf("GPT2Config", "GPT2Model", vocab_size=64, n_embd=32, n_layer=3, n_head=2,
                    n_positions=64, bos_token_id=0, eos_token_id=0), "hf", make_input=tokens,
                 call=hidden_no_cache),
    "llama": Case(hf("LlamaConfig", "LlamaModel", **DECODER), "hf", make_input=tokens,
                  call=hidden_no_cache),
    "mistral": Case(hf("MistralConfig", "MistralModel", sliding_window=16, **DECODER), "hf",
                    make_input=tokens, call=hidden_no_cache),
    "t5": Case(hf("T5Config", "T5Model", vocab_size=64, d_model=32, d_kv=16, d_ff=64,
                  num_layers=3, num_heads=2, dropout_rate=0.1), "hf", make_input=tokens,
               call=seq2seq),
    "whisper": Case(hf("WhisperConfig", "WhisperModel", vocab_size=64, num_mel_bins=16,
                       d_model=32, encoder_layers=2, decoder_layers=2,
                       encoder_attention_heads=2, decoder_attention_heads=2,
                       encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=32,
                       max_target_positions=16, dropout=0.1, attention_dropout=0.1,
                       pad_token_id=0, decoder_start_token_id=1),
                    "hf", make_input=lambda: torch.randn(
                        2, 16, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2)),
                    call=whisper),
    "vit": Case(hf("ViTConfig", "ViTModel", image_size=32, patch_size=8,
                   hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, **SMALL), "hf",
                call=pixels),
    "resnet": Case(hf("ResNetConfig", "ResNetModel", embedding_size=16,
                      hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1]), "blocks",
                   call=pixels),
    "convnext": Case(hf("ConvNextConfig", "ConvNextModel", hidden_sizes=[16, 32, 64, 128],
                        depths=[1, 1, 1, 1], drop_path_rate=0.1), "blocks", call=pixels),
}


@pytest.mark.parametrize("name", HF)
def test_hugging_face_model_is_exact_lighter_and_undone(name):
    pytest.importorskip("transformers")
    run_case(HF[name])
