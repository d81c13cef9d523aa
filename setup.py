"""Packaging beyond what pyproject.toml can say: the recipes of configs/ ship inside the wheel.

configs/ stays the one copy in the tree; the wheel maps it to the package ``zoo.train.recipes``
(zoo/train/recipes/*.yaml once installed), where ``zoo.train.cli.recipes_dir`` finds it.
Everything else (metadata, dependencies, the console command) is in pyproject.toml.
"""
from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["zoo", "zoo.*"]), "zoo.train.recipes"],
      package_dir={"zoo.train.recipes": "configs"})
