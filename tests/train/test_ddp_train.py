"""train.py under torchrun for real: two processes on gloo, on the CPU.

The run must finish; rank 0 alone prints and writes the run directory; both ranks end with
identical weights (train.py checks this with an all_gather of checksums and logs it); and the
weights equal those of a single-process run with the same global batch. That last equality holds
for a model without BatchNorm and dropout (per-rank BatchNorm normalises over half the batch, and
dropout draws per rank), so the test uses cifar_cnn with batch_norm=False, drop_rate=0.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoo.train.config import resolve_config
from zoo.train.run_dir import load_checkpoint
from zoo.train.loop import fit
from zoo.train.run_state import resume_seed

ROOT = Path(__file__).resolve().parents[2]
RECIPE = """\
model: cifar_cnn
model_kwargs: {batch_norm: false, drop_rate: 0.0}
dataset: shapes
train_size: 32
test_size: 12
batch_size: 16
epochs: 1
lr: 0.05
schedule: constant
seed: 3
"""


def test_torchrun_two_gloo_processes_match_one_process(tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(RECIPE)
    logs = tmp_path / "logs"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--log_dir", str(logs), "--redirects", "3",
           str(ROOT / "train.py"), "--config", str(recipe), "--device", "cpu",
           "--out_dir", str(tmp_path / "ddp")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env)
    rank_out = {int(p.parent.name): p.read_text() for p in logs.rglob("stdout.log")}
    assert res.returncode == 0, res.stderr[-3000:] + "\n".join(rank_out.values())

    assert sorted(rank_out) == [0, 1]
    # Rank 0 logs the run, rank 1 prints nothing (torch 2.8's gloo prints a line of its own on
    # each rank: "[Gloo] Rank 1 is connected to 1 peer ranks. ...").
    assert "resolved config" in rank_out[0] and "DDP over 2 processes" in rank_out[0]
    assert "weights identical on all 2 ranks: True" in rank_out[0]
    assert [line for line in rank_out[1].splitlines() if not line.startswith("[Gloo] ")] == []
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == [
        "best.pt", "config.yaml", "last.pt", "metrics.jsonl"]
    assert not (tmp_path / "runs").exists()  # rank 1 did not make a run directory of its own
    ddp = load_checkpoint(tmp_path / "ddp")
    assert len(ddp["rng"]) == 2 and ddp["step"] == 2  # 32 images, global batch 16

    # The same run in one process: same images per step (the sampler with one replica), the
    # whole global batch at once.
    cfg, _ = resolve_config({"config": str(recipe), "device": "cpu",
                             "out_dir": str(tmp_path / "single")}, None)
    fit(cfg, log=lambda _m: None)
    single = load_checkpoint(tmp_path / "single")
    assert ddp["model"].keys() == single["model"].keys()
    for k in single["model"]:
        # Gradients are averaged in a different order (per rank, then all_reduce): equal to
        # float32 rounding, not bitwise.
        torch.testing.assert_close(ddp["model"][k], single["model"][k], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{k}: {m}")
    # And training changed them (the comparison is not between two untouched initialisations).
    init = resolve_config({"config": str(recipe)}, None)[0]
    import zoo
    torch.manual_seed(init.seed)
    fresh = zoo.create_model("cifar_cnn", num_classes=10, **init.model_kwargs).state_dict()
    assert not torch.equal(fresh["out.weight"], single["model"]["out.weight"])


def _torchrun(tmp_path: Path, logs: str, *args: str, fault: str | None = None,
              timeout: int = 400) -> subprocess.CompletedProcess:
    """train.py under torchrun, 2 gloo processes; each rank's stdout and stderr in ``logs``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "--log_dir", str(tmp_path / logs), "--redirects", "3", str(ROOT / "train.py"),
           "--device", "cpu", *args]
    extra = {"ZOO_FAULT": fault} if fault else {}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **extra})


@pytest.fixture(scope="module")
def stopped_and_resumed(tmp_path_factory) -> Path:
    """A torchrun run of 12 steps stopped by SIGTERM (ZOO_FAULT signals both ranks after step 2;
    they agree at step 10, DDP_STOP_CHECK_EVERY), then resumed with torchrun --resume: the
    folder holding the run (``ddp``), the recipe and both runs' logs (``logs1``, ``logs2``)."""
    tmp_path = tmp_path_factory.mktemp("ddp-resume")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(RECIPE.replace("train_size: 32", "train_size: 192"))
    run = tmp_path / "ddp"
    _torchrun(tmp_path, "logs1", "--config", str(recipe), "--out_dir", str(run),
              fault="step:2:SIGTERM")
    res = _torchrun(tmp_path, "logs2", "--resume", str(run))
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp_path


def _rank_logs(folder: Path, name: str) -> dict[int, str]:
    return {int(p.parent.name): p.read_text() for p in folder.rglob(name)}


