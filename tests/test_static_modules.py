"""The dashboard's ES modules (``service/static/*.js``, served as they are, no bundler), checked
from their source without a browser: their imports point one way (no circle: app.js at the top,
leaves such as config.js at the bottom), each import names a module beside it, each imported
name is exported by that module (a function moved to another module leaves no import dangling),
and each hook called (``hooks.NAME``) is declared in state.js. A small regex reads the import
and export lines; the modules keep them at the start of a line."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tests import test_layers as layers

STATIC = Path(__file__).resolve().parent.parent / "service" / "static"

# `import { a, b as c } from "./x.js";` (the braces may span lines), `import X from "./x.js"`,
# `import X, { a } from "./x.js"`, `import * as ns from "./x.js"`, `import "./x.js"`, and the
# re-export `export { a } from "./x.js"`.
STATIC_IMPORT = re.compile(
    r"^(?P<kind>import|export)\s*"
    r"(?:(?P<what>\{[^}]*\}|\*\s*as\s+[\w$]+|[\w$]+(?:\s*,\s*(?:\{[^}]*\}|\*\s*as\s+[\w$]+))?)"
    r"\s*from\s*)?"
    r"[\"'](?P<source>[^\"']+)[\"']",
    re.MULTILINE,
)
# `import("./x.js")`: loaded later, but a circle through it ties the modules together all the
# same.
DYNAMIC_IMPORT = re.compile(r"\bimport\s*\(\s*[\"'](?P<source>[^\"']+)[\"']")
EXPORT_DECLARATION = re.compile(
    r"^export\s+(?:async\s+)?(?:function\s*\*?\s*|(?:class|const|let|var)\s+)(?P<name>[\w$]+)",
    re.MULTILINE,
)
EXPORT_LIST = re.compile(r"^export\s*\{(?P<names>[^}]*)\}", re.MULTILINE)
EXPORT_DEFAULT = re.compile(r"^export\s+default\b", re.MULTILINE)
# state.js's `export const hooks = { name: ..., ... };` and the calls `hooks.name(...)`.
HOOKS_OBJECT = re.compile(r"^export const hooks = \{\n(?P<body>.*?)^\};", re.MULTILINE | re.DOTALL)
HOOK_KEY = re.compile(r"^  (?P<name>[\w$]+)\s*:", re.MULTILINE)
HOOK_USE = re.compile(r"\bhooks\.(?P<name>[\w$]+)")


@dataclass(frozen=True)
class Import:
    source: str  # as written: "./api.js"
    names: tuple[str, ...]  # the names taken from it ("default" for a default import)
    dynamic: bool = False


def imported_names(what: str | None) -> tuple[str, ...]:
    """The exported names an import clause takes: ``{ a, b as c }`` takes a and b, a default
    import takes "default", a namespace (``* as ns``) or a bare import none that can be told."""
    if what is None:
        return ()
    names: list[str] = []
    head, brace, rest = what.partition("{")
    default = head.split(",")[0].strip()
    if default and not default.startswith("*"):
        names.append("default")
    if brace:
        for item in rest.rstrip("}").split(","):
            name = item.split(" as ")[0].strip()
            if name:
                names.append(name)
    return tuple(names)


def parse_imports(text: str) -> list[Import]:
    found = [
        Import(m["source"], imported_names(m["what"]))
        for m in STATIC_IMPORT.finditer(text)
        if m["kind"] == "import" or m["what"] is not None
    ]
    found += [Import(m["source"], (), dynamic=True) for m in DYNAMIC_IMPORT.finditer(text)]
    return found


def parse_exports(text: str) -> set[str]:
    names = {m["name"] for m in EXPORT_DECLARATION.finditer(text)}
    for m in EXPORT_LIST.finditer(text):
        for item in m["names"].split(","):
            name = item.split(" as ")[-1].strip()
            if name:
                names.add(name)
    if EXPORT_DEFAULT.search(text):
        names.add("default")
    return names


def read_modules() -> dict[str, str]:
    """Each module's file name and source."""
    return {path.name: path.read_text() for path in sorted(STATIC.glob("*.js"))}


def target(source: str) -> str | None:
    """The module an import names, when it is one beside the importer ("./x.js")."""
    match = re.fullmatch(r"\./([\w.-]+\.js)", source)
    return match[1] if match else None


def import_graph(modules: Mapping[str, str]) -> dict[str, set[str]]:
    """Each module and the modules beside it that it imports."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, text in modules.items():
        for imp in parse_imports(text):
            other = target(imp.source)
            if other is not None and other in modules:
                graph[name].add(other)
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """A circle per tied group, as a path that comes back to where it starts ("a.js", "b.js",
    "a.js"): the shortest one through the group's first module."""
    return [shortest_circle(graph, set(group)) for group in tied_groups(graph)]


