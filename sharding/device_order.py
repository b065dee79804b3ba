"""Where each device sits in a mesh: on a TPU slice, by the chips' ICI coordinates.

`jax.devices()` lists a slice host by host, not in torus order, so a mesh reshaped from that list
can put consecutive shards of an axis several ICI hops apart. `device_grid` asks JAX's
`create_device_mesh` which chips share a row of the last (most network-intensive) axis, so the
first axis splits the slice where it costs least, then orders each row as a ring of ICI neighbours
(`ring_order`): JAX's own orders zig-zag where a physical axis is split (v5e:4x4 as (2, 8): chip
(0,1) then (1,0), two hops) and its 8-chip tray order assumes a 4-wide host (libtpu's v5e/v6e
2x4 hosts are 2 wide). Devices without coordinates (CPU, GPU), or that create_device_mesh refuses,
keep the list order: the grid is then exactly the list reshaped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from jax.experimental import mesh_utils


def device_grid(shape: tuple[int, ...], devices: Sequence) -> np.ndarray:
    """`devices` (exactly prod(shape) of them) as an array of `shape`, each row of the last axis a
    ring (or path) of ICI neighbours on a TPU slice; anywhere else the list in order."""
    devices = list(devices)
    listed = np.array(devices).reshape(shape)
    if not all(d.platform == "tpu" and getattr(d, "coords", None) is not None for d in devices):
        return listed
    try:
        # split physical axes where the shape needs it (v5e:4x4 as (2, 8)): refused otherwise
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (AssertionError, NotImplementedError, ValueError):  # not a whole cuboid of chips
        grid = listed
    rows = grid.reshape(-1, shape[-1])
    out = np.empty_like(rows)
    for i, row in enumerate(rows):
        # relative coordinates only: rows that are translates of each other get the same order,
        # so the devices paired across the first axis stay a fixed offset apart
        order = ring_order([(*d.coords, getattr(d, "core_on_chip", 0)) for d in row])
        out[i] = row if order is None else row[order]
    return out.reshape(shape)


def ring_order(coords: Sequence[Sequence[int]]) -> list[int] | None:
    """Indices into `coords` that visit them one unit step along one axis at a time, the last
    step back to the first where a ring exists (a box of 2+ dimensions with an even side; else a
    path). None when the coordinates do not fill a box exactly once (the order is then kept)."""
    points = [tuple(c) for c in coords]
    if not points or len(set(points)) != len(points):
        return None
    low = [min(p[i] for p in points) for i in range(len(points[0]))]
    sides = [max(p[i] for p in points) - low[i] + 1 for i in range(len(low))]
    if math.prod(sides) != len(points):
        return None
    # an even side first: its first column is the way back that closes the ring
    axes = sorted((i for i, s in enumerate(sides) if s > 1), key=lambda i: sides[i] % 2)
    where = {p: k for k, p in enumerate(points)}
    order = []
    for step in _walk([sides[i] for i in axes]):
        point = list(low)
        for axis, offset in zip(axes, step, strict=True):
            point[axis] += offset
        order.append(where[tuple(point)])
    return order


def _walk(sides: list[int]) -> list[tuple[int, ...]]:
    """Every point of a box with these sides, consecutive points one unit apart: rows along the
    first side snake over a walk of the rest; with that side even, the walk's first column is
    kept for the way back to the start."""
    if not sides:
        return [()]
    rest = _walk(sides[1:])
    a, b = sides[0], len(rest)
    if b == 1:
        return [(r, *rest[0]) for r in range(a)]
    if a % 2:
        return [(r, *rest[c if r % 2 == 0 else b - 1 - c]) for r in range(a) for c in range(b)]
    out = [(0, *rest[0])]
    for r in range(a):
        out += [(r, *rest[c]) for c in (range(1, b) if r % 2 == 0 else range(b - 1, 0, -1))]
    return out + [(r, *rest[0]) for r in range(a - 1, 0, -1)]
