"""Benchmarks of the zoo's models: memory, time and the largest batch, checkpointed or not.

``scripts/benchmark.py`` is the command line; the pieces live here so tests and other scripts
reuse them:

* :mod:`.variants` builds the compared variants of one model (plain, torch's checkpoint as
  torchvision and timm use it, and each zoo checkpoint mode; on request compiled ones and timm's
  DenseNet), all from the same weights;
* :mod:`.measure` takes one training step of each: peak memory, FLOPs, interleaved median time,
  BatchNorm running-statistics error against plain;
* :mod:`.max_batch` finds the largest batch under a memory budget, predicted exactly on the CPU
  under ``FakeTensorMode`` or searched for on a real CUDA device (out-of-memory safe);
* :mod:`.segments` sweeps the number of segments of ``checkpoint_sequential`` (seed 000);
* :mod:`.overhead` times a checkpoint's own work per region on a chain of 100 tiny regions,
  eager and compiled (``scripts/bench_checkpoint.py --overhead``);
* :mod:`.suite` is the set of GPU figures, in parts (``scripts/bench_gpu.py``);
* :mod:`.report` prints Markdown tables and writes the JSON results.
"""
