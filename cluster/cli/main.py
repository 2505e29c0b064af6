"""`pdserve` command line: serve | generate | bench | plan | simulate | testbed | export-tokenizer.

Each subcommand lives in its own module exposing `register(subparsers)`,
which adds its parser and sets `func(args) -> int`. Modules are imported
lazily so `pdserve plan` does not pay for Ray or torch.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from cluster.version import version

SUBCOMMANDS = {
    "serve": "cluster.cli.serve",
    "generate": "cluster.cli.generate",
    "bench": "cluster.tools.bench.cli",
    "plan": "cluster.tools.planner.cli",
    "simulate": "cluster.tools.sim.cli",
    "testbed": "cluster.tools.testbed.cli",
    "export-tokenizer": "cluster.cli.export_tokenizer",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--version", action="version", version=f"pdserve {version()}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, module in SUBCOMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith(module.rsplit(".", 1)[0]):
                continue   # subcommand not built yet
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # pdserve starts or joins Ray explicitly (cluster.orchestration.launcher.init_ray). Ray's implicit
    # ray.init() on a stray ray.get/kill after shutdown would start a second local cluster
    # from whatever thread made the call, and a cluster started from a thread dies with
    # that thread (Ray binds its GCS and raylet to the forking thread with PR_SET_PDEATHSIG).
    # Ray reads this once, when it is first imported; the subcommands import it lazily.
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    only = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    parser = build_parser(only)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2

