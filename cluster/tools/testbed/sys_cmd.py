"""The few system commands a test bed runs (ip, tc, nsenter), with errors that say what failed."""
from __future__ import annotations

import os
import shutil
import subprocess


class TestBedError(RuntimeError):
    pass


def need_root() -> str:
    """'' when this process can build test hosts; else why not (tests skip with it)."""
    if os.geteuid() != 0:
        return "test hosts need root (or CAP_NET_ADMIN and CAP_SYS_ADMIN): network namespaces, veths, mounts"
    missing = [t for t in ("ip", "tc", "unshare", "nsenter") if shutil.which(t) is None]
    if missing:
        return f"test hosts need {', '.join(missing)} (Debian: iproute2, util-linux)"
    return ""


def sh(*argv: str, check: bool = True, quiet: bool = False) -> str:
    res = subprocess.run(list(argv), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise TestBedError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def try_sh(*argv: str) -> bool:
    return subprocess.run(list(argv), capture_output=True).returncode == 0


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False
