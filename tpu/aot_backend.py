"""The JAX backend compiling for a TPU slice it does not have, and what a run would cost there.

`AotBackend` is `JaxBackend` with every program call compiled for compile-only devices instead
of run, so the project's own warm-up drives it and exactly the programs the loop would run are
compiled (probe, middle, tail, cached tail, residual add/sub and forecast combinations, each
scheduler combination, the frame write-back). `run_plan` sums their figures into one
trajectory's memory per chip and roofline time, with caching off and with the cache schedule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding, SingleDeviceSharding

from cache import CMConfig
from sampling.loop import Combination, folding
from sampling.stages import SignalPlan

from . import attention
from .backend import JaxBackend, rel_l1
from .hlo import collective_ops
from .program import Program, chip_bytes, record
from .topology import Chip

_TORCH_TO_JAX = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16,
                 torch.float16: jnp.float16, torch.bool: jnp.bool_, torch.int32: jnp.int32,
                 torch.int64: jnp.int64, torch.uint8: jnp.uint8, torch.int8: jnp.int8}


def jax_dtype(dtype: torch.dtype):
    # int64 becomes int32 when JAX runs without x64, as a transfer of the host tensor would
    return jax.dtypes.canonicalize_dtype(_TORCH_TO_JAX[dtype])


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
        # program name -> its collectives (first signature compiled), where it runs on the mesh
        self.collective_ops: dict[str, list] = {}
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
        hlo = compiled.as_text()
        if self.mesh is not None and self._on_mesh(compiled):
            self.collective_ops.setdefault(name, collective_ops(hlo))
        return record(name, compiled, seconds, weight_bytes=weights, activation_bytes=computed,
                      kernels=kernels, hlo=hlo)

    def _on_mesh(self, compiled) -> bool:
        """Whether the program runs on the mesh's devices in the mesh's order (partition k on
        `mesh.devices.flat[k]`), as every sharded program here does: else its collectives'
        partition ids name other chips and are left out of `collective_ops`."""
        flat = tuple(self.mesh.devices.flat)
        shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
        many = [s for s in shardings if len(s.device_set) > 1]
        return all(isinstance(s, NamedSharding) and tuple(s.mesh.devices.flat) == flat for s in many)

    # Nothing is read back: the gate sees zero signals, which is all warm-up needs.
    def read_signals(self, signals):
        batch, columns = signals.shape
        return [[0.0] * columns for _ in range(batch)]

    def relative_change(self, new, old) -> float:
        self._call("control_delta", rel_l1, tuple(new), tuple(old))
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


# --- the run plan: memory per chip and roofline time ---------------------------------------------

def step_helpers(backend: AotBackend, scheduler, sample, cfg_on: bool) -> dict[str, float]:
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
    """One trajectory's memory per chip at its peak and its roofline seconds, caching off and on,
    from the programs `backend` compiled during warm-up and `helpers` (`step_helpers`)."""
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
