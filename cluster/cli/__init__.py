"""The `pdserve` command line (main.py) and its serving subcommands; the tools' subcommands
(bench, plan, simulate, testbed) live with their tools under cluster/tools/."""
from cluster.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
