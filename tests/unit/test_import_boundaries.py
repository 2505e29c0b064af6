"""The import rules of docs/ARCHITECTURE.md, checked over the source: every import
statement in every .py of the packages (module level, inside functions, under
``TYPE_CHECKING``, relative ones resolved), plus ``importlib.import_module("...")``
with a literal name. One test per contract; a failure names each violating import
as ``file:line -> module``.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

WORKERS = ("prefill_worker", "decode_worker", "worker_api")
SERVING = ("cluster/frontends", "cluster/orchestration", "cluster/router", "cluster/observability",
           "cluster/server_stack.py", "cluster/config.py", "cluster/preflight.py", "cluster/cli/serve.py",
           *WORKERS, "engine", "kvtransfer")


@dataclass(frozen=True)
class Contract:
    """Files under ``sources`` (folders or files, relative to the repo) import
    nothing under any of the ``forbidden`` module prefixes."""
    name: str
    sources: tuple[str, ...]
    forbidden: tuple[str, ...]


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} -> {self.module}"


CONTRACTS = {c.name: c for c in (
    Contract("engine imports nothing above it nor kvtransfer", ("engine",),
             ("cluster", *WORKERS, "kvtransfer")),
    Contract("kvtransfer imports nothing above it nor engine", ("kvtransfer",),
             ("cluster", *WORKERS, "engine")),
    Contract("prefill_worker imports neither decode_worker nor cluster", ("prefill_worker",),
             ("decode_worker", "cluster")),
    Contract("decode_worker imports neither prefill_worker nor cluster", ("decode_worker",),
             ("prefill_worker", "cluster")),
    Contract("worker_api imports neither worker nor cluster", ("worker_api",),
             ("prefill_worker", "decode_worker", "cluster")),
    Contract("the router imports nothing above it", ("cluster/router",),
             ("cluster.frontends", "cluster.orchestration", "cluster.cli", "cluster.tools", "cluster.config",
              "cluster.observability")),
    Contract("serving code imports no tools", SERVING, ("cluster.tools",)),
    Contract("orchestration does not import the frontends", ("cluster/orchestration",), ("cluster.frontends",)),
)}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _literal_import(node: ast.Call) -> str | None:
    """``importlib.import_module("x")`` / ``import_module("x")`` / ``__import__("x")``."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def imports_of(path: Path, root: Path) -> list[Import]:
    """Every module ``path`` imports. ``from a import b`` yields ``a`` and ``a.b``
    (``b`` may be a submodule)."""
    module = module_name(path, root)
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(root)
    out: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(rel, node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, path.name == "__init__.py")
            out += [Import(rel, node.lineno, base)] if base else []
            out += [Import(rel, node.lineno, f"{base}.{a.name}" if base else a.name)
                    for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and (target := _literal_import(node)):
            out.append(Import(rel, node.lineno, target))
    return out


def python_files(root: Path, sources: tuple[str, ...]) -> list[Path]:
    files: list[Path] = []
    for src in sources:
        p = root / src
        files += [p] if p.is_file() else sorted(p.rglob("*.py"))
    return files


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(contract: Contract, root: Path = ROOT) -> list[str]:
    found: dict[tuple[Path, int], str] = {}
    for path in python_files(root, contract.sources):
        for imp in imports_of(path, root):
            if any(_under(imp.module, f) for f in contract.forbidden):
                found.setdefault((imp.path, imp.line), str(imp))   # one line per statement
    return [found[k] for k in sorted(found)]


def _mutates_sys_path(node: ast.AST) -> bool:
    def is_sys_path(n: ast.AST) -> bool:
        return (isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
                and n.value.id == "sys")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return is_sys_path(node.func.value)                     # sys.path.insert / append / extend ...
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)) for t in targets)
    return False


def benchmark_violations(root: Path = ROOT) -> list[str]:
    """Benchmarks import nothing from tests/ (by package or, as a sys.path hack
    would allow, by a test module's bare name) and do not edit sys.path."""
    tests_dir = root / "tests"
    test_modules = {p.stem for p in tests_dir.rglob("*.py")} if tests_dir.is_dir() else set()
    found: dict[tuple[Path, int], str] = {}
    for path in python_files(root, ("benchmarks",)):
        siblings = {p.stem for p in path.parent.glob("*.py")}
        for imp in imports_of(path, root):
            top = imp.module.split(".")[0]
            if top == "tests" or (top in test_modules and top not in siblings):
                found.setdefault((imp.path, imp.line), str(imp))
        rel = path.relative_to(root)
        for n in ast.walk(ast.parse(path.read_text())):
            if _mutates_sys_path(n):
                found[(rel, n.lineno)] = f"{rel}:{n.lineno} -> edits sys.path"
    return [found[k] for k in sorted(found)]


def _report(name: str, found: list[str]) -> str:
    return f"{name}: {len(found)} violating import(s):\n  " + "\n  ".join(found)


@pytest.mark.parametrize("name", list(CONTRACTS))
def test_contract(name):
    found = violations(CONTRACTS[name])
    assert not found, _report(name, found)


def test_benchmarks_use_no_tests_and_leave_sys_path_alone():
    found = benchmark_violations()
    assert not found, _report("benchmarks", found)


def test_the_contracts_cover_real_code():
    """Every contract's sources exist (worker_api may not yet) and hold Python files."""
    for c in CONTRACTS.values():
        present = [s for s in c.sources if (ROOT / s).exists()]
        assert present or c.sources == ("worker_api",), f"{c.name}: none of {c.sources} exists"
        if present:
            assert python_files(ROOT, tuple(present)), f"{c.name}: no .py under {present}"


def test_the_checker_finds_planted_violations(tmp_path):
    (tmp_path / "engine" / "sub").mkdir(parents=True)
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "sub" / "__init__.py").write_text("")
    (tmp_path / "engine" / "ok.py").write_text("import os\nfrom engine.sub import x\nfrom . import sub\n")
    (tmp_path / "engine" / "sub" / "bad.py").write_text(
        "import json\n"
        "def f():\n"
        "    from cluster.config import ServeConfig\n"          # inside a function
        "    import importlib\n"
        "    importlib.import_module('kvtransfer.handle')\n"     # by name
        "from ... import cluster\n"                               # relative, above the package
        "from .. import ok\n")
    (tmp_path / "cluster" / "router").mkdir(parents=True)
    (tmp_path / "cluster" / "router" / "r.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cluster import observability\n"
        "from cluster.router import cost\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "tiny_models.py").write_text("")
    (tmp_path / "benchmarks" / "helper.py").write_text("")
    (tmp_path / "benchmarks" / "b.py").write_text(
        "import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\nprint(sys.path)\n"
        "import helper\nfrom tiny_models import make_tiny_model\nfrom tests.grpc_harness import h\n")

    assert violations(CONTRACTS["engine imports nothing above it nor kvtransfer"], tmp_path) == [
        "engine/sub/bad.py:3 -> cluster.config", "engine/sub/bad.py:5 -> kvtransfer.handle",
        "engine/sub/bad.py:6 -> cluster"]
    assert violations(CONTRACTS["the router imports nothing above it"], tmp_path) == [
        "cluster/router/r.py:3 -> cluster.observability"]
    assert benchmark_violations(tmp_path) == [
        "benchmarks/b.py:2 -> edits sys.path", "benchmarks/b.py:3 -> edits sys.path",
        "benchmarks/b.py:6 -> tiny_models", "benchmarks/b.py:7 -> tests.grpc_harness"]
