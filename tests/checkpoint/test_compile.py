"""zoo.checkpoint under torch.compile: one graph (fullgraph=True), and the checkpoint contract.

Every test compiles the checkpointed model and compares it over three SGD steps, in train mode,
with the *eager, uncheckpointed* model: outputs, gradients, parameters and buffers (BatchNorm
``running_mean``/``running_var``/``num_batches_tracked`` updated exactly once per forward).
float64 keeps the comparison tight (compiled float32 differs from eager by rounding).

Most tests compile with the ``aot_eager`` backend: Dynamo traces the model and AOTAutograd builds
and partitions the joint graph exactly as for inductor (that is where checkpointing, recompute,
random-op and buffer-mutation handling are decided), but runs the graphs with eager kernels, so
a CPU test takes seconds instead of minutes of C++ compilation. One test per kind of region also
compiles with inductor. The recorded graphs prove that the checkpoint took effect: the region is
one ``tag_activation_checkpoint`` subgraph and the backward graph reruns the region's forward ops
(or, for ``save_ops``, does not rerun the saved ones).
"""
from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable

import pytest
import torch
from torch import nn

import zoo
from zoo.models.densenet import DenseNet
from helpers import GraphRecorder, assert_compiled_matches_eager_plain

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),  # torch's SAC/compile notices
              pytest.mark.skipif(zoo._torch.VERSION < zoo._torch.COMPILED_REGIONS_SINCE,
                                 reason="zoo.checkpoint under torch.compile needs torch >= 2.8 "
                                 "(see test_torch_compat.py)")]
TAG = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)  # torch >= 2.5


# ---- a user's own module calling zoo.checkpoint directly ---------------------------------------
class Block(nn.Module):
    def __init__(self, width: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, padding=1), norm(width)
        self.drop = nn.Dropout(0.3)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1), norm(width)

    def forward(self, x: torch.Tensor, scale: float = 1.0, *, shift: torch.Tensor | None = None
                ) -> torch.Tensor:
        y = self.drop(torch.relu(self.bn1(self.conv1(x))))
        y = self.bn2(self.conv2(y)) * scale
        return torch.relu(x + y + (0 if shift is None else shift))


class UserNet(nn.Module):
    """Blocks called through zoo.checkpoint with a non-tensor argument and a tensor keyword."""

    def __init__(self, how: str, norm: type[nn.Module] = nn.BatchNorm2d, depth: int = 3) -> None:
        super().__init__()
        self.how = how
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(Block(8, norm) for _ in range(depth))
        self.shift = nn.Parameter(torch.zeros(1, 8, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if self.how == "sequential":
            return zoo.checkpoint_sequential(self.blocks, x, segments=2).mean((2, 3))
        if self.how == "plain_sequential":
            for block in self.blocks:
                x = block(x)
            return x.mean((2, 3))
        for block in self.blocks:
            if self.how == "checkpoint":
                x = zoo.checkpoint(block, x, 0.5, shift=self.shift)
            else:
                x = block(x, 0.5, shift=self.shift)
        return x.mean((2, 3))


def user_nets(how: str, norm: type[nn.Module] = nn.BatchNorm2d) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = UserNet("plain" if how != "sequential" else "plain_sequential", norm).double()
    return plain, UserNet(how, norm).double()


@pytest.fixture
def images() -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("norm", [nn.BatchNorm2d, zoo.cp_BatchNorm2d])
def test_direct_call_in_a_users_module_is_one_graph_and_exact(images, norm):
    plain, ckpt = user_nets("checkpoint", norm)
    rec = GraphRecorder()
    assert_compiled_matches_eager_plain(plain, ckpt, images, backend=rec)
    assert len(rec.dynamo) == 1, "the model was split into several graphs"
    assert rec.count("dynamo", TAG) == 2 * 3, \
        "each zoo.checkpoint call is one checkpoint subgraph, then one of its outputs' views"
    conv = torch.ops.aten.convolution.default
    assert rec.count("backward", conv) >= 6, "backward does not rerun the regions' convolutions"


def test_compiled_plain_model_recomputes_nothing(images):
    plain, _ = user_nets("checkpoint")
    rec = GraphRecorder()
    assert_compiled_matches_eager_plain(plain, copy.deepcopy(plain), images, backend=rec)
    assert rec.count("dynamo", TAG) == 0
    assert rec.count("backward", torch.ops.aten.convolution.default) == 0


class RegionThenNorm(nn.Module):
    """conv-BN-ReLU-conv as one region (or plainly), then a BatchNorm outside it, which saves
    the region's output for its backward."""

    def __init__(self, checkpointed: bool, nested: bool = False) -> None:
        super().__init__()
        self.checkpointed, self.nested = checkpointed, nested
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1))
        self.norm = nn.BatchNorm2d(8)

    def region(self, x: torch.Tensor) -> torch.Tensor:
        return zoo.checkpoint(self.body, x) if self.nested else self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = zoo.checkpoint(self.region, x) if self.checkpointed else self.body(x)
        return torch.relu(self.norm(y)).mean((2, 3))


