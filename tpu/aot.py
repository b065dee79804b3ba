"""Ahead-of-time compile for a Cloud TPU slice, on a machine without one: `python -m tpu.aot`.

With libtpu installed (`pip install "jax[tpu]==0.10.2"`), a topology name gives the compile-only
devices of a TPU slice, and `jax.jit(f).lower(<abstract arguments sharded over a mesh of them>)
.compile()` runs the real TPU compiler, Mosaic (splash) kernels included. `AotBackend` is the JAX
backend with every program call compiled instead of run, and the project's own warm-up drives
it, so exactly the programs the loop would run are compiled: probe, middle, tail, cached tail,
the residual add/sub and forecast combinations, each scheduler combination, the frame write-back.

What is measured (the compiler's own figures, per chip): HBM arguments, outputs and temporaries
of each program, flops and bytes accessed (XLA's cost analysis; the splash kernel is a custom
call it cannot see, so its work is counted from the shapes it was traced with), collectives by
kind and bytes (read from the compiled HLO), compile seconds on this machine.
What is estimated: the memory plan of the whole run (weights resident, residual slots the gate
can hold, inputs, the largest program in flight) against the chip's HBM, and a roofline time
(each program bound by the larger of flops / peak bf16 rate, bytes / HBM bandwidth and received
collective bytes / ICI bandwidth) per call, per step and per run, with caching off and with the
cache schedule.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field

# Compiling for a TPU needs no TPU: several processes may load libtpu at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from sampling.platforms import quiet_cpu_default  # noqa: E402 - before jax: see its docstring

quiet_cpu_default()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from cache import CMConfig, ConfigError  # noqa: E402
from cache.flags import add_cache_arguments, config_from_args  # noqa: E402
from modules.checkpoint import CheckpointError, cast_model, load_model  # noqa: E402
from modules.layers import ModelConfigError  # noqa: E402
from modules.registry import build_model  # noqa: E402
from sampling.cli import UsageError, as_int, as_number, command  # noqa: E402
from sampling.loop import Combination, folding  # noqa: E402
from sampling.pipelines import MAX_GUIDANCE, MAX_STEPS, MAX_TOKENS, PIPELINES, SizeError, get_pipeline  # noqa: E402  # noqa: E402
from sampling.run import make_sample, warm_up  # noqa: E402
from sampling.schedulers import SOLVERS, SchedulerError, make_scheduler  # noqa: E402
from sampling.stage_io import StageFileError, check_writable_file  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402
from sharding.jax_sp import WEIGHT_SHARDINGS, make_mesh  # noqa: E402

from . import attention  # noqa: E402
from .backend import JaxBackend, _rel_l1  # noqa: E402

GiB = 2**30


class AotError(ValueError):
    """A topology, mesh or install that cannot give a compile; reported before any build."""


# --- chips and topologies ------------------------------------------------------------------------

@dataclass(frozen=True)
class Chip:
    """One TPU generation, per chip. Peak rates and bandwidths: Cloud TPU documentation
    (cloud.google.com/tpu/docs/v5e, v5p, v6e). hbm_bytes: the compiler's own limit, read from
    its RESOURCE_EXHAUSTED message ("exceeds available HBM (31.25G)" on v6e)."""

    name: str
    device_kind: str
    hbm_bytes: int
    bf16_flops: float  # per second
    hbm_bandwidth: float  # bytes per second
    ici_bandwidth: float  # bytes per second, bidirectional, all ports
    host_bounds: tuple[int, int, int]  # chips of one host


CHIPS = {
    "v5e": Chip("v5e", "TPU v5 lite", int(15.75 * GiB), 197e12, 819e9, 400e9, (2, 4, 1)),
    "v5p": Chip("v5p", "TPU v5", int(95.74 * GiB), 459e12, 2765e9, 600e9, (2, 2, 1)),
    "v6e": Chip("v6e", "TPU v6 lite", int(31.25 * GiB), 918e12, 1638e9, 800e9, (2, 4, 1)),
}
_TOPOLOGY = re.compile(r"^(v5e|v5p|v6e):(\d+)x(\d+)(?:x(\d+))?$")

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


def _slice_exists(chip: Chip, dims: tuple[int, ...]) -> bool:
    if chip.name != "v5p":
        return dims in SLICES_2D
    if dims in V5P_SUBCUBE:
        return True
    return all(d % 4 == 0 for d in dims) and list(dims) == sorted(dims) and \
        math.prod(d // 4 for d in dims) <= V5P_MAX_CUBES


def _slices(chip: Chip) -> str:
    if chip.name != "v5p":
        return ", ".join(f"{chip.name}:{a}x{b}" for a, b in SLICES_2D)
    return (", ".join(f"v5p:{a}x{b}x{c}" for a, b, c in V5P_SUBCUBE) + ", or whole 4x4x4 cubes: "
            f"AxBxC with A <= B <= C multiples of 4, at most {V5P_MAX_CUBES} cubes (v5p:16x16x24)")


def parse_topology(name: str) -> tuple[Chip, tuple[int, int, int]]:
    """"v6e:2x4" -> (chip, (2, 4, 1)); AotError for anything else."""
    m = _TOPOLOGY.match(name or "")
    if not m:
        raise AotError(f"--topology {name!r}: expected <generation>:<X>x<Y>[x<Z>] with generation "
                       f"one of {', '.join(CHIPS)}, e.g. v6e:2x4 (a v6e-8 slice), v5e:2x2, v5p:2x2x1")
    chip = CHIPS[m.group(1)]
    dims = tuple(int(d) for d in m.groups()[1:] if d is not None)
    if chip.name == "v5p" and len(dims) != 3 or chip.name != "v5p" and len(dims) != 2:
        raise AotError(f"--topology {name!r}: {chip.name} slices are "
                       f"{'3' if chip.name == 'v5p' else '2'}-dimensional, e.g. "
                       f"{'v5p:2x2x1' if chip.name == 'v5p' else chip.name + ':2x4'}")
    if not _slice_exists(chip, dims):
        raise AotError(f"--topology {name}: not a {chip.name} slice Cloud TPU offers; expected "
                       f"{_slices(chip)}")
    return chip, (*dims, 1)[:3]


def topology_devices(name: str):
    """(chip, compile-only devices of the slice). Needs libtpu; JAX itself may stay on the CPU."""
    chip, dims = parse_topology(name)
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise AotError('compiling for a TPU needs libtpu: pip install "jax[tpu]==0.10.2" '
                       "(about 700 MB; JAX keeps running on the CPU with JAX_PLATFORMS=cpu)") from None
    from jax.experimental import topologies
    # One host holds 8 chips on v5e/v6e, 4 on v5p; a smaller slice is one host of its own.
    host = [min(d, h) for d, h in zip(dims, chip.host_bounds, strict=True)]
    try:
        desc = topologies.get_topology_desc(topology_name=name, platform="tpu",
                                            chips_per_host_bounds=host)
    except Exception as exc:  # noqa: BLE001 - libtpu's messages are the useful part
        raise AotError(f"--topology {name}: libtpu refused it: {str(exc).splitlines()[0]}") from None
    return chip, list(desc.devices)


# --- what a compiled program costs ---------------------------------------------------------------

_ARRAY = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64|c64|c128|f8e4m3fn|f8e5m2)"
                    r"\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "f16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
         "f8e4m3fn": 8, "f8e5m2": 8}
_COLLECTIVE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-gather|all-reduce|all-to-all|reduce-scatter|"
                         r"collective-permute)(-start)?\((.*)$")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")


def _array_bytes(text: str) -> list[int]:
    out = []
    for dtype, dims in _ARRAY.findall(text):
        bits = _BITS.get(dtype) or int(dtype[1:])
        out.append(math.prod(int(d) for d in dims.split(",") if d) * bits // 8)
    return out


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


def loop_costs(hlo: str) -> tuple[float, float]:
    """(flops, bytes accessed) that XLA's cost analysis leaves out of a program with loops: it
    counts a while body once, so each body's cost (analysed as the entry of a copy of the
    module, by the CPU client: shape-based, so the same flops) times its trip count - 1."""
    found = loops(hlo)
    if not found:
        return 0.0, 0.0
    from jax._src.lib import _jax
    from jaxlib import _hlo
    client = jax.devices("cpu")[0].client
    plain = re.sub(r"^ENTRY ", "", hlo, flags=re.M)

    def cost(body):  # the body's own cost, nested loops included
        text = re.sub(rf"^(%?{re.escape(body)} )", r"ENTRY \1", plain, count=1, flags=re.M)
        c = _jax.hlo_module_cost_analysis(client, _hlo.hlo_module_from_text(text))
        flops, accessed = float(c.get("flops", 0.0)), float(c.get("bytes accessed", 0.0))
        for inner, n in found.get(body, ()):
            f, b = cost(inner)
            flops, accessed = flops + (n - 1) * f, accessed + (n - 1) * b
        return flops, accessed

    _, entry = computations(hlo)
    flops = accessed = 0.0
    for body, n in found.get(entry, ()):
        f, b = cost(body)
        flops, accessed = flops + (n - 1) * f, accessed + (n - 1) * b
    return flops, accessed


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


def chip_bytes(tree) -> int:
    """Bytes one chip holds of a tree of abstract arrays (its shard of each)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


