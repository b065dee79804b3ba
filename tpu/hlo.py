"""HLO text, read: the computations of a compiled program's optimized HLO, the while loops and
how often each computation runs per call, and the collectives with their bytes per chip.

Pure text parsing (no JAX): `tpu.program` turns it into a program's costs and `tpu.hbm` into its
HBM traffic.
"""

from __future__ import annotations

import math
import re

# an array's dtype and dimensions in a shape's text: bf16[2,4096,3072]
ARRAY_SHAPE = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64|c64|c128|f8e4m3fn|f8e5m2)"
                         r"\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "f16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
         "f8e4m3fn": 8, "f8e5m2": 8}
_COLLECTIVE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-gather|all-reduce|all-to-all|reduce-scatter|"
                         r"collective-permute)(-start)?\((.*)$")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")


def dtype_bits(dtype: str) -> int:
    """Bits of one element of an HLO dtype (pred 8, bf16 16, s32 32)."""
    return _BITS.get(dtype) or int(dtype[1:])


def _array_bytes(text: str) -> list[int]:
    return [math.prod(int(d) for d in dims.split(",") if d) * dtype_bits(dtype) // 8
            for dtype, dims in ARRAY_SHAPE.findall(text)]


def collectives(hlo: str) -> dict[str, dict]:
    """kind -> {count, bytes (result, per chip), received (bytes a chip takes in over ICI)}.
    An async pair counts once, at its -start; its result tuple holds operand and result, and
    the result is the larger. One inside a loop counts once per iteration."""
    out: dict[str, dict] = {}
    mult = multipliers(hlo)
    for current, line in _lines(hlo):  # lines outside a computation (a fragment) count once
        _count_collective(out, line, mult.get(current, 1))
    return out


def _count_collective(out: dict, line: str, times: int) -> None:
    m = _COLLECTIVE.search(line)
    if not m:
        return
    result, kind, start, rest = m.groups()
    sizes = _array_bytes(result)
    if not sizes:
        return
    size = max(sizes) if start else sum(sizes)
    group = _group_size(rest)
    received = {"all-gather": size * (group - 1) / group,
                "all-to-all": size * (group - 1) / group,
                "all-reduce": 2 * size * (group - 1) / group,  # reduce-scatter + all-gather
                "reduce-scatter": size * (group - 1),
                "collective-permute": size}[kind]
    entry = out.setdefault(kind, {"count": 0, "bytes": 0, "received": 0.0})
    entry["count"] += times
    entry["bytes"] += times * size
    entry["received"] += times * received



def _group_size(attributes: str) -> int:
    """Devices in one replica group: mesh['axis_0'=8,'axis_1'=1] {'axis_0'} (8), [2,4]<=[8]
    (4), or {{0,1,2,3},...} (4)."""
    m = _GROUPS_MESH.search(attributes)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    m = _GROUPS_IOTA.search(attributes)
    if m:
        return int(m.group(2))
    m = _GROUPS_LIST.search(attributes)
    return max(1, len([x for x in m.group(1).split(",") if x])) if m else 2


# A computation: `[ENTRY ]%name (params) -> result {`, its instructions, then `}` alone on a line.
# An instruction's text can run over several lines starting at column 0 (a Mosaic kernel's
# custom call carries its metadata with newlines; one such line starts `}},`), so the end is
# the bare `}` and nothing else.
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\)\s*->.*\{\s*$")


def _lines(hlo: str):
    """(the computation it belongs to, or None), line: of HLO text.
    A header opens a computation only outside one; the bare `}` closes it."""
    current = None
    for line in hlo.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                yield current, line
                continue
        elif line.rstrip() == "}":
            current = None
        yield current, line


_WHILE = re.compile(r"\swhile\(.*condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_REF = re.compile(r"%([\w.\-]+)")


def computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """name -> its lines, and the entry's name, of an HLO module's text."""
    comps, entry, last = {}, None, None
    for current, line in _lines(hlo):
        if current is None:
            pass
        elif current != last:  # its header
            comps[current] = []
            entry = current if line.startswith("ENTRY ") else entry
        else:
            comps[current].append(line)
        last = current
    return comps, entry


def _trip_count(line: str, condition: list[str]) -> int | None:
    """Iterations of a while: XLA's known trip count, else the one constant its condition
    compares the counter against (a scan's `i < n`, counting from 0)."""
    m = _TRIP.search(line)
    if m:
        return int(m.group(1))
    if sum("direction=LT" in c for c in condition) != 1:
        return None
    found = [int(x) for c in condition for x in re.findall(r"s32\[\][^=]*constant\((\d+)\)", c)]
    return found[0] if len(found) == 1 else None


def loops(hlo: str) -> dict[str, list[tuple[str, int]]]:
    """computation -> [(while body, trip count)] of the whiles it runs (trip count unknown: 1,
    the analysis's own assumption)."""
    comps, _ = computations(hlo)
    out = {}
    for name, lines in comps.items():
        for line in lines:
            m = _WHILE.search(line)
            if m:
                trips = _trip_count(line, comps.get(m.group(1), []))
                out.setdefault(name, []).append((m.group(2), trips or 1))
    return out


def multipliers(hlo: str) -> dict[str, int]:
    """Times each computation runs per call of the program: a while body its trip count times
    its caller's, anything else a computation calls as often as its caller."""
    comps, entry = computations(hlo)
    bodies = {(c, b): n for c, ws in loops(hlo).items() for b, n in ws}
    mult = {entry: 1} if entry else {}
    order = [entry] if entry else []
    for name in order:  # callers before callees: HLO computations form a DAG
        for line in comps[name]:
            for ref in set(_REF.findall(line)):
                if ref in comps and ref != name:
                    times = mult[name] * bodies.get((name, ref), 1)
                    if times > mult.get(ref, 0):
                        mult[ref] = times
                        order.append(ref)
    return mult
