"""The run directory's contract (DESIGN.md), each point on real tiny runs of cifar_cnn:
resume continues in the directory named; a new run never writes into another run's files; the
lock; checksums and going back one epoch; metrics rewritten from the checkpoint; config drift
refused by key; divergence stops the run; files honour the umask; stale temporary files go."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zoo.train.config import SAFE_ON_RESUME, ConfigError
from zoo.train.run_dir import CorruptCheckpointError, RunDir, atomic_write, load_checkpoint
from zoo.train.run_lock import RunBusyError, RunLock
from zoo.train.loop import RunStopped, fit
from helpers import quiet, tiny_run

ROOT = Path(__file__).resolve().parents[2]


tiny = tiny_run  # tiny(path, **overrides): a tiny run


def lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_checkpoint(a)["model"], load_checkpoint(b)["model"]
    return all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory) -> Path:
    """A finished 2-epoch run (used read-only: tests copy it)."""
    run = tmp_path_factory.mktemp("two") / "run"
    fit(tiny(run, epochs=2), log=quiet)
    return run


# ---- where a run writes ----

def test_resume_continues_in_the_directory_named_not_the_one_stored(tmp_path, two_epochs):
    """A copied run resumed from its copy writes into the copy; the original is untouched."""
    first = tmp_path / "first"
    fit(tiny(first, epochs=1), log=quiet)
    moved = tmp_path / "elsewhere" / "moved"
    shutil.copytree(first, moved)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    cfg = dataclasses.replace(tiny(None, epochs=2), resume=str(moved))
    summary = fit(cfg, log=quiet)
    assert summary["run_dir"] == str(moved)
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert [r["epoch"] for r in lines(moved)] == [1, 2]
    assert load_checkpoint(moved)["config"]["out_dir"] == str(moved)
    assert same_weights(moved, two_epochs)  # and it is the run it would have been


def test_resume_into_a_new_out_dir_forks_the_run(tmp_path, two_epochs):
    first = tmp_path / "first"
    fit(tiny(first, epochs=1), log=quiet)
    fork = tmp_path / "fork"
    fit(dataclasses.replace(tiny(fork, epochs=2), resume=str(first)), log=quiet)
    assert load_checkpoint(first)["epoch"] == 1 and len(lines(first)) == 1
    assert [r["epoch"] for r in lines(fork)] == [1, 2] and same_weights(fork, two_epochs)


def test_a_new_run_refuses_a_directory_with_files_unless_overwrite(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"already holds files \(notes.txt\).*--overwrite True"):
        fit(tiny(run), log=quiet)
    assert sorted(os.listdir(run)) == ["notes.txt"]
    fit(tiny(run, overwrite=True), log=quiet)
    assert load_checkpoint(run)["epoch"] == 1 and (run / "notes.txt").read_text() == "mine"
    first = (run / "last.pt").read_bytes()
    fit(tiny(run, overwrite=True, seed=5), log=quiet)  # replaces the run's files
    assert (run / "last.pt").read_bytes() != first and len(lines(run)) == 1


# ---- the lock ----

HOLD = """\
import sys, time
from zoo.train.run_lock import RunLock
lock = RunLock(sys.argv[1]); lock.acquire(); print("held", flush=True); time.sleep(120)
"""


def test_a_second_run_fails_at_once_naming_the_holder_and_a_dead_holders_lock_is_taken(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.perf_counter()
        with pytest.raises(RunBusyError, match=rf"in use by pid {holder.pid} on host \S+ "):
            fit(tiny(run), log=quiet)
        assert time.perf_counter() - started < 60  # at once, not after training
        assert sorted(os.listdir(run)) == ["train.lock"]  # it wrote nothing
    finally:
        holder.kill()  # SIGKILL: no clean-up, the lock file stays behind
        holder.wait()
    assert (run / "train.lock").exists()
    fit(tiny(run), log=quiet)  # the dead holder's lock is taken over
    assert not (run / "train.lock").exists() and load_checkpoint(run)["epoch"] == 1


def test_a_resume_of_a_live_run_is_refused_before_it_builds_data_or_model(tmp_path, two_epochs,
                                                                         monkeypatch):
    """The lock is taken once data and model are built; a resume of a run still training (or
    --overwrite True over one) must not build them first (a CIFAR download, minutes) only to
    be refused: it is refused at once, the run's files left as they were."""
    import zoo.train.run_state as run_state

    run = tmp_path / "run"
    shutil.copytree(two_epochs, run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    built = []
    monkeypatch.setattr(run_state, "build_datasets", lambda *a, **k: built.append(a) or 1 / 0)
    live = RunLock(run)
    live.acquire()
    try:
        with pytest.raises(RunBusyError, match=f"in use by pid {os.getpid()}"):
            fit(dataclasses.replace(tiny(None, epochs=3), resume=str(run)), log=quiet)
        with pytest.raises(RunBusyError, match=f"in use by pid {os.getpid()}"):
            fit(tiny(run, overwrite=True), log=quiet)
        assert built == []
        assert {p.name: p.read_bytes() for p in run.iterdir() if p.name != "train.lock"} == before
    finally:
        live.release()


def test_lock_in_one_process_twice_is_refused(tmp_path):
    a, b = RunLock(tmp_path), RunLock(tmp_path)
    a.acquire()
    with pytest.raises(RunBusyError, match=f"pid {os.getpid()}"):
        b.acquire()
    a.release()
    b.acquire()
    b.release()
    assert os.listdir(tmp_path) == []


# ---- integrity ----

def test_a_corrupt_last_pt_is_refused_by_name_and_prev_pt_goes_back_one_epoch(tmp_path,
                                                                              two_epochs):
    run = tmp_path / "run"
    shutil.copytree(two_epochs, run)
    ckpt = torch.load(run / "last.pt", weights_only=True)
    ckpt["model"]["out.bias"][0] += 1e-3  # a changed value, the checksum left as it was
    torch.save(ckpt, run / "last.pt")
    with pytest.raises(CorruptCheckpointError, match=rf"{run / 'last.pt'}' is corrupt.*"
                                                     rf"--resume {run / 'prev.pt'}"):
        fit(dataclasses.replace(tiny(None, epochs=2), resume=str(run)), log=quiet)
    prev = load_checkpoint(run / "prev.pt")
    assert prev["epoch"] == 1 and [r["epoch"] for r in prev["history"]] == [1]
    fit(dataclasses.replace(tiny(None, epochs=2), resume=str(run / "prev.pt")), log=quiet)
    assert same_weights(run, two_epochs) and [r["epoch"] for r in lines(run)] == [1, 2]


def test_going_back_to_an_epoch_that_was_best_keeps_the_better_best_pt(tmp_path, monkeypatch):
    """Epoch 1 (test accuracy 0.0) was the best when saved, epoch 2 (0.125) is best.pt now.
    --resume DIR/prev.pt goes back to epoch 1 and is stopped in its first step: best.pt must
    still hold epoch 2, not the epoch gone back to (its weights would be lost)."""
    run = tmp_path / "run"
    fit(tiny(run, epochs=2, seed=9), log=quiet)
    assert [r["test_acc"] for r in lines(run)] == [0.0, 0.125]
    best = (run / "best.pt").read_bytes()
    monkeypatch.setenv("ZOO_FAULT", "step:3:SIGTERM")  # (train.py's way to be stopped)
    with pytest.raises(RunStopped, match="stopped by SIGTERM in epoch 2 after step 3"):
        fit(dataclasses.replace(tiny(None, epochs=2, seed=9), resume=str(run / "prev.pt")),
            log=quiet)
    assert load_checkpoint(run)["step"] == 3
    assert (run / "best.pt").read_bytes() == best


def test_resume_rewrites_metrics_from_the_checkpoint(tmp_path, two_epochs):
    """A truncated, garbled or over-long metrics.jsonl is replaced by the checkpoint's lines."""
    run = tmp_path / "run"
    shutil.copytree(two_epochs, run)
    want = lines(two_epochs)
    (run / "metrics.jsonl").write_text(json.dumps(want[0]) + "\n" + '{"epoch": 2, "tra')
    fit(dataclasses.replace(tiny(None, epochs=2), resume=str(run)), log=quiet)
    assert lines(run) == want


# ---- config drift ----

def test_resume_refuses_changed_keys_by_name_and_allows_the_safe_ones(tmp_path, two_epochs):
    run = tmp_path / "run"
    shutil.copytree(two_epochs, run)
    base = dataclasses.replace(tiny(None, epochs=2), resume=str(run))
    with pytest.raises(ConfigError, match=r"changed lr \(0.05 -> 0.1\), momentum \(0.9 -> 0.5\)"):
        fit(dataclasses.replace(base, lr=0.1, momentum=0.5), log=quiet)
    assert set(SAFE_ON_RESUME) == {"epochs", "device", "workers", "efficient", "memory_budget",
                                   "card", "offload", "compile", "data_dir"}
    safe = dataclasses.replace(base, epochs=2, device="cpu", workers=0, efficient=True,
                               compile=False, data_dir=str(tmp_path / "elsewhere"))
    summary = fit(safe, log=quiet)
    assert summary["final"]["epoch"] == 2  # (nothing left to train; accepted)


def test_the_same_batch_size_auto_command_resumes_with_the_batch_auto_chose(tmp_path):
    """A requeued job repeats its command with --resume: ``--batch_size auto`` then means the
    batch auto chose for this run (saved in its config), not a drift and not a new search."""
    run = tmp_path / "run"
    cfg = tiny(run, batch_size="auto", memory_budget="60MB")
    fit(cfg, log=quiet)
    chosen = load_checkpoint(run)["config"]["batch_size"]
    assert isinstance(chosen, int)
    resumed = dataclasses.replace(cfg, out_dir=None, resume=str(run), epochs=2)
    assert fit(resumed, log=quiet)["final"]["epoch"] == 2
    assert load_checkpoint(run)["config"]["batch_size"] == chosen


# ---- divergence ----

def test_a_non_finite_loss_stops_the_run_keeps_the_last_good_checkpoint(tmp_path):
    """Epoch 1 trains at lr 0.05; a step schedule with gamma 1e30 makes epoch 2 diverge."""
    run = tmp_path / "run"
    cfg = tiny(run, epochs=2, schedule="step", milestones=[0.5], gamma=1e30)
    with pytest.raises(RunStopped, match=r"training diverged.*epoch 2.*still holds epoch 1") as e:
        fit(cfg, log=quiet)
    assert e.value.exit_code == 1
    assert load_checkpoint(run)["epoch"] == 1 and [r["epoch"] for r in lines(run)] == [1]
    for name in ("last.pt", "best.pt"):
        weights = load_checkpoint(run / name)["model"]
        assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())
    assert math.isfinite(lines(run)[0]["train_loss"])


