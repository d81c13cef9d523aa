"""fit()'s named steps, each run alone on a tiny real run of cifar_cnn: locate_run, build_run,
run_directory, train_epoch, finish_epoch, save_epoch. A fault path is reached by calling the one
step it lives in (a stop request inside an epoch, non-finite weights at its end)."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from zoo.train.config import TrainConfig
from zoo.train.run_dir import load_checkpoint
from zoo.train.setup import Distributed
from zoo.train.loop import (RunStopped, StopSignal, build_run, finish_epoch, locate_run,
                          run_directory, save_epoch, train_epoch)


def start(path: Path, **kw):
    """Steps 1 and 2 of fit(): (the Run, whether it continues in place)."""
    cfg = TrainConfig(**{**dict(model="cifar_cnn", dataset="shapes", train_size=24, test_size=8,
                                batch_size=8, epochs=2, seed=6, out_dir=str(path)), **kw})
    env = Distributed()
    cfg, ckpt, here = locate_run(cfg, env)
    return build_run(cfg, env, torch.device("cpu"), lambda _m: None, ckpt), here


def test_the_steps_compose_to_an_epoch_and_release_the_lock(tmp_path):
    run, here = start(tmp_path / "run")
    with run_directory(run, here):
        assert (tmp_path / "run" / "train.lock").exists()
        stats = train_epoch(run, StopSignal())
        assert stats.seen == 24 and run.step == 3
        record = finish_epoch(run, stats)
        assert record["epoch"] == 1 and 0 <= record["test_acc"] <= 1
        save_epoch(run, record)
    assert not (tmp_path / "run" / "train.lock").exists()
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt["epoch"] == 1 and ckpt["history"] == [record] and ckpt["position"] is None


def test_train_epoch_saves_at_the_step_boundary_when_asked_to_stop(tmp_path):
    run, here = start(tmp_path / "run")
    stop = StopSignal()
    stop.signum = signal.SIGTERM  # as the handler would set it
    with run_directory(run, here), pytest.raises(RunStopped, match="stopped by SIGTERM") as e:
        train_epoch(run, stop)
    assert e.value.exit_code == 143
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt["step"] == 1 and ckpt["epoch"] == 0
    assert ckpt["position"]["batches_done"] == 1 and ckpt["position"]["seen"] == 8
    # Resumed, the epoch goes on from batch 2 with the totals of batch 1.
    resumed, here = start(tmp_path / "run", out_dir=None, resume=str(tmp_path / "run"))
    assert here and resumed.position["batches_done"] == 1
    with run_directory(resumed, here):
        stats = train_epoch(resumed, StopSignal())
    assert stats.seen == 24 and resumed.step == 3


def test_finish_epoch_refuses_non_finite_weights_and_saves_nothing(tmp_path):
    run, here = start(tmp_path / "run")
    with run_directory(run, here):
        stats = train_epoch(run, StopSignal())
        with torch.no_grad():
            run.model.out.weight[0, 0] = float("inf")
        with pytest.raises(RunStopped, match="training diverged.*no checkpoint was written"):
            finish_epoch(run, stats)
    assert not (tmp_path / "run" / "last.pt").exists()
