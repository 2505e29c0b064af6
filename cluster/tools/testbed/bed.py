"""A test bed: N test hosts on one bridge in the root namespace, addressed in
198.18.0.0/15 (the range reserved for network test beds). Everything it creates
carries its run id (interfaces `pdtb<run>...`, namespaces `pdtb-<run>-h<i>`) and
is removed by down(); beds whose owner died are swept by the next up()."""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from cluster.tools.testbed.host import TestHost
from cluster.tools.testbed.sys_cmd import TestBedError, need_root, pid_alive, sh, try_sh

STATE_ROOT = Path(os.environ.get("PDSERVE_TESTBED_STATE", "/var/tmp/pdserve-testbed"))
MAX_HOSTS = 200


@dataclass
class TestBed:
    __test__ = False   # not a pytest test class

    run_id: str
    subnet: int                  # the bed is 198.18.<subnet>.0/24
    hosts: list[TestHost] = field(default_factory=list)
    owner_pid: int = 0           # 0: kept until `pdserve testbed down` (the CLI's beds)
    keep: list[str] = field(default_factory=list)   # paths under /tmp the hosts still see

    @property
    def bridge(self) -> str:
        return f"pdtb{self.run_id}"

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bed (where tests and users reach the hosts from)."""
        return f"198.18.{self.subnet}.1"

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT / self.run_id

    @property
    def shared_dir(self) -> Path:
        """A directory every host sees at the same path (models, configs); not under /tmp."""
        return self.state_dir / "shared"

    def host(self, name: str) -> TestHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} in bed {self.run_id} (hosts: {[h.name for h in self.hosts]})")

    # ---------------------------------------------------------------- up / down
    @classmethod
    def up(cls, num_hosts: int, *, link_gbit: float = 0.0, owner_pid: int | None = None,
           keep: list[str] = ()) -> "TestBed":
        """Build `num_hosts` hosts (h1 .. hN, addresses .11 ..). `keep`: paths under /tmp that
        the hosts must still see behind their private /tmp (a repo or venv cloned there)."""
        why = need_root()
        if why:
            raise TestBedError(why)
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"--hosts must be 1..{MAX_HOSTS}, got {num_hosts}")
        if link_gbit < 0:
            raise ValueError(f"--link-gbit must be >= 0 (0 = no cap), got {link_gbit}")
        sweep_stale()
        taken = {b.run_id for b in list_beds()}
        run_id = next(r for r in iter(lambda: os.urandom(2).hex(), None) if r not in taken)
        bed = cls(run_id=run_id, subnet=_free_subnet(),
                  owner_pid=os.getpid() if owner_pid is None else owner_pid)
        bed.shared_dir.mkdir(parents=True, exist_ok=True)
        bed._save()
        try:
            sh("ip", "link", "add", bed.bridge, "type", "bridge")
            sh("ip", "addr", "add", f"{bed.gateway}/24", "dev", bed.bridge)
            sh("ip", "link", "set", bed.bridge, "up")
            bed.keep = sorted({*keep, *_default_keep()})
            for i in range(1, num_hosts + 1):
                bed.hosts.append(bed._add_host(i, bed.keep))
                if link_gbit:
                    bed.hosts[-1].limit(link_gbit)
                bed._save()
        except BaseException:
            bed.down()
            raise
        return bed

    def _add_host(self, i: int, keep: list[str]) -> TestHost:
        h = TestHost(name=f"h{i}", netns=f"pdtb-{self.run_id}-h{i}", address=f"198.18.{self.subnet}.{10 + i}",
                     veth=f"pdtb{self.run_id}h{i}", state_dir=self.state_dir / f"h{i}")
        peer = f"pdtb{self.run_id}p{i}"
        sh("ip", "netns", "add", h.netns)
        sh("ip", "link", "add", h.veth, "type", "veth", "peer", "name", peer)
        sh("ip", "link", "set", peer, "netns", h.netns)
        sh("ip", "link", "set", h.veth, "master", self.bridge)
        sh("ip", "link", "set", h.veth, "up")
        ns = ("ip", "-n", h.netns)
        sh(*ns, "link", "set", peer, "name", "eth0")
        sh(*ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
        sh(*ns, "link", "set", "eth0", "up")
        sh(*ns, "link", "set", "lo", "up")
        sh(*ns, "route", "add", "default", "via", self.gateway)
        h.boot(keep)
        return h

    def reboot(self, name: str) -> TestHost:
        """Start a killed host again (fresh namespaces, same address and link), as a
        machine that comes back: nothing that ran on it runs any more."""
        h = self.host(name)
        h.kill()
        h.boot(self.keep)
        self._save()
        return h

    def down(self) -> None:
        """Kill every host and remove every namespace, link and file of the bed."""
        _teardown(self)

    def _save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "bed.json").write_text(json.dumps({
            "run_id": self.run_id, "subnet": self.subnet, "owner_pid": self.owner_pid, "keep": self.keep,
            "hosts": [{"name": h.name, "netns": h.netns, "address": h.address, "veth": h.veth,
                       "init_pid": h.init_pid, "unshare_pid": h.unshare_pid} for h in self.hosts]}))

    @classmethod
    def load(cls, run_id: str) -> "TestBed":
        path = STATE_ROOT / run_id / "bed.json"
        if not path.exists():
            raise ValueError(f"no test bed {run_id!r} (see `pdserve testbed status`)")
        d = json.loads(path.read_text())
        bed = cls(run_id=d["run_id"], subnet=d["subnet"], owner_pid=d["owner_pid"], keep=d.get("keep", []))
        bed.hosts = [TestHost(name=h["name"], netns=h["netns"], address=h["address"], veth=h["veth"],
                              state_dir=bed.state_dir / h["name"], init_pid=h["init_pid"],
                              unshare_pid=h["unshare_pid"]) for h in d["hosts"]]
        return bed

    def __enter__(self) -> "TestBed":
        return self

    def __exit__(self, *exc) -> None:
        self.down()


def _default_keep() -> list[str]:
    """This checkout and this interpreter's environment, when they live under /tmp."""
    root = str(Path(__file__).resolve().parents[2])
    return [p for p in (root, sys.prefix, os.getcwd()) if p.startswith("/tmp/")]


