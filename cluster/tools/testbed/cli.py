"""`pdserve testbed`: test hosts from Linux namespaces on this machine, to try a
multi-node deployment (Ray head on one host, prefill and decode pools on others,
KV over real links) without more machines. Needs root. docs/deploy.md walks
through a whole session.

    pdserve testbed up --hosts 3 [--link-gbit 10]   # prints the hosts and their addresses
    pdserve testbed exec h2 -- ray start ...        # run a command on a host
    pdserve testbed status | down [RUN_ID | --all]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("testbed", help="test hosts from Linux namespaces (multi-node on one machine)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="create a bed of test hosts (kept until `down`)")
    up.add_argument("--hosts", type=int, default=3, help="number of hosts h1..hN (default 3)")
    up.add_argument("--link-gbit", type=float, default=0.0, help="cap every host's link (Gbit/s; 0 = no cap)")
    down = sub.add_parser("down", help="remove a bed (every process, namespace, link and file)")
    down.add_argument("run_id", nargs="?", help="the bed to remove (default: the only one)")
    down.add_argument("--all", action="store_true", help="remove every bed")
    sub.add_parser("status", help="list beds and hosts as JSON")
    ex = sub.add_parser("exec", help="run a command on a host of a bed")
    ex.add_argument("host", help="h1, h2, ...")
    ex.add_argument("--run-id", help="the bed (default: the only one)")
    ex.add_argument("argv", nargs=argparse.REMAINDER, help="-- command and arguments")
    for action, fn in (("up", _up), ("down", _down), ("status", _status), ("exec", _exec)):
        sub.choices[action].set_defaults(func=fn)


def _describe(bed) -> dict:
    return {"run_id": bed.run_id, "gateway": bed.gateway, "shared_dir": str(bed.shared_dir),
            "hosts": {h.name: {"address": h.address, "alive": h.alive, "tmp": str(h.state_dir / "tmp")}
                      for h in bed.hosts}}


def _one(run_id: str | None):
    from cluster.tools.testbed.bed import TestBed, list_beds
    if run_id:
        return TestBed.load(run_id)
    beds = list_beds()
    if len(beds) != 1:
        raise ValueError(f"{len(beds)} beds are up ({[b.run_id for b in beds]}): name one by its run id")
    return beds[0]


def _up(args) -> int:
    from cluster.tools.testbed.bed import TestBed
    bed = TestBed.up(args.hosts, link_gbit=args.link_gbit, owner_pid=0)
    print(json.dumps(_describe(bed), indent=2))
    return 0


def _down(args) -> int:
    from cluster.tools.testbed.bed import list_beds
    beds = list_beds() if args.all else [_one(args.run_id)]
    for bed in beds:
        bed.down()
        print(f"removed test bed {bed.run_id}")
    return 0


def _status(args) -> int:
    from cluster.tools.testbed.bed import list_beds
    print(json.dumps([_describe(b) for b in list_beds()], indent=2))
    return 0


def _exec(args) -> int:
    argv, run_id = list(args.argv), args.run_id
    if argv[:1] == ["--run-id"] and len(argv) > 1:   # given after the host name
        run_id, argv = argv[1], argv[2:]
    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not argv:
        raise ValueError("give the command after --, e.g. `pdserve testbed exec h1 -- hostname`")
    host = _one(run_id).host(args.host)
    return subprocess.call(host.argv(argv), stdin=sys.stdin)
