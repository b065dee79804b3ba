"""HBM traffic of one call of a compiled TPU program, counted from its optimized HLO text.

XLA's cost analysis ("bytes accessed") adds up every operand and result of every instruction,
wherever it lives. On a TPU the compiler's memory-space assignment keeps many buffers in the
chip's vector memory (layouts marked `S(1)`) and moves them with explicit copies
(`copy-start`/`copy-done`, `slice-start`/`slice-done`), so an instruction that reads a buffer
already in VMEM costs no HBM bandwidth, and the prefetch that brought it there is counted again.
For an HBM roofline the bytes that cross the HBM interface are the ones to count:

    each instruction of the program's sequential computations (the entry, while bodies times
    their trip counts, conditional branches once): its operands and results in memory space 0
    (HBM), a slice read as its result (not the buffer it slices), an in-place update as its
    update, a fusion's parameter that only feeds slices as those slices, and an asynchronous
    copy or slice as the side of it that is in HBM.

It is a model, not a measurement: a fusion is taken to read each HBM operand once (a
convolution that re-reads its input tile by tile reads more), and VMEM traffic is free.
`tpu.aot` reports it beside the cost analysis's figure, which stays an upper bound.
"""

from __future__ import annotations

import collections
import math
import re
import sys

from .hlo import ARRAY_SHAPE, computations, dtype_bits, loops, multipliers

# an array's shape with its layout, which names a memory space other than HBM as S(n)
_LEAF = re.compile(ARRAY_SHAPE.pattern + r"(\{[^}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all",
         "partition-id", "replica-id", "while", "conditional", "call", "copy-done", "slice-done",
         "collective-permute-done", "all-gather-done", "all-reduce-done", "send-done",
         "recv-done", "async-done", "async-update", "opt-barrier", "add-dependency", "iota"}
_SLICES = {"slice", "dynamic-slice"}