def tied_groups(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (the Python check's Tarjan), and
    each module importing itself: each module of one reaches each other through imports.
    Sorted, so a failure reads the same each time."""
    groups = layers.circles({v: set(graph.get(v, set())) for v in graph})
    return sorted(groups + [[v] for v in graph if v in graph[v]])


def shortest_circle(graph: Mapping[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path within the group from its first module back to it (breadth first)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for v in frontier:
            for w in sorted(graph.get(v, set()) & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no circle within {sorted(group)}")  # a group always has one


def dangling(modules: Mapping[str, str]) -> list[str]:
    """Each import naming no module beside it, or a name its module does not export."""
    exports = {name: parse_exports(text) for name, text in modules.items()}
    problems: list[str] = []
    for name, text in sorted(modules.items()):
        for imp in parse_imports(text):
            other = target(imp.source)
            if other is None or other not in modules:
                problems.append(f"{name} imports {imp.source!r}: no such module beside it")
                continue
            problems += [
                f"{name} imports {wanted} from {other}, which does not export it"
                for wanted in imp.names
                if wanted not in exports[other]
            ]
    return problems


def undeclared_hooks(modules: Mapping[str, str]) -> list[str]:
    """Each ``hooks.NAME`` used (called or set) that state.js's hooks object does not declare."""
    declared = HOOKS_OBJECT.search(modules.get("state.js", ""))
    keys = {m["name"] for m in HOOK_KEY.finditer(declared["body"])} if declared else set()
    return sorted(
        f"{name} uses hooks.{m['name']}, which state.js does not declare"
        for name, text in modules.items()
        for m in HOOK_USE.finditer(text)
        if m["name"] not in keys
    )


# --------------------------------------------------------------------------------------------
# The checkers, on made-up modules: each can fail


def test_the_checker_finds_a_circle() -> None:
    graph = {
        "a.js": {"b.js"},
        "b.js": {"c.js", "e.js"},
        "c.js": {"a.js"},
        "d.js": {"a.js"},
        "e.js": set(),
        "f.js": {"f.js"},
    }
    assert circles(graph) == [["a.js", "b.js", "c.js", "a.js"], ["f.js", "f.js"]]
    assert circles({"a.js": {"b.js"}, "b.js": set(), "c.js": {"a.js", "b.js"}}) == []


def test_the_parser_reads_each_form_of_import_and_export() -> None:
    modules = {
        "a.js": (
            "/* a.js: made up.\n * import { nothing } from './comment.js' is no import */\n"
            'import { b1, b2 as two,\n  b3 } from "./b.js";\n'
            "import B, { b4 } from './b.js';\n"
            'import * as everything from "./c.js";\n'
            'import "./c.js";\n'
            'export { c1 } from "./c.js";\n'
            'const later = () => import("./d.js");\n'
            "export const a1 = 1;\n"
        ),
        "b.js": (
            "export function b1() {}\nexport async function b2() {}\nexport class b3 {}\n"
            "export let b4 = 0;\nexport default 1;\n"
        ),
        "c.js": "const c1 = 1, c2 = 2;\nexport { c1, c2 as renamed };\n",
        "d.js": (
            'import { a1, missing } from "./a.js";\nimport { c2 } from "./c.js";\n'
            'import { x } from "./gone.js";\n'
        ),
    }
    assert [(i.source, i.names, i.dynamic) for i in parse_imports(modules["a.js"])] == [
        ("./b.js", ("b1", "b2", "b3"), False),
        ("./b.js", ("default", "b4"), False),
        ("./c.js", (), False),
        ("./c.js", (), False),
        ("./c.js", ("c1",), False),
        ("./d.js", (), True),
    ]
    assert parse_exports(modules["b.js"]) == {"b1", "b2", "b3", "b4", "default"}
    assert parse_exports(modules["c.js"]) == {"c1", "renamed"}
    assert import_graph(modules) == {
        "a.js": {"b.js", "c.js", "d.js"},
        "b.js": set(),
        "c.js": set(),
        "d.js": {"a.js", "c.js"},
    }
    assert circles(import_graph(modules)) == [["a.js", "d.js", "a.js"]]
    assert dangling(modules) == [
        "d.js imports missing from a.js, which does not export it",
        "d.js imports c2 from c.js, which does not export it",
        "d.js imports './gone.js': no such module beside it",
    ]


def test_the_hook_check_finds_an_undeclared_hook() -> None:
    modules = {
        "state.js": "export const hooks = {\n  refresh: async () => {},\n};\n",
        "app.js": "hooks.refresh = go;\nhooks.refrsh = go;\n",
    }
    assert undeclared_hooks(modules) == [
        "app.js uses hooks.refrsh, which state.js does not declare"
    ]


# --------------------------------------------------------------------------------------------
# The dashboard's own modules


def test_the_dashboard_modules_are_read() -> None:
    graph = import_graph(read_modules())
    assert len(graph) >= 10 and "app.js" in graph, sorted(graph)
    # Nothing imports the entry; it reaches every other module.
    assert not [name for name, imports in graph.items() if "app.js" in imports]
    reached: set[str] = set()
    todo = ["app.js"]
    while todo:
        for other in graph[todo.pop()] - reached:
            reached.add(other)
            todo.append(other)
    assert reached == set(graph) - {"app.js"}, sorted(set(graph) - reached - {"app.js"})


def test_no_import_circle_among_the_dashboard_modules() -> None:
    graph = import_graph(read_modules())
    found = [
        f"{', '.join(group)} (e.g. {' -> '.join(shortest_circle(graph, set(group)))})"
        for group in tied_groups(graph)
    ]
    assert found == [], "modules tied by import circles: " + "; ".join(found)


def test_each_imported_name_is_exported() -> None:
    assert dangling(read_modules()) == []


def test_each_hook_used_is_declared() -> None:
    assert undeclared_hooks(read_modules()) == []
