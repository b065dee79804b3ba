"""The JAX backend: the stages of `sampling.stages` jitted through torchax, weights as arguments.

One jax.jit program per stage (probe, middle, tail) and input shape. The weights are the first
argument, never constants baked into the program, so the two Wan2.2 experts share every compiled
program and a new checkpoint needs no recompile. Nothing is donated: the cached residual and the
hidden state it is added to live on across steps. Between programs the loop holds plain jax
arrays; the helpers it needs (residual add/sub, scheduler combinations, frame write-back) are small
jitted functions, so the loop itself runs no eager op and compiles nothing after warm-up.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from compat.torchax_compat import import_torchax
from modules import ops
from sampling import progress
from sampling.stages import Middle, Probe, SignalPlan, Tail, reference_shape, stages_for
from sharding import layout
from sharding.layout import Layout

from . import attention, loading, scan
from .compile import compile_counts


@jax.jit
def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


@jax.jit
def _sub(a, b):
    return jax.tree.map(jnp.subtract, a, b)


@jax.jit
def _lincomb(weights, *xs):
    out = weights[0] * xs[0].astype(jnp.float32)
    for i in range(1, len(xs)):
        out = out + weights[i] * xs[i].astype(jnp.float32)
    return out


@jax.jit
def _tree_lincomb(weights, *trees):
    """sum(w_i * tree_i) leaf by leaf, in each leaf's dtype (forecast residuals)."""
    def combine(*leaves):
        out = weights[0].astype(leaves[0].dtype) * leaves[0]
        for i in range(1, len(leaves)):
            out = out + weights[i].astype(leaves[i].dtype) * leaves[i]
        return out
    return jax.tree.map(combine, *trees)


@jax.jit
def rel_l1(a, b):
    """mean |a - b| / mean |b| over every leaf: the control guard's delta."""
    num = sum(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)).sum() for x, y in zip(a, b, strict=True))
    den = sum(jnp.abs(y.astype(jnp.float32)).sum() for y in b)
    return num / (den + 1e-8)


@jax.jit
def _replace_first_frame(x, frame):
    return x.at[:, :, :1].set(frame.astype(x.dtype))


def _leaves(x):
    return jax.tree.leaves(x)


def _direct(name, program, *args):
    return program(*args)


class JaxOps:
    """TensorOps for jax arrays and tuples of them (HunyuanVideo's hidden pair). `call(name,
    program, *args)` runs a jitted helper (the backend's, so an ahead-of-time backend sees them
    all)."""

    def __init__(self, call=_direct):
        self.host = jax.devices("cpu")[0]
        self.call = call

    def add(self, a, b):
        return self.call("add", _add, a, b)

    def sub(self, a, b):
        return self.call("sub", _sub, a, b)

    def shape(self, x):
        return tuple(tuple(leaf.shape) for leaf in _leaves(x))

    def dtype(self, x):
        return tuple(leaf.dtype for leaf in _leaves(x))

    def device(self, x):
        # the sharding's device set, not leaf.devices(): the compile-only arrays of a deviceless
        # TPU compile carry a sharding and no devices (a reuse there fell back to compute)
        return tuple(frozenset(leaf.sharding.device_set) for leaf in _leaves(x))

    def move(self, x, device):
        return jax.device_put(x, device)

    def cast(self, x, dtype):
        leaves, tree = jax.tree.flatten(x)
        return jax.tree.unflatten(tree, [leaf.astype(d) for leaf, d in zip(leaves, dtype, strict=True)])

    def can_cast(self, src, dst):
        return len(src) == len(dst) and all(jnp.issubdtype(d, jnp.floating) for d in (*src, *dst))

    def is_oom(self, exc):
        return "RESOURCE_EXHAUSTED" in str(exc) or isinstance(exc, MemoryError)

    def combine(self, terms):
        weights = np.asarray([w for w, _ in terms], np.float32)
        return self.call("forecast", _tree_lincomb, weights, *(x for _, x in terms))

    def memory_fraction(self):
        stats = jax.local_devices()[0].memory_stats() or {}  # this host's (multi-host)
        limit = stats.get("bytes_limit")
        return stats["bytes_in_use"] / limit if limit and "bytes_in_use" in stats else None


