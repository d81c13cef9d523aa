"""One zoo model's three benchmarks (``variants``, ``max-batch``, ``segments``), each a payload.

* :func:`run_benchmark`: every variant at one or more batch sizes (memory, FLOPs, time, exactness);
* :func:`run_max_batch`: the largest batch of every variant under one or more memory budgets;
* :func:`run_segments`: ``checkpoint_sequential`` (torch's and the zoo's) against segments.

A payload holds ``kind``, ``model``, the ``machine``, the ``command`` and the ``rows``.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from zoo.memory import parse_bytes
from zoo.memory.cards import card as named_card
from zoo.models import ZooModel

from .max_batch import CardPredictor, PeakPredictor, cuda_peak, search_largest_batch
from .measure import measure_variants, training_step
from .report import command_line, machine_info
from .segments import sweep_segments
from .variants import (OFFLOAD, PLAIN, Variant, build_variant, build_variants, canonical_name,
                       create, variant_names)

__all__ = ["fake_mode", "parse_budgets", "run_benchmark", "run_max_batch", "run_segments"]


@contextlib.contextmanager
def fake_mode(fake: bool) -> Iterator[None]:
    """FakeTensorMode when ``fake``: shapes without data, so MemTracker and FlopCounterMode give a
    real step's bytes and FLOPs while nothing is allocated or computed."""
    if not fake:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def parse_budgets(memory_budget: str | int | float | Sequence[str | int | float]) -> list[int]:
    """``"11GB"``, ``"11GB,12GB"``, ``("11GB", "12GB")`` or bytes -> a list of byte counts."""
    items = memory_budget.split(",") if isinstance(memory_budget, str) else (
        list(memory_budget) if isinstance(memory_budget, (list, tuple)) else [memory_budget])
    if not items or items == [""]:
        raise ValueError("--memory_budget needs at least one size, like 11GB or 11GB,12GB")
    return [parse_bytes(b.strip() if isinstance(b, str) else b) for b in items]


def _device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device; use --device cpu (on the "
                         "CPU, --find_max_batch predicts the CUDA answer without a GPU)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda (cuda:N), got {device!r}")
    return dev


def _model(name: str | Callable[..., ZooModel], dev: torch.device, seed: int,
           **kwargs: Any) -> ZooModel:
    torch.manual_seed(seed)
    with torch.device(dev):  # built in place: also under FakeTensorMode, where .to() fails
        return create(name, **kwargs)


def _payload(kind: str, model: Any, dev: torch.device, rows: list[dict], **settings: Any) -> dict:
    return {"kind": kind, "model": model if isinstance(model, str) else repr(model),
            "machine": machine_info(dev), "command": command_line(),
            "settings": settings, "rows": rows}


def run_benchmark(model: str, batch_sizes: Sequence[int], device: str = "cpu",
                  size: int | None = None, variants: Sequence[str] | None = None,
                  repeats: int = 5, warmup: int = 1, fake: bool = False, seed: int = 0,
                  **model_kwargs: Any) -> dict:
    """Every variant of ``model`` at each batch size; ``fake``: memory and FLOPs only."""
    dev = _device(device)
    if fake and dev.type != "cpu":
        raise ValueError("--fake runs on the CPU (FakeTensorMode); drop --device cuda")
    rows: list[dict] = []
    for b in batch_sizes:
        with fake_mode(fake):
            base = _model(model, dev, seed, **model_kwargs)
            names = ([canonical_name(base, n) for n in variants] if variants
                     else variant_names(base))
            if PLAIN not in names:
                names.insert(0, PLAIN)
            names.sort(key=lambda n: n != PLAIN)  # plain first: the ratios' baseline
            if fake:  # fake models cannot be deep-copied: a fresh one per variant
                chosen = [build_variant(_model(model, dev, seed, **model_kwargs), n, reuse=True)
                          for n in names]
            else:
                chosen = build_variants(base, names)
            x = base.example_input(int(b), size)
            rows += measure_variants(chosen, x, repeats=repeats, warmup=warmup, timed=not fake,
                                     exact=not fake, seed=seed)
        del base, chosen, x
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return _payload("benchmark", model, dev, rows, batch_sizes=list(batch_sizes), size=size,
                    fake=fake, repeats=repeats, warmup=warmup, seed=seed, model_kwargs=model_kwargs)