@dataclass
class Program:
    """One compiled program, per chip."""

    name: str
    compile_seconds: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    weight_bytes: int  # the weights among its arguments
    activation_bytes: int  # its arguments the loop computed (not weights, not inputs)
    flops: float
    bytes_accessed: float
    kernel_flops: float  # splash attention, counted from its shapes (inside `flops`)
    collectives: dict = field(default_factory=dict)
    # bytes that cross the HBM interface (`tpu.hbm`: memory-space aware; None in a report
    # written before it was counted). `bytes_accessed` counts VMEM-resident operands too.
    hbm_bytes: float | None = None

    @property
    def ici_bytes(self) -> float:
        return sum(c["received"] for c in self.collectives.values())

    def seconds(self, chip: Chip, traffic: bool = False) -> dict | None:
        """Roofline: each bound, and the program's time if it ran at the largest of them.
        traffic: the HBM bound from `hbm_bytes` (the memory-space-aware count) rather than
        XLA's bytes accessed; None when the program has no such count."""
        if traffic and self.hbm_bytes is None:
            return None
        hbm = self.hbm_bytes if traffic else self.bytes_accessed
        bounds = {"compute": self.flops / chip.bf16_flops,
                  "hbm": hbm / chip.hbm_bandwidth,
                  "ici": self.ici_bytes / (chip.ici_bandwidth / 2)}  # received: one direction
        return {**bounds, "roofline": max(bounds.values())}

    def in_flight(self) -> int:
        """Bytes this program adds while it runs: its computed arguments, temporaries, outputs."""
        return self.activation_bytes + self.temp_bytes + self.output_bytes


