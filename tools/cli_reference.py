"""Print the CLI reference (docs/cli.md) from the commands' own argparse parsers.

    python -m tools.cli_reference > docs/cli.md

Each command's argument groups become sections, each flag one table row with its default, so
the page follows the parsers and tests/test_docs.py can check that it is current.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# how a user starts each command -> the module whose build_parser() it runs
COMMANDS: dict[str, str] = {
    "python generate.py": "commands.generate",
    "python stage1_encode.py": "commands.stage1",
    "python stage2_transformer_flax_deepcache.py": "commands.stage2",
    "python stage3_vae_decode.py": "commands.stage3",
    "python calibrate.py": "commands.calibrate",
    "python -m commands.calibrate": "commands.calibrate",
    "python -m commands.aot": "commands.aot",
    "python -m commands.vae_aot": "commands.vae_aot",
}

# a script or module a user may name -> the key of COMMANDS it means
ALIASES: dict[str, str] = {
    "generate.py": "python generate.py",
    "stage1_encode.py": "python stage1_encode.py",
    "stage2_transformer_flax_deepcache.py": "python stage2_transformer_flax_deepcache.py",
    "stage3_vae_decode.py": "python stage3_vae_decode.py",
    "calibrate.py": "python calibrate.py",
    "commands.calibrate": "python -m commands.calibrate",
    "commands.aot": "python -m commands.aot",
    "commands.vae_aot": "python -m commands.vae_aot",
}


def build_parser(command: str) -> argparse.ArgumentParser:
    """The parser of a command, named as in COMMANDS or ALIASES."""
    module = importlib.import_module(COMMANDS[ALIASES.get(command, command)])
    return module.build_parser()


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}`"
    if action.choices is not None and action.nargs != 0 and action.metavar is None:
        names += " {" + ", ".join(str(c) for c in action.choices) + "}"
    elif action.metavar is not None:
        names += f" {action.metavar}"
    return _cell(names)


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
        return "required" if action.required else ""
    return f"`{action.default}`"


def render_parser(command: str, parser: argparse.ArgumentParser,
                  shown: dict[tuple, str] | None = None) -> list[str]:
    """One command's section: a table per argument group. `shown` maps the groups already
    printed (title and rows) to their command, so a group shared by several commands (the
    caching flags) is printed once and referred to after."""
    shown = {} if shown is None else shown
    lines = [f"## `{command}`", ""]
    if parser.description:
        lines += [_cell(parser.description), ""]
    for group in parser._action_groups:  # argparse keeps no public list of its groups
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        rows = tuple(f"| {_flag(a)} | {_default(a)} | {_cell(a.help or '')} |" for a in actions)
        lines += [f"### {group.title}", ""]
        if (group.title, rows) in shown:
            lines += [f"The same flags as `{shown[group.title, rows]}` above.", ""]
            continue
        shown[group.title, rows] = command
        if group.description:
            lines += [_cell(group.description), ""]
        lines += ["| flag | default | what |", "|---|---|---|", *rows, ""]
    return lines


def render() -> str:
    lines = ["# Command-line reference", "",
             "Generated from the commands' parsers by `python -m tools.cli_reference > docs/cli.md`;",
             "do not edit by hand. Every command also prints this with `--help`.", ""]
    seen: set[str] = set()
    shown: dict[tuple, str] = {}
    for command, module in COMMANDS.items():
        if module in seen:  # calibrate.py and python -m commands.calibrate are one parser
            continue
        seen.add(module)
        lines += render_parser(command, build_parser(command), shown)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
