"""Datasets for training: CIFAR-10/100 (torchvision), ``shapes`` (built in, offline) and ``synthetic``.

``shapes`` is a procedurally drawn 10-class image dataset: disks, rings, squares, frames, triangles,
diamonds, lines, plus signs, crosses and dot triples, each at a random position, size, rotation
and colour on a random background, with pixel noise. Every image is a pure function of
(seed, split, index), so it needs no files, no network, and is the same on every machine; a model
has to learn shape, not colour or position, to classify it. ``synthetic`` is random noise with
random labels: for measuring speed and memory, not for learning.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from .config import ConfigError

__all__ = ["DATASETS", "DatasetNotFoundError", "SeededDraws", "ShapesDataset",
           "SyntheticDataset", "build_datasets", "num_classes_of"]

SHAPE_CLASSES = ("disk", "ring", "square", "frame", "triangle", "diamond", "line", "plus",
                 "cross", "dots")
CIFAR_STATS = {  # per-channel mean and std of the training images
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
DATASETS = {  # name -> (classes, train size, test size)
    "shapes": (10, 2000, 500),
    "synthetic": (10, 50000, 10000),
    "cifar10": (10, 50000, 10000),
    "cifar100": (100, 50000, 10000),
}


class DatasetNotFoundError(ConfigError):
    """A dataset's files are missing and could not be downloaded."""


def num_classes_of(name: str) -> int:
    _check_name(name)
    return DATASETS[name][0]


def _check_name(name: str) -> None:
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)} "
                          f"(shapes is built in and works offline)")


def _bar(u: np.ndarray, v: np.ndarray, angle: float, half_len: float, half_w: float) -> np.ndarray:
    """Signed distance to a rectangle centred at 0, rotated by ``angle`` (negative inside)."""
    c, s = math.cos(angle), math.sin(angle)
    a, b = u * c + v * s, -u * s + v * c
    return np.maximum(np.abs(a) - half_len, np.abs(b) - half_w)


def draw_shape(label: int, rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """One ``size`` x ``size`` RGB image (float32 in [0, 1], HWC) of class ``label``."""
    y, x = (np.mgrid[0:size, 0:size].astype(np.float32) + 0.5) / size
    r = rng.uniform(0.2, 0.36)
    cx, cy = rng.uniform(0.5 - (0.45 - r), 0.5 + (0.45 - r), size=2)
    u, v = x - cx, y - cy
    theta = rng.uniform(0, 2 * math.pi)
    w = r * rng.uniform(0.18, 0.3)  # stroke half-width
    kind = SHAPE_CLASSES[label]
    if kind == "disk":
        sdf = np.hypot(u, v) - r
    elif kind == "ring":
        sdf = np.abs(np.hypot(u, v) - r) - w
    elif kind == "square":
        sdf = np.maximum(np.abs(u), np.abs(v)) - 0.85 * r
    elif kind == "frame":
        sdf = np.abs(np.maximum(np.abs(u), np.abs(v)) - 0.85 * r) - w
    elif kind == "triangle":
        sdf = np.max([u * math.cos(theta + 2 * math.pi * k / 3) + v * math.sin(theta + 2 * math.pi * k / 3)
                      for k in range(3)], axis=0) - 0.5 * r
    elif kind == "diamond":
        sdf = np.abs(u) + np.abs(v) - 1.1 * r
    elif kind == "line":
        sdf = _bar(u, v, theta, r, w)
    elif kind in ("plus", "cross"):
        tilt = rng.uniform(-0.2, 0.2) + (math.pi / 4 if kind == "cross" else 0.0)
        sdf = np.minimum(_bar(u, v, tilt, r, w), _bar(u, v, tilt + math.pi / 2, r, w))
    else:  # dots: three small disks inside the shape's box
        centres = rng.uniform(-r, r, size=(3, 2))
        sdf = np.min([np.hypot(u - a, v - b) for a, b in centres], axis=0) - 0.4 * r
    mask = np.clip(0.5 - sdf * size, 0.0, 1.0)[..., None]  # anti-aliased edge, one pixel wide
    bg = rng.uniform(0, 1, size=3)
    fg = rng.uniform(0, 1, size=3)
    while np.abs(fg - bg).max() < 0.4:  # keep the shape visible
        fg = rng.uniform(0, 1, size=3)
    img = bg * (1 - mask) + fg * mask + rng.normal(0, rng.uniform(0.0, 0.08), size=(size, size, 3))
    return np.clip(img, 0, 1).astype(np.float32)


class ShapesDataset(Dataset):
    """``length`` procedurally drawn images (classes balanced, ``index % 10``), each standardised
    to zero mean and unit variance; image ``i`` depends only on (seed, train, i)."""

    classes = SHAPE_CLASSES

    def __init__(self, length: int, train: bool = True, seed: int = 0, size: int = 32) -> None:
        self.length, self.split, self.seed, self.size = length, int(not train), seed, size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} images")
        label = index % len(SHAPE_CLASSES)
        rng = np.random.default_rng([self.seed, self.split, index])
        img = torch.from_numpy(draw_shape(label, rng, self.size)).permute(2, 0, 1)
        # Per-image standardisation: the random colours carry no label, so take them out.
        return (img - img.mean()) / (img.std() + 1e-3), label