@pytest.mark.parametrize("nested", [False, True], ids=["region", "nested"])
def test_a_regions_output_kept_by_what_follows_is_not_recomputed(images, nested):
    """Eagerly the region's last conv is not rerun: the BatchNorm after it keeps its output.
    Compiled, the partitioner must keep it too, not recompute it (and the chain before it)
    because the region tagged it: the backward graph reruns the first conv only."""
    torch.manual_seed(0)
    plain = RegionThenNorm(False).double()
    ckpt = copy.deepcopy(plain)
    ckpt.checkpointed, ckpt.nested = True, nested
    rec = GraphRecorder()
    assert_compiled_matches_eager_plain(plain, ckpt, images, backend=rec)
    assert rec.count("backward", torch.ops.aten.convolution.default) == 1


def test_checkpoint_sequential_compiles_exactly(images):
    plain, ckpt = user_nets("sequential")
    rec = GraphRecorder()
    assert_compiled_matches_eager_plain(plain, ckpt, images, backend=rec)
    assert len(rec.dynamo) == 1 and rec.count("dynamo", TAG) == 2 * 2  # two segments


@pytest.mark.skipif(zoo._torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES,
                    reason="cp_BatchNorm2d in torch's own compiled checkpoint needs torch >= 2.9 "
                    "(torch 2.8's updates BatchNorm statistics twice whatever the layer; "
                    "zoo.checkpoint is exact there)")
def test_cp_batchnorm_under_torchs_checkpoint_compiles_exactly(images):
    """cp_BatchNorm reads autograd's graph task eagerly; while compiling it must not (no break)."""

    class TorchCheckpointed(UserNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, 0.5, shift=self.shift,
                                                      use_reentrant=False)
            return x.mean((2, 3))

    torch.manual_seed(0)
    plain = UserNet("plain", zoo.cp_BatchNorm2d).double()
    assert_compiled_matches_eager_plain(plain, TorchCheckpointed("x", zoo.cp_BatchNorm2d).double(),
                                        images)


class _NodeList(list):
    """A graph's nodes as torch 2.11 gives them: ``reversed()`` of them is an iterable that is
    no iterator (later releases return an iterator)."""

    def __reversed__(self):
        return list(super().__reversed__())


def test_outputs_policy_reads_the_traced_graph_whatever_reversed_returns(monkeypatch):
    """The policy of the region that keeps a region's outputs tags the op a view output comes
    from to be saved, reading the last node of the graph being traced; on torch 2.11, where
    ``reversed(graph.nodes)`` is no iterator, every compiled region failed with inductor."""
    from types import SimpleNamespace

    import torch.fx.experimental.proxy_tensor as proxy_tensor
    from zoo.checkpoint import _keep_bases

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    base = graph.call_function(torch.ops.aten.relu.default, (x,))
    base.meta["recompute"] = torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    view = graph.call_function(torch.ops.aten.view.default, (base, [-1]))
    out = graph.call_function(torch.ops.aten.alias.default, (view,))
    nodes = _NodeList([x, base, view, out])
    mode = SimpleNamespace(tracer=SimpleNamespace(graph=SimpleNamespace(nodes=nodes)))
    monkeypatch.setattr(proxy_tensor, "get_proxy_mode", lambda: mode)
    policy = _keep_bases(None, torch.ops.aten.alias.default)
    assert policy == torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    assert base.meta["recompute"] == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE


def test_is_recomputing_is_false_while_tracing():
    """A compiled graph never reruns Python: the flags read False when traced (and break no graph),
    inside a region as outside it."""

    def region(x: torch.Tensor) -> torch.Tensor:
        recomputing = zoo.is_recomputing() or zoo.nn._recomputing_under_any_checkpoint()
        return x.cos() if recomputing else x.sin()

    x = torch.randn(3, requires_grad=True)
    out = torch.compile(lambda t: zoo.checkpoint(region, t), fullgraph=True,
                        backend="aot_eager")(x)
    torch.testing.assert_close(out, x.sin())


# ---- selective recompute (save_ops) ---------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, save_ops: set | None, checkpointed: bool = True) -> None:
        super().__init__()
        self.save_ops, self.checkpointed = save_ops, checkpointed
        self.fc1, self.fc2, self.drop = nn.Linear(16, 32), nn.Linear(32, 16), nn.Dropout(0.2)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.checkpointed:
            return self.body(x)
        return zoo.checkpoint(self.body, x, save_ops=self.save_ops)


@pytest.mark.parametrize("save_ops, reruns_matmul", [
    (None, True), ([torch.ops.aten.addmm.default, torch.ops.aten.mm.default], False),
    pytest.param({torch.ops.aten.addmm.default, torch.ops.aten.mm.default}, False, marks=(
        pytest.mark.skipif(zoo._torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES,
                           reason="a set of save_ops under torch.compile needs torch >= 2.9"))),
])
def test_save_ops_are_honoured_when_compiled(save_ops, reruns_matmul):
    torch.manual_seed(0)
    plain = MLP(None, checkpointed=False).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    rec = GraphRecorder()
    assert_compiled_matches_eager_plain(plain, MLP(save_ops).double(), x, backend=rec)
    assert rec.count("dynamo", TAG) == 2  # the region, then its output's views
    gelu = torch.ops.aten.gelu.default
    assert rec.count("backward", gelu) == 1, "the cheap part is recomputed either way"
    assert (rec.count("backward", torch.ops.aten.addmm.default) > 0) == reruns_matmul


# ---- every family's models -------------------------------------------------------------------
def small_models() -> list:
    """One small model per family, each with every checkpoint mode."""
    builders = {
        "cifar_cnn": lambda: zoo.create_model("cifar_cnn"),
        "resnet20": lambda: zoo.create_model("resnet20"),
        "densenet": lambda: DenseNet(growth_rate=4, block_config=(3, 3), num_init_features=8,
                                     bn_size=2, num_classes=10, stem="cifar", drop_rate=0.2),
        "vit_cifar": lambda: zoo.create_model("vit_cifar", drop_rate=0.1),
        "bert": lambda: zoo.create_model("bert_base", vocab_size=64, max_positions=16,
                                         embed_dim=32, depth=2, num_heads=2),
        "gpt2": lambda: zoo.create_model("gpt2_small", num_classes=64, context_length=16,
                                         embed_dim=32, depth=2, num_heads=2),
    }
    params = []
    for family, build in builders.items():
        with torch.device("meta"):
            modes = build().checkpoint_modes
        params += [pytest.param(build, mode, id=f"{family}-{mode}") for mode in modes]
    return params


@pytest.mark.slow
@pytest.mark.parametrize("build, mode", small_models())
def test_every_mode_of_every_family_compiles_fullgraph_and_trains_like_eager_plain(build, mode):
    torch.manual_seed(0)
    plain = build().double()
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(mode)
    x = plain.example_input(2)
    x = x.double() if x.is_floating_point() else x
    rec = GraphRecorder()
    assert_compiled_matches_eager_plain(plain, ckpt, x, backend=rec)
    assert len(rec.dynamo) == 1 and rec.count("dynamo", TAG) > 0


# ---- inductor, the default backend ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("how", ["checkpoint", "save_ops"])
def test_inductor_compiled_regions_train_like_eager_plain(how, images):
    if how == "checkpoint":
        plain, ckpt = user_nets("checkpoint")
        for block in (*plain.blocks, *ckpt.blocks):
            block.drop.p = 0.0  # inductor draws a checkpointed region's dropout from its own RNG
        x = images
    else:
        torch.manual_seed(0)
        plain, ckpt = MLP(None, checkpointed=False).double(), MLP([torch.ops.aten.mm.default,
                                                                 torch.ops.aten.addmm.default])
        ckpt, x = ckpt.double(), torch.randn(8, 16, dtype=torch.float64)
    import torch._inductor.config as inductor_config
    with inductor_config.patch(fallback_random=True):  # dropout from eager's RNG stream
        assert_compiled_matches_eager_plain(plain, ckpt, x, backend="inductor")


