"""The denoising loop shared by both backends, and the one small interface it needs from them.

Per step: pick the expert (Wan2.2 I2V-A14B), run the model once per CFG branch through the gate
(probe -> decide -> middle or cached residual -> tail), combine the branches, step the
scheduler, and write back the TI2V first frame. Schedule-only gates read nothing from the device;
adaptive gates read one [B, K] signal tensor per model call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

import torch

from cache import PAIR, CacheManager, Signals, TensorOps

from .pipelines import Pipeline
from .stages import SignalPlan


@dataclass(frozen=True)
class CompileCounts:
    """Programs compiled: `lowered` traced and lowered in this process, `backend` handed to the
    backend compiler, `cache_hits` of those served by a persistent cache; `compiled` (the rest)
    the ones the compiler really compiled, which a run with a warm cache keeps at 0."""

    lowered: int = 0
    backend: int = 0
    cache_hits: int = 0

    @property
    def compiled(self) -> int:
        return self.backend - self.cache_hits

    def to_dict(self) -> dict[str, int]:
        """The counts as the commands report them (stage 2's `compiles`, stage 3's)."""
        return {"lowered": self.lowered, "backend": self.backend, "cache_hits": self.cache_hits,
                "compiled": self.compiled}

    def __sub__(self, other: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.lowered - other.lowered, self.backend - other.backend,
                             self.cache_hits - other.cache_hits)

    def __add__(self, other: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.lowered + other.lowered, self.backend + other.backend,
                             self.cache_hits + other.cache_hits)


class Backend(Protocol):
    """What the loop needs from a backend (JAX through torchax, or torch)."""

    ops: TensorOps  # how the gate adds, subtracts and moves residuals

    def put(self, tensor: torch.Tensor) -> Any: ...  # host tensor -> device
    def get(self, x) -> torch.Tensor: ...  # device -> host tensor (a sync)
    def sync(self, x) -> None: ...  # wait until x is computed (timing only)
    def probe(self, expert, x, t, conds: dict, reference, previous=None) -> tuple: ...
    # -> hidden, ctx, signals [B, K], r1; previous: last step's latent (None: x itself)
    def middle(self, expert, hidden, ctx): ...
    def tail(self, expert, hidden, ctx): ...  # with bn_ids: (output, tail-run residuals)
    def cached_tail(self, expert, hidden, ctx, residuals): ...  # bn_ids reuse step
    def read_signals(self, signals) -> list[list[float]]: ...  # [B][K] floats (a sync)
    # A backend whose signal reduction can fail (torch.distributed) also has
    # `reduce_failed() -> bool`: the last probe's signals are shard-local (Signals.reduce_error).
    def lincomb(self, terms) -> Any: ...  # sum(w * x) in fp32
    def relative_change(self, new, old) -> float: ...  # sum|new - old| / sum|old| (a sync)
    def replace_first_frame(self, x, frame): ...
    def compile_counts(self) -> CompileCounts | None: ...  # cumulative (None: nothing compiles)
    def activate(self, expert) -> None: ...  # the expert about to run (model offload)
    def release(self) -> None: ...  # sampling ended (offloaded weights go back to the host)
    def device_name(self) -> str: ...
    def platform(self) -> str: ...  # "cpu", "tpu", "gpu", "cuda", "npu"


@dataclass
class Sample:
    """One trajectory's inputs, already on the device."""

    pipeline: Pipeline
    noise: Any
    latent_shape: tuple
    conds: dict  # branch -> tensor kwargs on device; "pair": [uncond, cond] batched (fused CFG)
    guidance: Any = None  # None = the pipeline's default (a (low, high) pair for MoE)
    image: bool = False
    first_frame: Any = None  # TI2V image mode: clean frame-0 latent on device
    # Conditioning that changes during sampling (a new image latent mid-run): step -> branch ->
    # tensors replacing those of `conds` from that step on. The control guard reads the change.
    cond_updates: dict = field(default_factory=dict)