class SyntheticDataset(Dataset):
    """Random normal images with random labels, a pure function of (seed, split, index)."""

    def __init__(self, length: int, num_classes: int = 10, train: bool = True, seed: int = 0,
                 size: int = 32) -> None:
        self.length, self.num_classes, self.split = length, num_classes, int(not train)
        self.seed, self.size = seed, size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} images")
        rng = np.random.default_rng([self.seed, self.split, index])
        img = rng.standard_normal((3, self.size, self.size), dtype=np.float32)
        return torch.from_numpy(img), int(rng.integers(self.num_classes))


class SeededDraws(Dataset):
    """``ds`` indexed by ``(epoch, index)``: item ``index`` is made with torch's RNG seeded from
    (seed, epoch, index), then the caller's RNG is put back. A training image's augmentation
    (CIFAR's crop and flip) is then a pure function of where it is in the run, whichever
    DataLoader worker makes it: a run resumed inside an epoch, or with another ``--workers``,
    draws what the straight run drew, and data loading never moves the dropout stream."""

    def __init__(self, ds: Dataset, seed: int) -> None:
        self.ds, self.seed = ds, seed

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key
        # the CPU generator alone (torch.manual_seed also seeds every device: 0.5 ms an image)
        rng = torch.default_generator
        kept = rng.get_state()
        rng.manual_seed(((self.seed * 1_000_003 + epoch) * 2_147_483_647 + index) % 2**64)
        try:
            return self.ds[index]
        finally:
            rng.set_state(kept)


def _cifar(name: str, root: str, train: bool, image_size: int | None, download: bool) -> Dataset:
    """torchvision's CIFAR with the standard augmentation (He et al. 2016: 4-pixel padding, random
    32x32 crop, horizontal flip) on the training split; both splits normalised."""
    from torchvision import datasets, transforms

    cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
    mean, std = CIFAR_STATS[name]
    steps = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if train else []
    steps += [transforms.ToTensor(), transforms.Normalize(mean, std)]
    if image_size is not None and image_size != 32:
        steps.append(transforms.Resize(image_size, antialias=True))
    folder = os.path.join(root, cls.base_folder)
    try:
        return cls(root, train=train, transform=transforms.Compose(steps), download=download)
    except (OSError, RuntimeError) as e:  # URLError is an OSError; a bad md5 a RuntimeError
        archive = cls.url
        raise DatasetNotFoundError(
            f"{name} is not in {folder!r} (or its files are incomplete)"
            + (f" and downloading it failed: {e}" if download else f": {e}")
            + f". What to do: on a machine with network access, download {archive} and extract it "
            f"into {str(Path(root))!r} so that {os.path.join(folder, cls.train_list[0][0])!r} "
            f"exists, or point --data_dir at the folder that holds {cls.base_folder}/. To train "
            f"without any files, use --dataset shapes.") from e


def build_datasets(name: str, data_dir: str = "data", train_size: int | None = None,
                   test_size: int | None = None, seed: int = 0, image_size: int | None = None,
                   download: bool = True) -> tuple[Dataset, Dataset, int]:
    """(train set, test set, number of classes) of dataset ``name``; ``train_size``/``test_size``
    keep only the first N images of a split (the procedural sets are generated at that length)."""
    _check_name(name)
    classes, n_train, n_test = DATASETS[name]
    n_train = train_size or n_train
    n_test = test_size or n_test
    size = image_size or 32
    if name == "shapes":
        return (ShapesDataset(n_train, True, seed, size), ShapesDataset(n_test, False, seed, size),
                classes)
    if name == "synthetic":
        return (SyntheticDataset(n_train, classes, True, seed, size),
                SyntheticDataset(n_test, classes, False, seed, size), classes)
    train = _cifar(name, data_dir, True, image_size, download)
    test = _cifar(name, data_dir, False, image_size, download)
    if train_size is not None and train_size < len(train):
        train = Subset(train, range(train_size))
    if test_size is not None and test_size < len(test):
        test = Subset(test, range(test_size))
    return train, test, classes
