"""Meshes from the slice's topology (sharding/device_order.py): on a TPU slice each sp row of the
(cfg, sp) mesh is a ring of ICI neighbours, whatever order the devices are listed in; on the CPU
(and any device without coordinates) the mesh is the device list reshaped, as it always was."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sharding.device_order import device_grid, ring_order
from sharding.jax_sp import make_mesh

ROOT = Path(__file__).resolve().parents[1]


class FakeChip:
    """What create_device_mesh reads of a TPU device."""

    platform = "tpu"
    core_on_chip = 0

    def __init__(self, id, coords, process_index, device_kind="TPU v5 lite"):
        self.id, self.coords, self.process_index = id, coords, process_index
        self.device_kind = device_kind

    def __repr__(self):
        return f"chip{self.id}{self.coords[:2]}"


def v5e_4x4():
    """A v5litepod-16 as its 4 hosts list it: host by host, each host a 2x2 block of chips."""
    chips = []
    for host, (hx, hy) in enumerate([(0, 0), (2, 0), (0, 2), (2, 2)]):
        for dy in range(2):
            for dx in range(2):
                x, y = hx + dx, hy + dy
                chips.append(FakeChip(4 * y + x, (x, y, 0), host))
    return chips


def distance(p, q):
    return sum(abs(a - b) for a, b in zip(p, q, strict=True))


def hops(a, b):
    return distance(a.coords, b.coords)


def is_ring(row, closed=True):
    """Every step one ICI hop (no wraparound: a v5e slice below a full pod has none), and the
    last back to the first."""
    steps = list(zip(row[:-1], row[1:], strict=True)) + ([(row[-1], row[0])] if closed else [])
    return all(hops(a, b) == 1 for a, b in steps)


def test_sp_rows_are_rings_of_ici_neighbours_on_a_v5e_4x4():
    chips = v5e_4x4()
    # the premise: the list in order is not a ring (each host's 2x2 block, then the next host's)
    assert not is_ring(np.array(chips).reshape(2, 8)[0])
    mesh = make_mesh(8, 2, chips)
    grid = mesh.devices
    assert grid.shape == (2, 8) and mesh.axis_names == ("cfg", "sp")
    assert sorted(d.id for d in grid.flat) == list(range(16))
    for row in grid:
        assert is_ring(list(row)), row
        # a compact 4x2 block of the torus, not a scattered set
        xs, ys = {d.coords[0] for d in row}, {d.coords[1] for d in row}
        assert len(xs) * len(ys) == 8
    # cfg splits the slice into two halves: each sp shard's cfg partner sits at one fixed offset
    offsets = {tuple(np.subtract(b.coords, a.coords)) for a, b in zip(grid[0], grid[1], strict=True)}
    assert len(offsets) == 1
    # one ring of all 16, and a (1, 8) mesh over the first 8 listed (hosts 0 and 1)
    assert is_ring(list(make_mesh(16, 1, chips).devices[0]))
    assert is_ring(list(make_mesh(8, 1, chips).devices[0]))


def test_without_coordinates_the_grid_is_the_list_in_order():
    class Plain:
        platform = "tpu"
        device_kind = "TPU v5 lite"

    plain = [Plain() for _ in range(8)]
    assert (device_grid((2, 4), plain) == np.array(plain).reshape(2, 4)).all()
    # chips that do not fill a box (a hole at (1, 1)) are kept in the order given
    holed = [FakeChip(i, c, 0) for i, c in enumerate([(0, 0, 0), (1, 0, 0), (0, 1, 0), (2, 1, 0)])]
    assert list(device_grid((1, 4), holed)[0]) == holed


@pytest.mark.parametrize("sides", [(2, 4, 1), (4, 4, 1), (4, 2, 1), (2, 2, 2), (4, 1, 1), (3, 3, 1),
                                   (3, 2, 1), (1, 1, 1)])
def test_ring_order_visits_a_box_one_hop_at_a_time(sides):
    rng = np.random.default_rng(0)
    points = [(x + 5, y, z) for x in range(sides[0]) for y in range(sides[1]) for z in range(sides[2])]
    points = [points[i] for i in rng.permutation(len(points))]
    order = ring_order(points)
    assert sorted(order) == list(range(len(points)))
    walk = [points[i] for i in order]
    assert all(distance(a, b) == 1 for a, b in zip(walk[:-1], walk[1:], strict=True))
    flat = sum(s > 1 for s in sides) < 2
    if not flat and any(s % 2 == 0 for s in sides):  # a ring (a line, or all sides odd: none exists)
        assert distance(walk[-1], walk[0]) == 1


def test_ring_order_leaves_holes_and_repeats_alone():
    assert ring_order([(0, 0), (1, 0), (0, 1)]) is None
    assert ring_order([(0, 0), (0, 0)]) is None
    assert ring_order([]) is None


def test_libtpu_compile_only_devices_give_rings():
    """The devices a deviceless compile (python -m commands.aot) builds its mesh from."""
    from tpu.topology import topology_devices

    _, v5e = topology_devices("v5e:4x4")
    grid = make_mesh(8, 2, v5e).devices
    assert all(is_ring(list(row)) for row in grid)
    _, v6e = topology_devices("v6e:2x4")
    assert is_ring(list(make_mesh(8, 1, v6e).devices[0]))
    assert all(is_ring(list(row)) for row in make_mesh(4, 2, v6e).devices)


_CPU_CHECK = """
import json
import jax
import numpy as np
from sharding.jax_sp import make_mesh
from tpu.vae_plan import make_mesh as vae_mesh
devices = jax.devices()
out = {}
for cfg, sp in [(1, 8), (2, 4), (2, 2), (1, 3), (2, 1)]:
    mesh = make_mesh(sp, cfg)
    want = np.array(devices[: sp * cfg]).reshape(cfg, sp)
    out[f"{cfg}x{sp}"] = [mesh.devices.tolist() == want.tolist(), [d.id for d in mesh.devices.flat]]
for n in (8, 4):
    out[f"vae{n}"] = [vae_mesh(n).devices.tolist() == devices[:n], [d.id for d in vae_mesh(n).devices]]
print(json.dumps({"platform": devices[0].platform, "n": len(devices), "meshes": out}))
"""


def test_on_emulated_cpu_devices_the_mesh_is_the_list_reshaped():
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, "-c", _CPU_CHECK], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["platform"] == "cpu" and got["n"] == 8
    for name, (same, ids) in got["meshes"].items():
        assert same, (name, ids)
    assert got["meshes"]["2x4"][1] == list(range(8))
