"""UCX environment defaults, applied only where the user set nothing.

UCX reads ``UCX_*`` variables when a context is created, so these are put in
``os.environ`` just for the creation of a NIXL / ucxx backend
(``scoped_defaults``) and removed afterwards, together with any ``UCX_*``
variable a library added meanwhile (``import ucxx`` sets four, among them
``UCX_RNDV_FRAG_MEM_TYPE=cuda``, which made NIXL in the same process 5-10x
slower on this CPU-only host). Any variable the user exported wins; we never
overwrite it.

Defaults (measured on a 2-core host, see docs/kvtransfer.md):
- ``UCX_TLS=cma,tcp,self``: cma moves bytes process-to-process with one copy
  (process_vm_readv); tcp carries the small active messages (notifications,
  rendezvous control) and gives peer-failure detection; self for loopback.
  Skipping the probe of every other transport (ib, cuda, ...) also makes
  start-up quicker. On a GPU/RDMA fleet set ``UCX_TLS`` yourself (e.g. ``rc,cuda_copy,cuda_ipc``).
- ``UCX_NET_DEVICES``: the interface that holds the engine's host address (``lo``
  for a loopback host), so UCX's tcp transport listens on the cluster network only,
  not on every interface, and the address peers on other machines reach is the one
  it advertises. cma stays in the list for peers on the same machine: UCX counts
  it reachable only for a process of the same machine and PID namespace, so a
  peer on another host (or test host) is reached over tcp.
- ``UCX_TCP_TX_SEG_SIZE`` / ``UCX_TCP_RX_SEG_SIZE=512k``: UCX's tcp transport moves a
  large READ in segments of this size (8 KiB by default), each with its own header and
  progress round; between two test hosts with no link cap, NIXL read 0.75-0.88 GB/s with
  the default and 1.7-1.9 GB/s with 512k (docs/kvtransfer.md). Both ends set the same
  value (a receive segment must hold a peer's send segment); the cost is 512 KiB per
  buffer UCX posts, a few MB per process.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
from typing import Iterator, Mapping, MutableMapping, Optional

DEFAULT_TLS = "cma,tcp,self"
TCP_SEG_SIZE = "512k"
# Transports that can carry active messages with peer-failure handling.
_NETWORK_TLS = ("tcp", "rc", "ud", "dc", "ib", "all", "^")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds IPv4 `address`, if any."""
    import fcntl
    import socket
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:   # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def ucx_defaults(host: str, env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    env = os.environ if env is None else env
    # a user who set one segment size gets the same for the other: a receive segment
    # smaller than a peer's send segment cannot take it
    seg = env.get("UCX_TCP_TX_SEG_SIZE") or env.get("UCX_TCP_RX_SEG_SIZE") or TCP_SEG_SIZE
    defaults = {"UCX_TLS": DEFAULT_TLS, "UCX_TCP_TX_SEG_SIZE": seg, "UCX_TCP_RX_SEG_SIZE": seg}
    if is_loopback(host):
        defaults["UCX_NET_DEVICES"] = "lo"
    else:
        dev = interface_of(host)
        if dev is not None:
            defaults["UCX_NET_DEVICES"] = dev
    return defaults


def apply_defaults(defaults: Mapping[str, str],
                   env: Optional[MutableMapping[str, str]] = None) -> dict[str, str]:
    """Set each default the environment lacks; return what was actually set."""
    env = os.environ if env is None else env
    applied = {k: v for k, v in defaults.items() if k not in env}
    env.update(applied)
    return applied


@contextlib.contextmanager
def scoped_defaults(defaults: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """Apply ``defaults`` the user lacks; afterwards restore every UCX_* var."""
    before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    applied = apply_defaults(defaults)
    try:
        yield applied
    finally:
        for key in [k for k in os.environ if k.startswith("UCX_")]:
            if before.get(key) != os.environ[key]:
                if key in before:
                    os.environ[key] = before[key]
                else:
                    del os.environ[key]


def shared_memory_only(tls: str) -> bool:
    """True when UCX_TLS names no network transport (e.g. ``sm,self``).

    Such a set has no active-message transport that supports peer failure
    handling, so UCX endpoints must be created with error handling "none"
    (NIXL trap 3)."""
    tokens = [t.strip() for t in tls.split(",") if t.strip()]
    return bool(tokens) and not any(t.startswith(_NETWORK_TLS) for t in tokens)