@dataclass
class LoopStats:
    step_seconds: list[float] = field(default_factory=list)
    step_computed: list[bool] = field(default_factory=list)  # the leader ran the full stack
    step_expert: list[str | None] = field(default_factory=list)
    signal_reads: int = 0
    model_calls: int = 0
    wall_seconds: float = 0.0


class Combination(tuple):
    """A weighted sum ((w, x), ...) not computed yet: the CFG combination is handed to the
    scheduler in this form and folded into its first combination, saving one program a step."""


def folding(lincomb):
    """Wrap a backend's lincomb so that terms which are Combinations are expanded in place."""

    def fold(terms):
        flat = []
        for w, x in terms:
            if isinstance(x, Combination):
                flat.extend((w * wi, xi) for wi, xi in x)
            else:
                flat.append((w, x))
        return lincomb(flat)

    return fold


def branches(guidance: float, cfg_compute_first: bool) -> tuple[str, ...]:
    """CFG branches of one step, leader first; guidance 1 needs no unconditional pass."""
    if guidance == 1.0:
        return ("cond",)
    return ("uncond", "cond") if cfg_compute_first else ("cond", "uncond")


PAIR_ORDER = ("uncond", "cond")  # batch order of a fused CFG call


def model_call(backend: Backend, gate: CacheManager, plan: SignalPlan, stats: LoopStats,
               branch: str, expert, x, t, conds: dict, previous=None, control_delta=None):
    """One model call through the gate; returns the model output (noise/velocity prediction),
    or for a fused CFG call (branch PAIR) the outputs of (uncond, cond). control_delta: how much
    the branch's conditioning changed since its last call (None: it did not)."""
    gate.begin_step(branch, expert)
    reference = gate.probe_reference(branch) if plan.needs_reference else None
    hidden, ctx, signals_dev, r1 = backend.probe(expert, x, t, conds, reference, previous)
    signals = Signals() if branch != PAIR else {b: Signals() for b in PAIR_ORDER}
    if plan.fields and gate.config.needs_signals:
        rows = backend.read_signals(signals_dev)
        stats.signal_reads += 1
        failed = getattr(backend, "reduce_failed", None)
        reduce_error = failed is not None and failed()
        per_sample = []
        for values in rows:
            named = dict(zip(plan.fields, values, strict=True), reduce_error=reduce_error)
            if plan.needs_reference and reference is None:
                named["fbcache"] = None  # nothing to compare block 0's residual with yet
            if previous is None and plan.scene_guard:
                named["latent_delta"] = None  # the first step has no previous latent
            per_sample.append(Signals(**named))
        signals = per_sample[0] if branch != PAIR else dict(zip(PAIR_ORDER, per_sample, strict=True))
    if control_delta is not None:
        signals = replace(signals, control_delta=control_delta) if branch != PAIR else \
            {b: replace(s, control_delta=control_delta) for b, s in signals.items()}
    decision = gate.decide(signals)
    applied = gate.apply(decision, hidden)
    hidden, decision = applied.x, applied.decision
    stats.model_calls += 1
    if decision.skip:
        if plan.cached_tail:
            return backend.cached_tail(expert, hidden, ctx, applied.tail), decision
        return backend.tail(expert, hidden, ctx), decision
    after, parts = backend.middle(expert, hidden, ctx), None
    if plan.remodulate:  # the middle's residual comes split by the time gates that scale it
        after, parts = after
    out, tail = backend.tail(expert, after, ctx), ()
    if plan.tail_runs:
        out, tail = out
    if gate.config.enabled:  # caching off never reuses: storing a residual would be waste
        gate.update(decision, hidden, after, probe=r1 if plan.needs_reference else None, tail=tail,
                    residual=parts)
    return out, decision


def _update_conds(backend: Backend, conds: dict, updates: dict) -> dict:
    """Apply one step's condition updates in place; returns branch -> relative L1 change (one
    read, at the steps where something changed only)."""
    deltas = {}
    for branch, new in updates.items():
        old = conds[branch]
        deltas[branch] = backend.relative_change([new[n] for n in new], [old[n] for n in new])
        conds[branch] = {**old, **new}
    return deltas


