"""The import graph of src/layerkv: no cycle, and no edge from a lower layer up to a higher one
(STYLE: dependencies one way). Module-level imports only (a function-local import is a lazy,
optional dependency, e.g. torch or vllm); `if TYPE_CHECKING:` imports count for cycles too."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Who may not import whom: a module under the key may import none of the prefixes listed.
FORBIDDEN = {
    "layerkv.errors": ["layerkv."],
    # the one named-thread pool: below every package that runs threads (store/, transfer/)
    "layerkv.threads": ["layerkv."],
    "layerkv.config": ["layerkv.store", "layerkv.objects", "layerkv.transfer", "layerkv.connector", "layerkv.engine"],
    "layerkv.messages": ["layerkv.store", "layerkv.objects", "layerkv.metadata", "layerkv.transfer", "layerkv.connector"],
    "layerkv.metadata": ["layerkv.store", "layerkv.objects", "layerkv.transfer", "layerkv.connector"],
    "layerkv.store": ["layerkv.objects", "layerkv.transfer", "layerkv.connector", "layerkv.engine", "layerkv.integrations"],
    # what an object is: above the store (keys name its objects), below everything that moves them
    "layerkv.objects": ["layerkv.transfer", "layerkv.connector", "layerkv.metadata", "layerkv.engine",
                        "layerkv.integrations", "layerkv.bench", "layerkv.commands", "layerkv.demos", "layerkv.cli"],
    "layerkv.transfer": ["layerkv.connector", "layerkv.engine", "layerkv.integrations", "layerkv.bench",
                         "layerkv.commands", "layerkv.demos"],
    "layerkv.connector": ["layerkv.engine", "layerkv.integrations", "layerkv.bench", "layerkv.commands", "layerkv.demos"],
    # the two sides of the connector meet only in the step metadata and the workers' reports
    "layerkv.connector.worker": ["layerkv.connector.scheduler"],
    "layerkv.connector.worker_jobs": ["layerkv.connector.scheduler"],
    "layerkv.connector.scheduler": ["layerkv.connector.worker", "layerkv.connector.worker_jobs"],
    "layerkv.engine": ["layerkv.integrations", "layerkv.bench", "layerkv.commands", "layerkv.demos"],
    "layerkv.integrations": ["layerkv.bench", "layerkv.commands", "layerkv.demos"],
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """layerkv modules `path` imports at module level (TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` and friends
            body.extend(node.body)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("layerkv")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("layerkv"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from layerkv import worker_jobs`
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, f"import cycles: {cycles}"


def test_no_upward_import() -> None:
    graph = _graph()
    bad = [
        f"{mod} imports {dep}"
        for mod, deps in sorted(graph.items())
        for owner, banned in FORBIDDEN.items()
        if mod == owner or mod.startswith(owner + ".")
        for dep in sorted(deps)
        if any(dep == b.rstrip(".") or dep.startswith(b if b.endswith(".") else b + ".") or dep == b for b in banned)
        and not dep.startswith(owner)
    ]
    assert not bad, "upward imports: " + "; ".join(bad)
