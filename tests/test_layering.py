"""Imports run downward only (DESIGN.md, rooms): every import statement of every module of the
product packages, lazy ones inside functions included, read from the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("compat", "cache", "modules", "sharding", "vae_parallel", "sampling", "encoders", "tpu",
         "torch_backend", "commands")
BACKENDS = ("tpu", "torch_backend")

# room -> the rooms it must never import (a backend, a command, or anything above it)
FORBIDDEN = {
    "compat": set(ROOMS) - {"compat"},
    "cache": set(ROOMS) - {"cache"},
    "modules": set(ROOMS) - {"modules"},
    "sharding": set(ROOMS) - {"sharding", "modules", "compat"},
    "vae_parallel": {*BACKENDS, "commands", "sampling", "encoders", "cache", "sharding"},
    "sampling": {*BACKENDS, "commands", "encoders"},
    "encoders": {*BACKENDS, "commands", "cache"},
    "tpu": {"commands", "encoders", "torch_backend"},
    "torch_backend": {"commands", "encoders", "tpu"},
    "commands": set(),
}


def imported_rooms(path: Path, room: str) -> dict[str, int]:
    """{project room: first line} that the module at `path` imports (relative imports resolved
    against its own package)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names = [".".join([*base, node.module] if node.module else base)]
            else:
                names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in ROOMS and top != room:
                found.setdefault(top, node.lineno)
    return found


def modules_of(room: str) -> list[Path]:
    return sorted((ROOT / room).rglob("*.py"))


@pytest.mark.parametrize("room", ROOMS)
def test_imports_run_downward(room):
    assert modules_of(room), f"room {room}/ has no modules"
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {other}"
             for p in modules_of(room) for other, line in imported_rooms(p, room).items()
             if other in FORBIDDEN[room]]
    assert not wrong, "upward imports:\n" + "\n".join(wrong)


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


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: a lazy, relative import of a backend inside a function is found."""
    pkg = tmp_path / "sampling"
    pkg.mkdir()
    (pkg / "bad.py").write_text(
        "def f():\n    from tpu.backend import JaxBackend\n    from ..commands import stage2\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert imported_rooms(pkg / "bad.py", "sampling") == {"tpu": 2, "commands": 3}
