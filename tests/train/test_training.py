"""The training loop (zoo.train.loop.fit) on tiny runs of real zoo models: the run directory,
bitwise
resume (also after a crash mid-epoch), atomic writes, the learning-rate schedules, and checkpointed
training equal to plain training."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import zoo.train.data
import zoo.train.run_dir
from zoo.train.config import ConfigError, TrainConfig
from zoo.train.run_dir import atomic_save, load_checkpoint
from zoo.train.loop import fit, lr_factor

TIMING_KEYS = {"images_per_s", "epoch_time_s", "peak_memory_bytes"}


def tiny(tmp_path, name: str = "run", **kw) -> TrainConfig:
    """A run small enough for a test: 32 shapes, batches of 16, 2 epochs."""
    base = dict(model="cifar_cnn", dataset="shapes", train_size=32, test_size=16, batch_size=16,
                epochs=2, lr=0.05, out_dir=str(tmp_path / name), seed=1)
    base.update(kw)
    return TrainConfig(**base)


def quiet(_msg: str) -> None:
    pass


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def test_lr_schedules():
    cfg = TrainConfig(lr=0.1, schedule="step", milestones=[0.5, 0.75], gamma=0.1)
    f = lr_factor(cfg, 100)
    assert [f(i) for i in (0, 49, 50, 74, 75, 99)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    he = lr_factor(dataclasses.replace(cfg, warmup_iters=4, warmup_lr=0.01), 100)
    assert [he(i) for i in (0, 3, 4)] == pytest.approx([0.1, 0.1, 1.0])  # 0.01 / 0.1, then 0.1
    cos = lr_factor(dataclasses.replace(cfg, schedule="cosine", warmup_iters=10), 110)
    assert [cos(i) for i in (0, 9, 10, 60, 110)] == pytest.approx([0.1, 1.0, 1.0, 0.5, 0.0])
    assert lr_factor(dataclasses.replace(cfg, schedule="constant"), 10)(9) == 1.0


def test_an_epochs_lr_is_the_one_its_steps_trained_with(tmp_path):
    """2 steps an epoch, lr x0.1 after step 2: epoch 1 trained at 0.05 and says so (not the 0.005
    the scheduler holds for the next step); epoch 2 at 0.005."""
    fit(tiny(tmp_path, epochs=2, schedule="step", milestones=[0.5], gamma=0.1), log=quiet)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["lr"] for x in lines] == pytest.approx([0.05, 0.005])


def test_run_directory_holds_config_metrics_and_checkpoints(tmp_path):
    cfg = tiny(tmp_path, epochs=2, efficient=True)
    summary = fit(cfg, log=quiet)
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == ["best.pt", "config.yaml", "last.pt",
                                                     "metrics.jsonl", "prev.pt"]
    assert load_checkpoint(run / "prev.pt")["epoch"] == 1  # the epoch before last.pt's
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    for r in records:
        assert {"train_loss", "train_acc", "test_loss", "test_acc", "lr", "images_per_s",
                "peak_memory_bytes", "peak_memory_kind"} <= r.keys()
        assert r["images_per_s"] > 0 and r["peak_memory_bytes"] > 2**20
        assert r["peak_memory_kind"] == "cpu_peak_rss"
    assert records[0]["step"] == 2 and records[1]["step"] == 4
    ckpt = load_checkpoint(run)
    assert ckpt["model_name"] == "cifar_cnn" and ckpt["epoch"] == 2
    assert ckpt["model_args"] == {"num_classes": 10, "efficient": True}
    assert ckpt["config"]["out_dir"] == str(run) and len(ckpt["rng"]) == 1
    assert {"state", "param_groups"} <= ckpt["optimizer"].keys()
    assert ckpt["scheduler"]["last_epoch"] == 4
    best = load_checkpoint(run / "best.pt")
    assert best["best_acc"] == max(r["test_acc"] for r in records)
    assert summary["best_test_acc"] == best["best_acc"]
    assert "model: cifar_cnn" in (run / "config.yaml").read_text()
    # The saved weights are a plain state_dict of the registry model.
    model = zoo.create_model("cifar_cnn", **ckpt["model_args"])
    model.load_state_dict(ckpt["model"])
    assert [r["epoch"] for r in ckpt["history"]] == [1, 2]  # the metrics live in the checkpoint
    with pytest.raises(ConfigError, match="already holds files"):
        fit(cfg, log=quiet)


def test_resume_after_a_crash_mid_epoch_is_bitwise_the_straight_run(tmp_path, monkeypatch):
    """2 epochs straight == 1 epoch, a crash in the middle of epoch 2, then --resume (CPU, bitwise).
    cifar_cnn has dropout and BatchNorm, so the RNG states and buffers must be restored too."""
    straight = tiny(tmp_path, "straight")
    fit(straight, log=quiet)

    crashed = tiny(tmp_path, "crashed")
    calls, real_getitem = [0], zoo.train.data.ShapesDataset.__getitem__

    def crash_in_epoch_two(self, index):
        calls[0] += 1
        if calls[0] == 32 + 16 + 20:  # epoch 1 (32 train + 16 test images), then 20 into epoch 2
            raise RuntimeError("simulated crash")
        return real_getitem(self, index)

    monkeypatch.setattr(zoo.train.data.ShapesDataset, "__getitem__", crash_in_epoch_two)
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(crashed, log=quiet)
    monkeypatch.undo()
    run = tmp_path / "crashed"
    assert load_checkpoint(run)["epoch"] == 1  # the crash lost only the epoch it interrupted
    assert not [p for p in os.listdir(run) if p.endswith(".tmp")]

    fit(dataclasses.replace(crashed, resume=str(run), out_dir=None), log=quiet)
    a, b = load_checkpoint(tmp_path / "straight"), load_checkpoint(run)
    assert_same_state(a["model"], b["model"])
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert_same_state(sa, sb)
    assert a["scheduler"] == b["scheduler"] and a["step"] == b["step"] == 4
    assert torch.equal(a["rng"][0]["torch"], b["rng"][0]["torch"])
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING_KEYS}  # noqa: E731
    metrics = lambda p: [strip(json.loads(x)) for x in (p / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert metrics(run) == metrics(tmp_path / "straight")


def test_one_epoch_then_resume_one_more_equals_two_straight(tmp_path):
    """The literal form: a 1-epoch run extended by --resume --epochs 2 (a constant schedule, since
    a step or cosine schedule is laid out over the run's epochs and so changes with them)."""
    straight = tiny(tmp_path, "straight", schedule="constant", train_size=16, batch_size=8)
    fit(straight, log=quiet)
    first = tiny(tmp_path, "first", schedule="constant", train_size=16, batch_size=8, epochs=1)
    fit(first, log=quiet)
    fit(dataclasses.replace(first, resume=str(tmp_path / "first"), epochs=2), log=quiet)
    assert_same_state(load_checkpoint(tmp_path / "straight")["model"],
                      load_checkpoint(tmp_path / "first")["model"])


def test_resume_refuses_another_model_and_foreign_files(tmp_path):
    cfg = tiny(tmp_path, epochs=1)
    fit(cfg, log=quiet)
    with pytest.raises(ConfigError, match="is a run of cifar_cnn, not resnet20"):
        fit(dataclasses.replace(cfg, model="resnet20", resume=cfg.out_dir), log=quiet)
    torch.save({"weight": torch.zeros(2)}, tmp_path / "bare.pt")
    with pytest.raises(ConfigError, match="not a train.py run checkpoint"):
        load_checkpoint(tmp_path / "bare.pt")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable training checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
    with pytest.raises(ConfigError, match="nothing to resume"):
        load_checkpoint(tmp_path / "missing")


def test_atomic_save_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    atomic_save({"epoch": 1}, path)

    def broken_replace(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(zoo.train.run_dir.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_save({"epoch": 2}, path)
    monkeypatch.undo()
    assert torch.load(path)["epoch"] == 1
    assert os.listdir(tmp_path) == ["last.pt"]  # the temporary file was removed


def test_efficient_training_equals_plain_training(tmp_path):
    """--efficient changes memory, not results: same weights and BatchNorm statistics after
    training ResNet-20 checkpointed and plain (the checkpoint contract, through the real loop)."""
    small = dict(model="resnet20", epochs=1, train_size=16, test_size=8, batch_size=8)
    plain = tiny(tmp_path, "plain", efficient=False, **small)
    ckpt = tiny(tmp_path, "efficient", efficient=True, **small)
    fit(plain, log=quiet)
    fit(ckpt, log=quiet)
    a = load_checkpoint(tmp_path / "plain")["model"]
    b = load_checkpoint(tmp_path / "efficient")["model"]
    assert a.keys() == b.keys()
    for k in a:
        # (num_batches_tracked is an integer: compared exactly, 2 steps, not 4)
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert b["layer1.0.bn1.num_batches_tracked"].item() == 2  # 16 images, batches of 8: 2 steps


def test_model_and_input_problems_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="did you mean"):
        fit(tiny(tmp_path, model="resnet_20"), log=quiet)
    with pytest.raises(ConfigError, match="no checkpointing mode|mode"):
        fit(tiny(tmp_path, efficient="nonsense"), log=quiet)
    missing = tmp_path / "no_cifar"  # told before the dataset is looked for or fetched
    with pytest.raises(ConfigError, match="no checkpointing mode 'nonsense'"):
        fit(tiny(tmp_path, efficient="nonsense", dataset="cifar10", data_dir=str(missing)),
            log=quiet)
    assert not missing.exists()
    with pytest.raises(ConfigError, match="not an image model"):
        fit(tiny(tmp_path, model="bert_base"), log=quiet)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            fit(tiny(tmp_path, device="cuda"), log=quiet)
