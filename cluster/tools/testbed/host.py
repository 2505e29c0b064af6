"""One test host: its own network (a veth into the bed's bridge, its own address),
PID, IPC, UTS (hostname) and mount namespace (private /tmp and /dev/shm). No
shared-memory path reaches another host, so UCX and Ray must use the network."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.tools.testbed.sys_cmd import TestBedError, pid_alive, sh, try_sh

# The namespaces' first process: it mounts the private /tmp and /dev/shm, binds back
# the paths that live under /tmp and must stay visible (the repo, a venv), then waits.
# It is PID 1 of the host: killing it kills every process of the host at once.
_INIT = """set -e
hostname "$PDTB_HOSTNAME"
mount --make-rprivate /
i=0
for p in $PDTB_KEEP; do mkdir -p "$PDTB_STATE/keep/$i"; mount --bind "$p" "$PDTB_STATE/keep/$i"; i=$((i+1)); done
mount --bind "$PDTB_STATE/tmp" /tmp
mount -t tmpfs -o size=2g pdtb-shm /dev/shm
i=0
for p in $PDTB_KEEP; do mkdir -p "$p"; mount --bind "$PDTB_STATE/keep/$i" "$p"; i=$((i+1)); done
echo up > "$PDTB_STATE/init.ready"
exec sleep infinity
"""


@dataclass
class TestHost:
    __test__ = False   # not a pytest test class

    name: str              # hostname inside, e.g. "h1"
    netns: str             # ip netns name
    address: str           # its address on the bed's network (198.18.0.0/15)
    veth: str              # the root namespace's end of its link
    state_dir: Path        # /tmp of the host lives in state_dir/tmp (readable from outside)
    init_pid: int = 0      # PID (outside) of the host's PID 1
    unshare_pid: int = 0

    # ------------------------------------------------------------ lifecycle
    def boot(self, keep: list[str]) -> None:
        """Start the host's namespaces (again, after kill())."""
        (self.state_dir / "tmp").mkdir(parents=True, exist_ok=True)
        ready = self.state_dir / "init.ready"
        ready.unlink(missing_ok=True)
        env = dict(os.environ, PDTB_HOSTNAME=self.name, PDTB_STATE=str(self.state_dir),
                   PDTB_KEEP=" ".join(p for p in keep if p.startswith("/tmp/")))
        with open(self.state_dir / "init.log", "w") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", self.netns, "unshare", "--pid", "--fork", "--ipc",
                                     "--uts", "--mount", "--mount-proc", "--kill-child", "sh", "-c", _INIT],
                                    env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                    start_new_session=True)
        end = time.monotonic() + 20
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > end:
                raise TestBedError(f"host {self.name} did not start: {(self.state_dir / 'init.log').read_text()}")
            time.sleep(0.02)
        self.unshare_pid = proc.pid
        self.init_pid = self._child_of(self._child_of(proc.pid, "unshare"), "sleep")

    @staticmethod
    def _child_of(pid: int, comm: str) -> int:
        """The first child of `pid` (ip netns exec execs unshare; unshare forks the init)."""
        end = time.monotonic() + 5
        while time.monotonic() < end:
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == comm:
                        return pid
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except FileNotFoundError:
                kids = []
            if kids:
                pid = kids[0]
            else:
                time.sleep(0.01)
        raise TestBedError(f"no {comm} process under {pid}")

    @property
    def alive(self) -> bool:
        return bool(self.init_pid) and pid_alive(self.init_pid)

    def kill(self) -> None:
        """Every process of the host dies at once (its PID 1 is killed), as when a machine is lost."""
        if self.alive:
            os.kill(self.init_pid, signal.SIGKILL)
            end = time.monotonic() + 10
            while pid_alive(self.init_pid) and time.monotonic() < end:
                time.sleep(0.02)
        self.init_pid = 0

    # ------------------------------------------------------------- network
    def cut(self) -> None:
        """Its link goes down (a partition); restore() brings it back."""
        sh("ip", "link", "set", self.veth, "down")

    def restore(self) -> None:
        sh("ip", "link", "set", self.veth, "up")

    def limit(self, gbit: float) -> None:
        """Cap the link at `gbit` Gbit/s both ways (tc tbf on each end)."""
        if gbit <= 0:
            raise ValueError(f"link speed must be > 0 Gbit/s, got {gbit}")
        rate = f"{int(gbit * 1000)}mbit"
        burst = f"{max(64, int(gbit * 1000 * 1000 / 8 / 250))}kb"   # ~4 ms of traffic at the rate
        for ns in ((), ("ip", "netns", "exec", self.netns)):
            dev = self.veth if not ns else "eth0"
            sh(*ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
               "latency", "100ms")

    def unlimit(self) -> None:
        try_sh("tc", "qdisc", "del", "dev", self.veth, "root")
        try_sh("ip", "netns", "exec", self.netns, "tc", "qdisc", "del", "dev", "eth0", "root")

    def link_bytes(self) -> tuple[int, int]:
        """(bytes the host sent, bytes it received) on its link so far."""
        base = Path("/sys/class/net") / self.veth / "statistics"
        return int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text())

    # -------------------------------------------------------------- running
    def argv(self, argv: list[str]) -> list[str]:
        if not self.alive:
            raise TestBedError(f"host {self.name} is not running (killed?): boot it first")
        return ["nsenter", "--target", str(self.init_pid), "--net", "--pid", "--ipc", "--uts", "--mount",
                "--wd=" + os.getcwd(), "--", *argv]

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:
        """A process on this host (kw as subprocess.Popen)."""
        return subprocess.Popen(self.argv(argv), **kw)

    def run(self, argv: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), timeout=timeout, capture_output=True, text=True, **kw)
