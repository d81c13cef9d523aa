"""zoo._torch against the installed torch: every private name the library expects is there (or
its documented fallback applies), and no other module of the library reaches a private torch
name itself."""
from __future__ import annotations

import copy
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import torch

from zoo import _torch

ZOO = Path(_torch.__file__).parent


@pytest.mark.parametrize("path", sorted(_torch.NAMES))
def test_name_present_from_its_version(path):
    """A name is there on every torch from the release the table gives (before it, the library
    relies on the fallback the table names)."""
    since = _torch.NAMES[path].since
    if _torch.VERSION < since:
        pytest.skip(f"{path}: needs torch >= {'.'.join(map(str, since))}")
    assert _torch.resolve(path) is not None, (
        f"torch {torch.__version__} lacks {path}, which zoo._torch expects from torch "
        f"{'.'.join(map(str, since))}: update zoo/_torch.py")


def test_names_keep_their_kind():
    """The names used as callables are callable, the tables are dicts, the classes classes."""
    for name in ("current_graph_task_id", "will_engine_execute_node", "current_autograd_node",
                 "get_current_dispatch_mode", "pop_mode_temporarily", "tree_map_only",
                 "tree_flatten", "tree_leaves", "fused_sdp_choice", "is_fake",
                 "in_kernel_invocation_manager", "reparametrize_module",
                 "dispatch_tls_is_dispatch_key_excluded"):
        assert callable(getattr(_torch, name)), name
    assert isinstance(_torch.global_forward_pre_hooks, dict)
    for name in ("NormBase", "BatchNormBase", "InstanceNormBase", "TorchDispatchMode",
                 "OpOverload", "HigherOrderOperator", "FakeTensor", "FakeTensorMode"):
        assert isinstance(getattr(_torch, name), type), name
    assert issubclass(torch.nn.BatchNorm2d, _torch.BatchNormBase)
    assert issubclass(torch.nn.InstanceNorm2d, _torch.InstanceNormBase)
    assert hasattr(_torch.execution_engine, "queue_callback")


def test_accessors_read_the_private_attributes():
    t = torch.zeros(2, requires_grad=True)
    y = t * 2
    before = _torch.tensor_version(y)
    y.add_(1)
    assert _torch.tensor_version(y) == before + 1
    assert isinstance(_torch.sequence_nr(y.grad_fn), int)
    bn = torch.nn.BatchNorm1d(3)
    assert _torch.module_buffers(bn)["num_batches_tracked"] is bn.num_batches_tracked
    assert _torch.module_parameters(bn)["weight"] is bn.weight
    assert set(_torch.ATTRIBUTES.values()) <= set(dir(_torch))


def test_missing_feature_is_one_line_naming_the_torch_it_needs():
    path = "torch.utils.checkpoint.CheckpointPolicy"
    with pytest.raises(RuntimeError) as err:
        _torch.require(None, "zoo.checkpoint under torch.compile", path)
    message = str(err.value)
    assert "\n" not in message and "needs torch >= 2.5" in message
    assert torch.__version__ in message


def _private_uses(source: str) -> list[tuple[int, str]]:
    """(line, text) of every private torch name a module's code reaches: a dotted name from
    ``torch`` with a component starting with ``_``, ``from torch... import _x``, or one of the
    private attributes of :data:`zoo._torch.ATTRIBUTES` (strings and comments are not code)."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type in (tokenize.NAME, tokenize.OP)]
    found = []
    for i, tok in enumerate(tokens):
        prev = tokens[i - 1].string if i else ""
        if tok.type == tokenize.NAME and tok.string == "torch" and prev != ".":
            chain, j = [], i + 1
            while j + 1 < len(tokens) and tokens[j].string == "." and \
                    tokens[j + 1].type == tokenize.NAME:
                chain.append(tokens[j + 1].string)
                j += 2
            private = [c for c in chain if c.startswith("_") and not c.startswith("__")]
            if prev == "from" and j < len(tokens) and tokens[j].string == "import":
                k = j + 1
                while k < len(tokens) and tokens[k].start[0] == tokens[j].start[0]:
                    if tokens[k].type == tokenize.NAME and tokens[k].string.startswith("_") \
                            and tokens[k - 1].string != "as":
                        private.append(tokens[k].string)
                    k += 1
            if private:
                found.append((tok.start[0], "torch." + ".".join(chain)))
        elif tok.type == tokenize.NAME and prev == "." and tok.string in _torch.ATTRIBUTES:
            found.append((tok.start[0], "." + tok.string))
    return found


def test_no_private_torch_name_outside_the_compat_module():
    """Only zoo/_torch.py reaches torch's private names; everything else goes through it."""
    bad = []
    for path in sorted(ZOO.rglob("*.py")):
        if path.name == "_torch.py" and path.parent == ZOO:
            continue
        for line, name in _private_uses(path.read_text()):
            bad.append(f"{path.relative_to(ZOO.parent)}:{line}: {name}")
    assert not bad, "route these through zoo/_torch.py:\n" + "\n".join(bad)


def test_the_scanner_finds_what_it_looks_for():
    src = ("import torch\nfrom torch.utils._pytree import tree_map\nx = torch._C._foo()\n"
           "from torch.utils.checkpoint import _private\ny = t._version\n"
           "z = torch.nn.Linear  # torch._C in a comment\ns = 'torch._C'\n")
    assert [line for line, _ in _private_uses(src)] == [2, 3, 4, 5]


