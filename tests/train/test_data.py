"""Datasets: the built-in shapes and synthetic sets, and the real CIFAR loading path on files the
test writes in CIFAR's own format (python pickles).

torchvision checks each CIFAR file against the md5 sum of the published file, which test-written
files cannot match. The CIFAR tests therefore replace exactly one function, the md5 check
``torchvision.datasets.cifar.check_integrity``, by "the file exists"; everything else (the
``download=True`` path that returns early when the files are there, unpickling, reshaping to HWC,
PIL conversion, augmentation, normalisation) is torchvision's and zoo.train.data's real code.
"""
from __future__ import annotations

import os
import pickle
import urllib.error
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.datasets.cifar as tv_cifar

from zoo.train.config import ConfigError
from zoo.train.data import (CIFAR_STATS, DatasetNotFoundError, ShapesDataset, SyntheticDataset,
                      build_datasets, draw_shape)


def test_shapes_is_a_pure_function_of_seed_split_and_index():
    a, b = ShapesDataset(50, seed=3), ShapesDataset(50, seed=3)
    for i in (0, 7, 49):
        xa, ya = a[i]
        xb, yb = b[i]
        assert ya == yb and torch.equal(xa, xb)
    assert not torch.equal(a[7][0], ShapesDataset(50, seed=4)[7][0])
    assert not torch.equal(a[7][0], ShapesDataset(50, train=False, seed=3)[7][0])
    with pytest.raises(IndexError):
        a[50]


def test_shapes_are_balanced_varied_and_normalised():
    ds = ShapesDataset(200)
    xs, ys = zip(*(ds[i] for i in range(200)))
    x = torch.stack(xs)
    assert x.shape == (200, 3, 32, 32) and x.dtype == torch.float32 and torch.isfinite(x).all()
    assert Counter(ys) == {c: 20 for c in range(10)}
    assert abs(x.mean().item()) < 0.3 and 0.6 < x.std().item() < 1.6
    # Two images of one class differ (position, size, colour, noise), so the class is the shape.
    assert (x[0] - x[10]).abs().mean() > 0.1


def test_shapes_classes_differ_in_shape_not_only_colour():
    """Rendered on the same random draws, the ten classes give ten different masks."""
    ds = ShapesDataset(10, size=32)
    masks = []
    for label in range(10):
        img = draw_shape(label, np.random.default_rng(123), 32)
        masks.append(torch.from_numpy(img))
    for i in range(10):
        for j in range(i + 1, 10):
            assert (masks[i] - masks[j]).abs().sum() > 5, (ds.classes[i], ds.classes[j])


def test_synthetic_is_deterministic_and_shaped():
    ds = SyntheticDataset(20, num_classes=10, seed=1)
    x, y = ds[5]
    assert x.shape == (3, 32, 32) and 0 <= y < 10
    assert torch.equal(x, SyntheticDataset(20, num_classes=10, seed=1)[5][0])
    assert SyntheticDataset(4, size=64)[0][0].shape == (3, 64, 64)


def test_build_datasets_sizes_and_unknown_name():
    train, test, classes = build_datasets("shapes", train_size=30, test_size=12)
    assert (len(train), len(test), classes) == (30, 12, 10)
    assert build_datasets("shapes", image_size=48)[0][0][0].shape == (3, 48, 48)
    with pytest.raises(ConfigError, match="unknown dataset 'imagenet'.*shapes"):
        build_datasets("imagenet")


# ---- CIFAR: the real torchvision path on files written in the real format ----

def write_cifar(root: Path, name: str = "cifar10", per_file: int = 6, seed: int = 0) -> dict:
    """CIFAR's python-pickle files with random images; returns {file: (data, labels)}."""
    rng = np.random.default_rng(seed)
    cls = tv_cifar.CIFAR10 if name == "cifar10" else tv_cifar.CIFAR100
    folder = root / cls.base_folder
    folder.mkdir(parents=True)
    label_key, classes = ("labels", 10) if name == "cifar10" else ("fine_labels", 100)
    written = {}
    for file, _md5 in cls.train_list + cls.test_list:
        data = rng.integers(0, 256, size=(per_file, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, classes, size=per_file)]
        entry = {"batch_label": file, "data": data, label_key: labels,
                 "filenames": [f"img{i}.png" for i in range(per_file)]}
        if name == "cifar100":
            entry["coarse_labels"] = [v // 5 for v in labels]
        with open(folder / file, "wb") as f:
            pickle.dump(entry, f, protocol=2)
        written[file] = (data, labels)
    with open(folder / cls.meta["filename"], "wb") as f:
        pickle.dump({cls.meta["key"]: [f"class{i}" for i in range(classes)]}, f, protocol=2)
    return written


@pytest.fixture
def skip_md5(monkeypatch):
    """Accept test-written CIFAR files: the md5 check becomes an existence check (only that)."""
    monkeypatch.setattr(tv_cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))