def _free_subnet() -> int:
    used = {b.subnet for b in list_beds()}
    for n in range(1, 255):
        if n not in used:
            return n
    raise TestBedError("every 198.18.N.0/24 is taken by a test bed: `pdserve testbed down --all`")


def list_beds() -> list[TestBed]:
    beds = []
    if STATE_ROOT.exists():
        for d in sorted(STATE_ROOT.iterdir()):
            try:
                beds.append(TestBed.load(d.name))
            except (ValueError, KeyError, json.JSONDecodeError):
                continue
    return beds


def _teardown(bed: TestBed) -> None:
    for h in bed.hosts:
        h.kill()
    _remove_net(lambda run_id: run_id == bed.run_id)
    shutil.rmtree(STATE_ROOT / bed.run_id, ignore_errors=True)


def _remove_net(owned: Callable[[str], bool]) -> None:
    """Delete every pdtb namespace (`pdtb-<run>-h<i>`) and link (`pdtb<run>...`) whose run id
    `owned` says to; a namespace's deletion also deletes the veth end inside it."""
    for line in sh("ip", "netns", "list").splitlines():
        name = line.split(" ", 1)[0]
        if name.startswith("pdtb-") and owned(name[5:9]):
            try_sh("ip", "netns", "del", name)
    for line in sh("ip", "-o", "link", "show").splitlines():
        dev = line.split(":", 2)[1].strip().split("@", 1)[0]
        if dev.startswith("pdtb") and len(dev) >= 8 and owned(dev[4:8]):
            try_sh("ip", "link", "del", dev)


def sweep_stale() -> list[str]:
    """Remove the beds whose owner process is gone (a crashed test run); returns their ids.
    Also removes pdtb interfaces and namespaces that no bed's state names any more."""
    swept, known = [], set()
    for bed in list_beds():
        if bed.owner_pid and not pid_alive(bed.owner_pid):
            _teardown(bed)
            swept.append(bed.run_id)
        else:
            known.add(bed.run_id)
    _remove_net(lambda run_id: run_id not in known)
    return swept
