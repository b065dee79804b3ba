"""The shape every command shares: parse, run, one error line and exit 2 on a known error (nothing
written), one line and 128 + the signal's number on SIGINT/SIGTERM, else the summary from the rank
that speaks for the run. Plus the checks of numeric flags the commands share."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import time
import typing
from typing import Callable

from sampling.errors import StageFileError, UsageError
from sampling.journal import atomic_write

from . import progress
from .interrupt import Interrupted, handled
from .platforms import check_xla_flags
from .stage_io import check_writable_file


def launch_rank() -> int:
    """This process's rank under torchrun (RANK), 0 otherwise: rank 0 speaks for the launch."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


# How long a rank other than 0 waits before it exits on a refusal: torchrun stops every rank once
# one has exited, so a rank that refused first would silence rank 0's line. Rank 0 refuses alike
# (same flags, same checks) and the launcher ends the waiting ranks as soon as it exits.
QUIET_RANK_GRACE_S = 20.0


def _let_rank_0_speak() -> None:
    try:
        time.sleep(QUIET_RANK_GRACE_S)
    except (Interrupted, KeyboardInterrupt):
        pass


def command(build_parser: Callable, run: Callable[..., dict], format_summary: Callable[[dict], str],
            errors: tuple[type[BaseException], ...],
            speaks: Callable[[dict], bool] = lambda report: True) -> Callable[..., int]:
    def main(argv: list[str] | None = None) -> int:
        parser = build_parser()
        args = parser.parse_args(argv)
        progress.configure(quiet=getattr(args, "quiet", False), verbose=getattr(args, "verbose", 0))
        summary_json = getattr(args, "summary_json", None)
        try:  # before any work, as every other report path
            check_writable_file("--summary_json", summary_json)
        except StageFileError as exc:
            print(f"{parser.prog}: error: {exc}", file=sys.stderr)
            return 2
        with handled():
            try:
                if getattr(args, "backend", "torch") != "torch":  # only JAX starts XLA
                    check_xla_flags()
                report = run(args)
            except errors as exc:
                if launch_rank() == 0:  # every rank refuses alike; one says so
                    print(f"{parser.prog}: error: {exc}", file=sys.stderr)
                else:
                    _let_rank_0_speak()
                return 2
            except MemoryError:
                if launch_rank() == 0:
                    print(f"{parser.prog}: error: out of host memory; expected a smaller size "
                          "(--height/--width/--video_length) or fewer steps; nothing was written",
                          file=sys.stderr)
                return 2
            except (Interrupted, KeyboardInterrupt) as exc:
                signum = exc.signum if isinstance(exc, Interrupted) else 2
                name = exc.name if isinstance(exc, Interrupted) else "SIGINT"
                if launch_rank() == 0:
                    print(f"{parser.prog}: interrupted by {name}; no partial output was left "
                          "(files of earlier runs are as they were)", file=sys.stderr)
                return 128 + signum
        if speaks(report):
            print(format_summary(report))
            if summary_json is not None:  # numbers and strings; anything else by its str
                atomic_write(summary_json, lambda f: json.dump(report, f, indent=2, default=str))
        return 0
    return main


# --- help: the common flags one screen, one line each; --help_all for the rest -------------------

SECTIONS = ("inputs and model", "caching", "parallel", "outputs and reports", "advanced")


# flags other tools spell differently (diffusers' pipelines, the official generate.py scripts)
ALIASES = {"--steps": "--num_inference_steps", "--sample_steps": "--num_inference_steps",
           "--num_steps": "--num_inference_steps", "--cfg": "--guidance_scale",
           "--sample_guide_scale": "--guidance_scale", "--guidance": "--guidance_scale",
           "--frames": "--video_length", "--num_frames": "--video_length",
           "--ckpt_dir": "--model_path", "--sample_shift": "--shift", "--out": "--output_dir",
           "--output": "--output_dir", "--base_seed": "--seed"}


