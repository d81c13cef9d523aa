"""A card's GPU-suite measurements against the predictions filed before it ran.

``prediction --card NAME`` (any card but the H100, whose rows the constants were fitted on)
reads docs/results/prediction_before_NAME.json (:mod:`.prediction_before`, committed before the
card ran) and the suite's docs/results/gpu_<part>_NAME.json, and puts each measured row beside
its prediction: out of sample, since nothing was fitted on these rows. Goals: peaks within 3%,
steps within 15%, every ratio to plain within 0.10.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zoo.memory import format_bytes

__all__ = ["check_before"]

_KEY = ("part", "dtype", "model", "batch_size", "variant", "checkpoint", "run_as")


def _key(row: dict) -> tuple:
    return tuple(row.get(k) for k in _KEY)


def _measured(results: Path, tag: str) -> list[dict]:
    rows = []
    for path in sorted(results.glob(f"gpu_*_{tag}.json")):
        data = json.loads(path.read_text())
        rows += [dict(r, part=data["part"], source=path.name) for r in data["rows"]
                 if r.get("status", "ok") == "ok"]
    return rows


def _pct(p: float | None, m: float | None) -> str:
    return f"{(p / m - 1) * 100:+.1f}%" if p and m else "-"


def _plain(rows: list[dict], row: dict, key: str) -> float | None:
    for r in rows:
        if r.get("variant") == "plain" and all(r.get(k) == row.get(k)
                                                for k in ("part", "dtype", "model", "batch_size")):
            return r.get(key)
    return None


def check_before(card_name: str, results: Path) -> dict[str, Any]:
    """The table and the errors (module docstring); no measured rows: says so."""
    tag = card_name.lower()
    before_path = results / f"prediction_before_{tag}.json"
    if not before_path.exists():
        raise ValueError(f"no {before_path.name}: file the predictions first with "
                         f"`prediction --card {tag} --before`")
    before = json.loads(before_path.read_text())
    filed = {_key(r): r for r in before["rows"]}
    measured = [r for r in _measured(results, tag) if r.get("median_s") or r.get("peak_bytes")]
    lines = ["| source | precision | filed | part | model | batch | variant | peak measured | "
             "predicted | error | step measured | predicted | error | x plain measured | "
             "predicted | difference |", "|---|---|---|---|---|---:|---|---:|---:|---:|---:|"
             "---:|---:|---:|---:|---:|"]
    out = []
    for m in measured:
        p = filed.get(_key(m))
        if p is None or p.get("predicted_s") is None:
            continue
        ratio_m = m.get("median_s") / _plain(measured, m, "median_s") \
            if _plain(measured, m, "median_s") and m.get("median_s") else None
        ratio_p = p["predicted_s"] / _plain(before["rows"], p, "predicted_s") \
            if _plain(before["rows"], p, "predicted_s") else None
        row = {"source": m["source"], "dtype": m["dtype"], "part": m["part"],
               "model": m.get("model"), "batch_size": m.get("batch_size"),
               "variant": m.get("variant") or m.get("checkpoint"),
               "peak": m.get("peak_bytes"), "predicted_peak": p.get("predicted_peak_bytes"),
               "seconds": m.get("median_s"), "predicted_s": p["predicted_s"],
               "ratio_measured": ratio_m, "ratio_predicted": ratio_p}
        out.append(row)
        diff = f"{ratio_p - ratio_m:+.2f}" if ratio_m and ratio_p else "-"
        lines.append(
            f"| {m['source']} | {m['dtype']} | before (out of sample) | {m['part']} | "
            f"{row['model'] or '-'} | {row['batch_size']} | {row['variant']} | "
            f"{format_bytes(row['peak']) if row['peak'] else '-'} | "
            f"{format_bytes(row['predicted_peak']) if row['predicted_peak'] else '-'} | "
            f"{_pct(row['predicted_peak'], row['peak'])} | "
            f"{row['seconds'] * 1e3:.1f} ms | {row['predicted_s'] * 1e3:.1f} ms | "
            f"{_pct(row['predicted_s'], row['seconds'])} | "
            f"{f'{ratio_m:.2f}' if ratio_m else '-'} | {f'{ratio_p:.2f}' if ratio_p else '-'} | "
            f"{diff} |")
    if not out:
        lines = [f"No measured row of the {card_name} yet: {before_path.name} holds "
                 f"{len(before['rows'])} predictions filed at {before['code_commit'][:12]}."]
    return {"before": before_path.name, "rows": out, "table": "\n".join(lines)}
