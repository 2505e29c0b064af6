"""Transfer backends chosen by name: ``create_engine("nixl", name, config)``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvtransfer.engine import TransferEngine


@dataclass(frozen=True)
class BackendSpec:
    name: str
    is_available: Callable[[], bool]
    factory: Callable[..., TransferEngine]
    install_hint: str


def _nixl(name: str, config: Optional[Any] = None) -> TransferEngine:
    from kvtransfer.nixl_backend import NixlConfig, NixlEngine
    return NixlEngine(name, config or NixlConfig())


def _ucxx(name: str, config: Optional[Any] = None) -> TransferEngine:
    from kvtransfer.ucxx_backend import UcxxConfig, UcxxEngine
    return UcxxEngine(name, config or UcxxConfig())


def _tcp(name: str, config: Optional[Any] = None) -> TransferEngine:
    from kvtransfer.tcp_backend import TcpConfig, TcpEngine
    return TcpEngine(name, config or TcpConfig())


def _nixl_ok() -> bool:
    from kvtransfer.nixl_backend import nixl_available
    return nixl_available()


def _ucxx_ok() -> bool:
    from kvtransfer.ucxx_backend import ucxx_available
    return ucxx_available()


BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec("nixl", _nixl_ok, _nixl, "pip install 'pdserve[nixl]'"),
    BackendSpec("ucxx", _ucxx_ok, _ucxx, "pip install 'pdserve[ucx]'"),
    BackendSpec("tcp", lambda: True, _tcp, "always available"),
)


def _spec(backend: str) -> BackendSpec:
    for spec in BACKENDS:
        if spec.name == backend:
            return spec
    raise ValueError(f"unknown transfer backend {backend!r}: choose one of "
                     f"{[s.name for s in BACKENDS]}")


def available_backends() -> list[str]:
    """Installed backends, fastest first."""
    return [s.name for s in BACKENDS if s.is_available()]


def create_engine(backend: str, name: str, config: Optional[Any] = None) -> TransferEngine:
    """A transfer engine of ``backend`` named ``name`` (unique in the cluster)."""
    spec = _spec(backend)
    if not spec.is_available():
        raise ValueError(f"transfer backend {backend!r} is not installed ({spec.install_hint}); "
                         f"installed: {available_backends()}")
    return spec.factory(name, config)
