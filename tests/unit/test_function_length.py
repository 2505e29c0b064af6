"""No function in cluster/ (the generated cluster/pb aside) is 50 lines or longer:
a function that long does several things, and each deserves a name.
Lines run from ``def`` (or its first decorator) to the function's last line, nested
functions included in their parent."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 49
EXCLUDED = (ROOT / "cluster" / "pb",)


def function_lengths(root: Path, excluded: tuple[Path, ...] = ()) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function under ``root``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if any(path.is_relative_to(e) for e in excluded):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                assert node.end_lineno is not None
                out.append((node.end_lineno - first + 1, f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"))
    return out


def test_no_function_in_cluster_reaches_50_lines():
    long = sorted(((n, where) for n, where in function_lengths(ROOT / "cluster", EXCLUDED) if n > MAX_LINES),
                  reverse=True)
    assert not long, (f"{len(long)} function(s) in cluster/ over {MAX_LINES} lines; split them:\n  "
                      + "\n  ".join(f"{where}: {n} lines" for n, where in long))


def test_the_length_check_sees_long_and_nested_functions(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(50))
    (tmp_path / "m.py").write_text(f"@staticmethod\ndef long():\n{body}\n\nasync def short():\n"
                                   f"    def inner():\n        pass\n")
    lengths = {where.split(" ")[1]: n for n, where in function_lengths(tmp_path.resolve())}
    assert lengths == {"long": 52, "short": 3, "inner": 2}