def check_cond_updates(sample: Sample, steps: int) -> None:
    """Before sampling: every update names a step of the run, a branch and tensors it has."""
    for step, updates in sample.cond_updates.items():
        if not isinstance(step, int) or not 0 <= step < steps:
            raise ValueError(f"cond_updates step {step!r}: expected an integer in [0, {steps})")
        for branch, new in updates.items():
            if branch not in sample.conds:
                raise ValueError(f"cond_updates[{step}] names branch {branch!r}; this sample has "
                                 f"{', '.join(sample.conds)}")
            unknown = sorted(set(new) - set(sample.conds[branch]))
            if unknown:
                raise ValueError(f"cond_updates[{step}][{branch!r}] replaces {unknown}, which the "
                                 f"branch does not take; expected some of "
                                 f"{', '.join(sample.conds[branch])}")


def denoise(backend: Backend, gate: CacheManager, plan: SignalPlan, scheduler, sample: Sample,
            *, step_sync: bool = True, progress: Callable[[int, int, bool], None] | None = None,
            observe: Callable | None = None):
    """Run the whole trajectory; returns (final latent on device, LoopStats).
    observe(step, branch, expert, output): sees every model output (calibration)."""
    pipe, stats = sample.pipeline, LoopStats()
    timesteps = scheduler.timesteps
    meanflow = pipe.meanflow
    lincomb = folding(backend.lincomb)
    x, previous = sample.noise, None
    if sample.first_frame is not None:
        x = backend.replace_first_frame(x, sample.first_frame)
    # The schedule is known: every step's timestep inputs go to the device before the loop.
    t_inputs = [backend.put(pipe.timestep_input(t, sample.latent_shape, sample.image))
                for t in timesteps]
    # the step-distilled model reads the next timestep too (0 at the end, T23)
    r_inputs = [backend.put(torch.tensor([r])) for r in (*timesteps[1:], 0.0)] if meanflow else None
    check_cond_updates(sample, len(timesteps))
    if gate.config.step_weight:  # the gate weighs each step by its size (it imports no backend)
        gate.set_schedule(scheduler.sigmas)
    conds = dict(sample.conds)
    start = time.perf_counter()
    for i, t in enumerate(timesteps):
        began = time.perf_counter()
        deltas = _update_conds(backend, conds, sample.cond_updates.get(i, {}))
        expert = pipe.expert_at(t)
        backend.activate(expert)
        g = pipe.guidance_for(expert, sample.guidance)
        t_dev = t_inputs[i]
        per_step = {"timestep_r": r_inputs[i]} if meanflow else {}
        outs, leader = {}, None
        if "pair" in sample.conds:  # fused CFG: both branches in one batch-2 call
            pair, leader = model_call(backend, gate, plan, stats, PAIR, expert, x, t_dev,
                                      {**conds["pair"], **per_step}, previous, deltas.get("pair"))
            outs = dict(zip(PAIR_ORDER, pair, strict=True))
        else:
            for branch in branches(g, gate.config.cfg_compute_first):
                outs[branch], decision = model_call(backend, gate, plan, stats, branch, expert,
                                                    x, t_dev, {**conds[branch], **per_step},
                                                    previous, deltas.get(branch))
                leader = leader or decision
        if observe is not None:
            for branch, out in outs.items():
                observe(i, branch, expert, out)
        v = outs["cond"] if len(outs) == 1 else \
            Combination(((1.0 - g, outs["uncond"]), (g, outs["cond"])))  # uncond + g (cond - uncond)
        previous = x
        x = scheduler.step(i, v, x, lincomb)
        if sample.first_frame is not None:
            x = backend.replace_first_frame(x, sample.first_frame)
        if step_sync:
            backend.sync(x)
        stats.step_seconds.append(time.perf_counter() - began)
        stats.step_computed.append(not leader.skip)
        stats.step_expert.append(expert)
        if progress is not None:
            progress(i + 1, len(timesteps), not leader.skip)
    backend.sync(x)
    stats.wall_seconds = time.perf_counter() - start
    return x, stats
