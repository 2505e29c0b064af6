"""Test hosts from Linux namespaces (cluster/tools/testbed): each its own network,
PID, IPC, UTS and mount namespace; links that can be capped, cut and restored;
hosts killed whole; every trace removed by down() or by the next sweep."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.tools.testbed import TestBed, sweep_stale
from cluster.tools.testbed.bed import STATE_ROOT
from cluster.tools.testbed.sys_cmd import need_root

pytestmark = pytest.mark.skipif(bool(need_root()), reason=need_root() or "root")
PY = sys.executable


def _traces(run_id: str) -> list[str]:
    """The bed's namespaces (`pdtb-<run>-h<i>`), links (`pdtb<run>...`) and state directory still there.
    Matched by name, not as a substring of the line: a run id is 4 random hex digits, and one such as
    "defa" or "1000" also occurs in the loopback's line ("group default", "qlen 1000")."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [line.split(" ", 1)[0] for line in ns.splitlines()]
    devs = [line.split(":", 2)[1].strip().split("@", 1)[0] for line in links.splitlines() if line.count(":") >= 2]
    return ([n for n in names if n.startswith(f"pdtb-{run_id}-")] + [d for d in devs if d.startswith(f"pdtb{run_id}")]
            + ([str(STATE_ROOT / run_id)] if (STATE_ROOT / run_id).exists() else []))


def _connect(src, address: str, port: int, timeout: float = 2.0) -> str:
    code = (f"import socket\ntry:\n socket.create_connection(({address!r}, {port}), timeout={timeout}); print('ok')\n"
            f"except ConnectionRefusedError: print('refused')\nexcept OSError as e: print(type(e).__name__)")
    return src.run([PY, "-c", code]).stdout.strip()


def test_hosts_are_separate_machines_on_one_network_and_leave_no_trace():
    with TestBed.up(2) as bed:
        h1, h2 = bed.hosts
        run_id = bed.run_id
        assert [h1.run(["hostname"]).stdout.strip(), h2.run(["hostname"]).stdout.strip()] == ["h1", "h2"]
        # own PID namespace: the host sees only its own few processes
        assert int(h1.run(["sh", "-c", "ls /proc | grep -c '^[0-9]'"]).stdout) < 10
        # private /tmp and /dev/shm
        h1.run(["sh", "-c", "echo x > /tmp/only-h1 && echo y > /dev/shm/only-h1"])
        assert h2.run(["ls", "/tmp/only-h1"]).returncode != 0 and h2.run(["ls", "/dev/shm/only-h1"]).returncode != 0
        assert (h1.state_dir / "tmp" / "only-h1").exists()    # readable from outside, for logs
        # each its own address; hosts reach each other and the root namespace's gateway
        assert h2.address != h1.address and h1.address.startswith("198.18.")
        assert _connect(h1, h2.address, 9) == "refused"        # reachable, nothing listening
        assert _connect(h1, bed.gateway, 9) == "refused"
        # a cut link times out; restored, it answers again
        h2.cut()
        assert _connect(h1, h2.address, 9) == "TimeoutError"
        h2.restore()
        assert _connect(h1, h2.address, 9, timeout=5) == "refused"
        # link caps are tbf qdiscs on both ends
        h1.limit(1)
        assert "tbf" in subprocess.run(["tc", "qdisc", "show", "dev", h1.veth], capture_output=True, text=True).stdout
        with pytest.raises(ValueError, match="link speed must be > 0"):
            h1.limit(0)
        # killing a host kills every process in it at once
        sleeper = h2.popen(["sleep", "600"])
        h2.kill()
        assert not h2.alive and sleeper.wait(10) is not None
        h2.boot([])
        assert h2.alive and h2.run(["hostname"]).stdout.strip() == "h2"
    assert _traces(run_id) == []


def test_a_bed_whose_owner_died_is_swept():
    dead = subprocess.Popen(["true"])
    dead.wait()
    bed = TestBed.up(1, owner_pid=dead.pid)
    try:
        assert _traces(bed.run_id)
        assert bed.run_id in sweep_stale()
        assert _traces(bed.run_id) == []
    finally:
        bed.down()


def test_cli_up_exec_status_down():
    pdserve = [PY, "-m", "cluster.cli", "testbed"]
    up = subprocess.run(pdserve + ["up", "--hosts", "2"], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    run_id = json.loads(up.stdout)["run_id"]
    try:
        ex = subprocess.run(pdserve + ["exec", "h2", "--run-id", run_id, "--", "hostname"], capture_output=True,
                            text=True, timeout=60)
        assert (ex.returncode, ex.stdout.strip()) == (0, "h2"), ex.stderr
        status = json.loads(subprocess.run(pdserve + ["status"], capture_output=True, text=True).stdout)
        assert any(b["run_id"] == run_id and set(b["hosts"]) == {"h1", "h2"} for b in status)
        bad = subprocess.run(pdserve + ["up", "--hosts", "0"], capture_output=True, text=True)
        assert bad.returncode == 2 and "--hosts must be 1..200" in bad.stderr
    finally:
        down = subprocess.run(pdserve + ["down", run_id], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0 and _traces(run_id) == []
