"""The TPU chips and slice shapes a deviceless compile targets, and their compile-only devices.

`parse_topology` is pure (a slice name -> chip and shape, checked against the shapes Cloud TPU
offers), so a command can refuse a bad slice before libtpu is loaded; `topology_devices` loads
libtpu and asks it for the slice's devices.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from sampling.units import GiB

# Compiling for a TPU needs no TPU: several processes may load libtpu at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")



class AotError(ValueError):
    """A topology, mesh or install that cannot give a compile; reported before any build."""


@dataclass(frozen=True)
class Chip:
    """One TPU generation, per JAX device: a chip on v5e, v5p (its two TensorCores one megacore
    device) and v6e; one TensorCore, half a chip, on v7x (devices_per_chip 2). Peak rates and
    bandwidths: Cloud TPU documentation (cloud.google.com/tpu/docs/v5e, v5p, v6e, tpu7x).
    hbm_bytes: the compiler's own limit, read from its RESOURCE_EXHAUSTED message ("exceeds
    available HBM (31.25G)" on v6e)."""

    name: str
    device_kind: str
    hbm_bytes: int
    bf16_flops: float  # per second
    hbm_bandwidth: float  # bytes per second
    ici_bandwidth: float  # bytes per second, bidirectional, all ports
    host_bounds: tuple[int, int, int]  # chips of one host
    devices_per_chip: int = 1
    libtpu_name: str = ""  # the generation as libtpu's topology names spell it, where it differs


# TPU7x (Ironwood), docs.cloud.google.com/tpu/docs/tpu7x, "System architecture": per chip 2307
# TFLOP/s bf16, 192 GiB of HBM at 7380 GB/s, 1200 GB/s bidirectional ICI, two TensorCores; 4-chip
# VMs (224 vCPUs); "the Ironwood programming model lets you access two TPU devices" per chip (its
# dual-chiplet architecture), and libtpu 0.0.42 gives 2 devices per chip (core_on_chip 0 and 1,
# device_kind "TPU7x"), each compiled against 94.75 GiB ("exceeds available HBM (94.75G)"): half
# the chip's 192 GiB less the compiler's reserve. Per device here: half the chip's peak and HBM
# bandwidth (each TensorCore with its own chiplet's HBM), and, an assumption no page states, half
# its ICI bandwidth (each chiplet with half the links); two devices of one chip talk die to die,
# not over ICI, which the roofline does not model.
V7X = Chip("v7x", "TPU7x", int(94.75 * GiB), 2307e12 / 2, 7380e9 / 2, 1200e9 / 2, (2, 2, 1),
           devices_per_chip=2, libtpu_name="tpu7x")
CHIPS = {
    "v5e": Chip("v5e", "TPU v5 lite", int(15.75 * GiB), 197e12, 819e9, 400e9, (2, 4, 1)),
    "v5p": Chip("v5p", "TPU v5", int(95.74 * GiB), 459e12, 2765e9, 600e9, (2, 2, 1)),
    "v6e": Chip("v6e", "TPU v6 lite", int(31.25 * GiB), 918e12, 1638e9, 800e9, (2, 4, 1)),
    "v7x": V7X,
}
_TOPOLOGY = re.compile(r"^(v5e|v5p|v6e|v7x):(\d+)x(\d+)(?:x(\d+))?$")

# The slice shapes Cloud TPU offers (chips per axis, as `gcloud compute tpus tpu-vm create
# --topology` and GKE's cloud.google.com/gke-tpu-topology take them). libtpu's own parser
# (jax.experimental.topologies.get_topology_desc, libtpu 0.0.42) builds devices for any AxB[xC]
# its host bounds divide, v6e:2x3, v6e:64x64 and v5p:2x2x3 included, so a plan for a slice that
# cannot be rented would come out; the shape is checked here instead.
# v5e and v6e: the 2D shapes of cloud.google.com/tpu/docs/v5e and /tpu/docs/v6e (256-chip pods).
SLICES_2D = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))
# v5p (cloud.google.com/tpu/docs/v5p): below one 4x4x4 cube 2x2x1, 2x2x2, 2x2x4, 2x4x4; above,
# whole cubes (each axis a multiple of 4, listed ascending: 4x4x8, 8x16x16), up to the largest
# slice one job can have, 16x16x24 (96 cubes, 6144 chips).
V5P_SUBCUBE = ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4))
V5P_MAX_CUBES = 96
# v7x: the stored copy of docs.cloud.google.com/tpu/docs/tpu7x ends before its configurations,
# so the shapes are xpk's (github.com/AI-Hypercomputer/xpk, src/xpk/core/system_characteristics.py,
# its tpu7x topologies, which GKE's cloud.google.com/gke-tpu-topology takes): 1x1x1 (the 1-chip
# tpu7x-standard-1t VM), 2x2x1, 2x2x2, 2x2x4, 2x4x4, then whole 4x4x4 cubes ascending (4x4x8 ...
# 16x24x24), up to a whole 9,216-chip pod (tpu7x page), 144 cubes. Like v5p's, xpk lists most but
# not all of the whole-cube shapes this rule takes.
V7X_SUBCUBE = ((1, 1, 1), (2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4))
V7X_MAX_CUBES = 144
# 3-D generations: (shapes below a cube, most cubes in one slice, that largest slice)
CUBE_SLICES = {"v5p": (V5P_SUBCUBE, V5P_MAX_CUBES, "16x16x24"),
               "v7x": (V7X_SUBCUBE, V7X_MAX_CUBES, "16x24x24")}


