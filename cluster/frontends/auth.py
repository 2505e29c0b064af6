"""API keys and TLS files for every frontend (transport-neutral: no gRPC, no HTTP here).

Keys come from a file (one `key tenant` per line, `#` comments) or the env
variable PDSERVE_API_KEYS (`key:tenant` pairs separated by commas or
whitespace; a key without a tenant is its own tenant, under a hashed name).
Clients send `authorization: Bearer <key>` (gRPC metadata or an HTTP header);
the tenant of the key then scopes the prefix-cache salt. The transports apply
the check: cluster/frontends/grpc/auth.py (an interceptor) and the HTTP app's
route dependency.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

ENV_VAR = "PDSERVE_API_KEYS"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def bearer_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The key of an `authorization: Bearer <key>` pair (header or metadata), or None."""
    for k, v in metadata or ():
        if k.lower() == "authorization":
            value = v.decode() if isinstance(v, bytes) else v
            scheme, _, key = value.strip().partition(" ")
            if scheme.lower() == "bearer" and key.strip():
                return key.strip()
    return None


@dataclass(frozen=True)
class ApiKeys:
    """sha256(key) -> tenant. A lookup compares the digest with every known one in constant
    time (hmac.compare_digest), so neither the keys nor their number leak through timing."""
    tenants: Mapping[bytes, str]

    @classmethod
    def parse(cls, pairs: list[tuple[str, str | None]]) -> "ApiKeys":
        out: dict[bytes, str] = {}
        for key, tenant in pairs:
            if not key:
                raise ValueError("an API key must not be empty")
            out[_digest(key)] = tenant or "key-" + _digest(key).hex()[:12]
        if not out:
            raise ValueError("no API keys given; add `key tenant` lines or unset the option")
        return cls(out)

    @classmethod
    def from_file(cls, path: str | Path) -> "ApiKeys":
        pairs = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) > 2:
                raise ValueError(f"{path}:{n}: write `key tenant` (two words), got {len(parts)} words")
            pairs.append((parts[0], parts[1] if len(parts) == 2 else None))
        return cls.parse(pairs)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ApiKeys | None":
        text = (os.environ if env is None else env).get(ENV_VAR, "").strip()
        if not text:
            return None
        pairs = [(p.split(":", 1)[0], p.split(":", 1)[1] if ":" in p else None)
                 for p in re.split(r"[,\s]+", text) if p]
        return cls.parse(pairs)

    def tenant(self, metadata) -> str | None:
        """The tenant of the request's `authorization: Bearer <key>`, or None."""
        key = bearer_key(metadata)
        if key is None:
            return None
        digest = _digest(key)
        found = None
        for known, tenant in self.tenants.items():   # no early exit: the same work for every key
            if hmac.compare_digest(known, digest):
                found = tenant
        return found


@dataclass(frozen=True)
class TlsConfig:
    """Server certificate and key (PEM files); a client CA turns on mutual TLS. Each transport
    builds its own credentials from these files (grpc/auth.py, http/server.py)."""
    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca_file)

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        """(certificate chain, private key, client CA or None), as PEM bytes."""
        ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return Path(self.cert_file).read_bytes(), Path(self.key_file).read_bytes(), ca
