"""The planner's promise on the step a user runs (``planner-step``).

    python scripts/benchmark.py planner-step --out docs/results/bench_planner_step_cpu.json

Eight models (zoo, torchvision, timm, a Hugging Face encoder with an attention mask and labels, a
decoder with labels), each with AdamW and with SGD (momentum), in fp32 and in bf16 autocast, at
three budgets: the plain whole step's peak, the least a plan reaches, and halfway
(``zoo.planner.step_sweep``). Per plan: the predicted peak, the real step's measured peak
(forward, loss, backward, ``optimizer.step()`` on this CPU, exact bytes, counted without
MemTracker's module hooks), and whether the planned model trains bit for bit like plain for three
optimizer steps. Prints Markdown and writes JSON.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zoo.planner.step_sweep import step_rows

from .planner_vs_compile import build
from .report import comma_list, command_line, machine_info, write_json

__all__ = ["MODELS", "planner_step"]


def _hf_encoder() -> tuple[Callable[[], nn.Module], dict[str, torch.Tensor]]:
    import transformers
    config = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4,
                                     num_attention_heads=4, intermediate_size=512,
                                     max_position_embeddings=128, num_labels=4,
                                     attn_implementation="eager")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (8, 64), generator=g)
    mask = torch.ones_like(ids)
    mask[4:, 40:] = 0  # padded sequences: the mask changes the attention
    labels = torch.randint(0, 4, (8,), generator=g)
    return (lambda: transformers.BertForSequenceClassification(config),
            {"input_ids": ids, "attention_mask": mask, "labels": labels})


def _hf_decoder() -> tuple[Callable[[], nn.Module], dict[str, torch.Tensor]]:
    import transformers
    config = transformers.GPT2Config(vocab_size=1000, n_embd=128, n_layer=4, n_head=4,
                                     n_positions=128, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 1000, (8, 64), generator=torch.Generator().manual_seed(0))
    return lambda: transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def _timm_vit() -> tuple[Callable[[], nn.Module], torch.Tensor]:
    import timm
    return (lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64,
                                      num_classes=10), torch.randn(8, 3, 64, 64))


MODELS: dict[str, Callable[[], tuple[Callable[[], nn.Module], Any]]] = {
    "resnet20": lambda: build("resnet20", 16),
    "densenet40": lambda: build("densenet40", 8),
    "vit_cifar": lambda: build("vit_cifar", 16),
    "torchvision:resnet18": lambda: build("torchvision:resnet18", 8, size=64),
    "timm:resnet18": lambda: build("timm:resnet18", 8, size=64),
    "timm:vit_tiny_patch16_224 (64 px)": _timm_vit,
    "transformers:BertForSequenceClassification": _hf_encoder,
    "transformers:GPT2LMHeadModel": _hf_decoder,
}


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def seeded() -> nn.Module:
        torch.manual_seed(0)
        return make()
    return seeded


def _old(r: dict[str, Any]) -> str:
    if not r["arithmetic"]:
        return "no plan (budget less state below its least) | -"
    miss = r["arithmetic_measured"] - r["arithmetic"]
    over = " (over budget)" if r["arithmetic_measured"] > r["budget"] else ""
    return f"{miss:+,} B | {r['arithmetic_measured']:,}{over}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | optimizer | precision | budget (B) | predicted (B) | measured (B) | "
             "measured - predicted | trains like plain | arithmetic: measured - promised | "
             "its measured (B) |", "|---|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        over = "" if r["measured"] <= r["budget"] else " (over budget)"
        lines.append(f"| {r['model']} | {r['optimizer']} | {r['precision']} | {r['budget']:,} | "
                     f"{r['predicted']:,} | {r['measured']:,}{over} | "
                     f"{r['measured'] - r['predicted']:+,} B | "
                     f"{'bit for bit' if r['exact'] else 'NO'} | {_old(r)} |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """Per model: the planner's plans against their real steps, and the old arithmetic's."""
    lines = ["| model | plans | worst \\|measured - predicted\\| | within budget | trains like "
             "plain (3 steps) | the old arithmetic: plans | worst miss | over budget | no plan |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        n, old = len(mine), [r for r in mine if r["arithmetic"]]
        worst = max(abs(r["measured"] - r["predicted"]) for r in mine)
        gap = {id(r): abs(r["arithmetic_measured"] - r["arithmetic"]) for r in old}
        miss = max(old, key=lambda r: gap[id(r)] / r["arithmetic_measured"], default=None)
        missed = "-" if miss is None else \
            f"{gap[id(miss)]:,} B ({100 * gap[id(miss)] / miss['arithmetic_measured']:.1f}%)"
        lines.append(
            f"| {model} | {n} | {worst:,} B | "
            f"{sum(r['measured'] <= r['budget'] for r in mine)} of {n} | "
            f"{sum(r['exact'] for r in mine)} of {n} bit for bit | {len(old)} | {missed} | "
            f"{sum(r['arithmetic_measured'] > r['budget'] for r in old)} | {n - len(old)} |")
    return "\n".join(lines)


def planner_step(models: Any = ",".join(MODELS), out: str = "") -> list[dict[str, Any]]:
    """Plans of the whole step (batch, loss, optimizer, precision) predicted against measured."""
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for name in comma_list(models):
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}; expected some of {', '.join(MODELS)}")
        make, batch = MODELS[name]()
        rows += [vars(r) for r in step_rows(name, _seeded(make), batch)]
    print(summary(rows) + "\n\n" + markdown(rows))
    worst = max(abs(r["measured"] - r["predicted"]) / r["predicted"] for r in rows)
    print(f"\n{len(rows)} plans; worst |measured - predicted| {100 * worst:.4f}%; "
          f"{sum(r['exact'] for r in rows)} train bit for bit like plain; "
          f"{time.perf_counter() - start:.0f} s")
    if out:
        write_json(out, {"command": command_line(), "machine": machine_info(torch.device("cpu")),
                         "rows": rows})
    return rows
