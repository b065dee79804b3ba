"""A decode call as a chain of small programs, one per decoder block, each compiled once per
distinct block and shape (`Chain`).

Compiling a real-size decoder call as one program took libtpu 4-12 minutes on a 2-core host,
nearly all of it in the backend generating each large convolution's code (a Wan2.2 residual
block at 88 x 40 pixels a strip: 32 s alone), and one compile keeps only about two cores busy
however many the host has. A decoder repeats its blocks: a Wan2.2 TI2V-5B call runs 20 block
programs of which 12 are distinct. So each block is its own program, traced from one
representative module with the weights as arguments, compiled once per (block architecture,
weight and input shapes) and called for every block like it; the distinct programs compile a
core pair each, side by side, and none of them is large. The state a block carries (its causal
convs' last frames) is its own slice of the call's state.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import torch


@dataclasses.dataclass(frozen=True)
class Step:
    """One program call of a chain: `fn(parts, *inputs, caches) -> (output, caches)` on the
    modules `parts` (name -> module path under the VAE, e.g. "decoder.mid_block.resnets.0"),
    reading the chain's values named by `inputs` ("z", "x", or a name kept earlier) and the
    state slots `slots`; its output becomes "x". keep: a name to keep "x" under before the step
    runs (a block's input that its shortcut adds back). The program is shared by every step of
    the same `kind`, modules' architecture and weight shapes, on the same input shapes."""

    kind: str
    parts: tuple[tuple[str, str], ...]
    fn: Callable
    slots: tuple[int, ...] = ()
    inputs: tuple[str, ...] = ("x",)
    keep: str | None = None


class _Parts(torch.nn.Module):
    """The representative modules of a step as attributes, bound by functional_call under
    "name.*"; the step's function gets this module."""

    def __init__(self, parts: dict):
        super().__init__()
        for name, module in parts.items():
            self.add_module(name, module)

    def forward(self, fn, *args):
        return fn(self, *args)


def part_params(params: dict, parts) -> dict:
    """The weights of `parts` ((name, module path) pairs) out of the decoder's "vae.*" ones,
    under "name.*": the names the step's program binds, the same for every block like it."""
    view = {}
    for name, path in parts:
        prefix = f"vae.{path}."
        view.update({f"{name}.{k[len(prefix):]}": v for k, v in params.items()
                     if k.startswith(prefix)})
    return view


def _signature(module) -> str:
    """A module's architecture: its repr and every submodule's plain settings (a repr leaves
    some out: DupUp3D's factors, a norm's dims)."""
    plain = (int, float, bool, str, tuple, type(None))
    settings = [(name, sorted((k, v) for k, v in vars(m).items()
                              if not k.startswith("_") and isinstance(v, plain)))
                for name, m in module.named_modules()]
    return repr(module) + repr(settings)


def _abstract(a, sharding):
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)


class Chain:
    """A call of the decoder: `steps` in order, their programs in `programs` (by key, shared by
    the chains of one decoder: `ChainBuilder`). Called like the one program it replaces:
    chain(params, z[, state]) -> (output, state), params the decoder's "vae.*" weights; without
    a state (the first call) every one of its `slots` starts empty (None)."""

    def __init__(self, steps, programs: dict, keys: list, slots: int, extras: tuple = ()):
        self.steps, self.programs, self.keys, self.slots = steps, programs, keys, slots
        self.extras = extras  # the names the call's further arguments take
        self._views: dict = {}
        # key -> (its weights' bytes, its state slots' bytes) per chip; the compile seconds of
        # each program (both set by `ChainBuilder`)
        self.argument_split: dict = {}
        self.compile_seconds: dict = {}

    def _params(self, params: dict, step_index: int) -> dict:
        """The step's weights under its parts' names (cached per weights dict)."""
        views = self._views.get(id(params))
        if views is None or views[0] is not params:
            views = (params, {})
            self._views = {id(params): views}
        view = views[1].get(step_index)
        if view is None:
            view = views[1][step_index] = part_params(params, self.steps[step_index].parts)
        return view

    def __call__(self, params: dict, z, state=None, *extras):
        state = [None] * self.slots if state is None else list(state)
        values = {"z": z, **dict(zip(self.extras, extras, strict=True))}
        for i, (step, key) in enumerate(zip(self.steps, self.keys, strict=True)):
            if step.keep:
                values[step.keep] = values["x"]
            caches = [state[s] for s in step.slots]
            out, caches = self.programs[key](self._params(params, i),
                                             *[values[n] for n in step.inputs], caches)
            for s, c in zip(step.slots, caches, strict=True):
                state[s] = c
            values["x"] = out
        return values["x"], state

    def calls(self) -> dict:
        """key -> how many times one call of the chain runs that program."""
        counts: dict = {}
        for key in self.keys:
            counts[key] = counts.get(key, 0) + 1
        return counts

    def as_text(self) -> str:
        """Every program's optimized HLO text, once per call of it (collectives per call)."""
        return "\n".join(self.programs[key].as_text() for key in self.keys)


