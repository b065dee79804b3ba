"""Imports run downward only (DESIGN.md, rooms): every import statement of every module of the
product packages, lazy ones inside functions included, read from the source with `ast`. And
between modules: no import cycle, and no private name (`_x`) taken from another module."""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("compat", "cache", "modules", "sharding", "vae_parallel", "sampling", "encoders", "tpu",
         "torch_backend", "adapters", "commands")
BACKENDS = ("tpu", "torch_backend")

# room -> the rooms it must never import (a backend, a command, or anything above it)
FORBIDDEN = {
    "compat": set(ROOMS) - {"compat"},
    "cache": set(ROOMS) - {"cache"},
    "modules": set(ROOMS) - {"modules"},
    "sharding": set(ROOMS) - {"sharding", "modules", "compat"},
    "vae_parallel": {*BACKENDS, "commands", "sampling", "encoders", "cache", "sharding",
                     "adapters"},
    "sampling": {*BACKENDS, "commands", "encoders", "adapters"},
    "encoders": {*BACKENDS, "commands", "cache", "adapters"},
    "tpu": {"commands", "encoders", "torch_backend", "adapters"},
    "torch_backend": {"commands", "encoders", "tpu", "adapters"},
    # the gate on another library's model: it drives our torch backend, never a command (its
    # tiny demo pipelines embed their prompt with stage 1's word table)
    "adapters": {"commands", "tpu", "vae_parallel"},
    "commands": set(),
}


# Cycles and private names allowed to cross modules, each named with why it is due to go: the
# checks below fail on any other one, and on an entry that no longer occurs. None today.
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()


