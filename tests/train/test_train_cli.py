"""train.py's command line: config resolution (defaults < recipe < flags; resuming: defaults <
checkpoint's config < --config < flags), the published recipes, and bad input -> a clear
message on stderr, exit status 2, no traceback."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import call_command
from zoo.train.config import ConfigError, TrainConfig, config_keys, load_yaml, resolve_config
from zoo.train.run_dir import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "configs"
TINY = ["--dataset", "shapes", "--train_size", "16", "--test_size", "8", "--batch_size", "8",
        "--epochs", "1"]


def load_train_module():
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(capsys, **flags) -> tuple[int, str, str]:
    """train.main(**flags) in this process, as Fire would call it: (exit status, stdout, stderr)."""
    return call_command(load_train_module().main, capsys, **flags)


def run_script(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env={**os.environ, **(env or {})})


# ---- config resolution ----

def test_on_resume_the_checkpoints_config_stands_below_config_and_flags(tmp_path):
    """Resuming: defaults < the checkpoint's config < --config < flags; the model's own recipe
    is not read again (the checkpoint's config already holds it)."""
    saved = {**vars(TrainConfig(model="resnet110")), "lr": 0.3, "epochs": 7, "seed": 9}
    cfg, sources = resolve_config({"model": "resnet"}, RECIPES, saved)
    assert sources == ["defaults", "the resumed run's config", "command line"]
    assert (cfg.lr, cfg.epochs, cfg.seed, cfg.batch_size) == (0.3, 7, 9, 64)  # no recipe
    recipe = tmp_path / "more.yaml"
    recipe.write_text("epochs: 8\nseed: 2\n")
    cfg, sources = resolve_config({"config": str(recipe), "seed": 5}, RECIPES, saved)
    assert sources == ["defaults", "the resumed run's config", str(recipe), "command line"]
    assert (cfg.lr, cfg.epochs, cfg.seed) == (0.3, 8, 5)


def test_flags_override_the_models_recipe_which_overrides_defaults():
    cfg, sources = resolve_config({"model": "resnet", "lr": 0.05}, RECIPES)
    assert cfg.model == "resnet110"  # family alias
    assert sources == ["defaults", str(RECIPES / "resnet110.yaml"), "command line"]
    assert (cfg.lr, cfg.batch_size, cfg.epochs, cfg.warmup_iters) == (0.05, 128, 164, 400)
    cfg, sources = resolve_config({"model": "resnet20"}, RECIPES)  # no recipe: the defaults
    assert sources == ["defaults", "command line"] and cfg == TrainConfig(model="resnet20")


def test_cli_values_are_coerced_and_checked():
    cfg, _ = resolve_config({"efficient": "true", "out_dir": 7, "lr": 1, "batch-size": 32,
                             "milestones": (0.3, 0.6)}, None)
    assert cfg.efficient is True and cfg.out_dir == "7" and cfg.lr == 1.0 and cfg.batch_size == 32
    assert cfg.milestones == [0.3, 0.6]
    assert resolve_config({"efficient": "bottleneck"}, None)[0].efficient == "bottleneck"
    with pytest.raises(ConfigError, match="batch_size must be a number or 'auto', got 'many'"):
        resolve_config({"batch_size": "many"}, None)
    with pytest.raises(ConfigError, match="batch_size must be at least 1"):
        resolve_config({"batch_size": 0}, None)
    with pytest.raises(ConfigError, match=r"unknown key 'learning_rate'.*valid keys: model, "):
        resolve_config({"learning_rate": 0.1}, None)


def test_config_files_are_checked_like_flags(tmp_path):
    bad_key = tmp_path / "bad_key.yaml"
    bad_key.write_text("model: resnet20\nepoch: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'epoch'.*did you mean epochs.*valid keys"):
        resolve_config({"config": str(bad_key)}, RECIPES)
    bad_type = tmp_path / "bad_type.yaml"
    bad_type.write_text("lr: fast\n")
    with pytest.raises(ConfigError, match="lr must be float, got 'fast'"):
        resolve_config({"config": str(bad_type)}, RECIPES)
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_yaml(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("lr: [0.1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(tmp_path / "broken.yaml")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_yaml(tmp_path / "missing.yaml")


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_is_valid_and_names_a_registered_model(path):
    import zoo

    data = load_yaml(path)
    assert set(data) <= set(config_keys())
    cfg, _ = resolve_config({"config": str(path)}, RECIPES)
    assert cfg.model in zoo.list_models() and path.stem == cfg.model


def test_published_recipes():
    dn, _ = resolve_config({"model": "densenet"}, RECIPES)
    assert (dn.model, dn.optimizer, dn.lr, dn.momentum, dn.nesterov, dn.weight_decay,
            dn.batch_size, dn.epochs, dn.schedule, dn.milestones, dn.gamma) == (
        "densenet_bc_100", "sgd", 0.1, 0.9, True, 1e-4, 64, 300, "step", [0.5, 0.75], 0.1)
    rn, _ = resolve_config({"model": "resnet"}, RECIPES)
    assert (rn.lr, rn.momentum, rn.nesterov, rn.weight_decay, rn.batch_size, rn.epochs,
            rn.milestones, rn.warmup_iters, rn.warmup_lr) == (
        0.1, 0.9, False, 1e-4, 128, 164, [0.5, 0.75], 400, 0.01)
    vit, _ = resolve_config({"model": "vit"}, RECIPES)
    assert (vit.model, vit.optimizer, vit.schedule) == ("vit_cifar", "adamw", "cosine")


# ---- bad input: message, exit 2, no traceback ----

@pytest.mark.parametrize("flags, message", [
    ({"model": "densnet_bc_100"}, "did you mean densenet_bc_100"),
    ({"model": "cnn", "batch_size": 0}, "batch_size must be at least 1"),
    ({"model": "cnn", "dataset": "mnist"}, "unknown dataset 'mnist'"),
    ({"model": "cnn", "config": "/nonexistent/recipe.yaml"}, "cannot read config file"),
    ({"model": "cnn", "resume": "/nonexistent/run"}, "nothing to resume"),
    ({"model": "cnn", "optimiser": "sgd"}, "unknown key 'optimiser'"),
    ({"model": "cnn", "config": True}, "--config names a recipe file"),  # `--config` alone
])
def test_bad_input_exits_2_with_a_message(capsys, tmp_path, flags, message):
    code, _out, err = run_main(capsys, out_dir=str(tmp_path / "run"), **flags)
    assert code == 2
    assert message in err and err.startswith("train.py: error:")
    assert "Traceback" not in err


def test_help_lists_every_key_and_trains_nothing(capsys, tmp_path):
    code, out, err = run_main(capsys, help=True, out_dir=str(tmp_path / "run"))
    assert code == 0 and err == "" and out.startswith("usage: python train.py")
    missing = [k for k in config_keys() if k not in out]
    assert missing == [], f"--help does not mention {missing}"
    assert not (tmp_path / "run").exists()


def test_resuming_a_run_of_another_model_is_refused(capsys, tmp_path):
    code, out, err = run_main(capsys, model="cnn", dataset="shapes", train_size=16, test_size=8,
                              batch_size=8, epochs=1, out_dir=str(tmp_path / "run"))
    assert code == 0, err
    assert "config from: defaults < " in out and "resolved config" in out and "done:" in out
    code, _out, err = run_main(capsys, model="resnet20", resume=str(tmp_path / "run"))
    assert code == 2 and "is a run of cifar_cnn, not resnet20" in err


def test_a_resume_reads_its_checkpoint_once(capsys, tmp_path, monkeypatch):
    """--resume reads the whole checkpoint once, for its config and its state alike (a ViT-B
    checkpoint, 661 MiB, takes about 2 s to read and verify on a CPU). Once the lock is held
    it maps the file again, tensors untouched, to compare its SHA-256 with the one restored,
    and maps best.pt to see whether it holds the epoch resumed (which was the best)."""
    run = tmp_path / "run"
    code, _out, err = run_main(capsys, model="cnn", dataset="shapes", train_size=16, test_size=8,
                               batch_size=8, epochs=1, schedule="constant", out_dir=str(run))
    assert code == 0, err
    reads, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: reads.append(k.get("mmap", False))
                        or load(*a, **k))
    code, _out, err = run_main(capsys, resume=str(run), epochs=2)
    assert code == 0, err
    assert reads == [False, True, True], f"whole reads, mapped reads in order: {reads}"


def test_resume_in_a_config_file_stands_where_the_resume_flag_does(capsys, tmp_path):
    """A recipe holding ``resume: RUN`` (and epochs: 2) resumes RUN as --resume RUN does: the
    checkpoint's config below the file and the flags, not the defaults (which would refuse
    every key the run set as drift), and the run ends where the straight 2-epoch run ends."""
    tiny = dict(model="cnn", dataset="shapes", train_size=16, test_size=8, batch_size=8,
                schedule="constant", lr=0.05)
    straight, run = tmp_path / "straight", tmp_path / "run"
    for out, epochs in ((straight, 2), (run, 1)):
        code, _out, err = run_main(capsys, **tiny, epochs=epochs, out_dir=str(out))
        assert code == 0, err
    recipe = tmp_path / "more.yaml"
    recipe.write_text(f"resume: {run}\nepochs: 2\n")
    code, out, err = run_main(capsys, config=str(recipe))
    assert code == 0, err
    assert f"config from: defaults < the resumed run's config < {recipe}" in out
    assert "resuming after epoch 1" in out
    a, b = (load_checkpoint(p)["model"] for p in (run, straight))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_script_trains_and_fails_cleanly_as_a_subprocess(tmp_path):
    ok = run_script("--model", "cnn", *TINY, "--out_dir", str(tmp_path / "run"))
    assert ok.returncode == 0, ok.stderr
    assert "epoch 1/1:" in ok.stdout and "best test accuracy" in ok.stdout
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert record["epoch"] == 1 and 0 <= record["test_acc"] <= 1
    bad = run_script("--model", "resnet_110")
    assert bad.returncode == 2 and "did you mean" in bad.stderr and "Traceback" not in bad.stderr


def test_cifar10_offline_without_files_is_a_message_not_a_traceback(tmp_path):
    """The real download path runs, against a proxy that refuses connections: no network here or
    in CI, same outcome as an offline machine."""
    proxy = "http://127.0.0.1:9"
    res = run_script("--model", "cnn", "--dataset", "cifar10", "--data_dir", str(tmp_path / "d"),
                     "--out_dir", str(tmp_path / "run"),
                     env={"https_proxy": proxy, "HTTPS_PROXY": proxy, "http_proxy": proxy,
                          "HTTP_PROXY": proxy, "no_proxy": "", "NO_PROXY": ""})
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert str(tmp_path / "d" / "cifar-10-batches-py") in res.stderr
    assert "--dataset shapes" in res.stderr
