"""The checkpoint primitive alone (``primitive``): a zoo model's checkpointed mode on
zoo.checkpoint against the same regions run by torch.utils.checkpoint (non-reentrant).

    python scripts/benchmark.py primitive --model densenet_bc_100 --batch_size 1 --threads 1
    python scripts/benchmark.py primitive --model bert_base --batch_size 1 --mode selective

Both variants checkpoint exactly the same regions of the same model (the model modules' imported
``checkpoint`` is swapped for torch's, selective recompute mapped to torch's
``create_selective_checkpoint_contexts``), so the time difference is the primitive's own work per
region. Small batches on one thread make that work visible; on a GPU it is host time that the
device waits for when kernels are short. Steps are interleaved in shuffled order; medians and
interquartile ranges are ratios to the plain model in the same run. The last column is the
largest ``num_batches_tracked`` after one step: 1 for both variants on the zoo's convolutional
models, whose cp_BatchNorm2d stays exact under torch's checkpoint too.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch.utils import checkpoint as torch_checkpoint

import zoo
from zoo.memory import bn_count, bn_state

from .measure import measure_times, median_iqr, training_step
from .report import command_line, machine_info, write_json
from .variants import Variant

__all__ = ["torch_non_reentrant", "PrimitiveVariant", "restore_primitive", "primitive"]


def _model_modules() -> list[ModuleType]:
    """The zoo's model files that call ``checkpoint`` (imported by name: swappable)."""
    return [m for name, m in list(sys.modules.items())
            if name.startswith("zoo.models.") and hasattr(m, "checkpoint")]


def torch_non_reentrant(fn: Callable, *args: Any, save_ops: Any = None, **kwargs: Any) -> Any:
    """zoo.checkpoint's signature on torch.utils.checkpoint(use_reentrant=False)."""
    context_fn = ((lambda: torch_checkpoint.create_selective_checkpoint_contexts(list(save_ops)))
                  if save_ops else torch_checkpoint.noop_context_fn)
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn,
                                       **kwargs)


class PrimitiveVariant(Variant):
    """A zoo model in checkpoint ``mode`` with ``primitive`` doing the checkpointing."""

    def __init__(self, name: str, model: torch.nn.Module, mode: bool | str, description: str,
                 primitive: Callable = zoo.checkpoint):
        super().__init__(name, model, mode, description)
        self.primitive = primitive

    def prepare(self) -> None:
        """Before each step: the mode, and ``primitive`` wherever the zoo's models call
        ``checkpoint`` (undone by :func:`restore_primitive`)."""
        super().prepare()
        for m in _model_modules():
            m.checkpoint = self.primitive


def restore_primitive() -> None:
    """Every zoo model file calls zoo.checkpoint again."""
    for m in _model_modules():
        m.checkpoint = zoo.checkpoint


def _bn_count_after_one_step(variant: Variant, x: torch.Tensor) -> int:
    """The largest num_batches_tracked one step leaves (the model's buffers put back after)."""
    net = variant.model
    state = {k: t.clone() for k, t in net.state_dict().items()}
    training_step(variant, x)()
    count = bn_count(bn_state(net))
    net.load_state_dict(state)
    return count


def primitive(model: str = "densenet_bc_100", batch_size: int = 1, mode: Any = True,
              device: str = "cpu", threads: int | None = 1, repeats: int = 21, warmup: int = 3,
              json_out: str | None = None) -> list[dict]:
    """zoo.checkpoint against torch's checkpoint on the same regions of a zoo model.

    Plain, torch non-reentrant and zoo.checkpoint step times for ``--model`` in checkpoint
    ``--mode`` (True: the model's recommended one), interleaved; ratios to plain with their
    interquartile range, and the BatchNorm count one step leaves. ``--json_out`` writes them.
    """
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    net = zoo.create_model(model).to(dev)
    x = net.example_input(batch_size).to(dev)
    variants = [PrimitiveVariant("plain", net, False, "no checkpoint"),
                PrimitiveVariant("torch non-reentrant", net, mode, "torch.utils.checkpoint",
                                 torch_non_reentrant),
                PrimitiveVariant("zoo.checkpoint", net, mode, "zoo.checkpoint")]
    try:
        counts = {v.name: _bn_count_after_one_step(v, x) for v in variants}
        times = measure_times(variants, x, repeats, warmup)
    finally:
        restore_primitive()
    base = median_iqr(times["plain"])[0]
    rows = []
    for name, ts in times.items():
        median, q1, q3 = median_iqr(ts)
        rows.append({"variant": name, "median_s": median, "ratio": median / base,
                     "iqr_ratio": [q1 / base, q3 / base],
                     "num_batches_tracked_after_one_step": counts[name]})
    info = machine_info(dev)
    print(f"\n{model} (mode {mode!r}), batch {batch_size}; {info.get('gpu') or info['cpu']}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| variant | median step | x plain (IQR) | num_batches_tracked after 1 step |")
    print("|---|---|---|---|")
    for r in rows:
        lo, hi = r["iqr_ratio"]
        print(f"| {r['variant']} | {r['median_s'] * 1e3:.1f} ms | {r['ratio']:.2f}x "
              f"({lo:.2f}-{hi:.2f}) | {r['num_batches_tracked_after_one_step']} |")
    if json_out:
        write_json(json_out, {"command": command_line(), "machine": info, "rows": rows})
    return rows
