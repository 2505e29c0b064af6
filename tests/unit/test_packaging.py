"""pyproject.toml says what the code needs, no less: the Python version its syntax and stdlib
calls need, the grpcio / protobuf floors the generated code checks at import, every third-party
package the serving code imports (test tools only in the test extra), private APIs' packages
pinned to a minor series; `make serve` installs no test tools and `make test` does."""
from __future__ import annotations

import ast
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kvtransfer", "cluster", "prefill_worker", "decode_worker")
PB = ROOT / "cluster" / "pb" / "pdserve" / "v1"
TEST_ONLY = {"pytest", "hypothesis", "transformers", "openai", "guidellm", "grpcio-tools", "jsonschema",
             "kubernetes-validate", "dockerfile", "pytest-timeout", "mypy"}
TOOLS = ROOT / "cluster" / "tools"      # offline tools (bench, sim, planner, testbed, tiny models): not serving code
PRIVATE_APIS = {"nixl": "nixl._bindings", "ucxx-cu12": "ucxx._lib"}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements(group: str | None = None) -> dict[str, Requirement]:
    p = project()
    reqs = p["dependencies"] if group is None else p["optional-dependencies"][group]
    return {canonicalize_name(r.name): r for r in map(Requirement, reqs)}


def floor(req: Requirement) -> Version:
    floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert floors, f"{req} has no lower bound"
    return max(floors)


def _module_level(tree: ast.Module):
    """The nodes that run when the module is imported (not inside a function)."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield node
            stack.extend(ast.iter_child_nodes(node))


def imports(paths, module_level_only: bool = False) -> dict[str, set[str]]:
    """Top-level third-party module -> files importing it (function-level imports included
    unless ``module_level_only``)."""
    first = set(PACKAGES) | {p.stem for p in (ROOT / "tests").rglob("*.py")}
    out: dict[str, set[str]] = {}
    for f in paths:
        tree = ast.parse(f.read_text(), str(f))
        for node in (_module_level(tree) if module_level_only else ast.walk(tree)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for n in names:
                top = n.split(".")[0]
                if top not in first and top not in sys.stdlib_module_names:
                    out.setdefault(top, set()).add(str(f.relative_to(ROOT)))
    return out


def distributions(module: str) -> set[str]:
    dists = md.packages_distributions().get(module)
    assert dists, f"{module} is imported but no installed distribution provides it"
    return {canonicalize_name(d) for d in dists}


def runtime_files():
    return [f for p in PACKAGES for f in (ROOT / p).rglob("*.py")]


def serving_files():
    return [f for f in runtime_files() if not f.is_relative_to(TOOLS)]


def test_requires_python_covers_what_the_code_uses():
    spec = project()["requires-python"]
    lowest = min(Version(s.version) for s in Requirement("python" + spec).specifier if s.operator == ">=")
    uses_311 = [str(f.relative_to(ROOT)) for f in runtime_files()
                if re.search(r"\basyncio\.timeout\(|\bexcept\*|\bimport tomllib\b|\bTaskGroup\(", f.read_text())]
    assert uses_311, "nothing needs 3.11 any more: lower requires-python"
    assert lowest >= Version("3.11"), f"{uses_311[:3]} need Python 3.11 but requires-python is {spec!r}"
    assert sys.version_info >= (lowest.major, lowest.minor)


def test_protobuf_floor_matches_the_generated_codes_check():
    tree = ast.parse((PB / "generation_pb2.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "attr", "") == "ValidateProtobufRuntimeVersion"]
    assert len(calls) == 1
    major, minor, patch = (ast.literal_eval(a) for a in calls[0].args[1:4])
    declared = requirements()["protobuf"]
    assert floor(declared) >= Version(f"{major}.{minor}.{patch}"), \
        f"generation_pb2.py needs protobuf >= {major}.{minor}.{patch}; pyproject declares {declared}"
    assert Version(md.version("protobuf")) in declared.specifier


def test_grpcio_floor_matches_the_generated_codes_check():
    text = (PB / "generation_pb2_grpc.py").read_text()
    generated = Version(re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", text, re.M).group(1))
    reqs = requirements()
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert floor(reqs[name]) >= generated, \
            f"generation_pb2_grpc.py needs grpcio >= {generated}; pyproject declares {reqs[name]}"
    tools = requirements("test")["grpcio-tools"]
    assert floor(tools) >= generated, "`make proto` with an older grpcio-tools would lower the floor silently"


def test_every_package_the_serving_code_imports_is_declared():
    declared = set(requirements()) | set(requirements("nixl")) | set(requirements("ucx"))
    missing = {m: sorted(f)[:2] for m, f in imports(serving_files()).items()
               if m != "google" and not distributions(m) & declared}
    assert not missing, f"imported by the serving code but not declared in pyproject.toml: {missing}"
    assert "protobuf" in declared      # `google.protobuf`
    assert not TEST_ONLY & set(requirements()), "test tools belong in the test extra, not the core"


def test_the_tools_use_test_extra_packages_only_inside_functions():
    """cluster/tools may use a package of the test extra (transformers, for the tiny models that
    tests and benchmarks share) inside the function that needs it, so a `make serve` install
    still imports every tools module; everything else they import is declared like the serving code's."""
    declared = set(requirements()) | set(requirements("nixl")) | set(requirements("ucx"))
    files = sorted(TOOLS.rglob("*.py"))
    at_import = {m: sorted(f)[:2] for m, f in imports(files, module_level_only=True).items()
                 if m != "google" and not distributions(m) & declared}
    assert not at_import, f"imported by cluster/tools at module level but not declared in the core: {at_import}"
    declared |= set(requirements("test"))
    missing = {m: sorted(f)[:2] for m, f in imports(files).items()
               if m != "google" and not distributions(m) & declared}
    assert not missing, f"imported by cluster/tools but not declared in pyproject.toml: {missing}"


