"""A training step's time on a named CUDA card, predicted from the ops a fake step dispatches.

Per op (:class:`~zoo.memory.cards.peak.OpRecord`), a roofline: the larger of its FLOPs over the
card's peak for its arithmetic and its bytes over the bandwidth; views cost nothing. The host's
time is ``python_ops x per_op + engine_ops x per_engine_op + regions x per_region``
(:class:`HostCost`, fitted by least squares on recorded host-cost rows: :func:`fit_host`); the
kernels reach a fraction of the data sheet's peaks (:class:`Achieved`, :func:`fit_achieved`).
The step takes the larger of the device's sum and the host's. Cards (:data:`CARDS`) carry their
published peaks; a :class:`Card` of your own numbers works the same. Which peak each op runs at,
and the cards' table: docs/benchmarks/prediction.md."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .peak import HOPPER_WORKSPACE, OLDER_WORKSPACE, OpRecord

__all__ = ["Card", "CARDS", "card", "PCIE_GEN4", "PCIE_GEN5", "HostCost", "H100_HOST",
           "Achieved", "ROOFLINE", "H100_ACHIEVED", "StepTime", "op_bound", "op_seconds",
           "device_parts", "device_seconds", "host_ops", "step_time", "fit_host", "fit_achieved"]

_aten = torch.ops.aten
_MATMULS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm}
_CONVS = {_aten.convolution, _aten.convolution_backward, _aten.cudnn_convolution}
_HALF = (torch.float16, torch.bfloat16)
PCIE_GEN4 = 32e9  # bytes/s one way, x16 link, as data sheets count it (31.5e9 after coding)
PCIE_GEN5 = 64e9  # twice Gen4's


@dataclass(frozen=True)
class Card:
    """A CUDA card's published numbers: dense peak FLOP/s on the CUDA cores in float32
    (``fp32``) and on the tensor cores in TF32 and bfloat16/float16, memory bandwidth in
    bytes/s, memory in bytes, compute capability, and ``host_link``: bytes/s in one direction
    between the card and the host's memory (what offloading to the host moves at; default a
    PCIe Gen4 x16 link, 32 GB/s each way), and ``sms``: its streaming multiprocessors, which
    inductor's scheduler reads (0: unknown; a compiled step is then not predicted)."""

    name: str
    fp32: float
    tf32: float
    bf16: float
    bandwidth: float
    memory: int
    capability: tuple[int, int]
    host_link: float = PCIE_GEN4
    sms: int = 0

    @property
    def workspace(self) -> int:
        """Bytes of one cuBLAS workspace torch allocates on this card by default."""
        return HOPPER_WORKSPACE if self.capability[0] >= 9 else OLDER_WORKSPACE


# NVIDIA's data sheets: H100 SXM5 (2022), H200 SXM (2024), A100 SXM4 80GB (2021), L4 (2023),
# and the Ada Lovelace architecture whitepaper for the RTX 4090; dense tensor peaks (not "with
# sparsity"). The H200 is the H100 SXM5's compute (its sheet: 67 TFLOP/s FP32, 989 TF32 and
# 1,979 BF16 "with sparsity") with 141 GB of HBM3e at 4.8 TB/s. Host links, one direction: PCIe
# Gen5 x16 for the H100 and H200 SXM (the sheets' "PCIe Gen5: 128GB/s" counts both), Gen4 x16
# for the others; a GH200's NVLink-C2C moves 450 GB/s each way (its sheet's 900 GB/s, both):
# a Card of its numbers with host_link=450e9. SMs: the H100 architecture whitepaper (132 on the
# SXM5, the H200's GH100 the same), the A100's (108), the Ada whitepaper (L4 58, RTX 4090 128).
CARDS: dict[str, Card] = {
    "h100": Card("NVIDIA H100 SXM5 80GB", 66.9e12, 494.7e12, 989.4e12, 3.35e12, 80 * 10**9,
                 (9, 0), PCIE_GEN5, 132),
    "h200": Card("NVIDIA H200 SXM 141GB", 66.9e12, 494.7e12, 989.4e12, 4.8e12, 141 * 10**9,
                 (9, 0), PCIE_GEN5, 132),
    "a100": Card("NVIDIA A100 SXM4 80GB", 19.5e12, 156e12, 312e12, 2.039e12, 80 * 10**9,
                 (8, 0), PCIE_GEN4, 108),
    "l4": Card("NVIDIA L4", 30.3e12, 60e12, 121e12, 300e9, 24 * 10**9, (8, 9), PCIE_GEN4, 58),
    "rtx4090": Card("NVIDIA GeForce RTX 4090", 82.6e12, 82.6e12, 165.2e12, 1008e9, 24 * 10**9,
                    (8, 9), PCIE_GEN4, 128),
}


def card(name: str | Card) -> Card:
    """The card named ``name`` (a key of :data:`CARDS`, any case), or ``name`` if a Card."""
    if isinstance(name, Card):
        return name
    found = CARDS.get(str(name).lower().replace(" ", "").replace("-", ""))
    if found is None:
        raise ValueError(f"unknown card {name!r}; expected one of {', '.join(CARDS)} or a "
                         f"zoo.memory.cards.Card of your card's own numbers")
    return found


@dataclass(frozen=True)
class HostCost:
    """Seconds the host spends per op issued from Python (the forward and a region's
    recompute), per op the autograd engine issues (the backward's own), and per checkpointed
    region of a step."""

    per_op: float
    per_engine_op: float
    per_region: float
    source: str = ""