@dataclasses.dataclass
class ChainBuilder:
    """Lowers the chains of one decoder and compiles their distinct programs together.

    vae: the VAE the steps' module paths are under; trace(module, fn) -> a jax function of
    (params, *args) (tpu.vae's tracer, for any module); params: the "vae.*" weights (arrays or
    abstract); between(abstract) -> the sharding of an activation or state slot between steps;
    out_sharding: of the chain's final output."""

    vae: Any
    trace: Callable
    params: dict
    between: Callable
    out_sharding: Any
    programs: dict = dataclasses.field(default_factory=dict)
    lowered: dict = dataclasses.field(default_factory=dict)
    compile_seconds: dict = dataclasses.field(default_factory=dict)

    def _module(self, path: str):
        return self.vae.get_submodule(path)

    def chain(self, steps, z, state: list, extras: dict | None = None
              ) -> tuple[Chain, Any, list]:
        """Lower `steps` on the abstract input `z` and `state` (per slot: abstract, or None for
        the first call's empty slots); extras: further abstract arguments of the call by name
        (steps read them by name). Returns the chain, its abstract output and state."""
        from .program import chip_bytes

        extras = extras or {}
        values, state, keys, split = {"z": z, **extras}, list(state), [], {}
        for i, step in enumerate(steps):
            if step.keep:
                values[step.keep] = values["x"]
            parts = {name: self.vae.get_submodule(path) for name, path in step.parts}
            view = part_params(self.params, step.parts)
            inputs = [values[n] for n in step.inputs]
            caches = [state[s] for s in step.slots]
            key = (step.kind, tuple(_signature(m) for m in parts.values()),
                   tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(view.items())),
                   tuple((tuple(a.shape), str(a.dtype), str(a.sharding)) for a in inputs),
                   tuple(None if c is None else (tuple(c.shape), str(c.dtype)) for c in caches))
            fn = self.trace(_Parts(parts), step.fn)
            out_abs, caches_abs = jax.eval_shape(fn, view, *inputs, caches)
            out_sh = self.out_sharding if i == len(steps) - 1 else self.between(out_abs)
            cache_sh = [self.between(c) for c in caches_abs]
            if key not in self.programs and key not in self.lowered:
                self.lowered[key] = jax.jit(fn, out_shardings=(out_sh, cache_sh)).lower(
                    view, *inputs, caches)
            keys.append(key)
            split[key] = (chip_bytes(view), chip_bytes([c for c in caches if c is not None]))
            values["x"] = _abstract(out_abs, out_sh)
            for s, c, sh in zip(step.slots, caches_abs, cache_sh, strict=True):
                state[s] = _abstract(c, sh)
        chain = Chain(steps, self.programs, keys, len(state), tuple(extras))
        chain.argument_split, chain.compile_seconds = split, self.compile_seconds
        return chain, values["x"], state

    def compile(self) -> None:
        """Compile every program lowered so far, side by side (XLA compiles without the GIL), a
        compile per pair of the host's cores, each timed."""
        import time

        def one(item):
            key, lowered = item
            began = time.perf_counter()
            compiled = lowered.compile()
            return key, compiled, time.perf_counter() - began

        items = list(self.lowered.items())
        # one compile keeps about two cores busy (libtpu's backend compiles fusions in parallel:
        # a Wan residual block's compile took 78 s of CPU in 46 s), so a compile per core pair
        workers = max(1, min(len(items), (os.cpu_count() or 2) // 2))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for key, compiled, seconds in pool.map(one, items):
                self.programs[key] = compiled
                self.compile_seconds[key] = seconds
        self.lowered.clear()
