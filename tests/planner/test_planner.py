"""The memory planner (``zoo.plan``): its dynamic programme is exact (equal to brute force over
every schedule, on random chains and on a real toy model), its predicted peaks are what MemTracker
measures (within 5%, and within the budget) on ResNet-110 and DenseNet-BC-100, it recomputes no
more than blanket checkpointing, it refuses impossible budgets clearly, and train.py uses it
(``--memory_budget``, ``--batch_size auto``).

Peaks are measured with ``zoo.memory.cpu_peak_bytes`` (MemTracker) on one training step run under
``FakeTensorMode`` (``zoo.planner.measure_step``; byte-identical to a real CPU step, checked below
on the toy model), so the large models cost seconds.
"""
from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
from torch import nn

import zoo
from zoo.memory import count_flops, cpu_peak_bytes
from zoo.memory.step import peak_bytes
from zoo.models import ZooModel
from zoo.planner import (BudgetTooSmallError, ChainProfile, default_loss, least_peak, measure_step,
                         predict_peak, profile_chain, recompute_flops, smallest_peak,
                         solve_profile)
from zoo.planner.search.one_level import solve

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


def real_step(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(peak bytes by ``zoo.memory.cpu_peak_bytes``, FLOPs by ``count_flops``) of one real
    training step of ``model`` as configured."""
    def step() -> None:
        model.zero_grad(set_to_none=True)
        default_loss(model(x)).backward()

    peak = cpu_peak_bytes(step, [model])
    flops = count_flops(step)
    model.zero_grad(set_to_none=True)
    return peak, flops


# ---- brute force over every schedule ----

def all_schedules(n: int):
    """Every way to cut ``n`` units into segments, each stored or checkpointed."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        spans = list(zip(bounds, bounds[1:]))
        for flags in itertools.product((False, True), repeat=len(spans)):
            yield [(a, b, ck) for (a, b), ck in zip(spans, flags)]


def brute_force(p: ChainProfile) -> list[tuple[int, int, list]]:
    """(peak, recompute FLOPs, schedule) of every schedule."""
    return [(predict_peak(p, s), recompute_flops(p, s), s) for s in all_schedules(p.n_units)]


def assert_dp_equals_brute_force(p: ChainProfile, budgets: list[int]) -> None:
    table = brute_force(p)
    for budget in budgets:
        fitting = [cost for peak, cost, _ in table if peak <= budget]
        found = solve(p, budget)
        if not fitting:
            assert found is None, f"budget {budget}: the DP found {found}, no schedule fits"
            continue
        assert found is not None, f"budget {budget}: {len(fitting)} schedules fit, DP found none"
        segments, peak = found
        assert peak == predict_peak(p, segments) <= budget
        assert recompute_flops(p, segments) == min(fitting), f"budget {budget}: {segments}"
    assert smallest_peak(p) == min(peak for peak, _, _ in table)


def random_profile(rng: random.Random, n: int) -> ChainProfile:
    def ints(k: int, hi: int) -> list[int]:
        return [rng.randint(0, hi) for _ in range(k)]

    flops = ints(n, 100)
    return ChainProfile(
        block_names=[f"b{i}" for i in range(n)], units=[(i, i + 1) for i in range(n)],
        act=[0] + ints(n, 50), dgrad=[0] + ints(n, 50), saved=ints(n, 80),
        keeps_input=[rng.random() < 0.6 for _ in range(n)],
        keeps_output=[rng.random() < 0.3 for _ in range(n)],
        fwd_rise=ints(n, 60), fwd_rise_ckpt=ints(n, 60), bwd_rise=ints(n, 90), grads=ints(n, 20),
        flops=flops, recompute_flops=[rng.randint(0, f) for f in flops], base=rng.randint(0, 100),
        pre_peak=rng.randint(0, 150), tail_peak=rng.randint(0, 150), head_rise=rng.randint(0, 40),
        bwd_misc=rng.randint(0, 20), step_flops=3 * sum(flops) + 1)


def test_dp_equals_brute_force_on_random_chains():
    """Objective and feasibility both, at every budget where the answer can change (each
    schedule's peak, and one byte below it)."""
    rng = random.Random(0)
    for trial in range(60):
        p = random_profile(rng, rng.randint(1, 6))
        peaks = sorted({peak for peak, _, _ in brute_force(p)})
        assert_dp_equals_brute_force(p, [b + d for b in peaks for d in (-1, 0)])


# ---- a real toy chain ----

class ToyChain(ZooModel):
    """Linear layers of uneven widths with Tanh, in-place ReLU (merged into the layer before by the
    profile: same storage) and GELU between them: a chain whose blocks differ in what they save."""

    def __init__(self, widths: tuple[int, ...] = (24, 96, 16, 160, 48, 200, 8)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        acts = [nn.Tanh, lambda: nn.ReLU(inplace=True), nn.GELU]
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            layers += [nn.Linear(a, b), acts[i % 3]()]
        self.blocks = nn.Sequential(*layers)
        self.num_classes = self.num_features = widths[-1]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_plan is not None:
            return self.run_chain(self.checkpoint_chain(), x)
        return self.blocks(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return x

    def checkpoint_chain(self) -> list[nn.Module]:
        return list(self.blocks)

    def example_input(self, batch_size: int = 2, size: int | None = None) -> torch.Tensor:
        return torch.randn(batch_size, self.blocks[0].in_features)


@pytest.fixture(scope="module")
def toy() -> tuple[ToyChain, torch.Tensor, ChainProfile]:
    torch.manual_seed(0)
    model = ToyChain()
    x = model.example_input(32).requires_grad_()
    return model, x, profile_chain(model, x)


def test_toy_profile_merges_in_place_blocks_into_units(toy):
    model, _, p = toy
    assert p.n_blocks == 12
    assert len(p.units) == 10  # the two in-place ReLUs join the Linear before them
    assert all(p.block_names[b - 1] == "ReLU" for a, b in p.units if b - a == 2)


def test_dp_equals_brute_force_on_a_real_toy_chain(toy):
    _, _, p = toy
    peaks = sorted({peak for peak, _, _ in brute_force(p)})
    assert_dp_equals_brute_force(p, [b + d for b in peaks[:: max(1, len(peaks) // 40)]
                                     for d in (-1, 0)])


def test_toy_predictions_are_the_measured_peaks_and_flops(toy):
    """The prediction is byte-exact on the toy chain: for the DP's schedules at several budgets,
    and for the fake step against a real one (MemTracker counts the same bytes)."""
    model, x, p = toy
    plain_flops = measure_step(model, x)[1]
    plain = predict_peak(p, [(0, p.n_units, False)])
    low = smallest_peak(p)
    for f in (0.0, 0.2, 0.5, 0.8):
        result = solve_profile(p, int(low + f * (plain - low)))
        model.set_checkpoint_plan(result.segments)
        peak, flops = measure_step(model, x)
        assert peak == result.predicted_peak
        assert flops - plain_flops == result.recompute_flops
    x_real = x.detach().clone().requires_grad_()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        default_loss(model(x_real)).backward()

    model.zero_grad(set_to_none=True)
    assert peak_bytes(step, [model]) == measure_step(model, x_real)[0] == result.predicted_peak
    model.set_checkpoint_plan(None)


def test_plan_applies_the_schedule_and_prints_a_table(toy):
    model, x, p = toy
    plain = predict_peak(p, [(0, p.n_units, False)])
    budget = (smallest_peak(p) + plain) // 2
    result = zoo.plan(model, x, f"{budget / 1e6}MB")
    assert model.checkpoint_plan == result.segments
    assert result.predicted_peak <= budget < result.plain_peak
    assert any(ck for *_, ck in result.segments) and result.recompute_flops > 0
    table = str(result)
    assert "recomputed" in table and "saved" in table and "predicted peak" in table
    assert table.count("\n| ") == p.n_blocks  # a row per block (the header starts the table)
    model.set_checkpoint_plan(None)


def test_too_small_budget_names_the_smallest_feasible_and_changes_nothing(toy):
    model, x, p = toy
    least = least_peak([p])  # multi-level: below the one-level floor
    assert least < smallest_peak(p)
    with pytest.raises(BudgetTooSmallError, match=f"at least {least} bytes") as info:
        zoo.plan(model, x, least - 1)
    assert info.value.smallest == least
    assert model.checkpoint_plan is None
    assert zoo.plan(model, x, least).predicted_peak == least  # the smallest is feasible
    model.set_checkpoint_plan(None)


def test_budget_above_the_plain_peak_checkpoints_nothing(toy):
    model, x, p = toy
    plain = predict_peak(p, [(0, p.n_units, False)])
    for budget in (plain, "10GB"):
        result = zoo.plan(model, x, budget)
        assert result.segments == [(0, p.n_blocks, False)]
        assert result.recompute_flops == 0 and result.checkpointed_blocks == []
    model.set_checkpoint_plan(None)


# ---- the zoo's models ----

_PROFILED: dict[str, tuple[ZooModel, torch.Tensor, ChainProfile]] = {}


def profiled_model(name: str) -> tuple[ZooModel, torch.Tensor, ChainProfile]:
    """(model, batch of 2, profile), profiled once per pytest run (profiling takes seconds)."""
    if name not in _PROFILED:
        torch.manual_seed(0)
        model = zoo.create_model(name)
        x = model.example_input(2)
        _PROFILED[name] = model, x, profile_chain(model, x)
    return _PROFILED[name]


@pytest.fixture(params=["resnet110", pytest.param("densenet_bc_100", marks=pytest.mark.slow)])
def profiled(request) -> tuple[ZooModel, torch.Tensor, ChainProfile]:
    return profiled_model(request.param)


def test_measured_peak_is_within_5_percent_of_predicted_and_within_budget(profiled):
    model, x, p = profiled
    plain = predict_peak(p, [(0, p.n_units, False)])
    assert plain == real_step(model, x)[0]
    low = smallest_peak(p)
    assert low < 0.8 * plain
    for f in (0.0, 0.3, 0.7):
        result = solve_profile(p, int(low + f * (plain - low)))
        model.set_checkpoint_plan(result.segments)
        measured = real_step(model, x)[0]
        model.set_checkpoint_plan(None)
        assert measured <= result.budget, (f, result.segments)
        assert abs(measured - result.predicted_peak) <= 0.05 * result.predicted_peak, f


def test_with_room_to_spare_the_plan_recomputes_less_than_blanket_checkpointing():
    """At the peak ResNet-110's blanket ``halves`` checkpointing reaches, the plan fits and
    recomputes fewer FLOPs (measured: FlopCounterMode over a step). (Its recommended ``tapered``
    mode, which mixes block regions with bn_relu recompute, is cheaper than any block-level plan
    at its own peak: see docs/benchmarks/planner.md.)"""
    model, x, p = profiled_model("resnet110")
    plain_peak, plain_flops = real_step(model, x)
    model.set_grad_checkpointing("halves")
    blanket_peak, blanket_flops = real_step(model, x)
    model.set_grad_checkpointing(False)
    assert blanket_peak < plain_peak
    result = solve_profile(p, blanket_peak)
    model.set_checkpoint_plan(result.segments)
    peak, flops = real_step(model, x)
    model.set_checkpoint_plan(None)
    assert peak <= blanket_peak
    assert flops - plain_flops == result.recompute_flops < blanket_flops - plain_flops


def test_fake_measurement_is_the_real_one_for_blanket_checkpointing():
    """``measure_step`` (FakeTensorMode, what the benchmark uses for large batches) gives the same
    peak and FLOPs as a real step."""
    torch.manual_seed(0)
    model = zoo.create_model("resnet20", efficient=True)
    x = model.example_input(2)
    assert measure_step(model, x) == real_step(model, x)


# ---- train.py ----

def run_main(capsys, **flags) -> tuple[int, str, str]:
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = 0
    try:
        module.main(**flags)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


TINY = dict(model="resnet20", dataset="synthetic", train_size=16, test_size=8, epochs=1,
            device="cpu")


def test_train_batch_size_auto_picks_the_largest_batch_under_the_budget(capsys, tmp_path):
    code, out, err = run_main(capsys, **TINY, batch_size="auto", memory_budget="40MB",
                              out_dir=str(tmp_path / "run"))
    assert code in (0, None), err
    chosen = int(out.split("batch_size auto: ")[1].split()[0])
    model = zoo.create_model("resnet20", num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def plan_at(batch: int) -> zoo.Plan:
        return zoo.plan(model, torch.zeros(batch, 3, 32, 32), "40MB", apply=False, optimizer=opt,
                        loss_fn=lambda out: nn.functional.cross_entropy(
                            out, torch.zeros(out.shape[0], dtype=torch.long)))
    assert plan_at(chosen).predicted_peak <= 40_000_000
    with pytest.raises(BudgetTooSmallError):  # the largest
        plan_at(chosen + 1)
    assert "memory plan for memory_budget" in out and "predicted peak" in out
    assert f"batch_size: {chosen}" in (tmp_path / "run" / "config.yaml").read_text()


@pytest.mark.parametrize("card,budget", [(None, "20MB"), ("h100", "80MB")])  # + cuBLAS's
def test_train_amp_plans_the_whole_step_in_its_precision(capsys, tmp_path, card, budget):
    flags = dict(card=card) if card else {}
    code, out, err = run_main(capsys, **TINY, batch_size=16, memory_budget=budget, amp=True,
                              out_dir=str(tmp_path / "run"), **flags)
    assert code in (0, None), err
    where = "bf16 autocast (cuda)" if card else "bf16 autocast (cpu)"
    assert f"optimizer SGD, {where}" in out and "with SGD's state and step" in out


def test_train_memory_budget_too_small_and_auto_without_budget_are_clear_errors(capsys, tmp_path):
    code, out, err = run_main(capsys, **TINY, batch_size=8, memory_budget="3MB",
                              out_dir=str(tmp_path / "a"))
    assert code == 2 and "Traceback" not in err
    assert "smallest peak" in err and "Give --memory_budget" in err
    code, out, err = run_main(capsys, **TINY, batch_size="auto", out_dir=str(tmp_path / "b"))
    assert code == 2 and "--batch_size auto" in err and "--memory_budget" in err
    code, out, err = run_main(capsys, **TINY, memory_budget="ten gigs", out_dir=str(tmp_path / "c"))
    assert code == 2 and "memory_budget" in err


def test_every_zoo_model_exposes_a_chain_for_the_planner():
    for name in zoo.list_models():
        with torch.device("meta"):  # no memory, no initialisation cost
            model = zoo.create_model(name)
        chain = model.checkpoint_chain()
        assert len(chain) >= 2 and all(callable(block) for block in chain), name


def test_tied_weights_are_measured_once():
    """GPT-2's head shares the embedding's weight: the fake step shares its copy too, so its peak
    is the real step's."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(500, 64)
            self.head = nn.Linear(64, 500, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.wte(ids)))

    torch.manual_seed(0)
    model, ids = Tied(), torch.randint(0, 500, (4, 16))
    assert measure_step(model, ids) == real_step(model, ids)
