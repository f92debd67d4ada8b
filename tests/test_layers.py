"""The house's shape, checked from the source with ``ast``: no import circle among the
service's and the workers' modules (imports inside functions and under ``TYPE_CHECKING``
count: a circle there still ties two modules into one), imports between service/'s rooms
pointing one way (service/__init__.py), and no module over 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("service", "workers")
MAX_LINES = 600
# Modules still over the limit, each with its line count when it was listed: the test fails
# when one grows, and when one shrinks under the limit (then it leaves the list). Empty since
# the job spec became a package (service/specs/schemas/); keep it so.
OVER_THE_LIMIT: dict[str, int] = {}


# service/'s rooms, each a folder with an ``__init__`` docstring naming its entry points, and the
# few modules every room shares, which stay at the top.
ROOMS = ("api", "specs", "scheduling", "recording", "files", "people", "database", "client")
SHARED = ("cli", "settings", "errors", "vocabulary", "logs", "metrics", "priority")
# Shared modules that import nothing of the service or the workers.
LEAVES = ("service.errors", "service.vocabulary", "service.logs", "service.priority")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of PACKAGES and the modules of PACKAGES it imports, anywhere in it."""
    modules = {
        module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    if child in modules:  # ``from service import jobs``: the module jobs
                        graph[name].add(child)
                    elif node.module in modules:
                        graph[name].add(node.module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted. A
    package's ``__init__`` importing its own modules is no circle unless one imports it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v] - {v}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_import_circle_among_the_service_and_the_workers() -> None:
    graph = import_graph()
    assert len(graph) > 80 and "service.recording.history" in graph["workers.flush"]
    assert circles(graph) == []


def room(module: str) -> str:
    """``service.api.routes.jobs`` -> ``api``; ``service.settings`` -> ``settings``;
    ``workers.flush`` -> ``workers``."""
    parts = module.split(".")
    return parts[1] if parts[0] == "service" and len(parts) > 1 else parts[0]


def layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the direction HTTP -> domain -> database: into ``api`` from anywhere but
    itself and the CLI; out of ``database`` but to the shared leaves; from the workers into
    the HTTP layer or the client; from the client (it ships to users' machines) to anything
    but itself and the shared vocabulary; and from a leaf to anything."""
    breaches = []
    for a, targets in graph.items():
        for b in sorted(targets):
            ra, rb = room(a), room(b)
            if ra == rb:
                continue
            wrong = (
                (rb == "api" and ra != "cli")
                or (ra == "database" and b not in LEAVES)
                or (ra == "workers" and rb in ("api", "cli", "client"))
                or (ra == "client" and b != "service.vocabulary")
                or a in LEAVES
            )
            if wrong:
                breaches.append(f"{a} -> {b}")
    return breaches


def test_the_layer_checker_finds_an_import_against_the_direction() -> None:
    graph = {
        "service.api.app": {"service.scheduling.jobs"},
        "service.scheduling.jobs": {"service.database.models", "service.api.responses"},
        "service.database.models": {"service.vocabulary", "service.files.storage"},
        "workers.flush": {"service.recording.history", "service.client.api"},
        "service.errors": {"service.settings"},
    }
    assert layer_breaches(graph) == [
        "service.scheduling.jobs -> service.api.responses",
        "service.database.models -> service.files.storage",
        "workers.flush -> service.client.api",
        "service.errors -> service.settings",
    ]


def test_imports_between_the_rooms_point_one_way() -> None:
    graph = import_graph()
    assert "service.database.models" in graph["service.api.routes.jobs"]
    assert layer_breaches(graph) == []
    rooms: dict[str, set[str]] = {}
    for a, targets in graph.items():
        rooms.setdefault(room(a), set()).update(room(b) for b in targets)
    assert {"specs", "database"} <= rooms["scheduling"]
    assert circles(rooms) == [], "two rooms import each other"


def test_the_service_folder_holds_its_rooms_and_the_shared_modules() -> None:
    top = {
        p.stem
        for p in (ROOT / "service").iterdir()
        if (p.suffix == ".py" or p.is_dir()) and p.name not in ("__init__.py", "__pycache__")
    }
    assert top == set(ROOMS) | set(SHARED) | {"static"}
    for name in ROOMS:
        docstring = ast.get_docstring(
            ast.parse((ROOT / "service" / name / "__init__.py").read_text())
        )
        assert docstring and len(docstring) > 80, f"service/{name}/__init__.py says what it holds"


def test_no_module_over_600_lines() -> None:
    sources = [
        path
        for folder in ("service", "workers", "migrations", "benchmarks", "docs/hooks")
        for path in (ROOT / folder).rglob("*")
        if path.suffix in (".py", ".js") and "vendor" not in path.parts
    ]
    assert len(sources) > 90
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in sources}
    over = {name: n for name, n in lines.items() if n > MAX_LINES}
    for name, n in OVER_THE_LIMIT.items():
        assert name in over, f"{name} is within {MAX_LINES} lines now: take it off the list"
        assert over[name] <= n, f"{name} grew from {n} to {over[name]} lines"
    assert set(over) <= set(OVER_THE_LIMIT), sorted(set(over) - set(OVER_THE_LIMIT))
