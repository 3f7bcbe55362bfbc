"""The sizes the house keeps by machine (STYLE: modules small by concept): every Python module of
src, tests and scripts at most 400 lines, every function at most 60 (from `def` to its last line),
every line at most 120 characters (ruff's E501 lets a line pass whose excess is a `# type: ignore`;
this test does not). A file that grows past a limit is split by concept, never squeezed: the limits
are here so no one has to count by hand."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_LINE_CHARS = 120


def python_files() -> list[Path]:
    files = [p for folder in ("src", "tests", "scripts") for p in (ROOT / folder).rglob("*.py")]
    return sorted(p for p in files if "__pycache__" not in p.parts)


def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            num_lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if num_lines > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({num_lines} lines)")
    return out


def test_the_tree_is_found():
    files = python_files()
    assert len(files) > 250 and ROOT / "src/layerkv/config.py" in files and Path(__file__).resolve() in files


def test_every_module_is_at_most_400_lines():
    sizes = {p: len(p.read_text().splitlines()) for p in python_files()}
    over = [f"{p.relative_to(ROOT)} ({n} lines)" for p, n in sizes.items() if n > MAX_MODULE_LINES]
    assert not over, f"split by concept (STYLE.md): {over}"


def test_every_function_is_at_most_60_lines():
    over = [entry for p in python_files() for entry in long_functions(p)]
    assert not over, f"split by concept (STYLE.md): {over}"


def test_every_line_is_at_most_120_characters():
    over = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in python_files()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if len(line) > MAX_LINE_CHARS
    ]
    assert not over, over
