"""What every bench's results page shares: the machine and versions it names, the command that
reproduces it, the training step of trained weights, and the writers (a whole page, or one
section of a page several runs share) that replace a page atomically."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shlex

from sampling.journal import atomic_write, folder_lock


def machine() -> str:
    import torch  # here, not above: a bench's parent process may load no model stack

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.*)", f.read())
            cpu = found.group(1) if found else cpu
    return (f"{cpu}, {os.cpu_count()} cores visible, torch {torch.__version__} on CPU with "
            f"{torch.get_num_threads()} thread(s), Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}")


def versions(names=("diffusers", "cache_dit")) -> str:
    out = []
    for name in names:
        try:
            module = __import__(name)
            out.append(f"{name.replace('_', '-')} {module.__version__}")
        except Exception as exc:  # noqa: BLE001
            out.append(f"{name.replace('_', '-')} not importable ({type(exc).__name__})")
    return ", ".join(out)


def command_line(module: str, args, defaults: dict) -> str:
    """`python -m <module>` with the run's flags that differ from `defaults`: what reproduces it."""
    flags = "".join(f" --{k} {shlex.quote(str(getattr(args, k)))}" for k, v in defaults.items()
                    if getattr(args, k) != v)
    return f"python -m {module}{flags}"


def trained_step(weights: str) -> int | None:
    """The training step recorded beside trained weights (training.json), if any."""
    try:
        with open(os.path.join(weights, "training.json")) as f:
            return json.load(f).get("step")
    except (OSError, ValueError):
        return None


def write_page(path: str, lines: list[str]) -> None:
    """The whole page at `path`, atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, lambda f: f.write("\n".join(lines) + "\n"))
    print(f"wrote {os.path.relpath(path)}", flush=True)


# --- a page of sections, each written by its own run -------------------------------------------

MARK = "<!-- section: {} (written by its run; edits are overwritten) -->"
_MARK = re.compile(r"<!-- section: (.*) \(written by its run; edits are overwritten\) -->")


def splice(text: str, key: str, lines: list[str], head: str, rank=lambda key: 0) -> str:
    """The page `text` with section `key` set to `lines` (where it is, or added), the others kept,
    ordered by `rank` (stable); `head` first. Text outside any section (a page typed by hand
    before these markers) is dropped: only what a run wrote stays."""
    sections, current = {}, None
    for line in text.splitlines():
        found = _MARK.fullmatch(line)
        if found:
            current = found.group(1)
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    sections[key] = list(lines)
    out = [head.rstrip("\n")]
    for k in sorted(sections, key=rank):
        body = sections[k]
        while body and not body[-1]:
            body.pop()
        out += ["", MARK.format(k), *body]
    return "\n".join(out) + "\n"


def write_section(path: str, key: str, lines: list[str], head: str, rank=lambda key: 0) -> None:
    """Set one section of the page at `path`, atomically; the folder's lock keeps two runs
    writing their sections at once from losing one."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with folder_lock(folder, exclusive=True):
        try:
            with open(path) as f:
                old = f.read()
        except FileNotFoundError:
            old = ""
        text = splice(old, key, lines, head, rank)
        atomic_write(path, lambda f: f.write(text))
    print(f"wrote {os.path.relpath(path)} (section {key})", flush=True)
