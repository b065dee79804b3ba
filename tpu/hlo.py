"""HLO text, read: the computations of a compiled program's optimized HLO, the while loops and
how often each computation runs per call, and the collectives with their bytes per chip.

Pure text parsing (no JAX): `tpu.program` turns it into a program's costs, `tpu.hbm` into its
HBM traffic and `tpu.placement` its collectives' groups into the chips they run between.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

# an array's dtype and dimensions in a shape's text: bf16[2,4096,3072]
ARRAY_SHAPE = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64|c64|c128|f8e4m3fn|f8e5m2)"
                         r"\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "f16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
         "f8e4m3fn": 8, "f8e5m2": 8}
_COLLECTIVE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-gather|all-reduce|all-to-all|reduce-scatter|"
                         r"collective-permute)(-start)?\((.*)$")
# the forms of a collective's replica groups (partition ids: JAX compiles one replica, n partitions)
# mesh['axis_0'=2,'axis_1'=8] {'axis_1'}: the ids of an iota mesh, grouped along the named axes
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
# [2,8]<=[8,2]T(1,0): iota(16) reshaped to [8,2], transposed, read as 2 groups of 8
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# {{0,1,2,3},{4,5,6,7}}, or {} (one group of every partition)
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_AXIS = re.compile(r"'?([\w.\-]+?)'?(?::\((\d+)\)(\d+))?$")  # a group axis: name or name:(pre)size


def dtype_bits(dtype: str) -> int:
    """Bits of one element of an HLO dtype (pred 8, bf16 16, s32 32)."""
    return _BITS.get(dtype) or int(dtype[1:])


def _array_bytes(text: str) -> list[int]:
    return [math.prod(int(d) for d in dims.split(",") if d) * dtype_bits(dtype) // 8
            for dtype, dims in ARRAY_SHAPE.findall(text)]


@dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction: its kind, its result's bytes per chip (an async pair's larger
    half), the bytes a chip takes in over ICI, the times it runs per call of the program, and its
    groups of partition ids, each in the order the HLO lists it (a collective-permute's groups are
    its (source, target) pairs; None where the text gives no groups this module can read)."""

    kind: str
    bytes: int
    received: float
    times: int
    groups: tuple[tuple[int, ...], ...] | None


def collective_ops(hlo: str) -> list[CollectiveOp]:
    """Every collective of an HLO module's text, its groups expanded (`replica_groups`). An async
    pair counts once, at its -start; one inside a loop runs once per iteration (`times`)."""
    m = _PARTITIONS.search(hlo.split("\n", 1)[0])  # the HloModule line: `{}` is all of them
    partitions = int(m.group(1)) if m else None
    mult = multipliers(hlo)
    ops = []
    for current, line in _lines(hlo):  # lines outside a computation (a fragment) run once
        op = _collective(line, mult.get(current, 1), partitions)
        if op is not None:
            ops.append(op)
    return ops


def collectives(hlo: str) -> dict[str, dict]:
    """kind -> {count, bytes (result, per chip), received (bytes a chip takes in over ICI)}, per
    call: `collective_ops` summed by kind."""
    out: dict[str, dict] = {}
    for op in collective_ops(hlo):
        entry = out.setdefault(op.kind, {"count": 0, "bytes": 0, "received": 0.0})
        entry["count"] += op.times
        entry["bytes"] += op.times * op.bytes
        entry["received"] += op.times * op.received
    return out


def _collective(line: str, times: int, partitions: int | None) -> CollectiveOp | None:
    m = _COLLECTIVE.search(line)
    if not m:
        return None
    result, kind, start, rest = m.groups()
    sizes = _array_bytes(result)
    if not sizes:
        return None
    size = max(sizes) if start else sum(sizes)
    groups = replica_groups(rest, partitions)
    group = len(groups[0]) if groups and kind != "collective-permute" else 2
    received = {"all-gather": size * (group - 1) / group,
                "all-to-all": size * (group - 1) / group,
                "all-reduce": 2 * size * (group - 1) / group,  # reduce-scatter + all-gather
                "reduce-scatter": size * (group - 1),
                "collective-permute": size}[kind]
    return CollectiveOp(kind, size, received, times, groups)


