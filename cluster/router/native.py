"""The router's C module (``csrc/*.c``, one extension ``routerfast``), built on first use;
None where it cannot be.

A routing decision's cost was memory latency, not the interpreter: probing a
794k-entry dict along a 125-block prompt is a few dependent cache misses per
block, and recording the prompt as in flight writes 125 entries into a
1.5M-entry dict. ``BlockTable`` mirrors ``PrefixIndex._held`` in a flat
open-addressing table and walks a whole prompt in one call with prefetches
running ahead, so the misses overlap; ``InFlightTable`` holds
``InFlightPrefixes``' two generations the same way. Both answer exactly what
the pure-Python paths answer (tests compare them); those paths stay, for a
host without a C compiler or with ``PDSERVE_ROUTER_NATIVE=0``. ``Decider``
(csrc/decider.c, decide.c, records.c) makes a whole prefix_aware decision over
those tables in one call (native_router.py says when the Router uses it).

The module is compiled with the system C compiler against this Python's
headers (stdlib ``sysconfig`` + ``subprocess``: no torch, no build
dependency) into ``$PDSERVE_KERNEL_DIR`` or ``~/.cache/pdserve/kernels``,
keyed by the sources, the compiler flags and the Python ABI, and written by an
atomic rename, so concurrent processes share one build.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Any, Protocol, Sequence

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
# -ffp-contract=off: no fused multiply-adds, so the decider's costs round as Python's do
_FLAGS = ["-O2", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing", "-ffp-contract=off"]


class BlockTable(Protocol):
    def sync(self, hashes: Sequence[int], held: dict[int, int], /) -> None: ...
    def walk(self, hashes: Sequence[int], /) -> list[tuple[int, int, int, int]]: ...
    def get(self, h: int, /) -> int | None: ...
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...


class InFlightTable(Protocol):
    def record(self, hashes: Sequence[int], worker: int, epoch: int, expiry: float, /) -> None: ...
    def refresh(self, hashes: Sequence[int], worker: int, epoch: int, expiry: float, now: float,
                epochs: list[int], /) -> None: ...
    def age(self, now: float, ttl: float, /) -> None: ...
    def gen_start(self) -> float | None: ...
    def match(self, hashes: Sequence[int], now: float, epochs: list[int], /) -> tuple[int, int] | None: ...
    def on_removed(self, worker: int, hashes: Sequence[int], /) -> None: ...
    def nbytes(self) -> int: ...
    def empty(self) -> bool: ...
    def dump(self) -> tuple[list[tuple[int, int, int, float]], list[tuple[int, int, int, float]]]: ...
    def __len__(self) -> int: ...


def _sources() -> list[Path]:
    return sorted(_CSRC.glob("*.c"))


class Decider(Protocol):
    def add(self, worker_id: str, in_flight_number: int, /) -> int: ...
    def remove(self, slot: int, /) -> None: ...
    def set_load(self, slot: int, queued: int, running: int, waiting: int, kv_usage: float, /) -> None: ...
    def set_bit(self, bit: int, slot: int, /) -> None: ...
    def set_roles(self, prefill: Sequence[int], decode: Sequence[int], /) -> None: ...
    def load(self, slot: int, /) -> tuple[int, int, int, float]: ...
    def pending(self, slot: int, /) -> tuple[int, int, float | None]: ...
    def assigned(self, slot: int, /) -> int: ...
    def next_expiry(self) -> float | None: ...
    def decide(self, hashes: Sequence[int], prompt_tokens: int, block_size: int, request_id: str,
               tie_key: int, now: float, /) -> Any: ...


def _cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_KERNEL_DIR") or Path.home() / ".cache" / "pdserve" / "kernels")


def _build(target: Path) -> None:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [*cc.split(), *_FLAGS, f"-I{sysconfig.get_paths()['include']}", f"-I{_CSRC}",
               *map(str, _sources()), "-o", tmp]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def module() -> Any:
    """The compiled ``routerfast`` module, or None (disabled, or no compiler: logged once)."""
    if os.environ.get("PDSERVE_ROUTER_NATIVE", "1") == "0":
        return None
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    text = b"".join(p.name.encode() + p.read_bytes() for p in sorted(_CSRC.glob("*.[ch]")))
    key = hashlib.sha256(text + " ".join(_FLAGS).encode() + suffix.encode()).hexdigest()[:16]
    target = _cache_dir() / f"routerfast-{key}{suffix}"
    try:
        if not target.exists():
            _build(target)
        loader = importlib.machinery.ExtensionFileLoader("routerfast", str(target))
        spec = importlib.util.spec_from_file_location("routerfast", target, loader=loader)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        return mod
    except (OSError, subprocess.SubprocessError, ImportError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("router: C tables unavailable (%s); using the pure-Python index", detail)
        return None


def block_table() -> BlockTable | None:
    mod = module()
    return None if mod is None else mod.BlockTable()


def in_flight_table() -> InFlightTable | None:
    mod = module()
    return None if mod is None else mod.InFlightTable()


def decider(*args: Any) -> Decider | None:
    """A ``routerfast.Decider`` (arguments: see native_router.py), or None without the module."""
    mod = module()
    return None if mod is None else mod.Decider(*args)
