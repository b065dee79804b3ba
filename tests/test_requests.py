"""The command line stops at each command's edge: a command turns its argparse Namespace into a
frozen, typed request in one function (`request_of`) and its `run` hands that on; no other
function of the product takes a Namespace or reads `args.`. And each request holds exactly its
parser's flags, so a renamed flag fails here, not in a user's run."""

from __future__ import annotations

import ast
import dataclasses
import importlib

import pytest

from sampling.cli import SHELL, leaves
from tests.test_layering import product_modules

# (module, function) where a Namespace may be read: each command's run and request_of (stage
# 2's in stage2_resolve.py); the commands' shared shell (sampling.cli.command's main, `typed`)
# and the cache flags' step from a Namespace
EDGES = {
    *((f"commands.{c}", f) for c in ("stage1", "stage3", "generate", "calibrate", "aot", "vae_aot")
      for f in ("run", "request_of")),
    ("commands.stage2", "run"), ("commands.stage2_resolve", "request_of"),
    ("sampling.cli", "main"), ("sampling.cli", "typed"),
    ("sampling.cache_cli", "cache_flags"),
}


def _uses_namespace(fn: ast.FunctionDef) -> int | None:
    """The first line at which `fn` itself (not a function nested in it) takes or reads a
    Namespace: a parameter annotated Namespace, `args.<flag>`, `getattr(args, ...)`,
    `Namespace` (a parameter named args that is only indexed, a function's positional
    arguments, is none)."""
    params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    for a in params:
        if a.annotation is not None and "Namespace" in ast.unparse(a.annotation):
            return fn.lineno
    todo = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue  # its own entry
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "args":
            return node.lineno
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and node.args \
                and isinstance(node.args[0], ast.Name) and node.args[0].id == "args":
            return node.lineno
        if isinstance(node, ast.Name) and node.id == "Namespace" or \
                isinstance(node, ast.Attribute) and node.attr == "Namespace":
            return node.lineno
        todo.extend(ast.iter_child_nodes(node))
    return None


def namespace_readers(modules) -> set[tuple[str, str, int]]:
    found = set()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                line = _uses_namespace(node)
                if line is not None:
                    found.add((name, node.name, line))
    return found


def test_no_namespace_below_any_commands_run():
    found = namespace_readers(product_modules())
    wrong = sorted(f"{m}.{f} (line {line})" for m, f, line in found if (m, f) not in EDGES)
    assert not wrong, ("a Namespace below a command's edge (take the typed request instead):\n"
                       + "\n".join(wrong))
    gone = EDGES - {(m, f) for m, f, _ in found}
    assert not gone, f"no longer reads a Namespace, remove from EDGES: {sorted(gone)}"


def test_the_checker_sees_a_namespace_passed_down(tmp_path):
    (tmp_path / "bad.py").write_text(
        "def run(args: argparse.Namespace):\n    return go(args)\n\n"
        "def go(args):\n    return args.model\n\n"
        "def flag(args, name):\n    return getattr(args, name)\n\n"
        "def deep(request):\n    return request.args.model\n\n"
        "def tuple_args(fn, args):\n    return fn(*args[1:])\n\n"
        "def fine(request):\n    def inner(args):\n        return args.x\n    return request.model\n")
    found = {f for _, f, _ in namespace_readers({"bad": tmp_path / "bad.py"})}
    assert found == {"run", "go", "flag", "inner"}


COMMANDS = ("stage1", "stage2", "stage3", "generate", "aot", "vae_aot")


@pytest.mark.parametrize("name", COMMANDS)
def test_each_request_holds_exactly_its_parsers_flags(name):
    module = importlib.import_module(f"commands.{name}")
    parser = module.build_parser()
    dests = {a.dest for a in parser._actions} - set(SHELL) - {"help"}
    request = module.request_of.__annotations__["return"]
    cls = getattr(module, request) if isinstance(request, str) else request
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    fields = set(leaves(cls))
    assert fields == dests, (f"flags without a field: {sorted(dests - fields)}; "
                             f"fields without a flag: {sorted(fields - dests)}")


def test_a_request_is_built_from_the_flags_given():
    from commands import generate

    r = generate.request_of(generate.build_parser().parse_args(
        ["--prompt", "p", "--teacache", "--cache_warmup", "2", "--fb_warmup", "2", "--seed", "3",
         "--image", "x.png", "--fps", "8"]))
    assert r.sample.cache.teacache and r.sample.cache.cache_warmup == (2, 2)
    assert (r.sample.seed, r.inputs.image, r.fps, r.prompt, r.sample.prompt) == (3, "x.png", 8.0,
                                                                                   "p", "p")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.sample.seed = 4


def test_a_requests_flags_are_the_namespaces_so_batch_ids_hold():
    """A batch's request ids hash the flags (commands.resume.request_id): the typed request's
    flags are the command line's own values, appended aliases and --teacache_limits included."""
    from commands import generate

    args = generate.build_parser().parse_args(
        ["--prompt", "p", "--teacache", "--teacache_limits", "max_cached=3,max_continuous=2",
         "--cache_warmup", "2", "--fb_warmup", "2", "--bn_ids", "0,1"])
    flags = leaves(generate.request_of(args))
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items()
             if k not in SHELL}
    assert flags == given