@pytest.mark.slow
def test_inductor_recompute_uses_the_forwards_dropout_mask():
    """With x = 0.5 everywhere, dropout(x, 0.5) is the 0/1 mask itself, so the output
    sin(mask) reveals the mask the forward drew, and the gradient must be cos(mask) * mask * 2:
    a recompute that drew a new mask would give another gradient."""

    def region(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(torch.nn.functional.dropout(x, 0.5, training=True))

    x = torch.full((4096,), 0.5, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    out = torch.compile(lambda t: zoo.checkpoint(region, t), fullgraph=True)(x)
    out.sum().backward()
    mask = (out != 0).double()
    assert 0.3 < mask.mean() < 0.7
    torch.testing.assert_close(x.grad, torch.cos(mask) * mask * 2)


def test_a_backend_that_runs_dynamos_graph_eagerly_is_refused_in_one_line():
    """``backend="eager"`` (any backend without AOTAutograd) runs a traced region's checkpoint
    eagerly on Dynamo's ops, without the zoo's guards: there torch's own checkpoint (torch
    2.14, 2.15) trains this dropout region with other gradients than the plain model's (its
    recompute draws a new mask), so the zoo's region refuses the step in one line, and
    ``aot_eager`` trains it as plain."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)).double()
    x = torch.randn(16, 8, dtype=torch.float64)

    def grads(run) -> list[torch.Tensor]:
        model = copy.deepcopy(block)
        torch._dynamo.reset()
        torch.manual_seed(1)
        run(model, x).square().mean().backward()
        return [p.grad for p in model.parameters()]

    plain = grads(lambda m, t: m(t))
    with pytest.raises(RuntimeError, match=r'^zoo: zoo\.checkpoint under torch\.compile needs a '
                                           r'backend that runs AOTAutograd [^\n]*"aot_eager"$'):
        grads(lambda m, t: torch.compile(lambda u: zoo.checkpoint(m, u), backend="eager")(t))
    zoos = grads(lambda m, t: torch.compile(lambda u: zoo.checkpoint(m, u),
                                            backend="aot_eager")(t))
    for a, b in zip(zoos, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch._dynamo.reset()


def test_torch_keywords_and_a_users_selective_policy_compile():
    """A library handing zoo.checkpoint torch's keywords (and its own SAC context_fn) compiles."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    policy = functools.partial(create_selective_checkpoint_contexts,
                               [torch.ops.aten.addmm.default, torch.ops.aten.mm.default])
    torch.manual_seed(0)
    plain = MLP(None, checkpointed=False).double()

    class Keyworded(MLP):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return zoo.checkpoint(self.body, x, use_reentrant=False, preserve_rng_state=True,
                                  context_fn=policy, determinism_check="default")

    rec = GraphRecorder()
    x = torch.randn(8, 16, dtype=torch.float64)
    if zoo._torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES:  # torch 2.8: one line, naming 2.9
        torch._dynamo.reset()
        with pytest.raises(RuntimeError, match=r"^zoo: zoo.checkpoint\(\.\.\., context_fn=\.\.\.\) "
                                               r"under torch.compile needs torch >= 2\.9 [^\n]*$"):
            torch.compile(Keyworded(None).double(), backend=rec)(x)
        return
    assert_compiled_matches_eager_plain(plain, Keyworded(None).double(), x, backend=rec)
    assert rec.count("backward", torch.ops.aten.addmm.default) == 0  # the policy was honoured


def _context_fn_warnings(caplog: pytest.LogCaptureFixture, step: Callable[[], object]) -> list:
    """torch's "context_fn is passed ... in-place ops" log records of ``step``, compiled afresh.
    torch logs the line once a process (``warning_once``): its cache is cleared first, so that
    a line another test logged earlier cannot hide this one's."""
    torch._dynamo.reset()
    torch._logging._internal.warning_once.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        step()
    torch._dynamo.reset()
    return [r for r in caplog.records if "context_fn is passed" in r.getMessage()]


def test_a_compiled_zoo_region_logs_no_context_fn_warning(caplog):
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8))
    fn = torch.compile(lambda x: zoo.checkpoint(block, x).sum(), backend="aot_eager")
    assert not _context_fn_warnings(
        caplog, lambda: fn(torch.randn(4, 8, requires_grad=True)).backward())


def test_a_compiled_zoo_model_logs_no_context_fn_warning(caplog):
    model = zoo.create_model("resnet20", num_classes=10).train()
    model.set_grad_checkpointing("halves")
    fn = torch.compile(model, backend="aot_eager")
    assert not _context_fn_warnings(
        caplog, lambda: fn(model.example_input(2)).sum().backward())


@pytest.mark.skipif(zoo._torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES,
                    reason="torch 2.8 refuses a context_fn under torch.compile")
def test_a_users_own_context_fn_still_gets_torchs_warning(caplog):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    policy = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    fn = torch.compile(lambda x: zoo.checkpoint(block, x, context_fn=policy).sum(),
                       backend="aot_eager")
    assert _context_fn_warnings(
        caplog, lambda: fn(torch.randn(4, 8, requires_grad=True)).backward())

    def zoo_region_first() -> None:  # torch logs the line once a process: not for the zoo's
        own = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True))
        torch.compile(lambda x: zoo.checkpoint(own, x).sum(), backend="aot_eager")(
            torch.randn(4, 8, requires_grad=True)).backward()
        fn(torch.randn(4, 8, requires_grad=True)).backward()
    assert len(_context_fn_warnings(caplog, zoo_region_first)) == 1