def replica_groups(attributes: str, partitions: int | None = None) -> tuple[tuple[int, ...], ...] | None:
    """The groups of partition ids of a collective's attributes, in every form the HLO writes:
    mesh['axis_0'=2,'axis_1'=8] {'axis_1'} (sub-axes `'axis_0':(1)2` too), the iota form
    [2,8]<=[8,2]T(1,0), lists {{0,1},{2,3}}, {} (one group of all `partitions`), and a
    collective-permute's source_target_pairs={{0,1},{1,0}} (as pairs). None for anything else."""
    m = _PAIRS.search(attributes)
    if m:
        return _id_lists(m.group(1))
    m = _GROUPS_MESH.search(attributes)
    if m:
        return _mesh_groups(m.group(1), m.group(2))
    m = _GROUPS_IOTA.search(attributes)
    if m:
        shape, dims, perm = ([int(x) for x in g.split(",")] if g else None for g in m.groups())
        ids = np.arange(math.prod(dims)).reshape(dims)
        ids = ids.transpose(perm) if perm else ids
        return tuple(tuple(int(i) for i in g) for g in ids.reshape(-1, shape[-1]))
    m = _GROUPS_LIST.search(attributes)
    if m:
        groups = _id_lists(m.group(1))
        if groups:
            return groups
        return None if partitions is None else (tuple(range(partitions)),)
    return None


def _id_lists(text: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}", text))


