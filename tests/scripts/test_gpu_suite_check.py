"""The GPU suite refuses what it must not print as a figure: a failed row, a zoo variant that is
not the plain model (gradients, BatchNorm statistics), a precision asked for and missing. The
checks on made-up payloads, and ``gpu --smoke`` failing end to end on a variant that fails in
bfloat16 only."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import cli, suite
from bench.suite_check import problems


def _payload(rows: list[dict], dtypes: tuple[str, ...] = ("fp32", "bf16"),
             backend: str = "aot_eager") -> dict:
    return {"part": "densenet_b64", "rows": rows,
            "settings": {"dtypes": list(dtypes), "backend": backend}}


def _row(variant: str, dtype: str, **kw) -> dict:
    return {"model": "m", "batch_size": 2, "variant": variant, "dtype": dtype, "status": "ok",
            "bn_stats_error": 0.0, "bn_count_error": 0, "grad_error": 0.0, **kw}


def test_a_part_that_holds_has_no_problems():
    rows = [_row(v, d) for d in ("fp32", "bf16") for v in ("plain", "zoo bottleneck")]
    rows.append(_row("official", "fp32", bn_count_error=1, bn_stats_error=0.2))
    rows.append(_row("official", "bf16", bn_count_error=1, bn_stats_error=0.2))
    assert problems(_payload(rows)) == []


def test_a_failed_row_an_inexact_zoo_row_and_a_missing_precision_are_named():
    rows = [_row("plain", "fp32"), _row("plain", "bf16"),
            _row("zoo bottleneck", "fp32", grad_error=1e-7),
            _row("compiled zoo bottleneck", "fp32", status="failed", error="Boom: no"),
            _row("compiled zoo bottleneck", "bf16", bn_count_error=2)]
    found = problems(_payload(rows))
    assert found == [
        "densenet_b64: compiled zoo bottleneck (fp32) failed: Boom: no",
        "densenet_b64: zoo bottleneck (fp32) is not plain's: grad_error 1e-07",
        "densenet_b64: compiled zoo bottleneck (bf16) is not plain's: bn_count_error 2",
        "densenet_b64: no bf16 row for m, 2, zoo bottleneck"]


def test_compiled_rows_are_held_exact_only_where_the_backend_runs_the_same_kernels():
    rows = [_row("compiled plain", d, grad_error=3e-8) for d in ("fp32", "bf16")]
    assert problems(_payload(rows, backend="inductor")) == []
    assert len(problems(_payload(rows, backend="aot_eager"))) == 2


def test_zoo_checkpoint_in_the_overhead_chain_counts_batchnorm_once():
    rows = [{"checkpoint": c, "run_as": "eager", "dtype": "fp32", "status": "ok",
             "bn_count_after_one_step": n} for c, n in (("zoo.checkpoint", 2),
                                                        ("torch non-reentrant", 2))]
    payload = dict(_payload(rows, dtypes=("fp32",)), part="overhead")
    assert problems(payload) == ["overhead: zoo.checkpoint eager (fp32) counted BatchNorm "
                                 "2 times in one step"]


def test_gpu_smoke_fails_on_a_variant_that_fails_in_bf16(tmp_path: Path, monkeypatch, capsys):
    """End to end: one variant raising under autocast only makes ``gpu --smoke`` exit 2,
    naming the row, after writing the part with the failed row in it."""
    build = suite.build_variants

    def breaking(*args, **kwargs):
        variants = build(*args, **kwargs)
        (broken,) = [v for v in variants if v.name == "zoo selective"]

        def forward(x: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled("cpu"):
                raise RuntimeError("no bf16 kernel here")
            return broken.model(x)

        broken.forward = forward
        return variants

    monkeypatch.setattr(suite, "build_variants", breaking)
    threads = torch.get_num_threads()
    try:
        status = cli.main(["gpu", "--smoke", "--part", "bert", "--out_dir", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert status == 2
    assert "zoo selective (bf16) failed: RuntimeError: no bf16 kernel here" in err
    assert "(fp32) failed" not in err
    assert (tmp_path / "gpu_bert_smoke_cpu.json").exists()


def test_an_unknown_precision_is_one_line(capsys):
    assert cli.main(["gpu", "--smoke", "--dtype", "fp16"]) == 2
    assert capsys.readouterr().err.strip() == \
        "error: unknown --dtype 'fp16'; expected fp32, bf16 or both"


def test_a_whole_gpu_run_takes_every_part_the_uncompiled_first():
    """A lease that ends early keeps the parts that compile nothing."""
    from bench.gpu import FIRST_UNCOMPILED

    def compiles(part: str) -> bool:
        return part.startswith("overhead") or any(
            v.startswith(("compiled", "graphed"))
            for w in suite.workloads(False)[part] for v in w.variants)

    assert sorted(FIRST_UNCOMPILED) == sorted(suite.PARTS)
    flags = [compiles(p) for p in FIRST_UNCOMPILED]
    assert flags == sorted(flags) and not flags[0] and flags[-1]


def test_resume_skips_only_a_part_this_device_measured_and_that_holds(tmp_path: Path):
    from bench.gpu import done
    from bench.report import machine_info

    def write(problems: list, dtypes: list, torch_version: str = torch.__version__) -> None:
        machine = dict(machine_info(torch.device("cpu")), torch=torch_version)
        (tmp_path / "gpu_bert_cpu.json").write_text(json.dumps(
            {"machine": machine, "settings": {"dtypes": dtypes}, "problems": problems}))

    assert not done("bert", tmp_path, "cpu", ("fp32", "bf16"))  # nothing written yet
    write([], ["fp32", "bf16"])
    assert done("bert", tmp_path, "cpu", ("fp32", "bf16")) and done("bert", tmp_path, "cpu",
                                                                    ("bf16",))
    assert not done("resnet50", tmp_path, "cpu", ("fp32",))
    write(["bert: offload (bf16) is not plain's: grad_error 0.5"], ["fp32", "bf16"])
    assert not done("bert", tmp_path, "cpu", ("fp32",))  # a part that does not hold runs again
    write([], ["fp32"])
    assert not done("bert", tmp_path, "cpu", ("fp32", "bf16"))  # a precision missing
    write([], ["fp32", "bf16"], "2.0.0")
    assert not done("bert", tmp_path, "cpu", ("fp32",))  # another torch


def test_compile_ahead_runs_each_part_and_precision_apart_and_keeps_nothing_but_caches(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """``gpu --precompile``'s phase: real processes, one per (part, precision), two at a time;
    their tables go to a scratch folder that is removed, and a run that fails is named."""
    from bench.gpu import compile_ahead

    monkeypatch.chdir(tmp_path)
    seconds = compile_ahead(("overhead", "no_such_part"), ("fp32",), ["--smoke"], 2)
    out = capsys.readouterr().out
    assert seconds > 0
    assert "precompile: no_such_part (fp32) exited " in out
    assert "overhead (fp32) exited" not in out
    assert "precompile: 2 runs of overhead, no_such_part in" in out
    assert list(tmp_path.iterdir()) == []
