"""Byte sizes as the commands and pages print them: one constant per unit, one formatter."""

from __future__ import annotations

GiB = 2 ** 30
UNITS = {"GiB": GiB, "MiB": 2 ** 20, "KiB": 2 ** 10, "GB": 10 ** 9, "B": 1}


def size_text(n: float, unit: str | None = None, digits: int = 1) -> str:
    """`n` bytes in `unit` ("1.5 GiB"), or in the largest binary unit it reaches (None)."""
    if unit is None:
        unit = next((u for u in ("GiB", "MiB", "KiB") if n >= UNITS[u]), "B")
        if unit == "B":
            return f"{int(n)} B"
    return f"{n / UNITS[unit]:,.{digits}f} {unit}"