def _mesh_groups(mesh: str, axes: str) -> tuple[tuple[int, ...], ...] | None:
    """XLA's MeshAxesReplicaGroupList (xla/hlo/ir/replica_group.cc): the iota device array of the
    mesh, each axis with sub-axes reshaped (padding between them, a suffix after), the grouped
    dimensions (in mesh order; a dimension's sub-axes as listed) moved last, read in groups."""
    sizes = [(name, int(n)) for name, n in re.findall(r"'?([\w.\-]+?)'?=(\d+)", mesh)]
    names = [name for name, _ in sizes]
    refs: dict[int, list] = {}
    for part in axes.split(","):
        m = _AXIS.match(part.strip())
        if not m or m.group(1) not in names:
            return None
        name, pre, size = m.groups()
        refs.setdefault(names.index(name), []).append(None if pre is None else (int(pre), int(size)))
    shape, grouped = [], []
    for dim, (_, full) in enumerate(sizes):
        subs = refs.get(dim)
        if subs is None or subs == [None]:
            if subs:
                grouped.append(len(shape))
            shape.append(full)
            continue
        if None in subs:
            return None
        prefix, where = 1, {}
        for i in sorted(range(len(subs)), key=lambda i: subs[i][0]):  # by pre-size
            pre, size = subs[i]
            if pre != prefix:  # the part of the axis between two sub-axes
                shape.append(pre // prefix)
                prefix = pre
            where[i] = len(shape)
            shape.append(size)
            prefix *= size
        if prefix != full:
            shape.append(full // prefix)
        grouped += [where[i] for i in range(len(subs))]
    rest = [d for d in range(len(shape)) if d not in grouped]
    width = math.prod(shape[d] for d in grouped)
    ids = np.arange(math.prod(shape)).reshape(shape).transpose(rest + grouped).reshape(-1, width)
    return tuple(tuple(int(i) for i in g) for g in ids)


# A computation: `[ENTRY ]%name (params) -> result {`, its instructions, then `}` alone on a line,
# or `}, execution_thread="sparsecore"` (libtpu 0.0.42 for v7x puts collectives it offloads to the
# SparseCores in such computations, ahead of the entry). An instruction's text can run over
# several lines starting at column 0 (a Mosaic kernel's custom call carries its metadata with
# newlines; one such line starts `}},`), so the end is that line and nothing else.
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\)\s*->.*\{\s*$")
_CLOSE = re.compile(r'^\}(?:, execution_thread="[\w.\-]*")?\s*$')


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
        elif _CLOSE.match(line):
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


# an instruction: its name, opcode, operands (up to the first `)`) and the rest of its line
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?\s([a-z][\w\-]*)\(([^)]*)\)(.*)$")


def _instructions(lines: list[str]) -> dict[str, tuple[str, str, str]]:
    """name -> (opcode, operands text, the rest) of a computation's instructions; "ROOT" -> its
    root's name too."""
    out = {}
    for line in lines:
        m = _INSTRUCTION.match(line)
        if m:
            out[m.group(1)] = m.group(2, 3, 4)
            if line.lstrip().startswith("ROOT "):
                out["ROOT"] = (m.group(1), "", "")
    return out


def _constant(instructions: dict, name: str) -> int | None:
    """The integer a scalar constant holds, through copies of it; None for anything else."""
    for _ in range(4):
        opcode, operands, _ = instructions.get(name, ("", "", ""))
        if opcode == "constant":
            return int(operands) if re.fullmatch(r"-?\d+", operands.strip()) else None
        if opcode != "copy" or not _REF.findall(operands):
            return None
        name = _REF.findall(operands)[0]
    return None


def _counter(line: str, condition: list[str], body: list[str], caller: list[str]) -> tuple[int, int]:
    """(start, step) of the counter a while's condition compares: the constant it starts at in
    the while's operand tuple and the one the body adds to it each iteration. (0, 1), a scan's,
    where the text does not say (libtpu's windowed einsums on v7x count from 0 by 2)."""
    cond = _instructions(condition)
    compare = next((ops for op, ops, rest in cond.values() if op == "compare"
                    and "direction=LT" in rest), None)
    refs = _REF.findall(compare or "")
    gte = cond.get(refs[0]) if refs else None
    index = re.search(r"\bindex=(\d+)", gte[2]) if gte and gte[0] == "get-tuple-element" else None
    if index is None:
        return 0, 1
    k = int(index.group(1))

    def element(instructions: dict, tuple_name: str | None) -> str | None:
        opcode, operands, _ = instructions.get(tuple_name or "", ("", "", ""))
        elements = _REF.findall(operands) if opcode == "tuple" else []
        return elements[k] if k < len(elements) else None

    start, step = 0, 1
    calls = _instructions(caller)
    init = element(calls, (re.search(r"while\(%([\w.\-]+)\)", line) or [None, None])[1])
    if init is not None and _constant(calls, init) is not None:
        start = _constant(calls, init)
    inner = _instructions(body)
    opcode, operands, _ = inner.get(element(inner, inner.get("ROOT", ("",))[0]) or "", ("", "", ""))
    if opcode == "add":
        added = [c for c in (_constant(inner, r) for r in _REF.findall(operands)) if c is not None]
        if len(added) == 1 and added[0] > 0:
            step = added[0]
    return start, step


def _trip_count(line: str, condition: list[str], body: list[str] = (),
                caller: list[str] = ()) -> int | None:
    """Iterations of a while: XLA's known trip count, else from the one constant its condition
    compares the counter against (`i < n`), the counter's start and its step (`_counter`)."""
    m = _TRIP.search(line)
    if m:
        return int(m.group(1))
    if sum("direction=LT" in c for c in condition) != 1:
        return None
    found = [int(x) for c in condition for x in re.findall(r"[su]32\[\][^=]*constant\((\d+)\)", c)]
    if len(found) != 1:
        return None
    start, step = _counter(line, list(condition), list(body), list(caller))
    return max(0, -(-(found[0] - start) // step))


def loops(hlo: str) -> dict[str, list[tuple[str, int]]]:
    """computation -> [(while body, trip count)] of the whiles it runs (trip count unknown: 1,
    the analysis's own assumption)."""
    comps, _ = computations(hlo)
    out = {}
    for name, lines in comps.items():
        for line in lines:
            m = _WHILE.search(line)
            if m:
                trips = _trip_count(line, comps.get(m.group(1), []), comps.get(m.group(2), []),
                                    lines)
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
