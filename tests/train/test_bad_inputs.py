"""Every bad input to train.py: one line on stderr saying what was wrong and what to do, the exit
status (2 for usage), no traceback (unless --debug True), and an existing run directory left
byte for byte as it was. Table-driven: each row is one input a user gets wrong (a bad
value, a missing file, a wrong type); the run directory is a real finished run of cifar_cnn."""
from __future__ import annotations

import importlib.util
import os
import resource
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from zoo.train.config import ConfigError
from zoo.train.loop import fit

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(model="cifar_cnn", dataset="shapes", train_size=16, test_size=8, batch_size=8,
            epochs=1, seed=2)


def load_main():
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file and folder under ``folder`` (hidden ones too) by relative path: bytes, mode."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>")
            + oct(p.stat().st_mode).encode() for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    from zoo.train.config import TrainConfig

    run = tmp_path_factory.mktemp("finished") / "run"
    fit(TrainConfig(**TINY, out_dir=str(run)), log=lambda _m: None)
    return run


def _text_file(tmp: Path, name: str, data: bytes) -> str:
    path = tmp / name
    path.write_bytes(data)
    return str(path)


def _flip_a_byte(run: Path) -> None:
    """Flip one byte in the middle of the largest tensor's bytes inside last.pt (a zip file)."""
    path = run / "last.pt"
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    head = info.header_offset  # local header: 30 bytes, then the name and the extra field
    start = head + 30 + int.from_bytes(data[head + 26:head + 28], "little") \
        + int.from_bytes(data[head + 28:head + 30], "little")
    data[start + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(run: Path) -> None:
    data = (run / "last.pt").read_bytes()
    (run / "last.pt").write_bytes(data[: len(data) // 3])


# (id, flags given run=the run directory and tmp=a scratch folder, prepare(run), exit, message)
CASES = [
    ("lr-inf", lambda r, t: {"lr": float("inf")}, None, 2, "lr must be a finite number"),
    ("lr-nan-text", lambda r, t: {"lr": "nan"}, None, 2, "lr must be a finite number"),
    ("lr-zero", lambda r, t: {"lr": 0}, None, 2, "lr must be > 0"),
    ("weight-decay-negative", lambda r, t: {"weight_decay": -1}, None, 2,
     "weight_decay must be >= 0"),
    ("momentum-1.5", lambda r, t: {"momentum": 1.5}, None, 2, "momentum must be in [0, 1)"),
    ("seed-negative", lambda r, t: {"seed": -1}, None, 2, "seed must be in [0, 2**32)"),
    ("gamma-zero", lambda r, t: {"gamma": 0}, None, 2, "gamma must be > 0"),
    ("label-smoothing-1", lambda r, t: {"label_smoothing": 1}, None, 2, "label_smoothing must be"),
    ("epochs-zero", lambda r, t: {"epochs": 0}, None, 2, "epochs must be at least 1"),
    ("device-mps", lambda r, t: {"device": "mps"}, None, 2, "MPS is not available"),
    ("device-unknown", lambda r, t: {"device": "tpu"}, None, 2, "device must be auto, cpu"),
    ("memory-budget-words", lambda r, t: {"memory_budget": "lots"}, None, 2, "memory_budget"),
    ("unknown-key", lambda r, t: {"learning_rate": 0.1}, None, 2, "unknown key 'learning_rate'"),
    ("model-kwargs-num-classes", lambda r, t: {"model_kwargs": {"num_classes": 100}}, None, 2,
     "model_kwargs cannot set num_classes (100): train.py sets it to the dataset's classes"),
    ("model-kwargs-efficient", lambda r, t: {"model_kwargs": {"efficient": True}}, None, 2,
     "model_kwargs cannot set efficient (True): set it with --efficient"),
    ("model-kwargs-text", lambda r, t: {"model_kwargs": "depth=2"}, None, 2,
     "model_kwargs must be a mapping such as {depth: 2} (on the command line --model_kwargs"),
    ("model-kwargs-unknown", lambda r, t: {"model_kwargs": {"dept": 2}}, None, 2,
     "takes no argument 'dept'"),
    ("model-kwargs-no-blocks",
     lambda r, t: {"model": "rev_vit_cifar", "model_kwargs": {"depth": 0}}, None, 2,
     "depth must be an int >= 1 (the number of transformer blocks), got 0; fix that value"),
    ("model-kwargs-no-growth",
     lambda r, t: {"model": "densenet40", "model_kwargs": {"growth_rate": 0}}, None, 2,
     "growth_rate must be an int >= 1 (k, the channels each dense layer adds), got 0"),
    ("model-kwargs-image-side-not-trained-on",
     lambda r, t: {"model": "rev_vit_cifar", "model_kwargs": {"img_size": 64}}, None, 2,
     "model_kwargs img_size 64 builds rev_vit_cifar for that image side, but this run trains "
     "on 32 px images (--image_size, default 32); pass --image_size 64 as well"),
    ("config-not-utf8", lambda r, t: {"config": _text_file(t, "c.yaml", b"lr: \xff\xfe 0.1\n")},
     None, 2, "is not UTF-8 text"),
    ("config-yaml-error",
     lambda r, t: {"config": _text_file(t, "c.yaml", b"lr: [0.1\nepochs: 2\n")},
     None, 2, "is not valid YAML at line"),
    ("config-missing", lambda r, t: {"config": str(t / "none.yaml")}, None, 2,
     "cannot read config file"),
    ("out-dir-is-a-file", lambda r, t: {"out_dir": str(r / "config.yaml")}, None, 2, "is a file"),
    ("out-dir-under-a-file", lambda r, t: {"out_dir": str(r / "config.yaml" / "x")}, None, 2,
     "is a file"),
    ("new-run-into-a-run", lambda r, t: {"out_dir": str(r)}, None, 2, "already holds files"),
    ("resume-into-another-run", lambda r, t: {"resume": str(r), "out_dir": str(r.parent / "b")},
     lambda r: shutil.copytree(r, r.parent / "b"), 2, "already holds files"),
    ("resume-nothing", lambda r, t: {"resume": str(t / "nowhere")}, None, 2, "nothing to resume"),
    ("resume-without-a-path", lambda r, t: {"resume": True}, None, 2,  # `--resume` alone
     "--resume names a run directory or a checkpoint file (--resume runs/a"),
    ("resume-flipped-byte", lambda r, t: {"resume": str(r)}, _flip_a_byte, 2,
     "last.pt' is corrupt: its contents do not match the SHA-256 saved with it"),
    ("resume-truncated", lambda r, t: {"resume": str(r)}, _truncate, 2,
     "is not a readable training checkpoint"),
    ("resume-other-optimizer", lambda r, t: {"resume": str(r), "optimizer": "adamw"}, None, 2,
     "changed optimizer ('sgd' -> 'adamw')"),
    ("resume-other-batch-and-data", lambda r, t: {"resume": str(r), "batch_size": 4,
                                                   "dataset": "synthetic"}, None, 2,
     "changed dataset ('shapes' -> 'synthetic'), batch_size (8 -> 4)"),
    ("resume-other-model", lambda r, t: {"resume": str(r), "model": "resnet20"}, None, 2,
     "is a run of cifar_cnn, not resnet20"),
    ("resume-other-model-kwargs", lambda r, t: {"resume": str(r),
                                                 "model_kwargs": {"drop_rate": 0.2}}, None, 2,
     "changed model_kwargs ({} -> {'drop_rate': 0.2})"),
]


@pytest.mark.parametrize("make_flags, prepare, code, message",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_an_exit_status_and_changes_nothing(
        tmp_path, capsys, finished_run, make_flags, prepare, code, message):
    run = tmp_path / "runs" / "a"
    shutil.copytree(finished_run, run)
    if prepare is not None:
        prepare(run)
    flags = make_flags(run, tmp_path)
    if "resume" not in flags:
        flags = {**TINY, "out_dir": str(tmp_path / "runs" / "new"), **flags}
    before = snapshot(tmp_path / "runs")
    with pytest.raises(SystemExit) as exit_info:
        load_main()(**flags)
    err = capsys.readouterr().err
    assert exit_info.value.code == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("train.py: error: ") and message in lines[0], lines[0]
    assert snapshot(tmp_path / "runs") == before


def test_a_stray_positional_argument_is_refused_before_the_run(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "train.py"), "shapes", "--model", "cnn",
                          "--out_dir", str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert "unexpected argument(s) shapes" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()


def test_debug_true_shows_the_traceback(tmp_path):
    with pytest.raises(ConfigError, match="momentum must be in"):
        load_main()(**TINY, momentum=1.5, debug=True, out_dir=str(tmp_path / "run"))


def _small_files_only() -> None:  # (runs in the child: a "full disk" for files over 64 KiB)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE (POSIX)")
def test_a_full_disk_while_saving_is_one_line_and_leaves_no_temporary_file(tmp_path):
    """The kernel refuses the checkpoint's bytes (RLIMIT_FSIZE: EFBIG, as ENOSPC would)."""
    run = tmp_path / "run"
    args = [f"--{k}={v}" for k, v in TINY.items()]
    res = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "--out_dir", str(run)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         preexec_fn=_small_files_only, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 1, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: cannot write the run's files") and "Traceback" \
        not in res.stderr
    assert "File too large" in last
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.jsonl"]


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux sysfs")
def test_an_unwritable_out_dir_is_one_line(capsys):
    """sysfs refuses new folders even to root (where chmod-based tests would pass silently)."""
    with pytest.raises(SystemExit) as exit_info:
        load_main()(**TINY, out_dir="/sys/zoo-run-test/run")
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("train.py: error: cannot write into run directory '/sys/zoo-run-test")