def record(name: str, compiled, seconds: float, *, weight_bytes: int, activation_bytes: int,
           kernels=()) -> Program:
    """What the compiler says of one compiled program, per chip. `kernels`: the Pallas kernels
    traced into it (`attention.kernel_costs`), whose work the compiler's cost analysis omits."""
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older JAX returns one dict per partition
        cost = cost[0]
    kernel_flops = sum(k.flops for k in kernels)  # scaled by loop trips when traced
    hlo = compiled.as_text()
    loop_flops, loop_bytes = loop_costs(hlo)
    from .hbm import hbm_traffic  # tpu.hbm parses HLO with this module's helpers
    extra = sum(k.extra_bytes for k in kernels)
    return Program(name, seconds, memory.argument_size_in_bytes, memory.output_size_in_bytes,
                   memory.temp_size_in_bytes, weight_bytes, activation_bytes,
                   float(cost.get("flops", 0.0)) + loop_flops + kernel_flops,
                   float(cost.get("bytes accessed", 0.0)) + loop_bytes + extra,
                   kernel_flops, collectives(hlo), hbm_traffic(hlo) + extra)


_TORCH_TO_JAX = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16,
                 torch.float16: jnp.float16, torch.bool: jnp.bool_, torch.int32: jnp.int32,
                 torch.int64: jnp.int64, torch.uint8: jnp.uint8, torch.int8: jnp.int8}


def jax_dtype(dtype: torch.dtype):
    # int64 becomes int32 when JAX runs without x64, as a transfer of the host tensor would
    return jax.dtypes.canonicalize_dtype(_TORCH_TO_JAX[dtype])


# --- the backend ------------------------------------------------------------------------------