def _from_module(node: ast.ImportFrom, package: tuple[str, ...]) -> str:
    """The absolute module a `from ... import` names (relative ones resolved against `package`)."""
    if not node.level:
        return node.module
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imported_rooms(path: Path, room: str) -> dict[str, int]:
    """{project room: first line} that the module at `path` imports (relative imports resolved
    against its own package)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [_from_module(node, package)]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in ROOMS and top != room:
                found.setdefault(top, node.lineno)
    return found


def modules_of(room: str) -> list[Path]:
    return sorted((ROOT / room).rglob("*.py"))


def module_name(path: Path) -> str:
    """tpu/aot.py -> tpu.aot, tpu/__init__.py -> tpu."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for room in ROOMS for p in modules_of(room)}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def module_imports(path: Path, modules: dict[str, Path]) -> tuple[dict[str, int], list[tuple]]:
    """({product module: first line} that the module at `path` imports, [(line, module, private
    name)] it takes from another product module: `from a.b import _x`, or `a.b._x` / `b._x`
    after `import a.b` / `from a import b`). `from a import b` imports module a.b where there is
    one. The packages above an imported module, which Python runs first, are no edges of their
    own: else every package whose __init__ imports its modules would close a circle."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    me = module_name(path)

    def owner(name: str) -> str | None:  # the product module a dotted name lives in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    tree = ast.parse(path.read_text(), str(path))
    edges: dict[str, int] = {}
    private: list[tuple] = []
    bound: dict[str, str] = {}  # a name this module binds to a product module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if owner(a.name):
                    edges.setdefault(owner(a.name), node.lineno)
                    bound[a.asname or a.name] = owner(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = _from_module(node, package)
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    edges.setdefault(f"{base}.{a.name}", node.lineno)
                    bound[a.asname or a.name] = f"{base}.{a.name}"
                elif owner(base):
                    edges.setdefault(owner(base), node.lineno)
                    if _private(a.name) and owner(base) != me:
                        private.append((node.lineno, owner(base), a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            target = bound.get(ast.unparse(node.value))
            if target and target != me:
                private.append((node.lineno, target, node.attr))
    edges.pop(me, None)
    return edges, private


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle [a, b, ..., a] through each group of modules that import each other (each
    strongly connected component of more than one module; Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:  # v is the root of a component: the stack down to it
            group = set(stack[stack.index(v):])
            del stack[stack.index(v):]
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:  # a shortest way back to the group's first module, within the group
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in {w for v in frontier for w in graph[v]}:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in group and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        cycles.append(paths[last] + [start])
    return cycles


@pytest.mark.parametrize("room", ROOMS)
def test_imports_run_downward(room):
    assert modules_of(room), f"room {room}/ has no modules"
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {other}"
             for p in modules_of(room) for other, line in imported_rooms(p, room).items()
             if other in FORBIDDEN[room]]
    assert not wrong, "upward imports:\n" + "\n".join(wrong)


# rooms that never see a command line: a command turns its flags into a typed request, and the
# argparse Namespace stops at its run() (sampling/ holds the flag parsers the commands share,
# adapters/ takes our cache flags as keywords)
NO_ARGPARSE = ("compat", "cache", "modules", "sharding", "vae_parallel", "encoders", "tpu",
               "torch_backend")


@pytest.mark.parametrize("room", NO_ARGPARSE)
def test_no_command_line_below_the_commands(room):
    wrong = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in modules_of(room)
             for node in ast.walk(ast.parse(p.read_text(), str(p)))
             if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names)
             or isinstance(node, ast.ImportFrom) and node.module == "argparse"]
    assert not wrong, "argparse imported below the commands:\n" + "\n".join(wrong)


def test_nothing_outside_scripts_tests_and_bench_imports_commands():
    wrong = [f"{p.relative_to(ROOT)}:{line}" for room in ROOMS if room != "commands"
             for p in modules_of(room) for other, line in imported_rooms(p, room).items()
             if other == "commands"]
    assert not wrong, wrong


def test_top_level_scripts_are_thin():
    """Each top-level script calls one command's main and holds no logic of its own."""
    for script in sorted(ROOT.glob("*.py")):
        tree = ast.parse(script.read_text())
        rooms = {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        rooms |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert rooms & set(ROOMS) <= {"commands"}, (script.name, rooms)
        defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert not defs, f"{script.name} defines {[d.name for d in defs]}; it should only call a command"


def checked_modules() -> dict[str, Path]:
    """The product rooms, and bench/ and tools/ (no cycle and no private name there either)."""
    return {**product_modules(), **{module_name(p): p for d in ("bench", "tools")
                                    for p in sorted((ROOT / d).rglob("*.py"))}}


def _graph_and_private():
    modules = checked_modules()
    graph, private = {}, []
    for name, path in modules.items():
        graph[name], taken = module_imports(path, modules)
        private += [(name, *t) for t in taken]
    return graph, private


def test_no_import_cycle_between_modules_of_the_product_bench_and_tools():
    graph, _ = _graph_and_private()
    cycles = import_cycles(graph)
    new = [" -> ".join(f"{a} (line {graph[a][b]})" for a, b in pairwise(c)) + f" -> {c[-1]}"
           for c in cycles if frozenset(c) not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(new)
    gone = KNOWN_CYCLES - {frozenset(c) for c in cycles}
    assert not gone, f"no longer cycles, remove them from KNOWN_CYCLES: {gone}"


def test_no_private_name_is_taken_from_another_module_of_the_product_bench_and_tools():
    _, private = _graph_and_private()
    paths = checked_modules()
    new = [f"{paths[m].relative_to(ROOT)}:{line} takes {name} from {source}"
           for m, line, source, name in private if (m, source, name) not in KNOWN_PRIVATE]
    assert not new, "private names across modules (make them public or keep them home):\n" + \
        "\n".join(new)
    gone = KNOWN_PRIVATE - {(m, source, name) for m, _, source, name in private}
    assert not gone, f"no longer taken, remove them from KNOWN_PRIVATE: {gone}"


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: a lazy, relative import of a backend inside a function is found."""
    pkg = tmp_path / "sampling"
    pkg.mkdir()
    (pkg / "bad.py").write_text(
        "def f():\n    from tpu.backend import JaxBackend\n    from ..commands import stage2\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert imported_rooms(pkg / "bad.py", "sampling") == {"tpu": 2, "commands": 3}


def test_the_checker_sees_a_cycle_and_private_names(tmp_path, monkeypatch):
    """The checkers themselves: a lazy import closing a circle, `from a import _x`, and `m._x`
    after `from package import m`, relative or absolute."""
    pkg = tmp_path / "tpu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\nfrom tpu.c import _g\n")
    (pkg / "b.py").write_text("def f():\n    from . import a, c\n    return c._h(a)\n")
    (pkg / "c.py").write_text("import tpu.b\n_g = _h = None\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    modules = {module_name(p): p for p in sorted(pkg.glob("*.py"))}
    assert set(modules) == {"tpu", "tpu.a", "tpu.b", "tpu.c"}
    graph, private = {}, {}
    for name, path in modules.items():
        graph[name], private[name] = module_imports(path, modules)
    assert graph["tpu.a"] == {"tpu.b": 1, "tpu.c": 2} and graph["tpu.c"] == {"tpu.b": 1}
    assert import_cycles(graph) == [["tpu.a", "tpu.b", "tpu.a"]]
    assert private["tpu.a"] == [(2, "tpu.c", "_g")] and private["tpu.b"] == [(3, "tpu.c", "_h")]
    assert private["tpu.c"] == []


# --- one import path for one name: no façade re-exports ----------------------------------------

def _defined(tree: ast.Module) -> set[str]:
    """The names a module binds itself at its top level (not by importing them)."""
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.If, ast.Try, ast.With, ast.For)):
            for n in ast.walk(node):
                if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                    out.add(n.name)
                elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    out.add(n.id)
    return out


def reexported_imports(paths: dict[str, Path]) -> list[str]:
    """`from m import x` where module m (not a package) only imports x itself: the name has two
    import paths, and a caller should take it from where it is defined."""
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in paths.items()}
    defined = {m: _defined(t) for m, t in trees.items()}
    found = []
    for m, tree in trees.items():
        package = paths[m].relative_to(ROOT).with_suffix("").parts[:-1]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _from_module(node, package)
            if source not in trees or paths[source].name == "__init__.py":
                continue
            for alias in node.names:
                if alias.name not in defined[source] and f"{source}.{alias.name}" not in paths:
                    found.append(f"{paths[m].relative_to(ROOT)}:{node.lineno} takes "
                                 f"{alias.name} from {source}, which imports it")
    return found


def test_every_name_is_imported_from_the_module_that_defines_it():
    paths = {**product_modules(), **{module_name(p): p for d in ("bench", "tools", "tests")
                                     for p in sorted((ROOT / d).rglob("*.py"))}}
    found = reexported_imports(paths)
    assert not found, "take these from the module that defines them:\n" + "\n".join(found)


def test_the_checker_sees_a_reexport(tmp_path, monkeypatch):
    pkg = tmp_path / "cache"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    pass\n")
    (pkg / "b.py").write_text("from .a import f\n")
    (pkg / "c.py").write_text("from cache.b import f\nfrom cache import f as g\nfrom .a import f\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    paths = {module_name(p): p for p in sorted(pkg.glob("*.py"))}
    assert reexported_imports(paths) == ["cache/c.py:1 takes f from cache.b, which imports it"]
