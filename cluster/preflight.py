"""What `pdserve serve` checks before it starts Ray or loads a model.

Every input that can be wrong is read here first, so a mistake costs one clear
line (`pdserve serve: error: ...`, exit code 2) instead of a worker traceback
minutes later: the TLS certificate, key and client CA, the API-key file, the
cluster secret, the device, and the model (a path, or a Hugging Face id in the
local cache) with the context it allows. The result is the config with what the
model decides filled in: `max_model_len` (0 = the model's own) and
`served_model_name` (() = a name derived from the model).
"""
from __future__ import annotations

import dataclasses
import ssl

from cluster.config import ServeConfig


def preflight(cfg: ServeConfig) -> ServeConfig:
    """Check `cfg` (ValueError saying how to fix it) and resolve its model-dependent defaults."""
    check_secrets(cfg)
    check_device(cfg)
    return resolve_model(cfg)


def check_secrets(cfg: ServeConfig) -> None:
    from cluster.frontends.auth import ApiKeys
    from cluster.orchestration.launcher import cluster_secret

    if cfg.tls_key_file and not cfg.tls_cert_file:
        raise ValueError("tls_key_file is set but tls_cert_file is not: give both")
    if cfg.tls_cert_file:
        if not cfg.tls_key_file:
            raise ValueError("tls_cert_file is set but tls_key_file is not: give both")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file, password=_no_password)
        except (OSError, ssl.SSLError, TypeError) as e:
            raise ValueError(f"tls_cert_file {cfg.tls_cert_file!r} / tls_key_file {cfg.tls_key_file!r} cannot "
                             f"be used ({_reason(e)}): give a PEM certificate and its unencrypted private key") \
                from None
    if cfg.tls_client_ca_file:
        if not cfg.tls_cert_file:
            raise ValueError("tls_client_ca_file is set but tls_cert_file is not: mutual TLS needs the "
                             "server's certificate and key too")
        try:
            ssl.create_default_context(cafile=cfg.tls_client_ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"tls_client_ca_file {cfg.tls_client_ca_file!r} cannot be used ({_reason(e)}): "
                             "give the PEM certificate(s) client certificates must chain to") from None
    if cfg.api_keys_file:
        try:
            ApiKeys.from_file(cfg.api_keys_file)
        except OSError as e:
            raise ValueError(f"api_keys_file {cfg.api_keys_file!r} cannot be read ({e.strerror}): point it "
                             "at a file of `key tenant` lines") from None
    else:
        ApiKeys.from_env()
    if cfg.cluster_secret_file:
        cluster_secret(cfg)


def check_device(cfg: ServeConfig) -> None:
    """The device must exist where the workers run. Joining a cluster (`address`), they run on
    other machines (a GPU-less head is normal), so only this machine's own workers are checked."""
    if cfg.address or cfg.device == "cpu":
        return
    import torch

    kind, _, index = cfg.device.partition(":")
    backend = getattr(torch, kind, None)
    available = bool(backend and hasattr(backend, "is_available") and backend.is_available())
    count = backend.device_count() if available and hasattr(backend, "device_count") else (1 if available else 0)
    if not available or (index and int(index) >= count):
        raise ValueError(f"device {cfg.device!r} is not available on this machine ({count} {kind} device(s)); "
                         "use --device cpu, or join a cluster whose workers have it (--address)")


def resolve_model(cfg: ServeConfig) -> ServeConfig:
    from engine.loader.load import load_model_config, served_name

    model = load_model_config(cfg.model or None)
    own = model.max_position_embeddings
    if cfg.max_model_len > own:
        raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's context of {own} tokens "
                         f"(max_position_embeddings): lower --max-model-len to at most {own}, or leave it "
                         "at 0 for the model's own")
    return dataclasses.replace(cfg, max_model_len=cfg.max_model_len or own,
                               served_model_name=cfg.served_model_name or (served_name(cfg.model or None),))


def _no_password() -> bytes:
    raise TypeError("the private key is encrypted")


def _reason(e: Exception) -> str:
    if isinstance(e, OSError) and not isinstance(e, ssl.SSLError) and e.strerror:
        return e.strerror
    return getattr(e, "reason", None) or str(e) or type(e).__name__
