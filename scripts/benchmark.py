"""Every benchmark of the zoo: ``python scripts/benchmark.py SUBCOMMAND [--flags]``, the same
command as ``python -m zoo.bench`` (zoo/bench/cli.py); ``--help`` lists the subcommands."""
import sys

from zoo.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python scripts/benchmark.py"))