class AotBackend(JaxBackend):
    """The JAX backend compiling for compile-only TPU devices: weights and inputs are abstract
    arrays (shape, dtype, sharding), and every program call lowers and compiles its program
    once per abstract signature, records what the compiler says, and returns abstract outputs."""

    def __init__(self, models: dict, plan: SignalPlan, *, devices, mesh=None,
                 weights: str | None = None, attention_impl: str = "splash",
                 scan_blocks: bool = True):
        self._device = devices[0]
        self._persistent: set[int] = set()  # ids of weights and inputs (not computed per call)
        self.records: dict[tuple, Program] = {}
        self._outputs: dict[tuple, object] = {}
        self.calls: dict[str, int] = {}
        self.input_bytes = 0
        self.expert_bytes: dict = {}
        super().__init__(models, plan, attention_impl=attention_impl, mesh=mesh, weights=weights,
                         scan_blocks=scan_blocks)
        self.expert_bytes = {e: chip_bytes(p) for e, p in self.params.items()}
        self._weight_ids = {id(w) for p in self.params.values() for w in p.values()}

    def _default_placement(self):
        return SingleDeviceSharding(self._device)

    def _abstract(self, shape, dtype, sharding):
        x = jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)
        self._persistent.add(id(x))
        return x

    def _weights(self, model, checkpoint=None):
        specs, _ = self._weight_specs(model)
        return {f"model.{name}": self._abstract(s.shape, jax_dtype(s.dtype), s.sharding)
                for name, s in specs.items()}

    def put(self, tensor: torch.Tensor):
        x = self._abstract(tensor.shape, jax_dtype(tensor.dtype), self._placement)
        self.input_bytes += chip_bytes(x)
        return x

    def _call(self, name, program, *args):
        self.calls[name] = self.calls.get(name, 0) + 1
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
                            if isinstance(a, np.ndarray) else a, args)
        leaves, tree = jax.tree.flatten(args)
        key = (name, id(program), tree,
               tuple((a.shape, a.dtype, getattr(a, "sharding", None)) for a in leaves))
        if key in self.records:
            return self._outputs[key]
        began = time.perf_counter()
        with attention.kernel_costs() as kernels:
            lowered = program.lower(*args)
        compiled = lowered.compile()
        self.records[key] = self._record(name, compiled, leaves, kernels,
                                         time.perf_counter() - began)
        self._outputs[key] = jax.tree.map(
            lambda info, s: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=s),
            lowered.out_info, compiled.output_shardings)
        return self._outputs[key]

    def _record(self, name, compiled, leaves, kernels, seconds) -> Program:
        weights = sum(chip_bytes(a) for a in leaves if id(a) in self._weight_ids)
        computed = sum(chip_bytes(a) for a in leaves if id(a) not in self._persistent)
        return record(name, compiled, seconds, weight_bytes=weights, activation_bytes=computed,
                      kernels=kernels)

    # Nothing is read back: the gate sees zero signals, which is all warm-up needs.
    def read_signals(self, signals):
        batch, columns = signals.shape
        return [[0.0] * columns for _ in range(batch)]

    def relative_change(self, new, old) -> float:
        self._call("control_delta", _rel_l1, tuple(new), tuple(old))
        return 0.0

    def get(self, x):
        raise RuntimeError("an ahead-of-time backend holds no data to read back")

    def sync(self, x) -> None:
        pass

    def device_name(self) -> str:
        d = self._device
        shape = "" if self.mesh is None else \
            f" x{self.mesh.size} (sp {self.mesh.shape['sp']}, cfg {self.mesh.shape['cfg']})"
        return f"tpu:{d.device_kind}{shape} (compile only)"

    def program(self, name: str) -> Program | None:
        """The compiled program of that name (the first signature compiled)."""
        return next((p for p in self.records.values() if p.name == name), None)

    def _outputs_of(self, name: str):
        return next(out for key, out in self._outputs.items() if key[0] == name)

# --- the run plan: memory per chip and roofline time -----------------------------------------------

def _step_helpers(backend: AotBackend, scheduler, sample, cfg_on: bool) -> dict[str, float]:
    """Helper programs per step (scheduler combinations, frame write-back): counted over one
    pass of the real scheduler on abstract outputs."""
    before = dict(backend.calls)
    v = sample.noise
    if cfg_on:
        v = Combination(((-1.0, v), (2.0, v)))
    x, lincomb = sample.noise, folding(backend.lincomb)
    for i in range(len(scheduler.timesteps)):
        x = scheduler.step(i, v, x, lincomb)
        if sample.first_frame is not None:
            x = backend.replace_first_frame(x, sample.first_frame)
    steps = len(scheduler.timesteps)
    return {k: (n - before.get(k, 0)) / steps for k, n in backend.calls.items() if n != before.get(k, 0)}


@dataclass
class RunPlan:
    """What one trajectory costs a chip: memory held and roofline seconds."""

    memory: dict
    seconds: dict
    schedule: dict