def test_import_zoo_in_a_fresh_interpreter():
    """``import zoo`` works on the installed torch (on every supported one: .ci/run's legs)."""
    root = ZOO.parent
    code = "import zoo, zoo.checkpoint, zoo.memory, zoo.planner, zoo.reversible, zoo.models"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_compiled_region_on_old_torch_is_one_line_naming_the_torch_it_needs(monkeypatch):
    """A torch below the compiled regions' floor refuses a compiled region in one line, at the
    call (never a silently different model), and the same region runs eagerly as before. (The
    floor is moved above this torch, so the refusal is checked on every torch.)"""
    import zoo

    monkeypatch.setattr(_torch, "COMPILED_REGIONS_SINCE", (99, 0))
    torch._dynamo.reset()
    layer = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    compiled = torch.compile(lambda t: zoo.checkpoint(layer, t), backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"^zoo: zoo.checkpoint under torch.compile needs "
                                           r"torch >= 99\.0 \(this is torch [^\n]*$"):
        compiled(x)
    zoo.checkpoint(layer, x).sum().backward()
    assert x.grad is not None
    torch._dynamo.reset()


def test_torch_compiled_checkpoint_replays_batchnorm_updates_where_zoo_says():
    """What compiled zoo regions rest on: torch's own non-reentrant checkpoint under
    torch.compile updates BatchNorm's statistics once per step from torch 2.9, and twice on
    torch 2.8 (``COMPILED_RECOMPUTE_REPLAYS_UPDATES``, where zoo saves the update's source)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).double()
    ckpt = copy.deepcopy(plain)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    run = torch.compile(lambda t: torch.utils.checkpoint.checkpoint(ckpt, t, use_reentrant=False),
                        backend="aot_eager")
    for _ in range(2):
        plain(x).sum().backward()
        run(x).sum().backward()
    updates = 2 if _torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES else 1
    assert int(ckpt[1].num_batches_tracked) == updates * int(plain[1].num_batches_tracked)
    if updates == 1:
        for got, want in zip(ckpt[1].buffers(), plain[1].buffers()):
            torch.testing.assert_close(got, want)
    torch._dynamo.reset()


def test_what_this_torch_refuses_is_listed_for_the_table():
    """docs/torch-versions.md's "refused here" column: one entry per refusal this torch has."""
    flags = (_torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES, _torch.COMPILED_STORED_REVERSIBLE_WRONG,
             _torch.VERSION < _torch.COMPILED_CARD_STEP_SINCE)
    refused = _torch.refused()
    assert len(refused) == sum(flags)
    assert all(text and "\n" not in text for text in refused)


def test_a_compiled_step_on_a_card_is_predicted_from_2_11_and_refused_before():
    """Below ``COMPILED_CARD_STEP_SINCE`` the prediction is one line naming the torch it needs;
    from there it predicts (a small conv net: its kernels launched in both graphs)."""
    from zoo.memory import predict_compiled_step
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).train()
    x = torch.randn(2, 3, 8, 8)
    if _torch.VERSION < _torch.COMPILED_CARD_STEP_SINCE:
        with pytest.raises(RuntimeError, match=r"needs torch >= 2\.11 .*predict_step$"):
            predict_compiled_step(model, x, "h100")
    else:
        assert min(predict_compiled_step(model, x, "h100").kernels) > 0


def test_a_plan_for_compile_is_made_from_2_9_and_refused_before():
    """On torch 2.8 compiled regions keep each BatchNorm's output, so no plan keeps its peak
    compiled: ``compiled=True`` is one line naming torch 2.9, and a model running a plan that
    checkpoints something says at its first compiled call that it can peak above the plan;
    from 2.9 the compiled plan is made, and runs compiled without a word."""
    import warnings

    import zoo
    from zoo.planner import plans
    torch.manual_seed(0)
    model = zoo.create_model("resnet20", num_classes=10)
    x = torch.randn(2, 3, 16, 16)
    roomy = zoo.plan(model, x, "inf", apply=False)
    budget = (roomy.smallest_peak + roomy.plain_peak) // 2
    refused = _torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES
    if refused:
        with pytest.raises(RuntimeError, match=r"needs torch >= 2\.9 .*step eagerly$"):
            zoo.plan(model, x, budget, compiled=True)
    plan = zoo.plan(model, x, budget, compiled=not refused)
    assert plan.checkpointed_blocks
    torch._dynamo.reset()
    plans._SAID.clear()
    step = torch.compile(lambda inp: model(inp).square().mean(), backend="aot_eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            step(x).backward()
    said = [str(w.message) for w in seen if str(w.message).startswith("zoo.plan")]
    peak = zoo.memory.format_bytes(plan.predicted_peak)
    assert said == ([f"zoo.plan: this model runs a plan that torch {torch.__version__}'s compiled "
                     f"regions do not keep (they keep each BatchNorm's output): compiled, the "
                     f"step can peak above the predicted {peak}; on torch >= 2.9 plan with "
                     "zoo.plan(model, x, budget, compiled=True) before compiling"]
                    if refused else [])
    torch._dynamo.reset()
