"""What `pdserve serve` checks and resolves before Ray and the model load (cluster/preflight.py):
the model's own context as max_model_len's default, a too-large one refused in one line with exit
code 2 and no Ray started; served names; models by Hugging Face id from the local cache; strict
config values; certificates and key files; the version."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.config import ServeConfig
from cluster.preflight import preflight
from engine.loader.load import resolve_model_path, served_name
from grpc_harness import free_port, held_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """A tiny model whose context (512) is below the old 4096 default."""
    from tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("ctx512") / "tiny-ctx512", "llama", max_position_embeddings=512,
                           num_layers=1)


def serve_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`pdserve serve ...` in a fresh process, as a user runs it."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_AUTO_CONNECT": "0", **(env or {})}
    with held_port() as port:   # serve claims it before preflight: held while the process starts
        return subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "--grpc-port", str(port),
                               "--http-port", "0", "--metrics-port", "0", *args], capture_output=True, text=True,
                              timeout=timeout, env=full_env, cwd=ROOT)


def assert_refused(proc: subprocess.CompletedProcess, ray_dir: Path, *needles: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("pdserve serve: error: "), proc.stderr[-3000:]
    for n in needles:
        assert n in lines[0]
    assert not ray_dir.exists(), "Ray was started before the input was checked"


# ------------------------------------------------------------------ max_model_len
def test_max_model_len_defaults_to_the_models_context(short_model):
    cfg = preflight(ServeConfig(model=str(short_model)))
    assert cfg.max_model_len == 512
    assert preflight(ServeConfig(model=str(short_model), max_model_len=256)).max_model_len == 256


def test_no_ray_server_starts_on_a_short_context_model(short_model):
    """Before: the server's default of 4096 made the engine refuse a 512-token model."""
    import asyncio

    from cluster.server_stack import start_stack

    async def go():
        stack = await start_stack(ServeConfig(model=str(short_model), ray=False, grpc_port=free_port(), http_port=0,
                                              metrics_port=0, num_kv_blocks=64))
        try:
            return stack.backend.model_info()
        finally:
            await stack.drain_and_stop(1.0)

    info = asyncio.run(go())
    assert info.max_model_len == 512 and info.model_name == "tiny-ctx512"


def test_too_large_max_model_len_is_refused_before_ray(short_model, tmp_path):
    ray_dir = tmp_path / "ray"
    proc = serve_cli("--model", str(short_model), "--max-model-len", "1024", "--ray-temp-dir", str(ray_dir))
    assert_refused(proc, ray_dir, "max_model_len 1024 exceeds the model's context of 512")


def test_both_frontends_off_is_refused_in_one_line_before_ray(short_model, tmp_path):
    ray_dir = tmp_path / "ray"
    proc = serve_cli("--model", str(short_model), "--grpc-port", "0", "--ray-temp-dir", str(ray_dir))
    assert_refused(proc, ray_dir, "grpc_port and http_port are both 0", "set one")


# ------------------------------------------------------------------ names
def test_default_served_names_are_typeable(short_model, tmp_path):
    from engine.loader.default_model import default_model_path

    assert served_name(None) == served_name("") == "SmolLM2-135M-Instruct"
    assert served_name(str(short_model)) == "tiny-ctx512"
    assert served_name(str(short_model) + "/") == "tiny-ctx512"
    gguf = default_model_path()
    assert served_name(str(gguf)) == gguf.name.removesuffix(".gguf")
    assert preflight(ServeConfig(model=str(short_model))).served_model_name == ("tiny-ctx512",)
    cfg = preflight(ServeConfig(model=str(short_model), served_model_name=("a", "b")))
    assert cfg.served_model_name == ("a", "b")


def test_served_model_name_flag_env_and_yaml(tmp_path):
    parser_args = ["serve", "--served-model-name", "first", "second", "--no-ray"]
    import argparse

    from cluster.cli import serve as sc
    p = argparse.ArgumentParser()
    sc.register(p.add_subparsers())
    assert sc.config_from_args(p.parse_args(parser_args)).served_model_name == ("first", "second")
    assert ServeConfig.from_sources(env={"PDSERVE_SERVED_MODEL_NAME": "x, y"}).served_model_name == ("x", "y")
    y = tmp_path / "c.yaml"
    y.write_text("served_model_name: [m1, m2]\n")
    assert ServeConfig.from_sources(str(y), env={}).served_model_name == ("m1", "m2")
    with pytest.raises(ValueError, match="served_model_name"):
        ServeConfig(served_model_name=(" spaced",))


# ------------------------------------------------------------------ HF model ids
def _fake_hf_cache(home: Path, model_id: str, model_dir: Path) -> Path:
    repo = home / "hub" / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    return snapshot


