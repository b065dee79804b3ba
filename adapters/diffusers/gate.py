"""The gate on a diffusers transformer: one diffusers hook per transformer (both experts of Wan2.2
A14B share one gate, so its steps are counted once over the switch), each call run as our
loop runs a model call (`sampling.loop.model_call`: probe, decide, middle or cached residual,
tail) on the transformer's own layers, through our torch backend.

What a run is comes from the pipeline: a call whose `scheduler.timesteps` is not the one the
gate was attached to starts a new run of len(timesteps) steps (every pipeline sets its
timesteps before its loop); the branch is the pipeline's cache context ("cond", "uncond";
HunyuanVideo-1.5's guider says "pred_cond", "pred_uncond")."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState, StateManager
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.utils import USE_PEFT_BACKEND, scale_lora_layers, unscale_lora_layers

from cache import CacheManager, CMConfig
from sampling.loop import LoopStats, model_call
from sampling.stages import SignalPlan
from torch_backend.backend import TorchBackend, TorchOps

from .settings import CacheSettingsError

HOOK = "dit_cache_gate"
BRANCHES = {"cond": "cond", "uncond": "uncond", "pred_cond": "cond", "pred_uncond": "uncond"}


class _NoState(BaseState):
    def reset(self, *args, **kwargs) -> None:
        pass


@dataclass
class Run:
    """One pipeline call as the gate saw it."""

    steps: int
    seconds: float = 0.0  # inside the transformer calls


class Gate:
    """The gate of one pipeline: its CacheManager, the staged transformers by expert, the torch
    backend that runs their stages, and the run in progress."""

    def __init__(self, pipeline, staged: dict, config: CMConfig, *, compile: bool = False,
                 budget: dict | None = None):
        self.pipeline, self.staged, self.config = pipeline, staged, config
        self.plan = SignalPlan.from_config(config)
        self.compile, self.budget = compile, budget
        self.gate = CacheManager(config)
        self.backend: TorchBackend | None = None
        self.key = None  # what the backend's stages were built for
        self.timesteps = None  # the scheduler's timesteps the run was attached to
        self.run: Run | None = None
        self.stats = LoopStats()
        self.previous: dict[str, torch.Tensor] = {}
        self.uncached: Counter = Counter()  # calls the gate did not take, by reason
        self.observe = None  # observe(step, branch, expert, output on the host): calibration

    # --- one transformer call ------------------------------------------------------------------

    def _attach(self) -> None:
        scheduler = self.pipeline.scheduler
        timesteps = getattr(scheduler, "timesteps", None)
        if timesteps is self.timesteps and self.run is not None:
            return
        steps = len(timesteps) if timesteps is not None else 0
        if self.budget is not None and steps != self.budget["calibrated_steps"]:
            # a static schedule names steps: at another count it is another schedule
            raise CacheSettingsError(
                f"budget_profile was calibrated at {self.budget['calibrated_steps']} steps and "
                f"this call samples {steps}; expected num_inference_steps="
                f"{self.budget['calibrated_steps']}, or a profile calibrated at {steps}")
        self.timesteps = timesteps
        self.run, self.stats, self.previous = Run(max(steps, 1)), LoopStats(), {}
        self.gate.attach(max(steps, 1))
        sigmas = getattr(scheduler, "sigmas", None)
        if self.config.step_weight and sigmas is not None:
            self.gate.set_schedule([float(s) for s in sigmas])

    def _backend(self, x, conds: dict) -> TorchBackend:
        key = (tuple(x.shape), x.dtype, x.device, tuple(conds))
        if self.backend is None or key != self.key:
            # the pipeline places and offloads its models; the backend never moves them
            backend = TorchBackend(self.staged, self.plan, x.device, compile=self.compile,
                                   offload_model=True, ops_impl=TorchOps(x.device))
            backend.prepare(tuple(conds), {}, tuple(x.shape))
            self.backend, self.key = backend, key
            self.gate.ops = backend.ops
        return self.backend

    def call(self, expert, context, x, timestep, conds: dict):
        self._attach()
        branch = BRANCHES.get(context, context or "cond")
        backend = self._backend(x, conds)
        began = time.perf_counter()
        out, decision = model_call(backend, self.gate, self.plan, self.stats, branch, expert,
                                   x, timestep, conds, self.previous.get(branch))
        self.previous[branch] = x
        self.run.seconds += time.perf_counter() - began
        if self.observe is not None:
            self.observe(self.gate.telemetry.trace[-1]["step"], branch, expert,
                         out.detach().to("cpu", torch.float32))
        return out

    # --- what a run did ------------------------------------------------------------------------

    def report(self) -> dict:
        """The run's figures as our summaries print them: calls computed and reused, the
        fraction computed, the block-count ideal speedup and the per-step trace."""
        summary = self.gate.summary()
        trace = list(self.gate.telemetry.trace)
        computed = sum(1 for r in trace if r["action"] != "skip")
        reused = len(trace) - computed
        n = next(iter(self.staged.values())).num_blocks
        # of the block evaluations an uncached run makes (a reuse runs the probe and the tail)
        blocks = self.plan.computed_fraction(trace, n) if trace else None
        run = self.run
        return {"steps": run.steps if run else 0, "calls": len(trace), "computed": computed,
                "reused": reused,
                "computed_fraction": computed / len(trace) if trace else None,
                "computed_blocks": blocks, "ideal_speedup": 1 / blocks if blocks else None,
                "seconds_in_transformer": run.seconds if run else 0.0,
                "expert_switches": summary.get("expert_switches", 0),
                "failsafes": summary.get("failsafes", {}),
                "budget": self.budget, "trace": trace, "uncached_calls": dict(self.uncached),
                "signal_reads": self.stats.signal_reads,
                # compile=True: graphs dynamo compiled in this process so far (the three stages
                # once a shape); None when eager
                "compiled_graphs": (self.backend.compile_counts().lowered
                                    if self.backend is not None and self.compile else None)}


class GateHook(ModelHook):
    """diffusers' hook that hands every call of one transformer to the pipeline's Gate."""

    _is_stateful = True

    def __init__(self, gate: Gate, expert, conds: tuple[str, ...]):
        super().__init__()
        self.gate, self.expert, self.conds = gate, expert, conds
        self.state_manager = StateManager(_NoState)  # receives the pipeline's cache context

    def reset_state(self, module):
        return module

    def new_forward(self, module, hidden_states, timestep, *args, return_dict: bool = True,
                    **kwargs):
        if args:  # the pipelines call with keywords; a positional call maps onto forward's names
            names = self.conds[: len(args)]
            kwargs.update(zip(names, args, strict=True))
        lora_scale = (kwargs.pop("attention_kwargs", None) or {}).get("scale", 1.0)
        conds = {name: kwargs.pop(name) for name in self.conds if kwargs.get(name) is not None}
        for name in self.conds:
            kwargs.pop(name, None)
        if kwargs:
            raise TypeError(f"{type(module).__name__} with the cache gate: unexpected inputs "
                            f"{sorted(kwargs)}; expected {', '.join(self.conds)}")
        if hidden_states.shape[0] != 1:
            # the gate decides for one video a call: a batch of several runs uncached, counted
            self.gate.uncached[f"a batch of {hidden_states.shape[0]}"] += 1
            return self.fn_ref.original_forward(hidden_states, timestep, return_dict=return_dict,
                                                **conds)
        try:
            context = self.state_manager.context.name
        except ValueError:  # called outside a pipeline's cache_context: one branch, "cond"
            context = None
        scaled = lora_scale != 1.0 and USE_PEFT_BACKEND  # as forward's apply_lora_scale does
        if scaled:
            scale_lora_layers(module, lora_scale)
        try:
            with torch.no_grad():
                out = self.gate.call(self.expert, context, hidden_states, timestep, conds)
        finally:
            if scaled:
                unscale_lora_layers(module, lora_scale)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)


def install(transformer, gate: Gate, expert, conds: tuple[str, ...]) -> None:
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(
        GateHook(gate, expert, conds), HOOK)


def remove(transformer) -> None:
    registry = getattr(transformer, "_diffusers_hook", None)
    if registry is not None and registry.get_hook(HOOK) is not None:
        registry.remove_hook(HOOK, recurse=False)


def installed(transformer) -> GateHook | None:
    registry = getattr(transformer, "_diffusers_hook", None)
    return registry.get_hook(HOOK) if registry is not None else None
