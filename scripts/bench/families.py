"""Peak memory and FLOPs of one training step per model family (``densenet``, ``resnet``,
``transformers``): plain against each of the zoo's checkpoint modes, and timm's own
``set_grad_checkpointing`` measured in the same run.

    python scripts/benchmark.py densenet            # exact CPU figures (MemTracker, FlopCounterMode)
    python scripts/benchmark.py resnet --fake       # same bytes and FLOPs without running kernels
    python scripts/benchmark.py transformers

One step = ``zoo.memory.train_step``'s (forward, ``square().mean()`` loss, backward, in train
mode, from fresh gradients); the model's parameters count towards the peak, as they would on a
GPU (``zoo.memory.step_cost``). Each prints a Markdown table and whether each goal is met;
``--json_out`` writes the rows as JSON.
"""
from __future__ import annotations

from zoo.models.resnet import ResNet
from zoo.models.vit import VisionTransformer

from .peers import add_rows, print_goals, print_table, timm_checkpointing, write_json, zoo_modes

__all__ = ["densenet", "resnet", "transformers"]


def densenet(cifar_batch: int = 32, imagenet_batch: int = 8, imagenet_size: int = 224,
             fake: bool = False, json_out: str | None = None) -> list[dict]:
    """DenseNet-BC-100 and DenseNet-121, each checkpoint mode, beside timm's.

    DenseNet-BC-100 (k=12), batch 32 at 32x32, the Pleiss et al. 2017 setting. Goals: the
    ``bottleneck`` mode at <= 0.40x the plain peak for <= 2% extra FLOPs; ``layer`` at <= 0.20x.
    DenseNet-121, batch 8 at 224x224, beside timm's densenet121 with
    ``set_grad_checkpointing(True)``. Goal: the ``bottleneck`` mode's peak and FLOPs each at most
    timm's.
    """
    rows: list[dict] = []
    cifar = zoo_modes("densenet_bc_100", cifar_batch, 32, fake)
    add_rows(rows, f"densenet_bc_100 batch {cifar_batch} 32px", cifar, cifar["plain"])
    imagenet = zoo_modes("densenet121", imagenet_batch, imagenet_size, fake)
    timm_results = timm_checkpointing("densenet121", imagenet_batch, imagenet_size, fake)
    workload = f"densenet121 batch {imagenet_batch} {imagenet_size}px"
    add_rows(rows, workload, imagenet, imagenet["plain"])
    add_rows(rows, workload, timm_results, imagenet["plain"])
    print_table(rows, "FakeTensorMode" if fake else "real tensors")

    plain, timm_cp = cifar["plain"], timm_results["timm set_grad_checkpointing"]
    print_goals([
        ("bc_100 bottleneck peak <= 0.40x plain", cifar["bottleneck"][0] / plain[0], 0.40),
        ("bc_100 bottleneck FLOPs <= 1.02x plain", cifar["bottleneck"][1] / plain[1], 1.02),
        ("bc_100 layer peak <= 0.20x plain", cifar["layer"][0] / plain[0], 0.20),
        ("densenet121 bottleneck peak <= timm's", imagenet["bottleneck"][0] / timm_cp[0], 1.0),
        ("densenet121 bottleneck FLOPs <= timm's", imagenet["bottleneck"][1] / timm_cp[1], 1.0),
    ])
    write_json(json_out, rows, fake=fake)
    return rows


def resnet(imagenet_batch: int = 8, imagenet_size: int = 224, cifar_batch: int = 64,
           fake: bool = False, json_out: str | None = None) -> list[dict]:
    """ResNet-50, ResNet-110 and the CIFAR CNN, each checkpoint mode, beside timm's.

    ResNet-50, batch 8 at 224x224, beside timm's resnet50 with ``set_grad_checkpointing(True)``
    (goal: the recommended mode's peak *and* FLOPs each at most timm's); ResNet-110 (CIFAR) and
    the CIFAR CNN (``cifar_cnn``), batch 64 at 32x32. The ``block`` mode also with
    ``checkpoint_every`` 2 and 3.
    """
    rows: list[dict] = []
    r50 = zoo_modes("resnet50", imagenet_batch, imagenet_size, fake, every=(2, 3))
    timm_r50 = timm_checkpointing("resnet50", imagenet_batch, imagenet_size, fake)
    workload = f"resnet50 batch {imagenet_batch} {imagenet_size}px"
    add_rows(rows, workload, r50, r50["plain"])
    add_rows(rows, workload, timm_r50, r50["plain"])
    r110 = zoo_modes("resnet110", cifar_batch, 32, fake, every=(2, 3))
    add_rows(rows, f"resnet110 batch {cifar_batch} 32px", r110, r110["plain"])
    cnn = zoo_modes("cifar_cnn", cifar_batch, 32, fake)
    add_rows(rows, f"cifar_cnn batch {cifar_batch} 32px", cnn, cnn["plain"])
    print_table(rows, "FakeTensorMode" if fake else "real tensors")

    recommended = ResNet.checkpoint_modes[0]
    ours, theirs = r50[recommended], timm_r50["timm set_grad_checkpointing"]
    print_goals([(f"resnet50 {recommended} peak <= timm's (x timm)", ours[0] / theirs[0], 1.0),
                 (f"resnet50 {recommended} FLOPs <= timm's (x timm)", ours[1] / theirs[1], 1.0)])
    write_json(json_out, rows, fake=fake)
    return rows


def transformers(vit_batch: int = 8, vit_size: int = 224, bert_batch: int = 64,
                 bert_tokens: int = 128, gpt2_batch: int = 8, gpt2_tokens: int = 1024,
                 json_out: str | None = None) -> list[dict]:
    """ViT-S/16, BERT-base and GPT-2 small, each checkpoint mode, beside timm's ViT.

    ViT-S/16, batch 8 at 224x224, real tensors, beside timm's vit_small_patch16_224 plain and with
    ``set_grad_checkpointing(True)`` (goal: the recommended mode's peak and FLOPs each at most
    timm's). BERT-base, batch 64, sequence 128, under FakeTensorMode (bytes and FLOPs of a real
    run, nothing computed); goals: ``block`` >= 60% less peak than plain, ``selective`` >= 40%
    less at <= 5% extra FLOPs. GPT-2 small, batch 8, sequence 1024, FakeTensorMode: figures only.
    On the CPU, SDPA with attention dropout (BERT, GPT-2) runs its math path, which stores the
    T x T attention matrix and is counted by FlopCounterMode; without dropout (ViT) it runs a
    fused kernel whose FLOPs FlopCounterMode does not count (the same for every variant).
    """
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