def leaves(shape: str) -> list[tuple[int, int]]:
    """(bytes, memory space) of each array in a shape's text (a tuple's in order)."""
    out = []
    for m in _LEAF.finditer(shape):
        dims = [int(d) for d in m.group(2).split(",")] if m.group(2) else []
        space = _SPACE.search(m.group(3) or "")
        out.append((math.prod(dims) * dtype_bits(m.group(1)) // 8, int(space.group(1)) if space else 0))
    return out


def _hbm(shape: str) -> int:
    """Bytes of a shape's arrays that live in HBM."""
    return sum(b for b, space in leaves(shape) if space == 0)


def _size(shape: str) -> int:
    """Bytes of a shape's arrays, wherever they live."""
    return sum(b for b, _ in leaves(shape))


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket group opening at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


_NAME = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def instruction(line: str):
    """(name, result shape text, opcode, operand names, attributes) of one instruction line,
    or None."""
    m = _NAME.match(line)
    if not m:
        return None
    i = m.end()
    if i < len(line) and line[i] == "(":
        j = _balanced(line, i)
    else:
        j = line.find(" ", i)
        j = len(line) if j < 0 else j
    shape = line[i:j]
    op = re.match(r"\s*([a-z][\w\-]*)\(", line[j:])
    if not op:
        return None
    k = j + op.end() - 1
    end = _balanced(line, k)
    operands = re.findall(r"%([\w.\-]+)", line[k:end])
    return m.group(2), shape, op.group(1), operands, line[end:]


def _fusion_reads(lines: list[str]) -> tuple[dict[int, int | None], int | None]:
    """Of a fused computation: parameter index -> the bytes a call reads of it when it only
    feeds slices (else None: all of it), and the bytes written when its root updates a
    parameter in place (a dynamic-update-slice: only the update is written)."""
    params, shapes, users, root = {}, {}, {}, None
    for line in lines:
        p = instruction(line)
        if p is None:
            continue
        name, shape, op, operands, _ = p
        shapes[name] = shape
        if op == "parameter":
            params[name] = int(re.search(r"parameter\((\d+)\)", line).group(1))
        for position, o in enumerate(operands):
            users.setdefault(o, []).append((op, shape, position))
        if line.lstrip().startswith("ROOT"):
            root = p
    reads = {}
    for name, index in params.items():
        use = users.get(name, [])
        only_sliced = use and all(op in _SLICES and position == 0 for op, _, position in use)
        reads[index] = sum(_size(s) for _, s, _ in use) if only_sliced else None
    written = None
    if root is not None and root[2] == "dynamic-update-slice" and root[3][0] in params:
        reads[params[root[3][0]]] = 0  # updated in place: the rest is never read
        written = _size(shapes.get(root[3][1], ""))
    return reads, written


def hbm_traffic(hlo: str) -> float:
    """Bytes one call of the program moves to or from HBM, per chip (see the module's doc)."""
    return float(sum(breakdown(hlo).values()))


def breakdown(hlo: str) -> collections.Counter:
    """hbm_traffic by kind of instruction: its opcode, a fusion's with its kind (fusion:kLoop,
    fusion:kOutput for a convolution or dot with what XLA fused into it, ...)."""
    total: collections.Counter = collections.Counter()
    comps, entry = computations(hlo)
    if entry is None:
        return total
    times = multipliers(hlo)
    # the sequential computations: the entry, its whiles' bodies and its conditionals' branches
    # (not the fused and reducer computations, whose work their caller's instruction is)
    sequential = [entry] + [body for whiles in loops(hlo).values() for body, _ in whiles]
    for line in (ln for lines in comps.values() for ln in lines):
        m = re.search(r"branch_computations=\{([^}]*)\}", line)
        sequential += re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []
    fusions: dict[str, tuple] = {}
    for name in dict.fromkeys(sequential):
        if name not in times:  # a loop of a computation the entry never calls
            continue
        shapes = {}
        for line in comps.get(name, ()):
            p = instruction(line)
            if p is None:
                continue
            result, shape, op, operands, attrs = p
            shapes[result] = shape
            if op in _FREE:
                continue
            if op in ("copy-start", "slice-start"):
                # result: (source, destination, context); the copy moves the destination's
                # size out of its source and into the destination, whichever is in HBM
                source, destination = (leaves(part) for part in _top_level(shape)[:2])
                sides = [source[0][1], destination[0][1]]
                total[op] += times[name] * destination[0][0] * sides.count(0)
                continue
            if op.endswith("-start"):  # async collectives: (operands, results, ...)
                parts = _top_level(shape)
                total[op] += times[name] * sum(_hbm(s) for s in parts[:2])
                continue
            if op in _SLICES:
                out = _hbm(shape)
                src = _hbm(shapes.get(operands[0], "")) if operands else 0
                total[op] += times[name] * (out + (_size(shape) if src else 0))
                continue
            if op == "dynamic-update-slice":
                update = leaves(shapes.get(operands[1], "")) if len(operands) > 1 else []
                size = sum(b for b, _ in update)
                target = _hbm(shapes.get(operands[0], ""))
                total[op] += times[name] * (2 * size if target else  # in place: read, written
                                        sum(b for b, s in update if s == 0))
                continue
            reads, written = {}, None
            if op == "fusion":
                called = re.search(r"calls=%?([\w.\-]+)", attrs)
                if called and called.group(1) in comps:
                    if called.group(1) not in fusions:
                        fusions[called.group(1)] = _fusion_reads(comps[called.group(1)])
                    reads, written = fusions[called.group(1)]
            moved = 0
            for i, o in enumerate(operands):
                hbm = _hbm(shapes.get(o, ""))
                if hbm:
                    part = reads.get(i)
                    moved += hbm if part is None else min(part, hbm)
            out = _hbm(shape)
            moved += out if written is None or not out else min(written, out)
            kind = re.search(r"kind=(\w+)", attrs) if op == "fusion" else None
            total[f"fusion:{kind.group(1)}" if kind else op] += times[name] * moved
    return total


def _top_level(shape: str) -> list[str]:
    """The elements of a tuple shape's text (one element: the shape itself)."""
    s = shape.strip()
    if not s.startswith("("):
        return [s]
    inner, parts, depth, cur = s[1:_balanced(s, 0) - 1], [], 0, ""
    for c in inner:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += c
    if cur.strip():
        parts.append(cur.strip())
    return parts


def main(argv=None) -> int:
    """python -m tpu.hbm PROGRAM.hlo.txt: the traffic of an optimized HLO text, by instruction;
    of several programs one after another (a chain's call, tpu/vae_chain.py), their sum."""
    paths = sys.argv[1:] if argv is None else argv
    if len(paths) != 1:
        print("usage: python -m tpu.hbm PROGRAM.txt (a compiled program's as_text(); "
              "python -m commands.vae_aot --hlo_dir writes them)", file=sys.stderr)
        return 2
    try:
        text = open(paths[0]).read()
    except OSError as exc:
        print(f"error: {paths[0]}: {exc.strerror}", file=sys.stderr)
        return 2
    if computations(text)[1] is None:
        print(f"error: {paths[0]}: no ENTRY computation; expected a compiled program's optimized "
              "HLO text", file=sys.stderr)
        return 2
    counts = collections.Counter()
    for module in re.split(r"(?m)^(?=HloModule )", text):
        if module.strip():
            counts.update(breakdown(module))
    total = sum(counts.values())
    print(f"HBM traffic {total / 1e9:.2f} GB per call")
    for kind, b in counts.most_common():
        print(f"  {kind:28s} {b / 1e9:8.2f} GB  {b / max(total, 1):6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
