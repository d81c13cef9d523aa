"""Kill the real training process (``python train.py``) at each point of the save path, or stop it
with SIGTERM/SIGINT between two steps, then ``--resume``: the run must end bit for bit where an
uninterrupted run ends (weights, optimizer, schedule, RNG states, metrics.jsonl lines).

The process is killed from inside, at a named point (``ZOO_FAULT``, read by zoo.train.run_dir), so
the
test is deterministic: SIGKILL after the temporary checkpoint is written (before the rename),
after the rename (before best.pt and metrics.jsonl), after the metrics line; SIGTERM and SIGINT
after a given optimizer step, which makes train.py save a mid-epoch checkpoint and exit 143/130.
cifar_cnn has dropout and BatchNorm, so RNG states and buffers must come back exactly too; a
reversible RevNet (``--efficient True``: activations rebuilt in backward) goes through the same
kills, and through a SIGKILL in the middle of an epoch. A resume paused (SIGSTOP) just before
it takes the run's lock loses the directory to another resume that runs to the end.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from zoo.train.run_dir import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
# 48 images in batches of 16: 3 steps an epoch, 3 epochs.
MODELS = {"cnn": ["--model", "cnn"], "revnet38": ["--model", "revnet38", "--efficient", "True"],
          "rev_vit_d2": ["--model", "rev_vit_cifar", "--efficient", "True", "--model_kwargs",
                         "{depth: 2, embed_dim: 32, num_heads: 2}"]}  # (a variant's args, changed)
TINY = [*MODELS["cnn"], "--dataset", "shapes", "--train_size", "48", "--test_size", "16",
        "--batch_size", "16", "--epochs", "3", "--lr", "0.05", "--seed", "5", "--device", "cpu"]
TIMING_KEYS = {"images_per_s", "epoch_time_s", "peak_memory_bytes"}


def train(*args: str, fault: str | None = None, model: str = "cnn") -> subprocess.CompletedProcess:
    """train.py with the tiny run's flags for ``model``, then ``args``."""
    return train_only(*MODELS[model], *TINY[len(MODELS["cnn"]):], *args, fault=fault)


