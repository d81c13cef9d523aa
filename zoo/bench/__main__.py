"""``python -m zoo.bench SUBCOMMAND [--flags]`` (see :mod:`zoo.bench.cli`)."""
import sys

from zoo.bench.cli import main

sys.exit(main())