def run_plan(backend: AotBackend, chip: Chip, config: CMConfig, *, steps: int, branches: int,
             helpers: dict, computed_fraction: float | None, swap_experts: bool) -> RunPlan:
    plan = backend.plan
    prog = backend.program
    full_names = ["probe", "middle", "tail"] + (["sub"] if config.enabled else [])
    tail = "cached_tail" if plan.tail_runs else "tail"
    reuse_names = ["probe", "forecast" if plan.forecast else "add", tail]

    # the leader's schedule: known up front for DeepCache; a given fraction for adaptive gates
    gate_plan = None
    if config.enabled and not config.needs_signals:
        from cache import CacheManager
        gate = CacheManager(config)
        gate.attach(steps)
        gate_plan = gate.plan()
    if gate_plan is not None:
        computed, source = sum(gate_plan), "the DeepCache schedule"
    elif config.enabled and computed_fraction is not None:
        computed, source = round(computed_fraction * steps), "--computed_fraction"
    elif config.enabled:
        computed, source = None, "adaptive: give --computed_fraction for a run estimate"
    else:
        computed, source = steps, "caching off"

    def timing(traffic: bool) -> dict | None:
        """The run's roofline seconds, each program's HBM bound from XLA's bytes accessed or
        (traffic) from its HBM traffic count; None when a program has no such count."""
        used = [n for n in full_names + reuse_names + list(helpers) if prog(n) is not None]
        if traffic and any(prog(n).hbm_bytes is None for n in used):
            return None

        def secs(names):
            return sum(prog(n).seconds(chip, traffic)["roofline"] for n in names
                       if prog(n) is not None)

        full, reused = secs(full_names), secs(reuse_names)
        helper = sum(count * prog(n).seconds(chip, traffic)["roofline"]
                     for n, count in helpers.items())
        off_run = steps * (branches * (full - (secs(["sub"]) if config.enabled else 0)) + helper)
        cached_run = None if computed is None else \
            computed * branches * full + (steps - computed) * branches * reused + steps * helper
        return {"full_call": full, "reused_call": reused, "helpers_per_step": helper,
                "step_uncached": off_run / steps, "run_uncached": off_run,
                "run_cached": cached_run,
                "step_cached": None if cached_run is None else cached_run / steps,
                "speedup": None if not cached_run else off_run / cached_run}

    seconds = timing(False)
    traffic = timing(True)
    if traffic is not None:
        seconds["traffic"] = traffic
    schedule = {"steps": steps, "branches_per_step": branches, "computed_steps": computed,
                "source": source}

    # memory held by one chip at the peak of the run
    weights = (max if swap_experts else sum)(backend.expert_bytes.values())
    hidden = chip_bytes(backend._outputs_of("sub")) if prog("sub") else \
        prog("middle").output_bytes
    slots_per_branch = (1 + plan.forecast) * (1 + len(plan.tail_runs)) if config.enabled else 0
    reference = prog("probe").output_bytes if plan.needs_reference else 0
    slots = branches * slots_per_branch * hidden if config.cfg_mode != "fused" else \
        slots_per_branch * hidden  # a fused pair keeps one batch-2 residual
    largest = max(backend.records.values(), key=lambda p: p.in_flight())
    in_flight = largest.in_flight() + hidden  # + the hidden state the loop keeps for the gate
    inputs = backend.input_bytes
    total = weights + slots + branches * reference + inputs + in_flight
    memory = {"hbm": chip.hbm_bytes, "weights": weights, "experts_resident": 1 if swap_experts
              else len(backend.expert_bytes), "residual_slots": slots,
              "slots": (branches if config.cfg_mode != "fused" else 1) * slots_per_branch,
              "residual_bytes": hidden, "probe_references": branches * reference,
              "inputs": inputs, "in_flight": in_flight, "largest_program": largest.name,
              "total": total, "headroom": chip.hbm_bytes - total,
              "fits": total <= chip.hbm_bytes,
              "switch_bytes": max(backend.expert_bytes.values()) if swap_experts else 0}
    return RunPlan(memory, seconds, schedule)


# --- the command ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tpu.aot",
        description="Compile every program a stage-2 run would use for a Cloud TPU slice, on this "
                    "machine (no TPU needed; libtpu must be installed), and report per chip: "
                    "HBM, flops, collectives, a memory plan of the whole run and a roofline time.")
    p.add_argument("--model", required=True, choices=tuple(PIPELINES), metavar="NAME",
                   help=f"named pipeline: {', '.join(PIPELINES)}")
    p.add_argument("--model_path", help="checkpoint to check (headers only; no tensor is read); "
                   "default: the architecture of --model on the meta device")
    p.add_argument("--topology", required=True, help="TPU slice, e.g. v6e:2x4 (v6e-8), v6e:1x1, "
                   "v5e:2x4, v5p:2x2x1")
    p.add_argument("--sp_size", type=int, default=1, help="sequence-parallel devices (default 1)")
    p.add_argument("--cfg_parallel", action="store_true", help="cond and uncond on two device "
                   "groups (a fused pair; 2 x sp_size chips)")
    p.add_argument("--weight_sharding", choices=WEIGHT_SHARDINGS,
                   help="replicated, or fsdp: block weights split over the mesh, gathered per "
                        "block (default: fsdp on several chips, replicated on one)")
    p.add_argument("--swap_experts", action="store_true", help="plan for keeping only the running "
                   "Wan2.2 I2V-A14B expert on the device (the other loaded at the switch)")
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--video_length", type=int, help="frames, 4k + 1")
    p.add_argument("--num_inference_steps", type=int)
    p.add_argument("--sample_solver", choices=SOLVERS)
    p.add_argument("--sample_shift", type=float)
    p.add_argument("--guidance_scale", type=float, help="1 turns CFG off (one call per step)")
    p.add_argument("--image", action="store_true", help="TI2V with a first frame (per-token "
                   "timesteps); I2V pipelines always take their image")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="weights on the device, fp32 islands kept (default bf16, as a load gives)")
    p.add_argument("--attention", default="splash", choices=("splash", "jax_dpa"),
                   help="attention lowering (default splash, the TPU kernel)")
    p.add_argument("--computed_fraction", type=float,
                   help="adaptive caching (TeaCache/FBCache): the share of steps assumed computed, "
                        "for the run estimate")
    p.add_argument("--unrolled", action="store_true", help="compile the middle stage's blocks "
                   "unrolled, not as a loop over each run of identical blocks (slower to compile)")
    p.add_argument("--json", help="also write the report here")
    add_cache_arguments(p)
    return p