class CommandParser(argparse.ArgumentParser):
    """`--help`: the flags of the common path (`common`, by dest), one line each with its
    default, under five sections; `--help_all`: every flag with its full description, in the
    command's own groups. `sections` maps a group title to its section (titles that are
    sections, or start with "caching", map themselves; the rest is "advanced"). Every command
    also takes --quiet/-q, --verbose/-v and --summary_json."""

    def __init__(self, *args, common=(), sections=None, **kwargs):
        kwargs.setdefault("usage", "%(prog)s [flags]   (--help: the common ones, --help_all: all)")
        super().__init__(*args, **kwargs)
        self.common = set(common)
        self.sections = dict(sections or {})
        g = self.add_argument_group("outputs and reports")
        g.add_argument("--help_all", action=_HelpAll, nargs=0,
                       help="every flag, with its full description")
        g.add_argument("-q", "--quiet", action="store_true",
                       help="no progress bars, errors only on stderr")
        g.add_argument("-v", "--verbose", action="count", default=0,
                       help="more diagnostics on stderr (-vv: debug)")
        g.add_argument("--summary_json", help="also write the run's summary here as JSON")
        self.common |= {"help", "quiet", "summary_json"}

    def parse_args(self, args=None, namespace=None):
        """argparse's, where an unknown flag is named with the nearest one it has (`--steps`:
        did you mean --num_inference_steps?)."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            import difflib
            flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            hints = []
            for token in extras:
                name = token.split("=", 1)[0]
                if not name.startswith("--"):
                    continue
                near = ALIASES.get(name) or next(iter(difflib.get_close_matches(
                    name, flags, n=1, cutoff=0.7)), None)
                if near in flags:
                    hints.append(f"{name}: did you mean {near}?")
            self.error(f"unrecognized arguments: {' '.join(extras)}"
                       + (f" ({'; '.join(hints)})" if hints else ""))
        return namespace

    def add_argument_group(self, title=None, description=None, **kwargs):
        for group in self._action_groups:  # one group a title, whoever adds to it
            if title is not None and group.title == title:
                return group
        return super().add_argument_group(title, description, **kwargs)

    def section_of(self, title: str | None) -> str:
        if title in SECTIONS:
            return title
        if title in ("options", "optional arguments"):  # -h/--help
            return "outputs and reports"
        if title and title.startswith("caching"):
            return "caching"
        return self.sections.get(title, "advanced")

    def format_help(self) -> str:
        # the terminal's whole width (COLUMNS=250 shows 250), 100 where it cannot be read
        width = max(shutil.get_terminal_size((100, 24)).columns, 40)
        by_section: dict[str, list[str]] = {s: [] for s in SECTIONS}
        hidden = 0
        for group in self._action_groups:
            for action in group._group_actions:
                if action.help == argparse.SUPPRESS:
                    continue
                if action.dest not in self.common and action.option_strings:
                    hidden += 1
                    continue
                by_section[self.section_of(group.title)].append(_one_line(action, width))
        lines = [self.format_usage().rstrip(), "", self.description or ""]
        for section, rows in by_section.items():
            if rows:
                lines += ["", f"{section}:", *rows]
        if hidden:
            lines += ["", f"{hidden} more flags (caching details, backend, telemetry ...): --help_all"]
        return "\n".join(lines) + "\n"

    def format_help_all(self) -> str:
        return super().format_help()


def add_compile_cache_flag(group) -> None:
    """--compile_cache_dir, alike in every command that runs JAX (resolved by
    `tpu.compile.check_cache_dir`)."""
    group.add_argument("--compile_cache_dir", default=None,
                       help="persistent JAX compilation cache: a folder, or a bucket URL (gs://...) "
                            "that every host of a slice shares (default "
                            "~/.cache/dit-feature-cache/jax; 'none' turns it off)")


class _HelpAll(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(parser.format_help_all(), sys.stdout)
        parser.exit()


_DEFAULT = re.compile(r"\s*[(;,]?\s*\(?default:? ([^()]*(?:\([^()]*\)[^()]*)*)\)?")


def _metavar(action: argparse.Action) -> str:
    if action.choices is not None:
        return "CHOICE"
    if action.type is int:
        return "N"
    if action.type is float:
        return "X"
    if re.search(r"dir|path|json|csv|png|profile|out|file|prompts", action.dest):
        return "PATH"
    return "VALUE"


def _first_clause(text: str) -> str:
    """The text up to its first '; ' or ': ' outside parentheses."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch in ";:" and text[i + 1: i + 2] == " ":
            return text[:i].rstrip(" .,")
    return text.rstrip(" .;,")