class JaxBackend:
    """Runs one model family's stages as jitted JAX programs.

    models: expert -> torch module (same architecture); their weights move to the device once.
    attention: an implementation name of `ops.attention` used while tracing (default: splash on
    TPU, jax.nn.dot_product_attention elsewhere).
    mesh: a ("cfg", "sp") mesh (`sharding.jax_sp.make_mesh`) for sequence and CFG parallelism:
    inputs are replicated over it, the probe splits the tokens over `sp` (and a fused CFG pair
    over `cfg`), attention runs as Ulysses over `sp` around the chosen lowering, and the signals
    are reduced with one psum. None: one device.
    weights: "replicated" (every device holds every weight) or "fsdp" (the block weights split
    over the mesh, each block gathering its own just before it runs; needs a mesh); None:
    `sharding.jax_sp.default_weights` (FSDP on a mesh of several devices).
    checkpoints: expert -> a `modules.checkpoint.CheckpointReader` of its weights (that expert's
    model then only gives names, shapes and dtypes: it may live on the meta device); each
    process reads only the rows its own devices hold (`tpu.loading`). Experts without one are
    placed from their model's host tensors the same way.
    scan_blocks: the middle stage runs each run of repeating blocks as one `jax.lax.scan` over
    their weights, stacked at placement (`tpu.scan`): one period of blocks to compile per run.
    """

    def __init__(self, models: dict, plan: SignalPlan, *, attention_impl: str | None = None,
                 mesh=None, weights: str | None = None, checkpoints: dict | None = None,
                 scan_blocks: bool = True):
        self.torchax = import_torchax()
        self.env = self.torchax.default_env()
        attention.install()
        self.attention = attention_impl or attention.default_attention()
        if self.attention not in ops.implementations("attention"):
            raise ops.OpError(f"--attention {self.attention!r}: expected one of "
                              f"{', '.join(ops.implementations('attention'))}")
        if weights is None:
            from sharding.jax_sp import default_weights
            weights = default_weights(mesh)
        if weights != "replicated" and (mesh is None or mesh.size == 1):
            raise ValueError(f"weight sharding {weights!r} splits the weights over a mesh of "
                             "several devices; give sp_size x cfg > 1, or keep them replicated")
        self.plan, self.mesh = plan, mesh
        self.layout, self._placement = Layout(), self._default_placement()
        if mesh is not None:
            from sharding import jax_sp
            jax_sp.install()
            self.layout = jax_sp.JaxSequenceLayout(mesh, self.attention, weights)
            self._placement = self.layout.replicated()
        self.weight_sharding = weights
        self.template = next(iter(models.values()))
        blocks = self.template.num_blocks
        if plan.fn_blocks + plan.bn_blocks > blocks:
            raise ValueError(f"probe blocks ({plan.fn_blocks}) + tail blocks ({plan.bn_blocks}) "
                             f"exceed the model's {blocks} blocks")
        # the middle window's blocks, as runs (scanned) and single blocks (unrolled)
        # (a block another stage also reads, e.g. block 0 for TeaCache's signature, keeps its
        # own weights and runs unrolled)
        shared = Probe(self.template, plan, (), {}).blocks_used() | \
            Tail(self.template, plan, (1, 1, 1)).blocks_used()
        self.middle_blocks = scan.block_runs(self.template, plan.fn_blocks, blocks - plan.bn_blocks,
                                             unrolled=frozenset(shared)) if scan_blocks else None
        self.runs = [r for r in self.middle_blocks or () if isinstance(r, scan.Run)]
        checkpoints = checkpoints or {}
        began = time.perf_counter()
        self.params = {expert: self._weights(model, checkpoints.get(expert))
                       for expert, model in models.items()}
        self.placement_seconds = time.perf_counter() - began  # reading included
        self.ops = JaxOps(self._call)
        self._programs = None
        self._built = {}  # (conditions, static switches, latent shape) -> programs

    def _default_placement(self):
        """Where inputs go without a mesh: None, jax's default device."""
        return None

    def _weight_specs(self, model):
        """(key -> WeightSpec, stacked key -> its members): every parameter by name, except those
        of a scanned run, which come stacked per run (`scan.Run.stacks`)."""
        params = dict(model.named_parameters())
        specs, stacks = {}, {}
        for run in self.runs:
            for key, members in run.stacks():
                p = params[members[0]]
                specs[key] = loading.WeightSpec((len(members), *p.shape), p.dtype,
                                                self._stacked_sharding(members[0], tuple(p.shape)))
                stacks[key] = members
        in_runs = set().union(*(run.members for run in self.runs))
        for name, p in params.items():
            if name not in in_runs:
                specs[name] = loading.WeightSpec(tuple(p.shape), p.dtype,
                                                 self._weight_sharding(name, tuple(p.shape)))
        return specs, stacks

    def _weights(self, model, checkpoint=None):
        """One expert's weights on the devices, by parameter name (a scanned run's stacked, by
        `scan.Run.stacks`): read from `checkpoint`, or from the model's own host tensors."""
        specs, stacks = self._weight_specs(model)
        read = checkpoint.read if checkpoint is not None else \
            loading.host_rows(dict(model.named_parameters()))
        placed = loading.place_all(specs, read, stacks=stacks)
        return {f"model.{name}": placed[name] for name in specs}

    def _stacked_sharding(self, name: str, shape: tuple[int, ...]):
        """A run's stacked weight: each block's sharding, the new leading axis whole (so a scan
        step gathers one block, as the unrolled blocks do)."""
        per_block = self._weight_sharding(name, shape)
        if self.mesh is None:
            return per_block
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        return NamedSharding(self.mesh, P(None, *per_block.spec))

    def _weight_sharding(self, name: str, shape: tuple[int, ...]):
        """A weight's sharding: the layout's rule on a mesh (replicated or FSDP), else None."""
        if self.mesh is None:
            return self._placement
        return self.layout.weight_sharding(shape, self.template.block_of(name) is not None)

    def _place(self, array):
        """Inputs are replicated on a mesh; GSPMD splits the work from there."""
        return array if self._placement is None else jax.device_put(array, self._placement)

    def _device_kind(self) -> str:
        """The kind of device the programs compile for (kernels pick their block sizes by it)."""
        if self.mesh is not None:
            return self.mesh.devices.flat[0].device_kind
        device = next(iter(self._placement.device_set)) if self._placement is not None \
            else jax.devices()[0]
        return device.device_kind

    def _call(self, name: str, program, *args):
        """Run one jitted program (a stage or a helper): the one place the loop's device work
        starts, so an ahead-of-time backend (`tpu.aot_backend`) can compile instead of run."""
        progress.tick(name)  # the warm-up's bar, if one is shown (a None check otherwise)
        return program(*args)

    # --- programs ------------------------------------------------------------------------

    def _jit(self, stage):
        """(jitted stage, the names of the weights it takes). Weights a stage does not read stay
        out of its arguments; they are bound to meta tensors while tracing, so a stage that read
        one after all would fail loudly at warm-up instead of baking a constant in."""
        env, impl, lay, kind = self.env, self.attention, self.layout, self._device_kind()
        if self.mesh is not None:
            from sharding.jax_sp import ATTENTION
            impl = ATTENTION
        scanned = isinstance(stage, Middle) and bool(self.runs)
        stacked = [f"model.{k}" for r in self.runs for k in r.keys] if scanned else []
        in_runs = {f"model.{n}" for r in self.runs for n in r.members} if scanned else set()
        names = [n for n, _ in stage.named_parameters()
                 if stage.uses_parameter(n) and n not in in_runs]
        absent = {n: torch.empty(p.shape, dtype=p.dtype, device="meta")
                  for n, p in stage.named_parameters() if n not in names}
        forward = self._scanned_middle(stage) if scanned else None

        def traced(params, *args):
            with env, torch.no_grad(), ops.use(attention=impl), layout.use(lay), \
                    attention.tracing_for(kind):
                if not scanned:
                    return torch.func.functional_call(stage, {**absent, **params}, args)
                params = dict(params)
                runs = {k: params.pop(k) for k in stacked}
                return torch.func.functional_call(scan.OnModel(stage.model, forward),
                                                  {**absent, **params}, (runs, *args))

        return jax.jit(self.torchax.interop.jax_view(traced)), names + stacked

    def _scanned_middle(self, stage):
        """The middle stage's forward with each run of repeating blocks as one scan."""
        model = stage.model

        def forward(stacked, hidden, ctx):
            local = stage._local_ctx(ctx)
            state = stage.begin(hidden, local)  # hidden, or what a remodulated middle carries
            for item in self.middle_blocks:
                if isinstance(item, scan.Run):
                    state = scan.scan_run(model, item, [stacked[f"model.{k}"] for k in item.keys], state,
                                          lambda i, s: stage.block_step(i, s, local))
                else:
                    state = stage.block_step(item, state, local)
            return stage.finish(state, hidden, local)
        return forward

    def prepare(self, cond_names, static: dict, latent_shape) -> None:
        """Build the stage programs for one input shape and condition set (compiled on first call)."""
        model, plan = self.template, self.plan
        grid = model.grid(latent_shape)
        self.cond_names = tuple(cond_names)
        self.rope = tuple(self.put(r) for r in model.rope(grid))
        # Stands in for block 0's stored residual before the first compute (the gate discards
        # that call's tensor metric). Only the FBCache tensor metric reads it: for any other
        # plan one zero per sample does, not [B, L, D] fp32 on every chip.
        shape = reference_shape(model, latent_shape[0], grid, plan) if plan.needs_reference \
            else (latent_shape[0], 1, 1)
        self.zero_reference = self.put(torch.zeros(shape, dtype=torch.float32))
        # Programs are kept per shape and condition set: another trajectory of the same shapes
        # (the next prompt of a job) reuses their jitted functions, so it compiles nothing.
        key = (self.cond_names, repr(sorted(static.items())), tuple(latent_shape))
        if key not in self._built:
            programs, weights_of = {}, {}
            for name, stage in stages_for(model, plan, self.cond_names, static, grid).items():
                program, names = self._jit(stage)
                programs[name] = program
                weights_of[name] = {e: {n: p[n] for n in names} for e, p in self.params.items()}
            self._built[key] = programs, weights_of
        self._programs, self._weights_of = self._built[key]

    def programs(self):
        """name -> jitted program, for compile inspection (`_cache_size()`)."""
        return dict(self._programs)

    def _run(self, name, expert, *args):
        return self._call(name, self._programs[name], self._weights_of[name][expert], *args)

    # --- what the loop calls --------------------------------------------------------------

    def put(self, tensor: torch.Tensor):
        if tensor.dtype == torch.bfloat16:  # numpy has no bf16: go through torchax's mapping
            return self._place(self.env.t2j_copy(tensor.contiguous()))
        # a transfer, no eager op
        return jax.device_put(tensor.detach().cpu().numpy(), self._placement)

    def get(self, x) -> torch.Tensor:
        return torch.from_numpy(np.asarray(jnp.asarray(x, jnp.float32)).copy())

    def sync(self, x) -> None:
        jax.block_until_ready(x)

    def probe(self, expert, x, t, conds, reference, previous=None):
        ref = self.zero_reference if reference is None else reference
        prev = x if previous is None else previous
        args = (x, t, *self.rope, ref, prev, *(conds[n] for n in self.cond_names))
        return self._run("probe", expert, *args)

    def middle(self, expert, hidden, ctx):
        return self._run("middle", expert, hidden, ctx)

    def tail(self, expert, hidden, ctx):
        return self._run("tail", expert, hidden, ctx)

    def cached_tail(self, expert, hidden, ctx, residuals):
        return self._run("cached_tail", expert, hidden, ctx, *residuals)

    def read_signals(self, signals):
        return np.asarray(signals).tolist()

    def relative_change(self, new, old) -> float:
        return float(self._call("control_delta", rel_l1, tuple(new), tuple(old)))

    def lincomb(self, terms):
        weights = np.asarray([w for w, _ in terms], np.float32)
        return self._call(f"lincomb{len(terms)}", _lincomb, weights, *(x for _, x in terms))

    def replace_first_frame(self, x, frame):
        return self._call("first_frame", _replace_first_frame, x, frame)

    def compile_counts(self):
        return compile_counts()

    def platform(self) -> str:
        """Where the programs run: "cpu", "tpu", "gpu"."""
        return jax.devices()[0].platform

    def device_name(self) -> str:
        d = jax.devices()[0]
        if self.mesh is not None:
            weights = "" if self.weight_sharding == "replicated" else f", weights {self.weight_sharding}"
            hosts = (f"{jax.process_count()} hosts x {jax.local_device_count()} local, "
                     if jax.process_count() > 1 else "")
            return (f"{d.platform}:{d.device_kind} x{self.mesh.size} "
                    f"({hosts}sp {self.mesh.shape['sp']}, cfg {self.mesh.shape['cfg']}{weights})")
        return f"{d.platform}:{d.device_kind}"

    def activate(self, expert) -> None:
        """Every expert's weights stay on the device (replicated, or split by FSDP)."""

    def release(self) -> None:
        """Nothing to hand back between runs."""
