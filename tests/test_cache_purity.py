"""cache/ stays backend-free: it imports neither torch nor jax nor torchax (DESIGN.md rooms)."""

import ast
import pathlib
import subprocess
import sys

CACHE = pathlib.Path(__file__).resolve().parents[1] / "cache"
FORBIDDEN = {"torch", "jax", "jaxlib", "torchax", "flax", "torch_npu"}


def test_importing_the_gate_loads_no_backend():
    code = ("import sys, cache, cache.flags, cache.manager; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=CACHE.parent, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_no_source_file_in_cache_names_a_backend():
    offenders = []
    for path in CACHE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []
