"""Faults across test hosts at full counts (`make chaos-hosts`, marker chaos_hosts):
10 trials each of a decode host killed whole under 16 streams, a prefill host
killed while its KV is on the wire, and a prefill host cut off for 10 s, on one
bed of four hosts (h1 head and frontend, h2 prefill, h3 and h4 decode). The
fast subset (one trial each) is tests/e2e/test_multi_host.py, in `make test`."""
from __future__ import annotations

import os

import pytest

from cluster.tools.testbed import TestBed
from cluster.tools.testbed.sys_cmd import need_root
from testbed_cluster import MultiHostServe
from testbed_faults import Tally, decode_host_kill, prefill_host_kill, prefill_host_partition

pytestmark = [pytest.mark.ray, pytest.mark.chaos_hosts,
              pytest.mark.skipif(bool(need_root()), reason=need_root() or "root")]
TRIALS = int(os.environ.get("CHAOS_HOST_TRIALS", "10"))
FAULTS = {"decode-kill": ("decode host killed", decode_host_kill),
          "prefill-kill": ("prefill host killed mid-transfer", prefill_host_kill),
          "partition": ("prefill host partitioned 10 s", prefill_host_partition)}
# CHAOS_HOST_FAULTS=partition (comma-separated keys of FAULTS) runs a subset, in this order
_KEYS = os.environ.get("CHAOS_HOST_FAULTS", ",".join(FAULTS)).split(",")
if set(_KEYS) - set(FAULTS):
    raise ValueError(f"CHAOS_HOST_FAULTS takes a comma-separated subset of {', '.join(FAULTS)}, got {_KEYS}")
CHOSEN = [FAULTS[k] for k in _KEYS]


@pytest.mark.timeout(7200)
def test_faults_across_hosts_full_counts(tiny_llama_dir, hf_model, capsys):
    rows = {}
    with TestBed.up(4) as bed:
        serve = MultiHostServe(bed, tiny_llama_dir, decode_hosts=("h3", "h4"), decode_workers=2,
                               slots_per_host=1, transfer_backend=os.environ.get("PDSERVE_TESTBED_BACKEND", "tcp"),
                               lease_ttl=5.0, transfer_timeout=5.0)
        try:
            for name, fault in CHOSEN:
                tally = rows[name] = Tally()
                for t in range(TRIALS):
                    fault(bed, serve, hf_model, t, tally)
        finally:
            serve.stop()
            with capsys.disabled():
                for name, tally in rows.items():
                    print(f"\n{name}: {tally.row()}")
    assert all(t.trials == TRIALS for t in rows.values()), rows
