"""sinkwatch's own import graph, read from the source (imports inside functions too): no cycle, no import back
into a package that contains the importer, and the rooms of docs/design.md §11 are the code's, each importing
only the rooms listed below it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sinkwatch"


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the sinkwatch modules it imports (anywhere in its body), from the source alone. An import of a
    name the package's ``__init__`` defines is an edge to the package; so is ``from .. import x`` of a name that
    is no module."""
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package_name = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package_name.split(".")[: len(package_name.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # "from pkg import mod" imports the submodule when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                while t and t not in modules:  # a name inside a module: the module itself
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, stack + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def upward_edges(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of a package that contains the importer (``from . import __version__`` in ``sinkwatch/records.py``):
    the package's ``__init__`` runs first and imports its modules, so such an import runs back up the tree."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if a.startswith(b + "."))


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def documented_rooms() -> list[str]:
    """The rooms of docs/design.md §11's drawing, top down (``x.py`` -> ``x``, ``x/`` -> ``x``)."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text[text.index("## 11. Layout") :].split("```")[1]
    rooms = []
    for line in block.splitlines():
        m = re.match(r"^  (\S+)", line)
        if m:
            rooms += [w.rstrip("/").removesuffix(".py") for w in m.group(1).split() if w != "sinkwatch/"]
        m2 = re.match(r"^  (\S+/) (\S+/)\s", line)  # "data/ recipes/": two data folders on one line
        if m2:
            rooms.append(m2.group(2).rstrip("/"))
    return rooms


def code_rooms() -> set[str]:
    return {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if not p.name.startswith(".") and p.name != "__pycache__"}


def test_the_graph_is_read():
    """The graph holds the known edges, so an empty graph cannot pass the tests below."""
    graph = import_graph()
    assert "sinkwatch.kernels.contract" in graph["sinkwatch.kernels.torch_chunked"]
    assert "sinkwatch.kernels.torch_chunked" in graph["sinkwatch.kernels.api"]
    assert "sinkwatch.probe.monitor" in graph["sinkwatch.live.monitor"]


def test_the_cycle_finder_finds_a_cycle():
    """find_cycle reports a planted cycle."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_an_import_back_into_the_package_is_seen(tmp_path):
    """The planted ``from . import __version__`` of a module in its own package is an upward edge (the test
    before this one ignored imports of a module's own package, and missed the one sinkwatch had)."""
    pkg = tmp_path / "sinkwatch"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .records import x\n__version__ = '0'\n")
    (pkg / "records.py").write_text("def x():\n    from . import __version__\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from .. import records\nfrom . import b\n")
    (pkg / "sub" / "b.py").write_text("")
    graph = import_graph(pkg)
    assert upward_edges(graph) == [("sinkwatch.records", "sinkwatch")]
    assert graph["sinkwatch.sub.a"] == {"sinkwatch.records", "sinkwatch.sub.b"}


def test_no_import_cycle_in_sinkwatch():
    """No sinkwatch module reaches itself through its imports (top-level or inside functions)."""
    assert find_cycle(import_graph()) is None


def test_no_import_runs_back_up():
    """No module imports a package it sits in (the root ``sinkwatch`` included): moved paths are imported where
    they live now, never through ``sinkwatch._moved``'s old names."""
    assert upward_edges(import_graph()) == []


def test_the_documented_layout_is_the_code():
    """docs/design.md §11 lists exactly the package's top-level rooms, and each room imports only rooms listed
    below it: the drawing a newcomer reads is the flow the code has."""
    rooms = documented_rooms()
    assert len(rooms) == len(set(rooms)), rooms
    assert set(rooms) == code_rooms(), (sorted(set(rooms) - code_rooms()), sorted(code_rooms() - set(rooms)))
    order = {r: i for i, r in enumerate(rooms)}
    graph = import_graph()
    wrong = sorted(
        (room(a), room(b))
        for a, targets in graph.items()
        for b in targets
        if room(a) != room(b) and room(a) != "__init__" and order[room(b)] <= order[room(a)]
    )
    assert not wrong, f"imports upwards (importer, imported) against docs/design.md §11's order: {sorted(set(wrong))}"