def test_divergence_from_the_first_epoch_writes_no_checkpoint(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(RunStopped, match="no checkpoint was written"):
        fit(tiny(run, lr=1e30), log=quiet)
    assert not (run / "last.pt").exists() and not (run / "best.pt").exists()


# ---- files ----

@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_files_honour_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write(tmp_path / "f.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "f.txt").stat().st_mode & 0o777 == 0o666 & ~umask


def test_stale_temporary_files_are_removed_when_a_run_takes_the_directory(tmp_path, two_epochs):
    run = tmp_path / "run"
    shutil.copytree(two_epochs, run)
    (run / ".last.pt.abc123.tmp").write_bytes(b"half a checkpoint")
    d = RunDir(run)
    d.open(resuming_here=True, overwrite=False)
    d.close()
    assert not list(run.glob("*.tmp")) and not list(run.glob(".*.tmp"))


@pytest.mark.skipif(shutil.which("strace") is None or sys.platform != "linux",
                    reason="needs strace (Linux) to see the process's system calls")
def test_every_rename_into_the_run_directory_is_made_durable_by_a_directory_fsync(tmp_path):
    """A rename is an entry of the directory: fsyncing the file alone leaves it in the page
    cache, and a power cut may bring the old entry back. strace shows train.py's own system
    calls: each rename into the run directory is followed by an fsync of the directory (``-y``
    names an fd's path) before the next file is written."""
    run, log = tmp_path / "run", tmp_path / "strace.txt"
    cmd = ["strace", "-f", "-y", "-qq", "-e", "trace=rename,renameat,renameat2,fsync", "-o",
           str(log), sys.executable, str(ROOT / "train.py"), "--model", "cifar_cnn", "--dataset",
           "shapes", "--train_size", "16", "--test_size", "8", "--batch_size", "8",
           "--epochs", "1", "--out_dir", str(run)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode and "ptrace" in res.stderr:
        pytest.skip(f"strace cannot trace here: {res.stderr.strip()[:200]}")
    assert res.returncode == 0, res.stderr[-2000:]
    calls = [line.split(None, 1)[1] for line in log.read_text().splitlines()
             if str(run) in line and ("rename" in line or "fsync(" in line)]
    renamed = [c for c in calls if c.startswith("rename")]
    assert {Path(c.split('"')[3]).name for c in renamed} >= {"config.yaml", "metrics.jsonl",
                                                             "last.pt", "best.pt"}, calls
    for i, call in enumerate(calls):
        if call.startswith("rename"):
            assert i + 1 < len(calls) and calls[i + 1].startswith("fsync(") \
                and calls[i + 1].split("<", 1)[1].startswith(f"{run}>"), calls[i:i + 2]