def run_max_batch(model: str | Callable[..., ZooModel], budgets: Sequence[int], device: str = "cpu",
                  size: int | None = None, variants: Sequence[str] | None = None,
                  allocator: str = "cuda", check_prediction: bool = True,
                  probes: tuple[int, int] = (8, 16), max_batch: int = 1 << 16, seed: int = 0,
                  card: str | None = None, **model_kwargs: Any) -> dict:
    """The largest batch of each variant under each budget.

    On the CPU: predicted exactly under FakeTensorMode (``allocator="cuda"``: as the CUDA caching
    allocator would count it). On a named ``card`` (``zoo.memory.cards``; ``h100`` when
    ``device="cuda"`` is asked for on a machine without one): predicted with the card's kernels
    and caching allocator capped at the budget, with the predicted samples/s on the card. On
    CUDA: searched for with real steps on a device capped at the budget, and with
    ``check_prediction`` the CPU prediction of the peak at the batch found and its error against
    the measured peak (the predicted largest batch: run the same command with ``--device cpu``).
    """
    if card is None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        card = "h100"
    dev = torch.device("cpu") if card is not None else _device(device)
    predictor = PeakPredictor(model, size, allocator if dev.type == "cpu" else "cuda",
                              **model_kwargs)
    meta = _model(model, torch.device("meta"), seed, **model_kwargs)  # names only, no memory
    names = [canonical_name(meta, n) for n in variants] if variants else variant_names(meta)
    names.sort(key=lambda n: n != PLAIN)
    if OFFLOAD in names and card is None and dev.type == "cpu":
        raise ValueError("the offload variant moves saved tensors off a CUDA card; predict it "
                         "for one with --card h100 (or measure it with --device cuda)")
    built: list[Variant] = []
    if dev.type == "cuda":
        base = _model(model, dev, seed, **model_kwargs)
        built = build_variants(base, names)
    rows: list[dict] = []
    for budget in budgets:
        on_card = CardPredictor(model, budget, card, size, seed, **model_kwargs) \
            if card is not None else None
        for i, name in enumerate(names):
            row: dict[str, Any] = {"budget": _budget_label(budget), "budget_bytes": budget,
                                   "variant": name}
            if on_card is not None:
                b, seen = _card_search(on_card, name, row, probes, max_batch)
            elif dev.type == "cpu":
                b, seen = search_largest_batch(lambda n, v=name: predictor(v, n), budget, probes,
                                               max_batch)
                row["method"] = f"predicted (FakeTensorMode, {predictor.allocator} allocator)"
            else:
                b, seen = _measured_search(built, i, base, size, dev, budget, probes, max_batch)
                row["method"] = f"measured ({torch.cuda.get_device_name(dev)}, capped)"
                if check_prediction and b > 0:
                    predicted = predictor(name, b)
                    row["predicted_peak_bytes"] = predicted
                    row["prediction_error"] = (predicted - seen[b]) / seen[b]
            rows.append(_found(row, b, seen))
        _batch_ratios([r for r in rows if r["budget_bytes"] == budget])
    settings = {"card": named_card(card).name} if card is not None else {}
    return _payload("max_batch", model, dev, rows, budgets=list(budgets), size=size,
                    allocator=predictor.allocator, probes=list(probes), max_batch=max_batch,
                    seed=seed, model_kwargs=model_kwargs, **settings)


def _card_search(on_card: CardPredictor, name: str, row: dict, probes: tuple[int, int],
                 max_batch: int) -> tuple[int, dict[int, float]]:
    """The largest batch on the card, its predicted samples/s and step time into ``row``."""
    b, seen = search_largest_batch(lambda n: on_card.peak(name, n), on_card.budget, probes,
                                   max_batch)
    row["method"] = f"predicted ({on_card.card.name}, card model)"
    row["card"] = on_card.card.name
    step = on_card(name, b) if b else None
    row["step_s"] = step.time.step if step else None
    row["samples_per_s"] = b / step.time.step if step else None
    return b, seen


def _measured_search(built: list[Variant], i: int, base: ZooModel, size: int | None,
                     dev: torch.device, budget: int, probes: tuple[int, int],
                     max_batch: int) -> tuple[int, dict[int, float]]:
    """Real steps of ``built[i]`` on ``dev`` capped at ``budget`` (the others moved off it)."""
    v = built[i]
    others = {id(w.model): w.model for w in built if w.model is not v.model}
    for m in others.values():
        m.to("cpu")

    def step_at(n: int) -> Any:
        return training_step(v, base.example_input(n, size).to(dev))
    found = search_largest_batch(cuda_peak(step_at, budget, dev), budget, probes, max_batch)
    for m in others.values():
        m.to(dev)
    return found


def _found(row: dict, b: int, seen: dict[int, float]) -> dict:
    """``row`` with the batch found, its peak, the next batch's (None: out of memory), probes."""
    def finite(p: float | None) -> float | None:
        return None if p is None or p == math.inf else p
    row["largest_batch"] = b
    row["peak_bytes"] = seen.get(b) if b else None
    row["next_peak_bytes"] = finite(seen.get(b + 1))
    row["probes"] = {str(k): finite(v) for k, v in sorted(seen.items())}
    return row


def _batch_ratios(rows: list[dict]) -> None:
    """Each row's largest batch over plain's, under the same budget."""
    plain = next(r for r in rows if r["variant"] == PLAIN)
    for r in rows:
        r["batch_ratio"] = (r["largest_batch"] / plain["largest_batch"]
                            if plain["largest_batch"] else None)


def _budget_label(budget: int) -> str:
    """11000000000 -> ``11 GB`` (decimal, as cards are sold), 2**30 -> ``1.07 GB``."""
    return f"{budget / 1e9:.3g} GB" if budget >= 1e9 else f"{budget / 1e6:.3g} MB"


def run_segments(model: str, batch_size: int, device: str = "cpu", size: int | None = None,
                 segments: Sequence[int] | None = None, repeats: int = 5, warmup: int = 1,
                 fake: bool = False, seed: int = 0, **model_kwargs: Any) -> dict:
    """torch's and the zoo's ``checkpoint_sequential`` over the model's chain, per segments."""
    dev = _device(device)
    if fake and dev.type != "cpu":
        raise ValueError("--fake runs on the CPU (FakeTensorMode); drop --device cuda")
    with fake_mode(fake):
        net = _model(model, dev, seed, **model_kwargs)
        x = net.example_input(int(batch_size), size)
        rows = sweep_segments(net, x, segments, repeats=repeats, warmup=warmup, timed=not fake)
    return _payload("segments", model, dev, rows, batch_size=batch_size, size=size, fake=fake,
                    repeats=repeats, warmup=warmup, seed=seed, model_kwargs=model_kwargs,
                    chain_blocks=len(net.checkpoint_chain()))
