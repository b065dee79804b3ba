"""The shape every stage command shares: parse, run, one error line and exit 2 on a known
error (nothing written), else the summary from the rank that speaks for the run."""

from __future__ import annotations

import sys
from typing import Callable


def command(build_parser: Callable, run: Callable[..., dict], format_summary: Callable[[dict], str],
            errors: tuple[type[BaseException], ...],
            speaks: Callable[[dict], bool] = lambda report: True) -> Callable[..., int]:
    def main(argv: list[str] | None = None) -> int:
        parser = build_parser()
        args = parser.parse_args(argv)
        try:
            report = run(args)
        except errors as exc:
            print(f"{parser.prog}: error: {exc}", file=sys.stderr)
            return 2
        if speaks(report):
            print(format_summary(report))
        return 0
    return main
