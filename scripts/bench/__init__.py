"""Benchmarks of the zoo's models: memory, time and the largest batch, checkpointed or not.

``python scripts/benchmark.py SUBCOMMAND`` is the command line (:mod:`.cli` registers the subcommands;
``python scripts/benchmark.py --help`` lists them). The pieces live here so tests and other code reuse
them:

* :mod:`.variants` builds the compared variants of one model (plain, torch's checkpoint as
  torchvision and timm use it, and each zoo checkpoint mode; on request compiled ones and timm's
  DenseNet), all from the same weights;
* :mod:`.measure` takes one training step of each: peak memory, FLOPs, interleaved median time,
  BatchNorm running-statistics error against plain;
* :mod:`.runs` and :mod:`.model_commands`: one model's variants, largest batch and segments;
* :mod:`.max_batch` finds the largest batch under a memory budget, predicted exactly on the CPU
  under ``FakeTensorMode`` or searched for on a real CUDA device (out-of-memory safe);
* :mod:`.segments` sweeps the number of segments of ``checkpoint_sequential``;
* :mod:`.chain`, :mod:`.overhead` and :mod:`.primitive` compare checkpoint implementations on a
  chain of blocks, per tiny region (eager and compiled), and inside the zoo's own models; the
  chain of regions they and the host-cost command measure is :mod:`.region_chain`'s;
* :mod:`.peers`, :mod:`.families` and :mod:`.outside`: exact peaks and FLOPs of each family's
  checkpoint modes beside timm's, and of torchvision, timm and Hugging Face models;
* :mod:`.planner_vs_uniform`, :mod:`.planner_modes`, :mod:`.planner_levels`,
  :mod:`.planner_time` and :mod:`.planner_vs_compile` (with :mod:`.compile_budget`): the planner
  against uniform segments, hand modes, one level, its FLOP plan and torch.compile's budget;
* :mod:`.suite` and :mod:`.gpu`: the set of GPU figures, in parts;
* :mod:`.report` prints Markdown tables and writes the JSON results; :mod:`.plots` draws them.
"""