@pytest.fixture
def offline(monkeypatch):
    """Make torchvision's download fail as it does without a network, and record the URL."""
    calls = []

    def fail(url, *args, **kwargs):
        calls.append(url)
        raise urllib.error.URLError("[Errno -2] Name or service not known (test: offline)")

    monkeypatch.setattr(tv_cifar, "download_and_extract_archive", fail)
    return calls


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_loads_real_format_files(tmp_path, skip_md5, offline, name):
    written = write_cifar(tmp_path, name)
    train, test, classes = build_datasets(name, str(tmp_path))
    assert offline == []  # files present: download=True does not touch the network
    assert classes == (10 if name == "cifar10" else 100)
    files = tv_cifar.CIFAR10.train_list if name == "cifar10" else tv_cifar.CIFAR100.train_list
    assert (len(train), len(test)) == (6 * len(files), 6)
    test_file = tv_cifar.CIFAR10.test_list[0][0] if name == "cifar10" else "test"
    data, labels = written[test_file]
    # The test split is not augmented: exactly (pixel / 255 - mean) / std, in CHW order.
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in CIFAR_STATS[name])
    expected = (torch.from_numpy(data[2].reshape(3, 32, 32)).float() / 255 - mean) / std
    x, y = test[2]
    assert y == labels[2]
    torch.testing.assert_close(x, expected)
    # The training split is augmented (crop with 4-pixel padding, flip), so draws differ.
    torch.manual_seed(0)
    views = torch.stack([train[0][0] for _ in range(8)])
    assert views.shape == (8, 3, 32, 32) and (views - views[0]).abs().amax() > 0
    assert train[0][1] == written[tv_cifar.CIFAR10.train_list[0][0] if name == "cifar10"
                                  else "train"][1][0]
    sub_train, sub_test, _ = build_datasets(name, str(tmp_path), train_size=5, test_size=4)
    assert (len(sub_train), len(sub_test)) == (5, 4)


def test_cifar_missing_offline_says_where_it_looked_and_what_to_do(tmp_path, offline):
    with pytest.raises(DatasetNotFoundError) as err:
        build_datasets("cifar10", str(tmp_path / "nowhere"))
    message = str(err.value)
    assert offline == [tv_cifar.CIFAR10.url]  # the real download path was taken
    assert str(tmp_path / "nowhere" / "cifar-10-batches-py") in message
    assert "cifar-10-python.tar.gz" in message and "--dataset shapes" in message
    assert isinstance(err.value, ConfigError)


def test_cifar_corrupted_files_are_reported(tmp_path, offline):
    write_cifar(tmp_path)  # random contents: the real md5 check rejects them
    with pytest.raises(DatasetNotFoundError, match="incomplete"):
        build_datasets("cifar10", str(tmp_path))


def test_cifar_augmentation_resumes_mid_epoch_with_loader_workers(tmp_path, skip_md5, offline,
                                                                 monkeypatch):
    """Each training image's crop and flip are drawn from (seed, epoch, index), not from a
    worker's stream: a run stopped inside an epoch with --workers 2 and resumed ends bit for
    bit where a straight run with --workers 0 ends."""
    import dataclasses
    import signal

    import zoo.train.loop as loop
    from zoo.train.config import TrainConfig
    from zoo.train.run_dir import load_checkpoint

    write_cifar(tmp_path / "data", per_file=8)  # 40 training images: 5 steps an epoch
    base = TrainConfig(model="cifar_cnn", dataset="cifar10", data_dir=str(tmp_path / "data"),
                       batch_size=8, epochs=2, lr=0.05, seed=3, schedule="constant")
    loop.fit(dataclasses.replace(base, workers=0, out_dir=str(tmp_path / "straight")),
             log=lambda _m: None)
    stopped = dataclasses.replace(base, workers=2, out_dir=str(tmp_path / "stopped"))
    real = loop.fault_point
    monkeypatch.setattr(loop, "fault_point", lambda point, at: os.kill(
        os.getpid(), signal.SIGTERM) if (point, at) == ("step", 7) else None)
    with pytest.raises(loop.RunStopped, match="after step 7"):
        loop.fit(stopped, log=lambda _m: None)
    monkeypatch.setattr(loop, "fault_point", real)
    loop.fit(dataclasses.replace(stopped, out_dir=None, resume=str(tmp_path / "stopped")),
             log=lambda _m: None)
    a, b = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "stopped")
    assert a["step"] == b["step"] == 10
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
