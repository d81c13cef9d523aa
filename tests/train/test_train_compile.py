"""train.py --compile with every --efficient value: it trains the model eager plain training
gives, and its runs resume.

The library-level runs compile with the ``aot_eager`` backend (Dynamo and AOTAutograd as for
inductor, eager kernels: seconds instead of minutes of C++ compilation on a CPU); one real
command-line run uses the default backend, inductor.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoo import _torch
from zoo.train.config import ConfigError, TrainConfig
from zoo.train.run_dir import load_checkpoint
from zoo.train.loop import fit
from helpers import quiet, tiny_run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


tiny = tiny_run  # tiny(path, **overrides): a tiny run


@pytest.fixture(scope="module")
def eager_plain(tmp_path_factory) -> dict[str, torch.Tensor]:
    """Weights after two epochs, eager, no checkpointing."""
    run = tmp_path_factory.mktemp("plain") / "run"
    fit(tiny(run, epochs=2), log=quiet)
    return load_checkpoint(run / "last.pt")["model"]


@pytest.mark.parametrize("efficient", [False, True, "halves", "block", "bn_relu"])
def test_compiled_run_of_every_efficient_value_resumes_and_equals_eager_plain(
        tmp_path, eager_plain, efficient):
    run = tmp_path / "run"
    torch._dynamo.reset()
    fit(tiny(run, epochs=1, compile="aot_eager", efficient=efficient), log=quiet)
    torch._dynamo.reset()  # a resumed run is a new process: nothing compiled yet
    fit(dataclasses.replace(tiny(None, epochs=2, compile="aot_eager", efficient=efficient),
                            resume=str(run)), log=quiet)
    got = load_checkpoint(run / "last.pt")
    assert got["epoch"] == 2
    for key, value in eager_plain.items():
        torch.testing.assert_close(got["model"][key], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{key}: {m}")


def test_compile_takes_true_false_or_a_backend_name_and_refuses_others():
    TrainConfig(model="cifar_cnn", compile="aot_eager").validate()
    with pytest.raises(ConfigError, match="compile must be True, False or a torch.compile "
                                          "backend .*inductor.*got 'inductr'"):
        TrainConfig(model="cifar_cnn", compile="inductr").validate()


def test_compile_with_a_memory_budget_is_refused_where_no_plan_survives_compile():
    both = dict(model="cifar_cnn", compile="aot_eager", memory_budget="1GB")
    with pytest.raises(ConfigError, match=r"^--offload keeps saved tensors in host memory, "
                                          r"[^\n]*drop --compile or --offload$"):
        TrainConfig(**both, card="h100", offload=True).validate()
    if not _torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES:
        TrainConfig(**both).validate()
        return
    with pytest.raises(ConfigError, match=r"^--memory_budget with --compile plans the compiled "
                                          r"step, which needs torch >= 2\.9 [^\n]*$"):
        TrainConfig(**both).validate()


@pytest.mark.slow
def test_command_line_compile_true_efficient_true_with_inductor(tmp_path):
    args = ["--model", "cifar_cnn", "--efficient", "True", "--compile", "True", "--dataset",
            "shapes", "--train_size", "16", "--test_size", "8", "--batch_size", "8", "--epochs",
            "1", "--device", "cpu", "--out_dir", str(tmp_path / "run")]
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True,
                          text=True, timeout=900, cwd=ROOT, env={**os.environ})
    assert done.returncode == 0, done.stderr[-2000:]
    assert load_checkpoint(tmp_path / "run" / "last.pt")["epoch"] == 1
