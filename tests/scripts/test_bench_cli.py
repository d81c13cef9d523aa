"""The one benchmark command: ``python scripts/benchmark.py`` lists
every subcommand with one line, refuse an unknown one in one line, and read flags as Fire does
(also without Fire, as on a bare GPU machine)."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import cli

pytestmark = pytest.mark.slow  # a benchmark command's code, end to end: the whole suite's lane

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_subcommand_on_one_line(capsys: pytest.CaptureFixture) -> None:
    for argv in ([], ["--help"], ["-h"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: python scripts/benchmark.py SUBCOMMAND")
        for name, fn in cli.SUBCOMMANDS.items():
            (line,) = [ln for ln in out.splitlines() if ln.split()[:1] == [name]]
            summary = line.split(None, 1)[1]
            assert summary == fn.__doc__.strip().splitlines()[0] and summary.endswith(".")
    assert {"variants", "max-batch", "segments", "plot", "checkpoint", "overhead", "primitive",
            "densenet", "resnet", "transformers", "outside", "planner", "planner-modes",
            "planner-levels", "planner-time", "planner-vs-compile", "gpu"} <= set(cli.SUBCOMMANDS)


def test_the_script_is_the_command(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sys, "argv", ["scripts/benchmark.py", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(ROOT / "scripts" / "benchmark.py"), run_name="__main__")
    assert done.value.code == 0 and capsys.readouterr().out == cli.usage() + "\n"


def test_unknown_subcommand_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["benchmark"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown subcommand 'benchmark'; expected one of variants, ")
    assert err.count("\n") == 1
    assert cli.main(["max_batch", "--model", "densenet41"]) == 2  # underscores work too
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "densenet40" in err and err.count("\n") == 1


def test_the_script_is_the_command_and_gpu_without_cuda_is_one_line() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the error is for machines without")
    done = subprocess.run([sys.executable, "scripts/benchmark.py", "gpu", "--part", "bert"],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2
    assert done.stderr.startswith("error: --device cuda but torch sees no CUDA device")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_flags_without_fire_read_as_fire_reads_them() -> None:
    def f(model: str = "a", batch_size: object = 64, fake: bool = False, check: bool = True,
          budget: str = "11GB", fractions: object = "1,0.5") -> None:
        """Example."""

    got = cli.parse_flags(f, ["--model", "resnet20", "--batch-size=16", "--fake", "--nocheck",
                              "--budget", "12GB", "--fractions", "0.3"])
    assert got == {"model": "resnet20", "batch_size": 16, "fake": True, "check": False,
                   "budget": "12GB", "fractions": 0.3}
    assert cli.parse_flags(f, ["--fake", "--model", "x"]) == {"fake": True, "model": "x"}
    with pytest.raises(ValueError, match="unexpected argument '--modle'; the flags are --model"):
        cli.parse_flags(f, ["--modle", "x"])