def train_only(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """train.py with ``args`` alone, one torch thread, ``ZOO_FAULT=fault``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ZOO_FAULT", None)
    if fault:
        env["ZOO_FAULT"] = fault
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args],
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
def straight(tmp_path_factory) -> Callable[[str], Path]:
    """The uninterrupted run of a model (made once per model)."""
    runs: dict[str, Path] = {}

    def run_of(model: str) -> Path:
        if model not in runs:
            run = tmp_path_factory.mktemp(f"straight-{model}") / "run"
            res = train("--out_dir", str(run), model=model)
            assert res.returncode == 0, res.stderr
            runs[model] = run
        return runs[model]
    return run_of


@pytest.mark.parametrize("model, point, epoch", [
    ("cnn", "tmp_written", 2), ("cnn", "renamed", 2), ("cnn", "metrics_appended", 1),
    pytest.param("cnn", "renamed", 1, marks=pytest.mark.slow)])  # the point again, epoch 1
def test_sigkill_on_the_save_path_then_resume_is_bitwise_the_straight_run(
        tmp_path, straight, model, point, epoch):
    run = tmp_path / "run"
    killed = train("--out_dir", str(run), fault=f"{point}:{epoch}", model=model)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    saved = load_checkpoint(run)["epoch"]
    assert saved == (epoch - 1 if point == "tmp_written" else epoch)
    if point == "renamed":  # the metrics line of the saved epoch was never written
        assert len(metrics(run)) == epoch - 1
    resumed = train("--resume", str(run), model=model)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming after epoch {saved}" in resumed.stdout
    assert_same_run(run, straight(model))


@pytest.mark.slow  # a reversible model resumed mid-epoch; the fast lane kills cnn runs
@pytest.mark.parametrize("model", ["revnet38"])
def test_sigkill_mid_epoch_then_resume_is_bitwise_the_straight_run(tmp_path, straight, model):
    """kill -9 after the first step of epoch 2: nothing is saved; the run resumes after epoch 1
    and ends where the straight run ends."""
    run = tmp_path / "run"
    killed = train("--out_dir", str(run), fault="step:4", model=model)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert load_checkpoint(run)["epoch"] == 1 and len(metrics(run)) == 1
    resumed = train("--resume", str(run), model=model)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after epoch 1" in resumed.stdout
    assert_same_run(run, straight(model))


@pytest.mark.parametrize("model, sig, code, step", [  # the fast lane: one signal, one model
    ("cnn", "SIGTERM", 143, 4),
    pytest.param("cnn", "SIGINT", 130, 2, marks=pytest.mark.slow),
    pytest.param("revnet38", "SIGTERM", 143, 4, marks=pytest.mark.slow)])
def test_a_signal_saves_at_the_next_step_and_resume_is_bitwise(tmp_path, straight, model, sig,
                                                                code, step):
    run = tmp_path / "run"
    stopped = train("--out_dir", str(run), fault=f"step:{step}:{sig}", model=model)
    assert stopped.returncode == code, stopped.stderr
    message = stopped.stderr.strip().splitlines()[-1]
    assert message.startswith(f"train.py: stopped by {sig} in epoch ")
    assert f"after step {step}: saved" in message and "Traceback" not in stopped.stderr
    ckpt = load_checkpoint(run)
    assert ckpt["step"] == step and ckpt["position"]["batches_done"] == step % 3
    assert len(metrics(run)) == step // 3  # only finished epochs have a line
    resumed = train("--resume", str(run), model=model)
    assert resumed.returncode == 0, resumed.stderr
    assert f"step {step} (inside epoch {step // 3 + 1})" in resumed.stdout
    assert_same_run(run, straight(model))


def _patched_train(patch: str, args: list[str], **popen) -> tuple[subprocess.Popen, str]:
    """train.py run in a subprocess after the Python ``patch`` (which imports ``sys``), one
    torch thread; its process, once ended, and its stderr."""
    code = (f"{patch}sys.argv = ['train.py', *{args!r}]\n"
            "import runpy; runpy.run_path('train.py', run_name='__main__')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)
    _out, err = proc.communicate(timeout=300)
    return proc, err


def test_sigterm_before_any_step_says_nothing_was_saved(tmp_path):
    """A signal while the run is being built: exit 143, and the message does not claim a save."""
    run = tmp_path / "run"
    proc, err = _patched_train(
        "import os, signal, sys, zoo.train.loop as t\n"
        "real = t.build_run\n"
        "def build(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(*a, **k)\n"
        "t.build_run = build\n", [*TINY, "--out_dir", str(run)])
    assert proc.returncode == 143, err
    assert "before the first step: nothing was saved" in err.strip().splitlines()[-1]
    assert not (run / "last.pt").exists()


def test_sigterm_to_the_process_group_with_loader_workers_saves_and_resumes(tmp_path, straight):
    """Ctrl-C, Slurm's scancel and systemd signal the whole process group, DataLoader workers
    too: they must leave the stop to the main process, which saves at the next step."""
    run = tmp_path / "run"
    proc, err = _patched_train(
        "import os, subprocess, sys, time, zoo.train.loop as t\n"
        "def fault(point, at):\n"
        "    if point == 'step' and at == 2:\n"
        "        group = f'-{os.getpgid(0)}'  # signalled by another process, as a shell does\n"
        "        subprocess.run(['kill', '-s', 'TERM', '--', group])\n"
        "        time.sleep(1)  # the rest of a step: the workers have the signal by now\n"
        "t.fault_point = fault\n", [*TINY, "--workers", "2", "--out_dir", str(run)],
        start_new_session=True)  # its own process group: the signal stays inside it
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM in epoch 1 after step 2: saved" in err.strip().splitlines()[-1]
    resumed = train("--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert_same_run(run, straight("cnn"))


def test_memory_flags_may_change_on_resume_and_the_run_stays_bitwise(tmp_path, straight):
    """A requeued job given a memory budget (and a card to size it for, offload allowed, the
    batch left to auto) after a stop inside epoch 2: the plan checkpoints part of the model,
    the batch is the saved 16, and the run ends bit for bit where the plain straight run ends."""
    run = tmp_path / "run"
    stopped = train("--out_dir", str(run), fault="step:4:SIGTERM")
    assert stopped.returncode == 143, stopped.stderr
    resumed = train("--resume", str(run), "--batch_size", "auto", "--memory_budget", "106MiB",
                    "--card", "h100", "--offload", "True")
    assert resumed.returncode == 0, resumed.stderr
    assert "| halves |" in resumed.stdout  # the plan recomputes part of the first block
    assert load_checkpoint(run)["config"]["batch_size"] == 16
    assert_same_run(run, straight("cnn"))


def test_epochs_may_change_on_resume_only_where_the_past_steps_keep_their_lr(tmp_path):
    """A run of 4 epochs (3 steps each; a step schedule: lr x0.1 at 50% and 75% of its steps)
    stopped after epoch 1: as 2 epochs its first milestone would fall on step 4, which the run
    has set to the full lr (refused, nothing changed); as 3 epochs steps 1-4 keep their lr, and
    the resumed run is bit for bit the straight 3-epoch run."""
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert train("--out_dir", str(straight), "--schedule", "step").returncode == 0
    stopped = train("--out_dir", str(run), "--schedule", "step", "--epochs", "4",
                    fault="step:3:SIGTERM")
    assert stopped.returncode == 143, stopped.stderr
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    refused = train("--resume", str(run), "--epochs", "2")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert ("cannot resume" in refused.stderr and "--epochs 2" in refused.stderr
            and "learning rate" in refused.stderr), refused.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    resumed = train("--resume", str(run), "--epochs", "3")
    assert resumed.returncode == 0, resumed.stderr
    assert_same_run(run, straight)


def test_a_resume_that_loses_the_race_for_the_lock_never_trains_from_an_older_checkpoint(
        tmp_path):
    """Two jobs resume one run (a requeue racing its own restart): the late one reads last.pt
    (epoch 1) and, before it takes the lock, the other takes it, trains to epoch 3 and ends.
    The late one then holds the lock over a newer last.pt than it restored: it must stop in one
    line and leave the finished run as it is, not train from epoch 1 again over it."""
    run = tmp_path / "run"
    stopped = train("--out_dir", str(run), "--schedule", "constant", fault="step:3:SIGTERM")
    assert stopped.returncode == 143, stopped.stderr
    late = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *TINY, "--resume", str(run), "--epochs", "2"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "ZOO_FAULT": "lock::SIGSTOP"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert os.WIFSTOPPED(os.waitpid(late.pid, os.WUNTRACED)[1])  # paused before the lock
        first = train("--resume", str(run))
        assert first.returncode == 0, first.stderr
        finished = {p.name: p.read_bytes() for p in run.iterdir()}
        assert load_checkpoint(run)["epoch"] == 3
        os.kill(late.pid, signal.SIGCONT)
        _out, err = late.communicate(timeout=300)
    finally:
        late.kill()
    assert late.returncode == 2, err
    assert err.count("\n") == 1 and "changed while this run was starting" in err, err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == finished


def test_model_kwargs_set_the_architecture_and_a_bare_resume_rebuilds_it(tmp_path, straight):
    """--model_kwargs overrides a variant's architecture arguments, as zoo.create_model's keywords
    do (rev_vit_cifar at depth 2, width 32, 2 heads). The same run from a recipe file, stopped by
    SIGTERM inside epoch 2, resumes with --resume alone into that architecture and ends bit for
    bit where the straight run (flags) ends; a resume with other model_kwargs is refused in one
    line naming the key, the run left as it was."""
    import zoo

    recipe, run = tmp_path / "rev_vit_d2.yaml", tmp_path / "run"
    recipe.write_text("model: rev_vit_cifar\nefficient: true\n"
                      "model_kwargs: {depth: 2, embed_dim: 32, num_heads: 2}\n")
    stopped = train_only("--config", str(recipe), *TINY[len(MODELS["cnn"]):], "--out_dir",
                         str(run), fault="step:4:SIGTERM")
    assert stopped.returncode == 143, stopped.stderr
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    refused = train_only("--resume", str(run), "--model_kwargs", "{depth: 3}")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "changed model_kwargs" in refused.stderr and "'depth': 3" in refused.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    resumed = train_only("--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert "step 4 (inside epoch 2)" in resumed.stdout
    assert_same_run(run, straight("rev_vit_d2"))
    want = zoo.create_model("rev_vit_cifar", num_classes=10, depth=2, embed_dim=32, num_heads=2)
    got = load_checkpoint(run)["model"]
    assert {k: v.shape for k, v in got.items()} == {
        k: v.shape for k, v in want.state_dict().items()}
    assert len(got) < len(zoo.create_model("rev_vit_cifar").state_dict())