def _models(pipe, model_path, dtype) -> dict:
    models = {}
    for expert, name in pipe.experts:
        if model_path is None:
            models[expert] = cast_model(build_model(name, meta=True), dtype)
        else:
            sub = pipe.checkpoint_dirs.get(expert)
            path = os.path.join(model_path, sub) if sub else model_path
            models[expert], _ = load_model(path, name, dtype=dtype, meta=True)
    return models


def run(args) -> dict:
    # Every flag is checked before libtpu is loaded (its setup noise, seconds) and long before the
    # compile (minutes at real sizes): a refusal is one line, at once.
    chip, dims = parse_topology(args.topology)
    chips = math.prod(dims)  # one JAX device per chip on v5e, v5p (megacore) and v6e
    pipe = get_pipeline(args.model)
    config = config_from_args(args)
    if args.cfg_parallel:
        if args.cfg_mode not in (None, "fused"):
            raise AotError(f"--cfg_parallel runs cond and uncond as one fused call; it cannot run "
                           f"with --cfg_mode {args.cfg_mode}")
        config = dataclasses.replace(config, cfg_mode="fused")
    sp, cfg = args.sp_size, 2 if args.cfg_parallel else 1
    if sp < 1:
        raise AotError(f"--sp_size {sp}: expected >= 1")
    if sp * cfg != chips:
        raise AotError(f"--sp_size {sp}{' --cfg_parallel' if cfg > 1 else ''} uses {sp * cfg} "
                       f"chip(s); topology {args.topology} has {chips}: give --sp_size "
                       f"{chips // cfg if chips % cfg == 0 else chips}"
                       f"{' --cfg_parallel' if cfg > 1 and chips % cfg == 0 else ''}, or a "
                       f"{sp * cfg}-chip topology")
    given = {}
    for flag in ("height", "width", "video_length", "num_inference_steps"):
        value = getattr(args, flag)
        if value is not None:
            steps_flag = flag == "num_inference_steps"
            given[flag] = as_int(f"--{flag}", value, minimum=1,
                                 maximum=MAX_STEPS if steps_flag else None,
                                 expected=f"an integer in [1, {MAX_STEPS}]" if steps_flag
                                 else "a positive integer")
    if args.computed_fraction is not None and not 0 < args.computed_fraction <= 1:
        raise AotError(f"--computed_fraction {args.computed_fraction}: expected in (0, 1]")
    size = tuple(given.get(k, d) for k, d in
                 zip(("height", "width", "video_length"), pipe.size, strict=True))
    try:
        latent_shape = pipe.latent_shape(*size)
    except SizeError as exc:
        raise AotError(f"--{exc.name} {exc.value}: expected {exc.expected}") from None
    tokens = pipe.tokens(latent_shape)
    if tokens > MAX_TOKENS:  # the same bound as stage 2's
        raise AotError(f"--height {size[0]}, --width {size[1]}, --video_length {size[2]}: "
                       f"{tokens:,} tokens per model call; expected at most {MAX_TOKENS:,}")
    steps = given.get("num_inference_steps", pipe.steps)
    shift = as_number("--sample_shift", args.sample_shift, above=0.0,
                      expected="a finite number > 0 (1.0 = no shift)") \
        if args.sample_shift is not None else pipe.shift
    solver = args.sample_solver or pipe.solver
    guidance = args.guidance_scale
    if guidance is not None:
        as_number("--guidance_scale", guidance, minimum=0.0, maximum=MAX_GUIDANCE,
                  expected=f"a number in [0, {MAX_GUIDANCE:g}] (1 turns CFG off)")
    cfg_on = any(pipe.guidance_for(e, guidance) != 1.0 for e, _ in pipe.experts)
    fused = config.cfg_mode == "fused"
    if fused and not cfg_on:
        raise AotError("a fused CFG pair (--cfg_parallel, --cfg_mode fused) needs guidance != 1")
    if args.swap_experts and args.weight_sharding == "fsdp":
        raise AotError("--swap_experts plans for whole experts swapped in at the switch; with "
                       "--weight_sharding fsdp both stay resident, split")
    check_writable_file("--json", args.json)
    image = pipe.task == "i2v" or (pipe.task == "ti2v" and args.image)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    chip, devices = topology_devices(args.topology)
    if len(devices) != chips:  # the chip count the checks above assumed
        raise AotError(f"--topology {args.topology}: libtpu gave {len(devices)} devices for "
                       f"{chips} chips")
    models = _models(pipe, args.model_path, dtype)
    mesh = make_mesh(sp, cfg, devices) if sp * cfg > 1 else None
    plan = SignalPlan.from_config(config)
    began = time.perf_counter()
    weights = "replicated" if args.swap_experts else args.weight_sharding
    backend = AotBackend(models, plan, devices=devices, mesh=mesh, weights=weights,
                         attention_impl=args.attention, scan_blocks=not args.unrolled)
    tensors = pipe.synthesize(latent_shape, cfg_on, image, 0)
    sample = make_sample(backend, pipe, tensors, latent_shape, image=image, seed=0,
                         guidance=guidance, fused_cfg=fused)
    scheduler = make_scheduler(solver, steps, shift)
    warm_up(backend, plan, scheduler, sample)
    helpers = _step_helpers(backend, scheduler.fresh(), sample, cfg_on)
    branches = 1 if fused or not cfg_on else 2
    # each timestep input goes to the device before the loop; make_sample put one
    backend.input_bytes += (steps - 1) * chip_bytes(backend.put(
        pipe.timestep_input(0.0, latent_shape, image)))
    run_ = run_plan(backend, chip, config, steps=steps, branches=branches, helpers=helpers,
                    computed_fraction=args.computed_fraction, swap_experts=args.swap_experts)
    programs = {}
    for p in backend.records.values():
        programs.setdefault(p.name, {**dataclasses.asdict(p), **p.seconds(chip),
                                     "traffic": p.seconds(chip, traffic=True),
                                     "ici_bytes": p.ici_bytes})
    report = {
        "model": pipe.name, "topology": args.topology, "chip": dataclasses.asdict(chip),
        "chips": len(devices), "sp": sp, "cfg": cfg, "weight_sharding": backend.weight_sharding,
        "swap_experts": args.swap_experts, "attention": args.attention, "dtype": args.dtype,
        "scanned_runs": [[r.start, r.stop] for r in backend.runs],
        "size": list(size), "latent_shape": list(latent_shape), "tokens": pipe.tokens(latent_shape),
        "steps": steps, "solver": solver, "cache": {"modes": list(config.modes),
                                                    "probe_blocks": plan.fn_blocks,
                                                    "tail_blocks": plan.bn_blocks,
                                                    "config": config.to_dict()},
        "device": backend.device_name(), "programs": programs, "helpers_per_step": helpers,
        "memory": run_.memory, "seconds": run_.seconds, "schedule": run_.schedule,
        "compile_seconds": sum(p["compile_seconds"] for p in programs.values()),
        "wall_seconds": time.perf_counter() - began,
    }
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(report, f, indent=1, default=str)
        os.replace(args.json + ".tmp", args.json)
    return report


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _collectives(c: dict) -> str:
    return ", ".join(f"{k} {v['count']} ({v['bytes'] / 2**20:.0f} MiB)" for k, v in sorted(c.items())) or "-"