def test_every_package_the_tests_import_comes_with_the_test_extra():
    declared = set(requirements()) | set(requirements("test")) | set(requirements("nixl")) | set(requirements("ucx"))
    files = list((ROOT / "tests").rglob("*.py"))
    mods = imports(files)
    for f in files:   # pytest.importorskip(name) is an import too
        mods.update({m: {str(f)} for m in re.findall(r'importorskip\("(\w+)"', f.read_text())
                     if m not in sys.stdlib_module_names})
    missing = {m: sorted(f)[:2] for m, f in mods.items() if m != "google" and not distributions(m) & declared}
    assert not missing, f"imported by the tests but not in pyproject's test extra: {missing}"


@pytest.mark.parametrize("dist, extra", [("nixl", "nixl"), ("ucxx-cu12", "ucx")])
def test_private_apis_are_pinned_to_the_tested_minor_series(dist, extra):
    module = PRIVATE_APIS[dist]
    assert any(module in f.read_text() for f in (ROOT / "kvtransfer").rglob("*.py")), \
        f"kvtransfer no longer uses {module}: the pin can be relaxed"
    req = requirements(extra)[canonicalize_name(dist)]
    lo = floor(req)
    uppers = [Version(s.version) for s in req.specifier if s.operator == "<"]
    assert uppers == [Version(f"{lo.major}.{lo.minor + 1}")], f"{req}: pin to {lo.major}.{lo.minor}.x"
    try:
        installed = Version(md.version(dist))
    except md.PackageNotFoundError:
        return
    assert installed in req.specifier, f"tested with {dist} {installed}, outside {req}"


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_serve_installs_no_test_tools_and_make_test_does():
    def dry(target: str) -> str:
        run = subprocess.run(["make", "-n", target, "VENV=/nonexistent/pdserve-venv"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        return run.stdout

    installs = [ln for ln in dry("serve").splitlines() if "pip install" in ln]
    assert any("-e '.[nixl,ucx]'" in ln for ln in installs), installs
    assert not any("test" in ln or any(t in ln for t in TEST_ONLY) for ln in installs), installs
    test_installs = [ln for ln in dry("test").splitlines() if "pip install" in ln]
    assert any(re.search(r"-e '\.\[[^\]]*\btest\b", ln) for ln in test_installs), test_installs
