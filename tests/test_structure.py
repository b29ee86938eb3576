"""The layout's rules, read from the source: protocol/ is the only seam between client/ and
server/, and no module imports another in a circle (``TYPE_CHECKING`` imports count too: they
are the same knot, only hidden from the interpreter)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"protocol": "wstream.protocol", "server": "wstream.server", "client": "wstream.client"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (``from .x import y`` counts ``.x``, and ``.x.y``
    where that is a module)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            targets = [module, *(f"{module}.{a.name}" for a in node.names)]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def test_the_scan_sees_the_imports_it_must() -> None:
    graph = _graph()
    assert "wstream.client.executor" in graph["wstream.client.trainer"]
    assert "wstream.protocol.messages" in graph["wstream.server.job"]
    assert "wstream.client.plans.registry" in graph["wstream.client.options"]


def test_client_and_server_meet_only_in_protocol() -> None:
    crossing = [
        (a, b)
        for a, targets in _graph().items()
        for b in targets
        if {a.split(".")[1], b.split(".")[1]} == {"client", "server"}
    ]
    assert crossing == []


def test_no_import_circles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == [], f"modules that import one another in a circle: {circles}"