def format_summary(r: dict) -> str:
    m, s, sch = r["memory"], r["seconds"], r["schedule"]
    chip = r["chip"]
    lines = [
        f"{r['model']} on {r['topology']} ({r['chips']} x {chip['name']}, {_gib(chip['hbm_bytes'])} "
        f"GiB HBM each): sp {r['sp']}, cfg {r['cfg']}, weights {r['weight_sharding']}"
        + (" (one expert on the device)" if r["swap_experts"] else "")
        + f", {r['dtype']}, attention {r['attention']}",
        f"  {r['size'][0]}x{r['size'][1]}, {r['size'][2]} frames -> latents {r['latent_shape']} "
        f"({r['tokens']} tokens), {r['steps']} steps {r['solver']}; cache: "
        f"{'+'.join(r['cache']['modes']) or 'off'} (probe {r['cache']['probe_blocks']}, tail "
        f"{r['cache']['tail_blocks']} blocks)",
        "",
        "per chip, per call  (measured by the compiler; roofline estimated)",
        f"  {'program':12s} {'compile s':>9s} {'args GiB':>9s} {'out GiB':>8s} {'temp GiB':>9s} "
        f"{'TFLOP':>8s} {'GB acc.':>8s} {'GB HBM':>7s} {'roofline ms':>11s} {'bound':>7s}  "
        "collectives",
    ]
    for name, p in r["programs"].items():
        bound = max(("compute", "hbm", "ici"), key=lambda k: p[k])
        lines.append(f"  {name:12s} {p['compile_seconds']:9.1f} {_gib(p['argument_bytes']):>9s} "
                     f"{_gib(p['output_bytes']):>8s} {_gib(p['temp_bytes']):>9s} "
                     f"{p['flops'] / 1e12:8.2f} {p['bytes_accessed'] / 1e9:8.2f} "
                     f"{_gb(p.get('hbm_bytes')):>7s} "
                     f"{1e3 * p['roofline']:11.2f} {bound:>7s}  {_collectives(p['collectives'])}")
    lines += [
        "",
        "memory per chip over the run (estimated from the compiled programs)",
        f"  weights resident  {_gib(m['weights']):>7s} GiB  ({m['experts_resident']} expert(s), "
        f"{r['weight_sharding']})",
        f"  residual slots    {_gib(m['residual_slots']):>7s} GiB  ({m['slots']} x "
        f"{_gib(m['residual_bytes'])} GiB)",
        f"  probe references  {_gib(m['probe_references']):>7s} GiB",
        f"  inputs            {_gib(m['inputs']):>7s} GiB",
        f"  in flight         {_gib(m['in_flight']):>7s} GiB  (largest program: "
        f"{m['largest_program']}, + the hidden state the loop holds)",
        f"  total             {_gib(m['total']):>7s} GiB of {_gib(m['hbm'])}  -> "
        + (f"fits, {_gib(m['headroom'])} GiB headroom" if m["fits"]
           else f"DOES NOT FIT by {_gib(-m['headroom'])} GiB"),
    ]
    if m["switch_bytes"]:
        lines.append(f"  expert switch moves {_gib(m['switch_bytes'])} GiB to every chip once")
    lines += [
        "",
        f"roofline (peak {chip['bf16_flops'] / 1e12:.0f} TFLOP/s bf16, HBM "
        f"{chip['hbm_bandwidth'] / 1e9:.0f} GB/s, ICI {chip['ici_bandwidth'] / 1e9:.0f} GB/s "
        "bidirectional per chip; each program at its largest bound)",
        f"  full call {1e3 * s['full_call']:.1f} ms, reused call {1e3 * s['reused_call']:.1f} ms, "
        f"helpers {1e3 * s['helpers_per_step']:.2f} ms/step, {sch['branches_per_step']} call(s)/step",
        f"  caching off: {s['step_uncached']:.3f} s/step, {s['run_uncached']:.1f} s/run",
    ]
    if s["run_cached"] is not None:
        lines.append(f"  cached ({sch['computed_steps']}/{sch['steps']} steps computed, "
                     f"{sch['source']}): {s['step_cached']:.3f} s/step, {s['run_cached']:.1f} s/run,"
                     f" {s['speedup']:.2f}x")
    elif r["cache"]["modes"]:
        lines.append(f"  cached: {sch['source']}")
    t = s.get("traffic")
    if t is not None:
        lines.append(f"  with HBM traffic as the HBM bound (tpu.hbm): caching off "
                     f"{t['step_uncached']:.3f} s/step"
                     + (f", cached {t['step_cached']:.3f} s/step, {t['run_cached']:.1f} s/run"
                        if t["run_cached"] is not None else ""))
    lines.append(f"compiled {len(r['programs'])} programs in {r['compile_seconds']:.0f} s "
                 f"(wall {r['wall_seconds']:.0f} s)" + (f"; wrote {r['json']}" if r.get("json") else ""))
    return "\n".join(lines)


ERRORS = (AotError, UsageError, ConfigError, CheckpointError, ModelConfigError, StageFileError,
          SchedulerError)
main = command(build_parser, run, format_summary, ERRORS)

if __name__ == "__main__":
    sys.exit(main())
