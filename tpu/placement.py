"""Where a program's collectives run on the slice: each group of partition ids (`tpu.hlo`) mapped
to the chips that hold those partitions, and the ICI hops between them.

JAX compiles a sharded program for one replica and n partitions, partition k being the k-th
device of the mesh flattened, so the same HLO lands on other chips under another device order:
the summary takes the chips' coordinates in partition order. A group's ring is its members in the
order the HLO lists them, the last step back to the first; the compiler's own collective
algorithm may route otherwise, so hops per step are a model of the traffic, not a measurement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .hlo import CollectiveOp

Coords = Sequence[tuple[int, ...]]


def hops(a: Sequence[int], b: Sequence[int], extents: Sequence[int], wraps: Sequence[bool]) -> int:
    """ICI hops between two chips: per axis the distance, the shorter way round where the axis
    wraps around."""
    return sum(min(d, n - d) if w else d
               for d, n, w in zip((abs(p - q) for p, q in zip(a, b, strict=True)), extents, wraps,
                                  strict=True))


def ring_steps(group: Sequence[int], coords: Coords, extents, wraps) -> list[int]:
    """Hops of each step around a group's ring: member i to i + 1, the last back to the first."""
    points = [coords[i] for i in group]
    if len(points) < 2:
        return []
    return [hops(a, b, extents, wraps) for a, b in zip(points, points[1:] + points[:1], strict=True)]


def _steps(op: CollectiveOp, group, coords, extents, wraps) -> list[int]:
    if op.kind == "collective-permute":  # a (source, target) pair: one step
        return [hops(coords[group[0]], coords[group[1]], extents, wraps)]
    return ring_steps(group, coords, extents, wraps)


def summarize(ops: Mapping[str, Sequence[CollectiveOp]], coords: Coords, extents: Sequence[int],
              wraps: Sequence[bool]) -> dict[str, dict]:
    """kind -> where its collectives run, over every program's (`ops`: program -> its collectives;
    `coords`: each partition's chip). count: times run per call of each program, summed; groups:
    the distinct shapes, groups x members; hops_min/max: of one ring step (a permute's pair);
    mean_hops: per step, over the steps of every group of every run; rings / rings_closed: the
    distinct groups of 2+ members (not permutes), and those whose every step is 1 hop at most (0
    between the two devices of one v7x chip, which share its coordinates);
    received: bytes a chip takes in over ICI per call; byte_hops: those bytes times the mean hops
    of their op's steps (the link traffic if each ring runs in listed order); unmapped: ops whose
    groups the HLO text did not give."""
    out: dict[str, dict] = {}
    rings: dict[str, set] = {}
    steps_run: dict[str, list[int]] = {}  # kind -> [hops summed, steps] over every run
    for program, program_ops in ops.items():
        for op in program_ops:
            s = out.setdefault(op.kind, {"count": 0, "programs": [], "groups": [], "hops_min": None,
                                         "hops_max": None, "mean_hops": None, "rings": 0,
                                         "rings_closed": 0, "received": 0.0, "byte_hops": 0.0,
                                         "unmapped": 0})
            s["count"] += op.times
            s["received"] += op.times * op.received
            if program not in s["programs"]:
                s["programs"].append(program)
            if not op.groups:
                s["unmapped"] += op.times
                continue
            shape = f"{len(op.groups)}x{len(op.groups[0])}"
            if shape not in s["groups"]:
                s["groups"].append(shape)
            steps = [h for g in op.groups for h in _steps(op, g, coords, extents, wraps)]
            if not steps:
                continue
            s["byte_hops"] += op.times * op.received * sum(steps) / len(steps)
            s["hops_min"] = min(steps + ([] if s["hops_min"] is None else [s["hops_min"]]))
            s["hops_max"] = max(steps + ([] if s["hops_max"] is None else [s["hops_max"]]))
            total = steps_run.setdefault(op.kind, [0, 0])
            total[0] += op.times * sum(steps)
            total[1] += op.times * len(steps)
            if op.kind != "collective-permute":
                rings.setdefault(op.kind, set()).update(g for g in op.groups if len(g) > 1)
    for kind, s in out.items():
        if kind in steps_run:
            s["mean_hops"] = steps_run[kind][0] / steps_run[kind][1]
        s["rings"] = len(rings.get(kind, ()))
        s["rings_closed"] = sum(all(h <= 1 for h in ring_steps(g, coords, extents, wraps))
                                for g in rings.get(kind, ()))
    return dict(sorted(out.items()))


def placement(ops: Mapping[str, Sequence[CollectiveOp]], orders: Mapping[str, Coords], *,
              extents: Sequence[int], wraps: Sequence[bool], sp: int) -> dict:
    """The collectives of a run's programs under each device order (`orders`: name -> the chip
    coordinates of partition 0, 1, ...; the HLO is the same, only the chips differ), with the
    slice's extents and wraparound, and whether each sp group (partitions c*sp ... c*sp + sp - 1,
    a row of the (cfg, sp) mesh) is a closed ring of steps of 1 hop at most (0 hops: two devices
    of one chip)."""
    out = {"extents": list(extents), "wraparound": list(wraps), "sp": sp, "orders": {}}
    for name, coords in orders.items():
        rows = [range(c, c + sp) for c in range(0, len(coords), sp)]
        sp_steps = [ring_steps(r, coords, extents, wraps) for r in rows]
        out["orders"][name] = {"chips": [list(c) for c in coords], "sp_ring_steps": sp_steps,
                               "sp_rings_closed": all(h <= 1 for steps in sp_steps for h in steps),
                               "collectives": summarize(ops, coords, extents, wraps)}
    return out


def format_placement(p: dict) -> str:
    """One line: each order's sp rings and the hops per step of each kind."""
    def order(name, o):
        kinds = ", ".join(f"{k} {s['hops_min']}-{s['hops_max']}" for k, s in o["collectives"].items()
                          if s["hops_max"] is not None)
        return (f"{name.replace('_', ' ')}: sp rings {'closed' if o['sp_rings_closed'] else 'OPEN'} "
                f"({'/'.join(str(sum(s)) for s in o['sp_ring_steps'])} hops), hops per step "
                f"{kinds or '-'}")
    wraps = "wraparound on " + "/".join("xyz"[i] for i, w in enumerate(p["wraparound"]) if w) \
        if any(p["wraparound"]) else "no wraparound"
    return (f"collectives on the {'x'.join(map(str, p['extents']))} chips ({wraps}): "
            + "; ".join(order(n, o) for n, o in p["orders"].items()))
