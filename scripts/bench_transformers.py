"""Peak memory and FLOPs of one transformer training step, plain against each checkpoint mode.

    python scripts/bench_transformers.py             # exact CPU figures (MemTracker, FlopCounterMode)

One step = forward, ``square().mean()`` loss, backward, in train mode (dropout active), from fresh
gradients; the model's parameters count towards the peak (``track``), as they would on a GPU.

* ViT-S/16, batch 8 at 224x224, real tensors, beside timm's vit_small_patch16_224 plain and with
  ``set_grad_checkpointing(True)`` in the same run. Goal: the recommended mode's peak and FLOPs
  each at most timm's checkpointed model's.
* BERT-base, batch 64, sequence 128 (seed 004's setting), under ``FakeTensorMode``: model and
  inputs are built inside the mode, so nothing is computed, yet MemTracker's bytes and
  FlopCounterMode's FLOPs are the ones of a real run. Goals: ``block`` >= 60% less peak than
  plain; ``selective`` >= 40% less at <= 5% extra FLOPs.
* GPT-2 small, batch 8, sequence 1024, under ``FakeTensorMode``: figures only.

On the CPU, SDPA with attention dropout (BERT, GPT-2) runs its math path, which stores the T x T
attention matrix and is counted by FlopCounterMode; without dropout (ViT) it runs a fused kernel
whose FLOPs FlopCounterMode does not count (the same for every variant, timm's included).

Prints a Markdown table and whether each goal is met; ``--json_out`` writes the rows as JSON.
"""
from __future__ import annotations

import fire

from zoo.bench.peers import (add_rows, print_goals, print_table, timm_checkpointing, write_json,
                             zoo_modes)
from zoo.models.vit import VisionTransformer


def main(vit_batch: int = 8, vit_size: int = 224, bert_batch: int = 64, bert_tokens: int = 128,
         gpt2_batch: int = 8, gpt2_tokens: int = 1024, json_out: str | None = None) -> list[dict]:
    """Measure the three workloads, print a table and the goals, optionally write JSON."""
    rows: list[dict] = []
    vit = zoo_modes("vit_small_patch16_224", vit_batch, vit_size, fake=False)
    # real tensors: timm's ViT constructor reads tensor values, which FakeTensorMode cannot give
    timm_vit = timm_checkpointing("vit_small_patch16_224", vit_batch, vit_size, fake=False)
    workload = f"vit_small_patch16_224 batch {vit_batch} {vit_size}px"
    add_rows(rows, workload, vit, vit["plain"], fake=False)
    add_rows(rows, workload, timm_vit, vit["plain"], fake=False)
    bert = zoo_modes("bert_base", bert_batch, bert_tokens, fake=True)
    add_rows(rows, f"bert_base batch {bert_batch} seq {bert_tokens}", bert, bert["plain"],
             fake=True)
    gpt2 = zoo_modes("gpt2_small", gpt2_batch, gpt2_tokens, fake=True)
    add_rows(rows, f"gpt2_small batch {gpt2_batch} seq {gpt2_tokens}", gpt2, gpt2["plain"],
             fake=True)
    print_table(rows, "ViT on real tensors, BERT and GPT-2 under FakeTensorMode")

    recommended = VisionTransformer.checkpoint_modes[0]
    timm_cp = timm_vit["timm set_grad_checkpointing"]
    print_goals([
        (f"vit_small {recommended} peak <= timm's", vit[recommended][0] / timm_cp[0], 1.0),
        (f"vit_small {recommended} FLOPs <= timm's", vit[recommended][1] / timm_cp[1], 1.0),
        ("bert_base block peak <= 0.40x plain", bert["block"][0] / bert["plain"][0], 0.40),
        ("bert_base selective peak <= 0.60x plain", bert["selective"][0] / bert["plain"][0], 0.60),
        ("bert_base selective FLOPs <= 1.05x plain", bert["selective"][1] / bert["plain"][1], 1.05),
    ])
    write_json(json_out, rows)
    return rows


if __name__ == "__main__":
    fire.Fire(main, serialize=lambda rows: None)
