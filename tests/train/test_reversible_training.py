"""RevNet-110 rebuilding its activations trains as ResNet-110 does: the same training run
(zoo.train.loop.fit, the recipe below for both) on the built-in shapes data, at a small size
(8x8 images, 3000 of them seen twice: fresh images rather than repeats, so that what is measured
is learning, not memorising; 240 steps of batch 25). AdamW at lr 1e-3 after a 20-step warm-up:
at this budget SGD leaves ResNet-110 near chance while Adam's per-parameter steps let both
learn (one thread, torch.manual_seed(0): ResNet-110 0.162, RevNet-110 0.226; at 16x16, four
times the work, 0.274 and 0.440). The reversible model must reach the ResNet's test accuracy
less 0.05 or better, and both must learn clear of chance (0.10): the comparison then means
something."""
from __future__ import annotations

import pytest

from zoo.train.config import TrainConfig
from zoo.train.loop import fit

pytestmark = pytest.mark.slow  # two 110-layer networks trained for 240 steps: minutes


def test_revnet110_rebuilt_trains_as_resnet110_does(tmp_path):
    accuracy = {}
    for model in ("resnet110", "revnet110"):
        cfg = TrainConfig(model=model, efficient=True, dataset="shapes", image_size=8,
                          train_size=3000, test_size=500, batch_size=25, epochs=2,
                          optimizer="adamw", lr=1e-3, momentum=0.9, weight_decay=5e-4,
                          schedule="cosine", warmup_iters=20, seed=0,
                          device="cpu", out_dir=str(tmp_path / model))
        accuracy[model] = fit(cfg, log=lambda _msg: None)["final"]["test_acc"]
    assert accuracy["revnet110"] >= accuracy["resnet110"] - 0.05, accuracy
    # ten classes, 500 test images: 0.14 is four standard errors above chance
    assert accuracy["resnet110"] >= 0.14, accuracy
    assert accuracy["revnet110"] >= 0.18, accuracy
