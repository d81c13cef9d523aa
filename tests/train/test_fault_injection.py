"""Kill the real training process (``python train.py``) at each point of the save path, or stop it
with SIGTERM/SIGINT between two steps, then ``--resume``: the run must end bit for bit where an
uninterrupted run ends (weights, optimizer, schedule, RNG states, metrics.jsonl lines).

The process is killed from inside, at a named point (``ZOO_FAULT``, read by zoo.train.run_dir), so
the
test is deterministic: SIGKILL after the temporary checkpoint is written (before the rename),
after the rename (before best.pt and metrics.jsonl), after the metrics line; SIGTERM and SIGINT
after a given optimizer step, which makes train.py save a mid-epoch checkpoint and exit 143/130.
cifar_cnn has dropout and BatchNorm, so RNG states and buffers must come back exactly too.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoo.train.run_dir import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
# 48 images in batches of 16: 3 steps an epoch, 3 epochs.
TINY = ["--model", "cnn", "--dataset", "shapes", "--train_size", "48", "--test_size", "16",
        "--batch_size", "16", "--epochs", "3", "--lr", "0.05", "--seed", "5", "--device", "cpu"]
TIMING_KEYS = {"images_per_s", "epoch_time_s", "peak_memory_bytes"}


def train(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ZOO_FAULT", None)
    if fault:
        env["ZOO_FAULT"] = fault
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def strip(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING_KEYS}


def metrics(run: Path) -> list[dict]:
    return [strip(json.loads(line)) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_tree(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_run(got: Path, want: Path) -> None:
    """Bit for bit: every tensor and number in last.pt but the timings and the run's place."""
    a, b = load_checkpoint(got), load_checkpoint(want)
    for key in ("model", "optimizer", "scheduler", "scaler", "rng", "epoch", "step", "best_acc",
                "position"):
        assert_same_tree(a[key], b[key], key)
    assert [strip(r) for r in a["history"]] == [strip(r) for r in b["history"]]
    assert metrics(got) == metrics(want)
    assert_same_tree(load_checkpoint(got / "best.pt")["model"],
                     load_checkpoint(want / "best.pt")["model"], "best.pt")
    assert not [p.name for p in got.iterdir() if p.name.endswith(".tmp") or p.name == "train.lock"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight") / "run"
    res = train("--out_dir", str(run))
    assert res.returncode == 0, res.stderr
    return run


@pytest.mark.parametrize("point, epoch", [("tmp_written", 2), ("renamed", 2),
                                          ("metrics_appended", 1), ("renamed", 1)])
def test_sigkill_on_the_save_path_then_resume_is_bitwise_the_straight_run(
        tmp_path, straight, point, epoch):
    run = tmp_path / "run"
    killed = train("--out_dir", str(run), fault=f"{point}:{epoch}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    saved = load_checkpoint(run)["epoch"]
    assert saved == (epoch - 1 if point == "tmp_written" else epoch)
    if point == "renamed":  # the metrics line of the saved epoch was never written
        assert len(metrics(run)) == epoch - 1
    resumed = train("--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming after epoch {saved}" in resumed.stdout
    assert_same_run(run, straight)


@pytest.mark.parametrize("sig, code, step", [("SIGTERM", 143, 4), ("SIGINT", 130, 2)])
def test_a_signal_saves_at_the_next_step_and_resume_is_bitwise(tmp_path, straight, sig, code,
                                                                step):
    run = tmp_path / "run"
    stopped = train("--out_dir", str(run), fault=f"step:{step}:{sig}")
    assert stopped.returncode == code, stopped.stderr
    message = stopped.stderr.strip().splitlines()[-1]
    assert message.startswith(f"train.py: stopped by {sig} in epoch ")
    assert f"after step {step}: saved" in message and "Traceback" not in stopped.stderr
    ckpt = load_checkpoint(run)
    assert ckpt["step"] == step and ckpt["position"]["batches_done"] == step % 3
    assert len(metrics(run)) == step // 3  # only finished epochs have a line
    resumed = train("--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert f"step {step} (inside epoch {step // 3 + 1})" in resumed.stdout
    assert_same_run(run, straight)


def test_sigterm_before_any_step_says_nothing_was_saved(tmp_path):
    """A signal while the run is being built: exit 143, and the message does not claim a save."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, sys, zoo.train.loop as t\n"
        "real = t.build_run\n"
        "def build(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(*a, **k)\n"
        "t.build_run = build\n"
        f"sys.argv = ['train.py', *{TINY!r}, '--out_dir', {str(run)!r}]\n"
        "import runpy; runpy.run_path('train.py', run_name='__main__')\n")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    assert "before the first step: nothing was saved" in err.strip().splitlines()[-1]
    assert not (run / "last.pt").exists()