def test_hf_model_id_resolves_from_the_local_cache(short_model, tmp_path, monkeypatch):
    snapshot = _fake_hf_cache(tmp_path / "hf", "tiny-org/tiny-ctx512", short_model)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert resolve_model_path("tiny-org/tiny-ctx512") == snapshot
    cfg = preflight(ServeConfig(model="tiny-org/tiny-ctx512"))
    assert cfg.served_model_name == ("tiny-org/tiny-ctx512",) and cfg.max_model_len == 512
    from engine.config import CacheConfig
    from engine.llm_engine import LLMEngine
    engine = LLMEngine.from_model("tiny-org/tiny-ctx512", cache=CacheConfig(num_blocks=64))
    assert engine.model_path == snapshot and engine.max_model_len == 512


def test_missing_hf_model_id_is_one_line_saying_where_it_looked(tmp_path):
    ray_dir = tmp_path / "ray"
    proc = serve_cli("--model", "no-org/no-model", "--ray-temp-dir", str(ray_dir),
                     env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": ""})
    assert_refused(proc, ray_dir, str(tmp_path / "hf" / "hub" / "models--no-org--no-model"))


# ------------------------------------------------------------------ strict values
@pytest.mark.parametrize("raw, expected", [("true", True), ("TRUE", True), ("1", True), ("yes", True),
                                           ("on", True), ("false", False), ("0", False), ("Off", False)])
def test_boolean_env_values(raw, expected):
    assert ServeConfig.from_sources(env={"PDSERVE_COLOCATED": raw}).colocated is expected


def test_misspelt_boolean_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"PDSERVE_COLOCATED \(config key 'colocated'\): cannot read 'ture'"):
        ServeConfig.from_sources(env={"PDSERVE_COLOCATED": "ture"})
    y = tmp_path / "c.yaml"
    y.write_text("ray: 'nope'\n")
    with pytest.raises(ValueError, match=r"c.yaml: key 'ray': cannot read 'nope' as bool"):
        ServeConfig.from_sources(str(y), env={})
    with pytest.raises(ValueError, match="PDSERVE_GRPC_PORT"):
        ServeConfig.from_sources(env={"PDSERVE_GRPC_PORT": "50051.5"})


def test_misspelt_boolean_env_refuses_serve_in_one_line(tmp_path):
    ray_dir = tmp_path / "ray"
    proc = serve_cli("--ray-temp-dir", str(ray_dir), env={"PDSERVE_COLOCATED": "ture"})
    assert_refused(proc, ray_dir, "PDSERVE_COLOCATED", "'colocated'")


def test_dtype_and_device_are_checked_at_start_up():
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, got 'fp16'"):
        ServeConfig(dtype="fp16")
    for bad in ("gpu", "cuda:x", "cpu:1", ""):
        with pytest.raises(ValueError, match="device must be"):
            ServeConfig(device=bad)
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda:0' is not available on this machine"):
            preflight(ServeConfig(device="cuda:0"))
        # joining a cluster: the workers' machines decide (a GPU-less head is normal)
        preflight(ServeConfig(device="cuda:0", address="auto"))


# ------------------------------------------------------------------ secrets and certificates
def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    for name in ("a", "b"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)
    return d


def test_certificates_and_key_files_are_checked(certs, tmp_path):
    ok = ServeConfig(tls_cert_file=str(certs / "a.pem"), tls_key_file=str(certs / "a.key"))
    preflight(ok)
    bad = [
        (dict(tls_cert_file=str(certs / "a.pem"), tls_key_file=str(certs / "b.key")), "cannot be used"),
        (dict(tls_cert_file=str(tmp_path / "none.pem"), tls_key_file=str(certs / "a.key")), "No such file"),
        (dict(tls_cert_file=str(certs / "a.key"), tls_key_file=str(certs / "a.key")), "cannot be used"),
        (dict(tls_cert_file=str(certs / "a.pem")), "tls_key_file is not"),
        (dict(tls_key_file=str(certs / "a.key")), "tls_cert_file is not"),
        (dict(tls_cert_file=str(certs / "a.pem"), tls_key_file=str(certs / "a.key"),
              tls_client_ca_file=str(certs / "a.key")), "tls_client_ca_file"),
        (dict(api_keys_file=str(tmp_path / "keys.txt")), "api_keys_file"),
        (dict(cluster_secret_file=str(tmp_path / "secret")), "cluster_secret_file"),
    ]
    for kwargs, needle in bad:
        with pytest.raises(ValueError, match=needle):
            preflight(ServeConfig(**kwargs))


def test_bad_tls_key_refuses_serve_before_ray(certs, tmp_path):
    ray_dir = tmp_path / "ray"
    proc = serve_cli("--tls-cert-file", str(certs / "a.pem"), "--tls-key-file", str(certs / "b.key"),
                     "--ray-temp-dir", str(ray_dir))
    assert_refused(proc, ray_dir, "tls_cert_file")
    keys = tmp_path / "keys.txt"
    keys.write_text("k1 t1 extra\n")
    proc = serve_cli("--api-keys-file", str(keys), "--ray-temp-dir", str(ray_dir))
    assert_refused(proc, ray_dir, "keys.txt:1")


# ------------------------------------------------------------------ version
def test_version_flag(capsys):
    from cluster.version import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"pdserve {version()}"
    assert version().split(".")[0].isdigit()
