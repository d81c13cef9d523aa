"""RevNet-110 rebuilding its activations trains as ResNet-110 does: the same training run
(zoo.train.loop.fit, the recipe below for both) on the built-in shapes data, at a small size
(16x16 images, 1000 of them, 6 epochs). ResNet-110 needs a small learning rate at the start (He
et al. 2016 warm it up at 0.01); both get 0.02. The reversible model must reach the ResNet's test
accuracy less 0.05 or better, and learn (chance is 0.1)."""
from __future__ import annotations

import pytest

from zoo.train.config import TrainConfig
from zoo.train.loop import fit

pytestmark = pytest.mark.slow  # two 110-layer networks trained for 60 steps: minutes


def test_revnet110_rebuilt_trains_as_resnet110_does(tmp_path):
    accuracy = {}
    for model in ("resnet110", "revnet110"):
        cfg = TrainConfig(model=model, efficient=True, dataset="shapes", image_size=16,
                          train_size=1000, test_size=500, batch_size=100, epochs=6,
                          optimizer="sgd", lr=0.02, momentum=0.9, nesterov=True,
                          weight_decay=5e-4, schedule="cosine", warmup_iters=0, seed=0,
                          device="cpu", out_dir=str(tmp_path / model))
        accuracy[model] = fit(cfg, log=lambda _msg: None)["final"]["test_acc"]
    assert accuracy["revnet110"] >= accuracy["resnet110"] - 0.05, accuracy
    assert accuracy["revnet110"] >= 0.15, accuracy
