"""What a GPU-suite part must hold before its figures count: the checks ``gpu`` runs on every
part it writes (and the smoke test in CI runs on tiny sizes on the CPU).

* no failed row: a variant that fails is a row with its one-line error, and that is a defect,
  not a figure;
* exactness: zoo's variants (offload included) give plain's gradients and BatchNorm statistics
  and counts, bit for bit (compiled ones too where the backend runs the same kernels:
  ``aot_eager``); zoo's checkpoint in the overhead chain counts each BatchNorm once;
* every precision asked for: each row of one precision has its twin in every other.
"""
from __future__ import annotations

__all__ = ["problems"]

_EXACT = ("bn_stats_error", "bn_count_error", "grad_error")


def _key(row: dict) -> tuple:
    """A row's identity apart from its precision."""
    return tuple(row.get(k) for k in ("model", "batch_size", "variant", "checkpoint", "run_as",
                                       "budget_bytes"))


def _name(row: dict) -> str:
    what = row.get("variant") or f"{row.get('checkpoint')} {row.get('run_as')}"
    return f"{what} ({row.get('dtype', 'fp32')})"


def _inexact(row: dict, same_kernels: bool) -> list[str]:
    variant = row.get("variant") or ""
    checked = variant.startswith(("zoo", "offload")) or \
        (same_kernels and variant.startswith(("compiled", "graphed")))
    if not checked:
        return []
    return [f"{k} {row[k]}" for k in _EXACT if row.get(k) not in (None, 0, 0.0)]


def problems(payload: dict) -> list[str]:
    """The problems of one part's payload (``run_part``'s), one line each; none: it holds."""
    part, rows = payload["part"], payload["rows"]
    same_kernels = payload["settings"].get("backend") == "aot_eager"
    out = [f"{part}: {_name(r)} failed: {r.get('error')}" for r in rows
           if r.get("status") == "failed"]
    for r in rows:
        wrong = _inexact(r, same_kernels)
        if wrong:
            out.append(f"{part}: {_name(r)} is not plain's: {', '.join(wrong)}")
        if r.get("checkpoint") == "zoo.checkpoint" and r.get("status") == "ok" \
                and r.get("bn_count_after_one_step") not in (None, 1):
            out.append(f"{part}: {_name(r)} counted BatchNorm "
                       f"{r['bn_count_after_one_step']} times in one step")
    asked = payload["settings"].get("dtypes", ["fp32"])
    keys = {d: {_key(r) for r in rows if r.get("dtype", "fp32") == d} for d in asked}
    every = set().union(*keys.values()) if keys else set()
    for d in asked:
        for k in sorted(every - keys[d], key=str):
            out.append(f"{part}: no {d} row for {', '.join(str(v) for v in k if v is not None)}")
    return out