def test_torchrun_sigterm_saves_mid_epoch_on_every_rank_and_resumes(stopped_and_resumed):
    """Both ranks save step 10 and exit 143; torchrun --resume ends bit for bit where an
    uninterrupted torchrun run ends."""
    tmp_path = stopped_and_resumed
    err = _rank_logs(tmp_path / "logs1", "stderr.log")
    assert "stopped by SIGTERM in epoch 1 after step 10: saved" in err[0], err
    ckpt = load_checkpoint(tmp_path / "ddp" / "prev.pt")  # (last.pt: the finished epoch)
    assert ckpt["step"] == 10 and ckpt["position"]["batches_done"] == 10 and len(ckpt["rng"]) == 2

    straight = tmp_path / "straight"
    res = _torchrun(tmp_path, "logs3", "--config", str(tmp_path / "tiny.yaml"), "--out_dir",
                    str(straight))
    assert res.returncode == 0, res.stderr[-3000:]
    want, got = load_checkpoint(straight), load_checkpoint(tmp_path / "ddp")
    assert got["step"] == want["step"] == 12
    for k in want["model"]:  # gloo's all_reduce is deterministic: bit for bit
        assert torch.equal(got["model"][k], want["model"][k]), k
    for a, b in zip(got["rng"], want["rng"]):
        assert torch.equal(a["torch"], b["torch"])


def test_the_progress_bar_of_a_resumed_epoch_counts_its_images_once(stopped_and_resumed):
    """The bar's images/s at the resumed epoch's last step is the epoch's, as metrics.jsonl
    has it (all its images over its time, before and after the stop), not the images the
    ranks saw before the stop counted once per rank."""
    bar = _rank_logs(stopped_and_resumed / "logs2", "stderr.log")[0]
    shown = [float(x) for x in re.findall(r"img_s=(\d+)", bar)]
    assert shown, bar
    (record,) = [json.loads(x) for x in (stopped_and_resumed / "ddp" / "metrics.jsonl")
                 .read_text().splitlines()]
    assert 0.8 < shown[-1] / record["images_per_s"] < 1.25, (shown, record)


@pytest.mark.parametrize("case", ["new-run-into-a-run", "resume-forked-into-a-run"])
def test_a_refusal_on_rank_0_is_every_ranks_one_line_at_once(tmp_path, case):
    """Rank 0 alone checks the run directory (a new run into another run's files; a resume
    forked with --out_dir into them): every rank leaves with rank 0's one line, at once, where
    the others used to wait at the next collective (or die of the dropped connection)."""
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("another run's\n")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(RECIPE)
    if case == "new-run-into-a-run":
        args = ["--config", str(recipe), "--out_dir", str(taken)]
    else:
        cfg, _ = resolve_config({"config": str(recipe), "device": "cpu",
                                 "out_dir": str(tmp_path / "a")}, None)
        fit(cfg, log=lambda _m: None)
        args = ["--resume", str(tmp_path / "a"), "--out_dir", str(taken)]
    res = _torchrun(tmp_path, "logs", *args, timeout=120)
    assert res.returncode != 0
    err = {rank: [line for line in text.splitlines() if not line.startswith("[Gloo] ")]
           for rank, text in _rank_logs(tmp_path / "logs", "stderr.log").items()}
    line = (f"train.py: error: {str(taken)!r} already holds files (notes.txt) and a new run "
            f"never writes into another run's")
    assert sorted(err) == [0, 1] and err[0][0].startswith(line), err
    assert err[1] == err[0] == err[0][:1], err
    assert sorted(p.name for p in taken.iterdir()) == ["notes.txt"]


def test_a_resume_by_more_processes_gives_each_rank_its_own_random_numbers(tmp_path):
    """A one-process run resumed at its epoch boundary by two processes: rank r draws from
    resume_seed(seed, step, r), not both from the one saved state (every rank's dropout masks
    alike). The model draws no random numbers (no dropout), so each rank's state at the end is
    the seeded one, untouched."""
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(RECIPE)
    cfg, _ = resolve_config({"config": str(recipe), "device": "cpu",
                             "out_dir": str(tmp_path / "run")}, None)
    fit(cfg, log=lambda _m: None)
    saved = load_checkpoint(tmp_path / "run")
    assert len(saved["rng"]) == 1 and saved["step"] == 2
    res = _torchrun(tmp_path, "logs", "--resume", str(tmp_path / "run"), "--epochs", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = load_checkpoint(tmp_path / "run")
    assert resumed["epoch"] == 2 and len(resumed["rng"]) == 2
    for rank, state in enumerate(resumed["rng"]):
        torch.manual_seed(resume_seed(3, 2, rank))
        assert torch.equal(state["torch"], torch.get_rng_state()), rank
    assert not torch.equal(resumed["rng"][0]["torch"], resumed["rng"][1]["torch"])
