"""The README and docs/ stay true: python blocks run, shell blocks name scripts, modules and flags
that exist, links resolve inside the repository, docs/cli.md is what the parsers print now."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tools import cli_reference, room_table

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 9 * 1024

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
SHELL = ("sh", "bash")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)
# what means nothing to a reader of a clone: the development sessions' notes and numbering
INTERNAL = re.compile(r"\.\./shared|DESIGN\.md|\bissues? #?\d+|\bseed's\b|\bseeds'|\bseed 0\d\d", re.I)

# command words of other tools, not checked (their -r requirement files are)
EXTERNAL = {"pip", "pip3", "uv", "gcloud", "export", "cd", ".", "source", "curl", "sh", "bash",
            "git", "printf", "echo", "mkdir", "ls"}
SEPARATORS = {"&&", "||", ";", "|", "&"}


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _blocks():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            yield pytest.param(page, m.group(1).strip(), m.group(2), id=f"{_rel(page)}:{line}")


BLOCKS = list(_blocks())
PYTHON = [b for b in BLOCKS if b.values[1] == "python"]
SHELL_BLOCKS = [b for b in BLOCKS if b.values[1] in SHELL]


def test_readme_is_short():
    size = (ROOT / "README.md").stat().st_size
    assert size < README_LIMIT, f"README.md is {size:,} bytes; keep it under {README_LIMIT:,} " \
                                "and move details into docs/"


def test_docs_exist_and_have_code():
    assert len(PAGES) > 1 and PYTHON and SHELL_BLOCKS


@pytest.mark.parametrize("page,info,body", BLOCKS)
def test_every_block_is_run_or_shell(page, info, body):
    assert info in ("python", *SHELL), (
        f"{_rel(page)}: a ```{info} block; mark it ```python (then the test runs it) or ```sh / "
        "```bash (then its commands and flags are checked)")


@pytest.mark.parametrize("page,info,body", PYTHON)
def test_python_block_runs(page, info, body, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{_rel(page)}: the python block failed:\n{result.stderr[-3000:]}"


# --- shell blocks: scripts, modules and flags ---------------------------------------------------

@functools.cache
def _parser(command: str):
    return cli_reference.build_parser(command)


def _commands(body: str):
    """Each command of a shell block, as its list of words (continuations joined, comments gone,
    split at && || ; |)."""
    for line in body.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars="&|;")
        lexer.whitespace_split = True
        words: list[str] = []
        for token in lexer:
            if token in SEPARATORS:
                if words:
                    yield words
                words = []
            else:
                words.append(token)
        if words:
            yield words


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_flags(command: str, args: list[str]) -> list[str]:
    """Every option given to one of our commands is its parser's, with a value it takes."""
    actions = _parser(command)._option_string_actions
    problems = []
    i = 0
    while i < len(args):
        word = args[i].strip("[]")
        i += 1
        if not word.startswith("-") or _is_number(word):
            continue
        flag, has_value, value = word.partition("=")
        action = actions.get(flag)
        if action is None:
            problems.append(f"{command}: no flag {flag}")
            continue
        if action.nargs == 0:
            continue
        if not has_value:
            if i >= len(args):
                problems.append(f"{command}: {flag} needs a value")
                continue
            value = args[i].strip("[]")
            i += 1
        try:
            converted = action.type(value) if action.type else value
        except Exception as exc:  # noqa: BLE001 - argparse's own type functions raise anything
            problems.append(f"{command}: {flag} {value!r}: {exc}")
            continue
        if action.choices is not None and converted not in action.choices:
            problems.append(f"{command}: {flag} {value!r} is not one of {list(action.choices)}")
    return problems


def _check_command(words: list[str]) -> list[str]:
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value python ...
        words = words[1:]
    if not words:
        return []
    head, rest = words[0], words[1:]
    if head in ("pip", "pip3", "uv"):
        return [f"{' '.join(words)}: no file {rest[i + 1]}" for i, w in enumerate(rest[:-1])
                if w == "-r" and not (ROOT / rest[i + 1]).is_file()]
    if head == "gcloud":  # the command it runs on the workers is ours
        return [p for i, w in enumerate(rest[:-1]) if w == "--command"
                for cmd in _commands(rest[i + 1]) for p in _check_command(cmd)]
    if head in EXTERNAL:
        return []
    if head == "torchrun":
        scripts = [i for i, w in enumerate(rest) if w.endswith(".py")]
        if not scripts:
            return [f"{' '.join(words)}: torchrun names no script"]
        return _check_script(rest[scripts[0]], rest[scripts[0] + 1:])
    if head in ("python", "python3"):
        if rest[:1] == ["-m"] and len(rest) > 1:
            module = rest[1]
            if importlib.util.find_spec(module) is None:
                return [f"python -m {module}: no such module"]
            if module in cli_reference.ALIASES:
                return _check_flags(cli_reference.ALIASES[module], rest[2:])
            return []
        if rest and rest[0].endswith(".py"):
            return _check_script(rest[0], rest[1:])
    return [f"{' '.join(words)}: not a command the docs test knows; run it in a ```python block "
            "or teach tests/test_docs.py the tool"]


def _check_script(script: str, args: list[str]) -> list[str]:
    if not (ROOT / script).is_file():
        return [f"{script}: no such script in the repository"]
    if script in cli_reference.ALIASES:
        return _check_flags(cli_reference.ALIASES[script], args)
    return []


@pytest.mark.parametrize("page,info,body", SHELL_BLOCKS)
def test_shell_block_commands_exist(page, info, body):
    problems = [p for words in _commands(body) for p in _check_command(words)]
    assert not problems, f"{_rel(page)}:\n" + "\n".join(problems)


def test_the_shell_check_catches_mistakes():
    assert _check_command(["python", "generate.py", "--prompt", "x", "--no_such_flag"])
    assert _check_command(["python", "stage2_transformer_flax_deepcache.py", "--cache_type", "x"])
    assert _check_command(["python", "nowhere.py"])
    assert _check_command(["python", "-m", "no_such_module_here"])
    assert _check_command(["torchrun", "--nproc_per_node", "2", "stage3_vae_decode.py", "--grids"])
    assert _check_command(["pip", "install", "-r", "requirements-none.txt"])
    assert not _check_command(["XLA_FLAGS=--x", "python", "stage2_transformer_flax_deepcache.py",
                               "--sp_size", "4", "[--num_clips", "2]"])


# --- links and wording --------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in HEADING.findall(page.read_text(encoding="utf-8"))}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_resolve_inside_the_repository(page):
    problems = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if target.startswith("https://"):
            continue
        if ":" in target.split("/")[0] or target.startswith("../shared"):
            problems.append(f"{target}: only public https links or paths in the repository")
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(ROOT) or not file.exists():
            problems.append(f"{target}: no such file in the repository")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            problems.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not problems, f"{_rel(page)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_internal_references(page):
    found = [m.group(0) for m in INTERNAL.finditer(page.read_text(encoding="utf-8"))]
    assert not found, (f"{_rel(page)} mentions {found}: development notes mean nothing to a "
                       "reader of the repository")


def test_module_index_is_current():
    """docs/modules.md names every module of the product rooms with its docstring's summary."""
    want = room_table.render()
    have = (ROOT / "docs" / "modules.md").read_text(encoding="utf-8")
    assert have == want, "docs/modules.md is stale: run `python -m tools.room_table > docs/modules.md`"


def test_cli_reference_is_current():
    want = cli_reference.render()
    have = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert have == want, "docs/cli.md is stale: run `python -m tools.cli_reference > docs/cli.md`"