def _slice_exists(chip: Chip, dims: tuple[int, ...]) -> bool:
    if chip.name not in CUBE_SLICES:
        return dims in SLICES_2D
    subcube, max_cubes, _ = CUBE_SLICES[chip.name]
    if dims in subcube:
        return True
    return all(d % 4 == 0 for d in dims) and list(dims) == sorted(dims) and \
        math.prod(d // 4 for d in dims) <= max_cubes


def _slices(chip: Chip) -> str:
    if chip.name not in CUBE_SLICES:
        return ", ".join(f"{chip.name}:{a}x{b}" for a, b in SLICES_2D)
    subcube, max_cubes, largest = CUBE_SLICES[chip.name]
    return (", ".join(f"{chip.name}:{a}x{b}x{c}" for a, b, c in subcube) + ", or whole 4x4x4 "
            f"cubes: AxBxC with A <= B <= C multiples of 4, at most {max_cubes} cubes "
            f"({chip.name}:{largest})")


def parse_topology(name: str) -> tuple[Chip, tuple[int, int, int]]:
    """"v6e:2x4" -> (chip, (2, 4, 1)); AotError for anything else."""
    m = _TOPOLOGY.match(name or "")
    if not m:
        raise AotError(f"--topology {name!r}: expected <generation>:<X>x<Y>[x<Z>] with generation "
                       f"one of {', '.join(CHIPS)}, e.g. v6e:2x4 (a v6e-8 slice), v5e:2x2, v5p:2x2x1, "
                       "v7x:2x2x1 (4 chips, 8 devices)")
    chip = CHIPS[m.group(1)]
    dims = tuple(int(d) for d in m.groups()[1:] if d is not None)
    cubes = chip.name in CUBE_SLICES
    if len(dims) != (3 if cubes else 2):
        raise AotError(f"--topology {name!r}: {chip.name} slices are "
                       f"{'3' if cubes else '2'}-dimensional, e.g. "
                       f"{chip.name + (':2x2x1' if cubes else ':2x4')}")
    if not _slice_exists(chip, dims):
        raise AotError(f"--topology {name}: not a {chip.name} slice Cloud TPU offers; expected "
                       f"{_slices(chip)}")
    return chip, (*dims, 1)[:3]


def wraparound(chip: Chip, dims: tuple[int, ...]) -> tuple[bool, ...]:
    """Which axes of a slice close into a ring with a wraparound link. The Scaling Book ("How to
    Think About TPUs", jax-ml.github.io/scaling-book/tpus): v5e and v6e have one only along an
    axis of 16 chips ("a 4x4 slice ... no wraparound connections"); v5p gets them from its optical
    switches on slices of whole 4x4x4 cubes ("a 2x2x4 won't have any"). v7x is taken to be v5p's
    case (an assumption: its pods are 4x4x4 cubes joined by optical switches too, and its shapes
    follow v5p's, but no page read here says where it wraps)."""
    if chip.name in CUBE_SLICES:
        return tuple(d > 1 and all(e % 4 == 0 for e in dims) for d in dims)
    return tuple(d == 16 for d in dims)


def topology_devices(name: str):
    """(chip, compile-only devices of the slice). Needs libtpu; JAX itself may stay on the CPU."""
    chip, dims = parse_topology(name)
    try:
        import libtpu  # noqa: F401
    except ImportError:
        import jax  # the libtpu that matches this JAX (0.10.2 in requirements-tpu.txt)
        raise AotError(f'compiling for a TPU needs libtpu: pip install "jax[tpu]=={jax.__version__}" '
                       "(about 700 MB; JAX keeps running on the CPU with JAX_PLATFORMS=cpu)") from None
    from jax.experimental import topologies
    # One host holds 8 chips on v5e/v6e, 4 on v5p and v7x; a smaller slice is one host of its own.
    host = [min(d, h) for d, h in zip(dims, chip.host_bounds, strict=True)]
    # libtpu names v7x "tpu7x" (it refuses "v7x:2x2x1")
    libtpu_name = chip.libtpu_name + name[len(chip.name):] if chip.libtpu_name else name
    try:
        desc = topologies.get_topology_desc(topology_name=libtpu_name, platform="tpu",
                                            chips_per_host_bounds=host)
    except Exception as exc:  # noqa: BLE001 - libtpu's messages are the useful part
        raise AotError(f"--topology {name}: libtpu refused it: {str(exc).splitlines()[0]}") from None
    return chip, list(desc.devices)
