"""The distribution a pip user installs: the sdist and the wheel built from a copy of the tree,
as ``python -m build`` builds them (the sdist first, the wheel from the unpacked sdist). The wheel
carries the recipes of configs/ and declares the ``zoo-train`` console command, and the command
run from the unpacked wheel reads the recipe inside it. (CI also installs the wheel with its
dependencies in a fresh environment: .ci/package_check.sh.)"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", ".ci-venv", "runs", "data", "site", "build",
                                     "dist", "__pycache__", "*.egg-info", ".pytest_cache")
BUILD = "import sys, setuptools.build_meta as b; print(getattr(b, sys.argv[1])(sys.argv[2]))"


def backend(step: str, source: Path, out: Path) -> Path:
    """Run setuptools' PEP 517 hook ``step`` (build_sdist, build_wheel) in ``source``."""
    res = subprocess.run([sys.executable, "-c", BUILD, step, str(out)], cwd=source,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return out / res.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("dist")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    sdist = backend("build_sdist", source, tmp)
    with tarfile.open(sdist) as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp / "unpacked", **safe)
    (unpacked,) = (tmp / "unpacked").iterdir()
    wheel = backend("build_wheel", unpacked, tmp)
    return {"sdist": sdist, "wheel": wheel, "tmp": tmp}


@pytest.mark.slow
def test_wheel_carries_the_recipes_and_declares_the_console_command(dist):
    recipes = sorted((ROOT / "configs").glob("*.yaml"))
    assert recipes
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        names = set(wheel.namelist())
        for recipe in recipes:
            assert wheel.read(f"zoo/train/recipes/{recipe.name}") == recipe.read_bytes()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
        metadata = Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
    assert "[console_scripts]" in entry_points
    assert "zoo-train = zoo.train.cli:console" in entry_points
    assert "zoo/train/cli.py" in names and "zoo/__init__.py" in names
    assert not any(n.startswith(("tests/", "configs/")) for n in names)
    assert metadata["Name"] == "torch-checkpoint-zoo"
    assert metadata["License-Expression"] == "MIT"
    assert "torch>=2.8" in metadata.get_all("Requires-Dist")
    with tarfile.open(dist["sdist"]) as sdist:
        assert {f"configs/{r.name}" for r in recipes} <= {m.split("/", 1)[-1]
                                                          for m in sdist.getnames()}


@pytest.mark.slow
def test_console_command_from_the_wheel_trains_with_the_recipe_inside_it(dist):
    """The wheel unpacked as site-packages would hold it, with the test environment's torch."""
    site = dist["tmp"] / "site"
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        wheel.extractall(site)
    run = dist["tmp"] / "run"
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-c", "from zoo.train.cli import console; console()", "--model", "cnn",
         "--dataset", "shapes", "--train_size", "16", "--test_size", "8", "--batch_size", "8",
         "--epochs", "1", "--device", "cpu", "--out_dir", str(run)],
        capture_output=True, text=True, timeout=300, cwd=dist["tmp"], env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    recipe = site.resolve() / "zoo" / "train" / "recipes" / "cifar_cnn.yaml"
    assert f"config from: defaults < {recipe} < command line" in res.stdout
    assert (run / "metrics.jsonl").is_file()
