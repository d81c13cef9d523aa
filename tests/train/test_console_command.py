"""The training command behind both entry points: ``python train.py`` and the installed
``zoo-train`` run the same code and differ only in the name they speak under."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import call_command
from zoo.train.cli import command, recipes_dir
from zoo.train.config import config_keys

ROOT = Path(__file__).resolve().parents[2]


def test_console_command_help_lists_every_key():
    """What the ``zoo-train`` entry point runs (``zoo.train.cli:console``), as a process."""
    res = subprocess.run([sys.executable, "-c", "from zoo.train.cli import console; console()",
                          "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.startswith("usage: zoo-train [--KEY VALUE ...]")
    missing = [k for k in config_keys() if k not in res.stdout]
    assert missing == [], f"zoo-train --help does not mention {missing}"


@pytest.mark.parametrize("flags", [
    {"help": True},
    {"model": "densnet_bc_100"},
    {"model": "cnn", "batch_size": 0},
    {"model": "cnn", "resume": "/nonexistent/run"},
])
def test_script_and_console_give_the_same_output_and_status(capsys, tmp_path, flags):
    script = call_command(command("train.py"), capsys, out_dir=str(tmp_path / "a"), **flags)
    console = call_command(command("zoo-train"), capsys, out_dir=str(tmp_path / "a"), **flags)
    assert script[0] == console[0] and script[0] in (0, 2)
    as_console = [s.replace("python train.py", "zoo-train").replace("train.py:", "zoo-train:")
                  for s in script[1:]]
    assert as_console == list(console[1:])
    assert not (tmp_path / "a").exists()


def test_recipes_are_the_checkouts_configs_folder():
    """From a checkout the recipes are configs/, the one copy in the tree (the wheel's copy is
    checked in tests/test_package.py)."""
    assert recipes_dir() == ROOT / "configs"
    assert sorted(p.name for p in recipes_dir().glob("*.yaml")) == [
        "cifar_cnn.yaml", "densenet_bc_100.yaml", "resnet110.yaml", "revnet110.yaml",
        "vit_cifar.yaml"]
