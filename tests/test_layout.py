"""The package's layout keeps its rules: no import cycle between modules or between
rooms (top-level packages), no room above 20 % of the source lines, no function over 80 lines.
Pure reading of the source with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "trainguard"
MAX_SHARE = 0.20
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The trainguard modules a module imports, at any depth of its code (lazy imports count)."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("trainguard"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                deps.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name.startswith("trainguard"))
    return {d for d in deps if d in known}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(path, known) - {name} for name, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_import_cycle_between_modules():
    assert _cycles(_graph()) == []


def test_no_import_cycle_between_rooms():
    rooms: dict[str, set[str]] = {}
    for mod, deps in _graph().items():
        if mod == "trainguard":  # the package's own __init__ re-exports the worker API; not a room
            continue
        rooms.setdefault(_room(mod), set()).update(_room(d) for d in deps if d != "trainguard")
    for room, deps in rooms.items():
        deps.discard(room)
    assert _cycles(rooms) == []


def test_no_room_holds_more_than_a_fifth_of_the_lines():
    lines: dict[str, int] = {}
    for mod, path in _modules().items():
        lines[_room(mod)] = lines.get(_room(mod), 0) + len(path.read_text(encoding="utf-8").splitlines())
    total = sum(lines.values())
    too_big = {room: f"{n / total:.0%}" for room, n in lines.items() if n > MAX_SHARE * total}
    assert too_big == {}


def test_no_function_over_80_lines():
    long = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []


def test_the_cycle_finder_finds_a_cycle():
    # the checks above pass on an empty answer: the finder itself must see a real cycle
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
