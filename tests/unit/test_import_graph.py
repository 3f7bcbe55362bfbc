"""The import graph of src/layerkv: no cycle, and no edge from a lower layer up to a higher one
(STYLE: dependencies one way). Every import counts for cycles, function-local ones too (lazy is
still a dependency); the upward rule reads module-level imports (`if TYPE_CHECKING:` included):
a function-local import there is a lazy, optional dependency, e.g. torch or vllm."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
# the two sides of the connector meet only in the step metadata and the workers' reports
_WORKER_SIDE = [f"layerkv.connector.{m}" for m in ("worker", "worker_jobs", "worker_step", "worker_threads")]
_SCHEDULER_SIDE = [f"layerkv.connector.{m}" for m in ("scheduler", "lookup")]

# Who may not import whom: a module under the key may import none of the prefixes listed.
FORBIDDEN = {
    "layerkv.errors": ["layerkv."],
    # the one named-thread pool: below every package that runs threads (store/, transfer/)
    "layerkv.threads": ["layerkv."],
    "layerkv.config": ["layerkv.store", "layerkv.objects", "layerkv.transfer", "layerkv.connector", "layerkv.engine"],
    "layerkv.messages": [
        "layerkv.store",
        "layerkv.objects",
        "layerkv.metadata",
        "layerkv.transfer",
        "layerkv.connector",
    ],
    "layerkv.metadata": ["layerkv.store", "layerkv.objects", "layerkv.transfer", "layerkv.connector"],
    "layerkv.store": [
        "layerkv.objects",
        "layerkv.transfer",
        "layerkv.connector",
        "layerkv.engine",
        "layerkv.integrations",
    ],
    # what an object is: above the store (keys name its objects), below everything that moves them
    "layerkv.objects": [
        "layerkv.transfer",
        "layerkv.connector",
        "layerkv.metadata",
        "layerkv.engine",
        "layerkv.integrations",
        "layerkv.bench",
        "layerkv.commands",
        "layerkv.demos",
        "layerkv.cli",
    ],
    "layerkv.transfer": [
        "layerkv.connector",
        "layerkv.engine",
        "layerkv.integrations",
        "layerkv.bench",
        "layerkv.commands",
        "layerkv.demos",
    ],
    "layerkv.connector": [
        "layerkv.engine",
        "layerkv.integrations",
        "layerkv.bench",
        "layerkv.commands",
        "layerkv.demos",
    ],
    **{module: _SCHEDULER_SIDE for module in _WORKER_SIDE},
    **{module: _WORKER_SIDE for module in _SCHEDULER_SIDE},
    "layerkv.engine": ["layerkv.integrations", "layerkv.bench", "layerkv.commands", "layerkv.demos"],
    "layerkv.integrations": ["layerkv.bench", "layerkv.commands", "layerkv.demos"],
    # vLLM's general plugin, loaded in every vLLM process before any connector: no layerkv module
    # (the connector loads lazily; the package __init__ imports it only for type checking)
    "layerkv.integrations.vllm.plugin": ["layerkv."],
    # the prefill / decode proxy runs beside the engines, without vLLM, torch or a store: aiohttp,
    # prometheus_client and layerkv.errors only
    "layerkv.integrations.pd_proxy": [
        "layerkv.integrations.vllm",
        "layerkv.store",
        "layerkv.objects",
        "layerkv.transfer",
        "layerkv.connector",
        "layerkv.engine",
        "layerkv.config",
    ],
    # inside it, each module below the handler: config <- bodies, metrics <- routing <- app <- server, proxy
    "layerkv.integrations.pd_proxy.config": ["layerkv.integrations.pd_proxy."],
    "layerkv.integrations.pd_proxy.metrics": ["layerkv.integrations.pd_proxy."],
    "layerkv.integrations.pd_proxy.bodies": ["layerkv.integrations.pd_proxy."],
    "layerkv.integrations.pd_proxy.routing": [
        "layerkv.integrations.pd_proxy.app",
        "layerkv.integrations.pd_proxy.server",
        "layerkv.integrations.pd_proxy.proxy",
    ],
    "layerkv.integrations.pd_proxy.app": [
        "layerkv.integrations.pd_proxy.server",
        "layerkv.integrations.pd_proxy.proxy",
    ],
}
# Edges the rules above would refuse, each a decision: config validates `backend` against the
# store registry's names (the registry imports no config: a cycle would fail the test above).
ALLOWED = {("layerkv.config", "layerkv.store.registry")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.startswith("layerkv")}
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("layerkv"):
        return {node.module} | {f"{node.module}.{a.name}" for a in node.names}  # `from layerkv import worker_jobs`
    return set()


def _imports(path: Path, *, local: bool = False) -> set[str]:
    """layerkv modules `path` imports at module level (TYPE_CHECKING blocks included); with
    `local`, inside functions too."""
    tree = ast.parse(path.read_text())
    if local:
        return {m for node in ast.walk(tree) for m in _imported(node)}
    found: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` and friends
            body.extend(node.body)
        found |= _imported(node)
    return found


def _graph(*, local: bool = False) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {
        name: {m for m in _imports(path, local=local) if m in modules and m != name} for name, path in modules.items()
    }


def test_no_import_cycle() -> None:
    graph = _graph(local=True)
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
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
        and (mod, dep) not in ALLOWED
    ]
    assert not bad, "upward imports: " + "; ".join(bad)
