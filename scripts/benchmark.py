"""Every benchmark of the zoo: ``python scripts/benchmark.py SUBCOMMAND [--flags]`` (the
subcommands are registered in scripts/bench/cli.py); ``--help`` lists them."""
import sys

from bench.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python scripts/benchmark.py"))