def _one_line(action: argparse.Action, width: int) -> str:
    """'  --flag VALUE   what it is (default X)', cut to the terminal's width."""
    flags = ", ".join(action.option_strings) or action.dest
    if action.nargs != 0 and action.option_strings:
        if action.choices is not None and len(",".join(map(str, action.choices))) <= 40:
            flags += " {" + ",".join(map(str, action.choices)) + "}"
        else:
            flags += " " + (action.metavar or _metavar(action))
    text = " ".join((action.help or "").split())
    default = None
    found = _DEFAULT.search(text)
    if found:
        default = found.group(1).strip().rstrip(")")
        text = (text[: found.start()] + text[found.end():]).strip()
    elif action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0:
        default = str(action.default)
    text = _first_clause(text)
    if default:
        text = f"{text} (default {default})" if text else f"(default {default})"
    row = f"  {flags:<30} {text}" if len(flags) <= 30 else f"  {flags} {text}"
    return row if len(row) <= width else row[: width - 1] + "…"


# --- the typed request --------------------------------------------------------------------------

# flags `command` reads itself (help, verbosity, the summary file); no request carries them
SHELL = ("help_all", "quiet", "verbose", "summary_json")


def typed(cls, args: argparse.Namespace):
    """The frozen dataclass `cls` (a command's request) from a parsed command line: each field
    from the flag of its name, a field whose type is a dataclass from the same flags, a list of
    appended values as a tuple. This is the one step from a Namespace to a request; a field with
    no flag of its name fails here on every run, and each command's test holds its request's
    fields to its parser's flags (`leaves`), so a renamed flag fails in a test."""
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            values[field.name] = typed(kind, args)
            continue
        value = getattr(args, field.name)
        values[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def leaves(request) -> dict:
    """{flag's dest: value} of a request `typed` built (nested requests flattened), or of its
    class (values None): what the command line gave, for identities and the tests."""
    out = {}
    hints = typing.get_type_hints(request if isinstance(request, type) else type(request))
    for field in dataclasses.fields(request):
        kind = hints[field.name]
        value = None if isinstance(request, type) else getattr(request, field.name)
        if dataclasses.is_dataclass(kind):
            out.update(leaves(kind if value is None else value))
        else:
            out[field.name] = value
    return out


# --- numeric flags -------------------------------------------------------------------------------

def _shown(value) -> str:
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else repr(value)


def as_int(label: str, value, *, minimum: int | None = None, maximum: int | None = None,
           expected: str | None = None) -> int:
    """`value` (a flag's or a config file's) as an int within [minimum, maximum], else UsageError
    naming `label` ("--height"), the value and what is expected."""
    if minimum is not None and maximum is not None:
        want = expected or f"an integer in [{minimum}, {maximum}]"
    elif minimum is not None:
        want = expected or f"an integer >= {minimum}"
    else:
        want = expected or "an integer"
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            pass
    if number is None or (minimum is not None and number < minimum) or \
            (maximum is not None and number > maximum):
        raise UsageError(f"{label} {_shown(value)}: expected {want}")
    return number


def as_number(label: str, value, *, minimum: float | None = None, above: float | None = None,
              maximum: float | None = None, expected: str | None = None) -> float:
    """`value` as a finite float, >= minimum, > above and <= maximum where given, else
    UsageError."""
    bounds = ([f">= {minimum:g}"] if minimum is not None else []) + \
        ([f"> {above:g}"] if above is not None else []) + \
        ([f"<= {maximum:g}"] if maximum is not None else [])
    want = expected or ("a finite number" + (" " + " and ".join(bounds) if bounds else ""))
    number = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None or not math.isfinite(number) or \
            (minimum is not None and number < minimum) or (above is not None and number <= above) \
            or (maximum is not None and number > maximum):
        raise UsageError(f"{label} {_shown(value)}: expected {want}")
    return number
