"""The planner's subcommands (``planner``, ``planner-modes``, ``planner-levels``,
``planner-time``, ``planner-vs-compile``, ``planner-promise``, ``planner-step``) end to end on
the CPU, on the zoo's CIFAR CNN and ResNet-20 at tiny batches: each writes its JSON with the machine and the command, and its
figures say what the planner promises (within the budget, never dearer than what it is
compared with). Not timed tests: times are only checked to be there."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench import cli
from helpers import needs_plans_for_compile
from zoo.models.cifar_cnn import CifarCNN

pytestmark = [pytest.mark.slow,  # benchmark commands end to end: the whole suite's lane
              pytest.mark.usefixtures("one_thread")]  # small CPU steps: one thread is fastest


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    """The planner subcommands set torch's threads (one or two); put them back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def bench(*args: object) -> None:
    """``python scripts/benchmark.py ARGS`` in this process; it must succeed."""
    assert cli.main([str(a) for a in args]) == 0


def test_planner_against_uniform_and_blanket(tmp_path: Path) -> None:
    bench("planner", "--models", "cifar_cnn", "--batches", "{cifar_cnn: 2}", "--points", 4,
          "--out_dir", tmp_path)
    data = json.loads((tmp_path / "results" / "bench_planner_cpu.json").read_text())
    assert data["meta"]["command"].startswith("python ") and data["meta"]["torch"]
    (r,) = data["results"]
    assert r["model"] == "cifar_cnn" and r["batch"] == 2
    assert r["smallest_peak"] <= r["plain_peak"] == r["plain_peak_measured"]
    assert r["goal"]["planner_never_worse"]
    for c in r["curve"]:
        assert c["planner_peak"] <= c["budget"] and c["planner"] >= 0
        assert c["uniform"] is None or c["planner"] <= c["uniform"] + 1e-12
    for m in r["max_batch"].values():
        assert m["planner"] >= m["plain"] >= 1
    assert (tmp_path / "img" / "planner_cpu.png").read_bytes()[:4] == b"\x89PNG"


def test_planner_modes_never_dearer_than_a_mode(tmp_path: Path) -> None:
    out = tmp_path / "modes.json"
    bench("planner-modes", "--models", "cifar_cnn", "--batch", 2, "--out", out)
    data = json.loads(out.read_text())
    assert data["command"].startswith("python ")
    (r,) = data["results"]
    assert {w["mode"] for w in r["rows"]} == set(CifarCNN.checkpoint_modes)
    for w in r["rows"]:  # at a mode's own peak the plan recomputes at most what the mode does
        assert w["plan_recompute"] is not None and w["plan_recompute"] <= w["mode_recompute"]
    for floor in r["floors"].values():
        assert 0 < floor["measured_ratio"] <= 1


def test_planner_levels_plans_fit_as_measured(tmp_path: Path) -> None:
    out = tmp_path / "levels.json"
    bench("planner-levels", "--models", "resnet20", "--batch", 2, "--budgets", "0.9", "--out", out)
    data = json.loads(out.read_text())
    (r,) = data["results"]
    assert r["least_nested_modes"] <= r["least_nested"] <= r["least_one_level"] < r["plain_peak"]
    assert [row["budget"] for row in r["rows"]][1:] == ["0.9x"]
    for row in r["rows"]:
        for key in ("one_level", "nested", "nested_modes"):
            if key in row:
                assert row[key]["peak"] <= row["budget_bytes"] and row[key]["recompute"] >= 0


