"""Print the module index (docs/modules.md) from the modules' own docstrings.

    python -m tools.room_table > docs/modules.md

One table per room, in the order imports run (commands at the top, compat at the bottom: the
rooms of docs/development.md), one row per module with the first sentence of its docstring, so
the index follows the tree and tests/test_docs.py can check that it is current.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# top to bottom: a room imports only the rooms below it (tests/test_layering.py)
ROOMS = ("commands", "adapters", "tpu", "torch_backend", "encoders", "sampling", "vae_parallel",
         "sharding", "modules", "cache", "compat")
MOST = 160  # characters of a summary
# what only the team reads (the design seeds, issues, the shared notes): left out of the index
INTERNAL = re.compile(r"DESIGN\.md|issue \d+|seed \d+|\.\./shared")


def _public(text: str) -> str:
    """`text` without the items of a parenthesis that point at the team's own notes."""
    def keep(match: re.Match) -> str:
        items = [i for i in match.group(1).split(", ") if not INTERNAL.search(i)]
        return f" ({', '.join(items)})" if items else ""
    return re.sub(r"\s*\(([^()]*)\)", keep, text)


def summary(path: Path) -> str:
    """The first sentence of a module's docstring (at most MOST characters), on one line."""
    text = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    text = _public(" ".join(text.split("\n\n")[0].split()))
    first = re.split(r"(?<=\.)\s", text, maxsplit=1)[0]
    first = first.rstrip(".:;").strip()
    if len(first) > MOST:
        first = first[: MOST - 3].rsplit(" ", 1)[0] + " ..."
    return first.replace("|", "\\|")


def render() -> str:
    lines = ["# Modules", "",
             "Generated from the modules' docstrings by `python -m tools.room_table > docs/modules.md`;",
             "do not edit by hand. The rooms and their rules: [development.md](development.md).", ""]
    for room in ROOMS:
        lines += [f"## `{room}/`", "", "| module | what |", "|---|---|"]
        for path in sorted((ROOT / room).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            lines.append(f"| `{name}` | {summary(path)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