# fit_host over docs/results/host_cost_cuda.json (NVIDIA H100 80GB HBM3 with 16 CPU cores,
# torch 2.11.0+cu130; 16 rows: DenseNet-BC-100 b64, ResNet-110 b8, ResNet-50 b8, plain and
# checkpointed), ops and regions counted here, as `python scripts/benchmark.py prediction`
# printed it (docs/results/prediction_h100.json).
H100_HOST = HostCost(32.59e-6, 12.79e-6, 166.4e-6,
                     "16 host-cost rows of an H100 machine (host_cost_cuda.json)")


@dataclass(frozen=True)
class StepTime:
    """A predicted step: the device's sum, the host's, ``link``: what the compute stream waits
    for offload copies on the host link (``zoo.checkpoint.offload_cost.link_wait``), and the
    step (the larger of the device's time with that wait and the host's)."""

    device: float
    host: float
    link: float = 0.0

    @property
    def step(self) -> float:
        return max(self.device + self.link, self.host)


@dataclass(frozen=True)
class Achieved:
    """The fraction of the data sheet's peak a card's kernels reach, by what bounds them:
    float32 matmuls and attention on the CUDA cores, convolutions on the tensor cores, memory
    bandwidth. 1.0 throughout is the plain roofline."""

    matmul: float = 1.0
    conv: float = 1.0
    memory: float = 1.0
    source: str = "data sheet (no fraction)"


ROOFLINE = Achieved()


def op_bound(record: OpRecord, on: Card) -> tuple[str, float]:
    """What bounds one op on card ``on`` (``"matmul"``, ``"conv"`` or ``"memory"``) and its
    roofline time at the data sheet's numbers (module docstring)."""
    if not record.bytes and not record.flops:
        return "memory", 0.0
    half = record.dtype in _HALF
    conv = record.op in _CONVS
    peak = on.bf16 if half else on.tf32 if conv else on.fp32
    compute, memory = record.flops / peak, record.bytes / on.bandwidth
    if compute >= memory:
        return ("conv" if conv else "matmul"), compute
    return "memory", memory


def op_seconds(record: OpRecord, on: Card, achieved: Achieved = ROOFLINE) -> float:
    """One op's time on card ``on``: its roofline time over the achieved fraction."""
    bound, seconds = op_bound(record, on)
    return seconds / getattr(achieved, bound)


def device_parts(records: Iterable[OpRecord], on: Card) -> dict[str, float]:
    """Roofline seconds of a step's ops summed by what bounds them."""
    parts = {"matmul": 0.0, "conv": 0.0, "memory": 0.0}
    for r in records:
        bound, seconds = op_bound(r, on)
        parts[bound] += seconds
    return parts


def device_seconds(records: Iterable[OpRecord], on: Card,
                   achieved: Achieved = ROOFLINE) -> float:
    return sum(t / getattr(achieved, k) for k, t in device_parts(records, on).items())


def step_time(records: Sequence[OpRecord], regions: int, on: str | Card,
              host: HostCost = H100_HOST, achieved: Achieved = ROOFLINE) -> StepTime:
    """The predicted time of a step that dispatched ``records`` and ran ``regions``
    checkpointed regions, on card ``on`` with ``host``'s costs and the ``achieved``
    fractions of the card's peaks (default: the plain roofline)."""
    python, engine = host_ops(records)
    return StepTime(device_seconds(records, card(on), achieved),
                    python * host.per_op + engine * host.per_engine_op
                    + regions * host.per_region)


def host_ops(records: Iterable[OpRecord]) -> tuple[int, int]:
    """The ops the host dispatches on the card (autograd's shallow copies left out): those
    issued from Python (forward, recompute) and those the autograd engine issues."""
    python = engine = 0
    for r in records:
        if not r.copy:
            if r.backward and not r.recompute:
                engine += 1
            else:
                python += 1
    return python, engine


def fit_achieved(rows: Iterable[tuple[dict[str, float], float]], source: str = "") -> Achieved:
    """Least-squares achieved fractions over ``rows`` of (:func:`device_parts`, measured
    seconds) of steps the device sets the pace of; a class no row exercises stays at 1."""
    rows = list(rows)
    keys = ("matmul", "conv", "memory")
    a = torch.tensor([[p[k] for k in keys] for p, _ in rows], dtype=torch.float64)
    b = torch.tensor([[s] for _, s in rows], dtype=torch.float64)
    free = a.abs().sum(0) > 0
    inverse = torch.ones(3, dtype=torch.float64)
    while free.any():  # least squares with every fraction at most 1: fix those past it at 1
        rest = b - a[:, ~free] @ inverse[~free].unsqueeze(1)
        inverse[free] = torch.linalg.lstsq(a[:, free], rest).solution.flatten()
        past = free & (inverse < 1)
        if not past.any():
            break
        inverse[past] = 1.0
        free &= ~past
    return Achieved(*(1 / inverse).tolist(), source=source)


# fit_achieved over the 21 recorded H100 rows whose roofline puts the device behind the host
# (`python scripts/benchmark.py prediction`, docs/results/prediction_h100.json): fitted on the
# rows it is then checked against (in-sample), said so wherever it is used. Convolutions came
# out at the TF32 peak (the bound), bandwidth-bound ops at 38% of it.
H100_ACHIEVED = Achieved(0.720, 1.0, 0.383, "21 device-bound H100 rows (in-sample)")


def fit_host(rows: Iterable[tuple[int, int, int, float]], source: str = "") -> HostCost:
    """Least-squares ``seconds = python x per_op + engine x per_engine_op + regions x
    per_region`` over ``rows`` of (python ops, engine ops, regions, seconds) measured where
    the host sets the pace."""
    rows = list(rows)
    a = torch.tensor([[float(x) for x in row[:3]] for row in rows], dtype=torch.float64)
    b = torch.tensor([[row[3]] for row in rows], dtype=torch.float64)
    fitted = torch.linalg.lstsq(a, b).solution.flatten().clamp(min=0.0).tolist()
    return HostCost(*fitted, source)