def test_planner_time_reports_both_plans_within_the_budget(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    """The time plan against the FLOP plan (a GPU comparison) end to end on the CPU."""
    out = tmp_path / "time.json"
    bench("planner-time", "--models", "resnet20", "--batch", 4, "--device", "cpu", "--budgets",
          0.5, "--repeats", 1, "--out", out)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["plain"]["ratio"] == 1.0 and row["plain"]["recompute_flops"] == 0
    for cost in ("flops", "time"):
        assert row[cost]["peak"] <= row["budget"] < row["plain_peak"]
        assert row[cost]["recompute_flops"] > 0 and row[cost]["median_s"] > 0
    assert "| resnet20 (4) | " in capsys.readouterr().out


@needs_plans_for_compile
def test_planner_vs_compile_meets_torchs_peak(tmp_path: Path) -> None:
    out = tmp_path / "vs_compile.json"
    bench("planner-vs-compile", "--models", "cifar_cnn", "--batch", 2, "--fractions", "1.0",
          "--threads", 1, "--timing", "cifar_cnn", "--repeats", 1, "--out", out)
    data = json.loads(out.read_text())
    assert data["machine"]["torch"] == torch.__version__
    (timed,) = data["timing"]
    assert timed["median_seconds"] > 0 and timed["median_cpu_seconds"] > 0
    assert timed["least_peak_bytes"] == data["results"][0]["zoo_least"]["peak_bytes"]
    (r,) = data["results"]
    (row,) = r["rows"]
    assert row["fraction"] == 1.0 and row["torch_recompute_flops"] == 0
    assert row["zoo_peak_bytes"] <= row["torch_peak_bytes"]
    assert r["zoo_least"]["peak_bytes"] <= r["plain_peak_bytes"]


@needs_plans_for_compile
def test_planner_vs_compile_fake_gives_the_cpu_figures(tmp_path: Path) -> None:
    """``--fake True`` (torch's compiled steps and the compile-safe plans compiled, on the meta
    device) writes the rows, least peaks and verdict the CPU run writes."""
    runs = {}
    for fake in (False, True):
        out = tmp_path / f"fake_{fake}.json"
        bench("planner-vs-compile", "--models", "cifar_cnn", "--batch", 2, "--fractions",
              "1.0,0.3", "--threads", 1, "--fake", fake, "--out", out)
        (runs[fake],) = json.loads(out.read_text())["results"]
    assert runs[True].pop("fake") is True and runs[False].pop("fake") is False
    runs[True].pop("plan_seconds"), runs[False].pop("plan_seconds")
    assert runs[True] == runs[False]
    assert runs[True]["rows"][1]["torch_recompute_flops"] > 0
    assert runs[True]["zoo_least"]["zoo_compiled_peak_bytes"] is not None  # compiled, on meta


@needs_plans_for_compile
def test_planner_promise_measures_what_each_plan_predicts(tmp_path: Path, capsys) -> None:
    out = tmp_path / "promise.json"
    bench("planner-promise", "--models", "cifar_cnn", "--batch", 2, "--compiled", "cifar_cnn",
          "--compiled_fractions", "1.0", "--out", out)
    data = json.loads(out.read_text())
    assert data["command"].startswith("python ") and data["machine"]["torch"]
    m = data["models"]["cifar_cnn"]
    assert len(m["rows"]) >= 2 and m["rows"][0]["predicted"] == m["plain_peak_bytes"]
    assert all(r["measured"] == r["predicted"] <= r["budget"] for r in m["rows"])
    (c,) = m["compiled"]
    assert c["plan"] == "0/2 blocks, 0 levels" and not c["warns"]
    assert c["compiled"] <= c["predicted"] == m["plain_peak_bytes"]
    assert "| cifar_cnn | 2 | 1.000 |" in capsys.readouterr().out


def test_planner_step_predicts_the_whole_step_and_trains_like_plain(tmp_path: Path,
                                                                   capsys) -> None:
    out = tmp_path / "step.json"
    bench("planner-step", "--models", "resnet20", "--out", out)
    # the page's summary row, from the same rows
    assert "| resnet20 | 12 | 0 B | 12 of 12 | 12 of 12 bit for bit | 10 |" in \
        capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["command"].startswith("python ") and data["machine"]
    rows = data["rows"]
    assert {(r["optimizer"], r["precision"]) for r in rows} == {
        ("AdamW", "fp32"), ("AdamW", "bf16"), ("SGD", "fp32"), ("SGD", "bf16")}
    assert all(r["measured"] == r["predicted"] <= r["budget"] and r["exact"] for r in rows)


def test_offload_command_sets_offload_between_the_bound_and_recompute(tmp_path: Path) -> None:
    """One workload, one card: offload's least peak lies between the step's lower bounds and
    recompute's least, and at every budget the plan with offload is no slower than recompute
    alone (where that fits)."""
    out = tmp_path / "offload.json"
    assert cli.main(["offload", "--workloads", "ResNet-56 b128", "--cards", "h100", "--dtypes",
                     "fp32", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    least = row["offload"]["peak"]
    assert row["bound"] <= row["bound_with_engine"] <= least < row["recompute"]["peak"]
    assert row["offload"]["offloaded"] > 0 and row["save_on_cpu"]["peak"] == least
    for b in row["sweep"]:
        assert b["with_offload"]["peak"] <= b["budget"]
        if b["alone"] is not None:
            assert b["with_offload"]["ms"] <= b["alone"]["ms"]
    assert row["sweep"][0]["alone"] is None  # below recompute's floor only offload fits
