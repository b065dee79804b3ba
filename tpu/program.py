"""What one compiled program costs a chip: the compiler's memory and cost analyses, completed
with what they leave out (loop bodies past their first iteration, Pallas kernels, collectives
from the HLO, HBM traffic from `tpu.hbm`), and the program's roofline time on a chip.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import jax
import numpy as np

from .hbm import hbm_traffic
from .hlo import collectives, computations, loops
from .topology import Chip


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
           kernels=(), hlo: str | None = None) -> Program:
    """What the compiler says of one compiled program, per chip. `kernels`: the Pallas kernels
    traced into it (`attention.kernel_costs`), whose work the compiler's cost analysis omits;
    `hlo`: its text, where the caller has it already."""
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older JAX returns one dict per partition
        cost = cost[0]
    kernel_flops = sum(k.flops for k in kernels)  # scaled by loop trips when traced
    hlo = compiled.as_text() if hlo is None else hlo
    loop_flops, loop_bytes = loop_costs(hlo)
    extra = sum(k.extra_bytes for k in kernels)
    return Program(name, seconds, memory.argument_size_in_bytes, memory.output_size_in_bytes,
                   memory.temp_size_in_bytes, weight_bytes, activation_bytes,
                   float(cost.get("flops", 0.0)) + loop_flops + kernel_flops,
                   float(cost.get("bytes accessed", 0.0)) + loop_bytes + extra,
                   kernel_flops, collectives(hlo), hbm_traffic(hlo) + extra)


@dataclass
class ChainProgram(Program):
    """A call made of several programs run one after another (tpu/vae_chain.py), per chip: the
    steps' costs and collectives summed over the call, its roofline the steps' rooflines added
    (each step is bound by its own limit), and in flight the carried state beside the step
    that needs the most. Argument, temporary and output bytes: the largest step's."""

    steps: list = field(default_factory=list, repr=False)  # (Program, calls per call)
    state_bytes: int = 0  # the state carried from call to call
    step_bytes: int = 0  # beside it, the most one step holds: inputs, temporaries, outputs

    @property
    def programs(self) -> int:
        """Distinct programs among its steps."""
        return len(self.steps)

    @property
    def step_calls(self) -> int:
        """Program calls in one call of it."""
        return sum(n for _, n in self.steps)

    def seconds(self, chip: Chip, traffic: bool = False) -> dict | None:
        each = [(p.seconds(chip, traffic), n) for p, n in self.steps]
        if any(s is None for s, _ in each):
            return None
        bounds = {k: sum(n * s[k] for s, n in each) for k in ("compute", "hbm", "ici")}
        return {**bounds, "roofline": sum(n * s["roofline"] for s, n in each)}

    def in_flight(self) -> int:
        return self.state_bytes + self.step_bytes

    def report(self) -> dict:
        """Its fields for a JSON report, each distinct step program by its kind, calls and
        compile seconds."""
        return {**{k: v for k, v in self.__dict__.items() if k != "steps"},
                "programs": self.programs, "step_calls": self.step_calls,
                "steps": [{"kind": p.name, "calls": n, "compile_seconds": p.compile_seconds,
                           "flops": p.flops, "bytes_accessed": p.bytes_accessed}
                          for p, n in self.steps]}


def chain_record(name: str, chain, *, weight_bytes: int) -> ChainProgram:
    """What one call of `chain` (tpu.vae_chain.Chain, compiled) costs a chip: each distinct
    program recorded once and counted by its calls; the state it carries in, its steps' slots
    together."""
    steps, collective, held, state_bytes = [], {}, 0, 0
    for key, calls in chain.calls().items():
        compiled = chain.programs[key]
        own_weights, own_state = chain.argument_split[key]
        where = chain.steps[chain.keys.index(key)].parts[0][1]  # its first block
        p = record(f"{key[0]} {where}", compiled, chain.compile_seconds.get(key, 0.0),
                   weight_bytes=own_weights, activation_bytes=0)
        steps.append((p, calls))
        state_bytes += calls * own_state
        for kind, c in p.collectives.items():
            entry = collective.setdefault(kind, {"count": 0, "bytes": 0, "received": 0.0})
            for k in entry:
                entry[k] += calls * c[k]
        # beside the carried state (its own slots among it): its other arguments, temporaries
        # and outputs
        held = max(held, p.argument_bytes - own_weights - own_state + p.temp_bytes
                   + p.output_bytes)
    hbm = [p.hbm_bytes for p, _ in steps]
    seconds = [p.compile_seconds for p, _ in steps]
    return ChainProgram(
        name, sum(seconds), max(p.argument_bytes for p, _ in steps),
        max(p.output_bytes for p, _ in steps), max(p.temp_bytes for p, _ in steps),
        weight_bytes, state_bytes, sum(n * p.flops for p, n in steps),
        sum(n * p.bytes_accessed for p, n in steps), sum(n * p.kernel_flops for p, n in steps),
        collective, None if None in hbm else sum(n * p.hbm_bytes for p, n in steps),
        steps=steps, state_bytes=state_bytes, step_bytes=held)
