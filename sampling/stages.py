"""One model call as three stages over the models' staged API: probe, middle, tail.

    probe   prepare + blocks [0, Fn) + the scalars the gate reads   -> hidden, ctx, signals, r1
    middle  blocks [Fn, N - Bn)                                     -> hidden
    tail    blocks [N - Bn, N) + head + unpatchify                  -> model output

Full = probe, middle, tail; Cached = probe, hidden + cached residual, tail. With bn_ids (a subset
of the tail window that runs on reuse steps), the full tail also returns the residual of each run
of the other tail blocks, and a reuse step runs `cached tail`: the selected blocks, with each
run of the others replaced by its stored residual. Both backends run these
same bodies: torch eagerly (or compiled), JAX through torchax jit with the weights passed as
arguments. Every stage takes positional tensors only and keeps shapes static, so one program per
stage and input shape serves every step, both CFG branches and both Wan2.2 experts.

Signals are per-sample means over tokens (a [B, K] fp32 tensor), in the order of `SignalPlan.kinds`;
under sequence parallelism the layout (`sharding.layout`) reduces the same sums over the group.
A local-view layout (torch.distributed) also cuts every per-token context field the blocks read
(`TOKEN_AXES`) and, with CFG parallel, the inputs of a fused pair; the head reads the whole
context again after the tokens are gathered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from cache import CMConfig
from modules.hunyuan_video15 import HunyuanContext, HunyuanVideo15DiT
from modules.layers import StagedDiT
from modules.wan import WanContext, WanDiT
from modules.wan_s2v import WanS2VContext, WanS2VDiT
from sharding import layout

EPS = 1e-8


@dataclass(frozen=True)
class SignalPlan:
    """What the probe computes for the gate, derived from a CMConfig.

    kinds: ("teacache", signature kind) and/or ("fbcache", metric), in Signals field order.
    """

    fn_blocks: int
    bn_blocks: int
    kinds: tuple[tuple[str, str], ...] = ()
    downsample: int = 1
    forecast: int = 0  # the gate's forecasting order: warm-up compiles its combinations
    tc_downsample: int = 1  # TeaCache's token stride over the modulated input
    scene_guard: bool = False  # report the latent's relative L1 change since the last step
    tail_runs: tuple[tuple[int, int], ...] = ()  # reused runs of the tail window (bn_ids)
    saliency: float = 0.0  # token-saliency threshold of the residual tensor metric (0 = off)
    # the probe's reference is a forecast of block 0's residual (forecast_gate): warm-up runs
    # the probe on one, whose placement comes from the forecast program
    forecast_reference: bool = False
    # the middle's residual kept split by the time gates that scale it (CMConfig.remodulate):
    # the middle also returns (part no time term scales, sum of the outputs each one scales),
    # and a reuse step recombines them with its own step's gates in the cached tail
    remodulate: bool = False

    @classmethod
    def from_config(cls, config: CMConfig) -> "SignalPlan":
        kinds = []
        if config.teacache is not None:
            kinds.append(("teacache", config.teacache.signature_of))
        if config.fbcache is not None:
            kinds.append(("fbcache", config.fbcache.metric))
        downsample = config.fbcache.downsample if config.fbcache is not None else 1
        tc_downsample = config.teacache.downsample if config.teacache is not None else 1
        saliency = config.fbcache.saliency if config.fbcache is not None else 0.0
        return cls(config.probe_blocks, config.tail_blocks, tuple(kinds), downsample,
                   config.forecast, tc_downsample, "latent_delta" in config.needs_signals,
                   config.tail_runs, saliency, config.forecast_gate, config.remodulate)

    @property
    def fields(self) -> tuple[str, ...]:
        """The Signals field of each column of the probe's signal tensor."""
        return tuple(k for k, _ in self.kinds) + (("latent_delta",) if self.scene_guard else ())

    @property
    def reuse_tail_blocks(self) -> int:
        """Tail blocks a reuse step runs (all Bn, or the bn_ids subset)."""
        return self.bn_blocks - sum(b - a for a, b in self.tail_runs)

    def computed_fraction(self, trace, blocks: int) -> float:
        """The fraction of block evaluations a run's trace rows made (`blocks` per computed
        call; a reuse runs the probe and the reuse tail)."""
        reuse = self.fn_blocks + self.reuse_tail_blocks
        ran = sum(blocks if r["action"] == "compute" else reuse for r in trace)
        return ran / (blocks * len(trace))

    @property
    def cached_tail(self) -> bool:
        """A reuse step runs the cached tail (its residuals given), not the full one."""
        return bool(self.tail_runs) or self.remodulate

    @property
    def needs_reference(self) -> bool:
        """The probe compares block 0's residual with the one stored at the last compute."""
        return ("fbcache", "residual_tensor_rel_l1") in self.kinds

    @property
    def needs_residual(self) -> bool:
        return any(k == "fbcache" and m.startswith("residual") for k, m in self.kinds)


# Context fields with one row per image token, by token axis: a local-view layout cuts them like
# the image stream before the blocks read them. Wan's e/e0 hold one row (one timestep) or L rows
# (TI2V per-token timesteps); HunyuanVideo's key mask spans [image | text] and is left whole
# for the attention to split. Wan S2V's sequence is [noisy | reference | motion] tokens.
TOKEN_AXES = {WanContext: {"e": 1, "e0": 1, "rope_cos": 0, "rope_sin": 0},
              WanS2VContext: {"rope_cos": 0, "rope_sin": 0, "conditioning": 0},
              HunyuanContext: {"rope_cos": 0, "rope_sin": 0}}


def local_context(ctx):
    """ctx with its per-token fields cut to this shard's tokens (unchanged on one device). A
    staged model from outside (`adapters/`) names its context's token axes on the context
    class (`token_axes`)."""
    lay = layout.current()
    axes = getattr(type(ctx), "token_axes", None)
    return ctx._replace(**{name: lay.local_rows(getattr(ctx, name), axis) for name, axis in
                           (TOKEN_AXES[type(ctx)] if axes is None else axes).items()})


def replicated_key_lengths(model) -> tuple[int, ...]:
    """Lengths of the unmasked key sequences other than the image tokens (Wan's cross-attention
    over the padded text): a local-view layout keeps its shard length apart from them, since
    its attention tells an image-token call from a text one by the shapes it is given."""
    return (model.config.text_len,) if isinstance(model, WanDiT) else ()


def context_type(model: nn.Module):
    given = getattr(model, "context_type", None)  # a staged model from outside (`adapters/`)
    if given is not None:
        return given
    if isinstance(model, WanS2VDiT):  # before WanDiT, its base
        return WanS2VContext
    if isinstance(model, WanDiT):
        return WanContext
    if isinstance(model, HunyuanVideo15DiT):
        return HunyuanContext
    raise TypeError(f"no staged context for {type(model).__name__}")


def image_stream(hidden):
    """The image tokens of a hidden state (HunyuanVideo's is the pair (img, txt))."""
    return hidden[0] if isinstance(hidden, tuple) else hidden


def hidden_dim(model) -> int:
    if hasattr(model, "hidden_dim"):  # a staged model from outside (`adapters/`)
        return model.hidden_dim
    cfg = model.config
    return cfg.dim if isinstance(model, WanDiT) else cfg.hidden_size


def reference_shape(model, batch: int, grid, plan: SignalPlan) -> tuple[int, int, int]:
    """Shape of block 0's (downsampled) residual, the FBCache tensor-metric reference."""
    return batch, math.ceil(model.sequence_length(grid) / plan.downsample), hidden_dim(model)


def _mean_abs(x):
    return x.float().abs().flatten(1).mean(1)


class _TokenSums:
    """Per-token [B, L] columns whose sums over the sequence the probe needs; a layout reduces
    them all at once (one collective under sequence parallelism)."""

    def __init__(self):
        self.columns = []

    def add(self, per_token, stride: int = 1, step: int = 1) -> tuple[int, int]:
        """Queue per_token (every stride-th token counted; row j is token j * step of the stream);
        returns (column, tokens counted over the whole sequence). The layout's mask also drops
        the padding rows of a shard."""
        keep, counted = layout.current().token_mask(per_token.shape[1], step, stride,
                                                    per_token.device)
        if keep is not None:
            per_token = per_token * keep.to(per_token.dtype)
        self.columns.append(per_token)
        return len(self.columns) - 1, counted


def _salient_rel(sums: _TokenSums, r, reference, tau: float, step: int):
    """Relative L1 of r against reference over the tokens whose own relative change exceeds tau
    (per sample); the plain relative L1 where none does. Sums, not means, so the shards of a
    sequence-parallel run add their numerators, denominators and counts."""
    d = (r - reference).abs().mean(-1)  # [B, L] per-token change
    p = reference.abs().mean(-1)
    mask = (d > tau * (p + EPS)).to(d.dtype)
    i, _ = sums.add(d * mask, step=step)
    j, _ = sums.add(p * mask, step=step)
    k, _ = sums.add(mask, step=step)
    a, _ = sums.add(d, step=step)
    b, _ = sums.add(p, step=step)

    def finish(s):
        return torch.where(s[:, k] > 0, s[:, i] / (s[:, j] + EPS), s[:, a] / (s[:, b] + EPS))
    return finish


def _tree_map(fn, hidden):
    """fn on the image stream of a hidden state (HunyuanVideo's text stream stays whole)."""
    return (fn(hidden[0]), *hidden[1:]) if isinstance(hidden, tuple) else fn(hidden)


class _OnModel(nn.Module):
    """Calls fn(*args) as a module holding the model, so that torch.func.functional_call can
    hand it the weights a layout gathered (FSDP) without the model knowing."""

    def __init__(self, model: nn.Module, fn):
        super().__init__()
        self.model = model  # params named model.*
        object.__setattr__(self, "fn", fn)  # not a submodule

    def forward(self, *args):
        return self.fn(*args)


def with_block_weights(model, indices, fn, *args):
    """fn(*args), reading the weights of blocks `indices` (`model.block_of`) as the current
    layout gives them: whole, gathered just before (FSDP), so only the blocks at hand are ever
    whole on a device."""
    lay = layout.current()
    if not lay.splits_weights:
        return fn(*args)
    params = {f"model.{n}": p for n, p in model.named_parameters() if model.block_of(n) in indices}
    return torch.func.functional_call(_OnModel(model, fn), lay.block_weights(params), args)


def run_block(model, i: int, hidden, ctx):
    """model.block(i, hidden, ctx) with block i's weights as the current layout gives them."""
    return with_block_weights(model, (i,), model.block, i, hidden, ctx)


class _Stage(nn.Module):
    embeddings = True  # whether the stage reads parameters outside the block list

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.ctx_type = context_type(model)

    def _ctx(self, ctx):
        return self.ctx_type(*ctx)

    def _local_ctx(self, ctx):
        """What the blocks read: the per-token fields cut to this shard's tokens."""
        return local_context(self._ctx(ctx))

    def blocks_used(self) -> set[int]:
        raise NotImplementedError

    def uses_parameter(self, name: str) -> bool:
        """Whether `name` (as in self.named_parameters()) is read by this stage: a backend passes
        only those, since passing every block's weights to a 2-block program costs dispatch time."""
        block = self.model.block_of(name.removeprefix("model."))
        return self.embeddings if block is None else block in self.blocks_used()


class Probe(_Stage):
    """prepare + blocks [0, Fn) + signals. Inputs: x, t, rope_cos, rope_sin, reference,
    previous (the latent of the last step, for the scene guard), then the condition tensors
    named by `cond_names` (static switches bound in `static`)."""

    def __init__(self, model, plan: SignalPlan, cond_names: tuple[str, ...], static: dict):
        super().__init__(model)
        self.plan, self.cond_names, self.static = plan, tuple(cond_names), dict(static)

    def blocks_used(self):
        # block 0's modulation shapes the modulated-input signatures
        modulated = any(kind in ("modulated_input", "hidden_rel_l1", "hidden_rel_l2")
                        for _, kind in self.plan.kinds)
        return set(range(self.plan.fn_blocks)) | ({0} if modulated else set())

    def forward(self, x, t, rope_cos, rope_sin, reference, previous, *conds):
        model, plan = self.model, self.plan
        kwargs = dict(zip(self.cond_names, conds, strict=True))
        batch = x.shape[0]
        for c in conds:  # a plain loop: dynamo breaks the graph on max(..., default=)
            batch = c.shape[0] if c.ndim and c.shape[0] > batch else batch
        latent = x
        if x.shape[0] != batch:  # fused CFG: one latent, both branches' conditions
            x, t = x.expand(batch, *x.shape[1:]), t.expand(batch, *t.shape[1:])
        lay = layout.current()
        # CFG parallel: this rank's sample of the pair from here on
        x, t = lay.local_batch(x), lay.local_batch(t)
        kwargs = {name: lay.local_batch(c) for name, c in kwargs.items()}
        hidden, ctx = model.prepare(x, t, **kwargs, **self.static, rope=(rope_cos, rope_sin))
        hidden = _tree_map(lay.shard_tokens, hidden)
        local = local_context(ctx)
        entry = hidden
        for i in range(plan.fn_blocks):
            hidden = run_block(model, i, hidden, local)
        r1 = None
        if plan.needs_residual:
            r1 = (image_stream(hidden) - image_stream(entry))[:, ::plan.downsample].float()
        sums = _TokenSums()
        finish = []  # per signal: sums [B, K'] -> [B]
        for technique, kind in plan.kinds:
            if technique == "teacache":
                sig = with_block_weights(model, (0,), model.signature, kind, entry, local).float()
                if sig.ndim < 3 or sig.shape[1] != image_stream(entry).shape[1]:
                    # a per-sample embedding (Wan's e with one timestep is [B, 1, D]): nothing
                    # to reduce over the sequence
                    value = sig.abs().flatten(1).mean(1)
                    finish.append(lambda s, v=value: v)
                    continue
                stride = plan.tc_downsample if kind == "modulated_input" else 1
                # per token: mean over the rest ([B, L, 6, D] for Wan's per-token e0)
                i, n = sums.add(sig.abs().flatten(2).mean(-1), stride)
                finish.append(lambda s, i=i, n=n: s[:, i] / n)
            elif kind in ("hidden_rel_l1", "hidden_rel_l2"):
                mod = with_block_weights(model, (0,), model.signature, "modulated_input", entry,
                                         local).float()
                per_token = mod.abs().mean(-1) if kind == "hidden_rel_l1" else mod.square().mean(-1)
                i, n = sums.add(per_token, plan.downsample)
                finish.append((lambda s, i=i, n=n: s[:, i] / n) if kind == "hidden_rel_l1"
                              else (lambda s, i=i, n=n: (s[:, i] / n).sqrt()))
            elif kind == "residual_rel_l1":
                i, n = sums.add(r1.abs().mean(-1), step=plan.downsample)
                finish.append(lambda s, i=i, n=n: s[:, i] / n)
            elif plan.saliency > 0:  # residual_tensor_rel_l1 over the salient tokens
                finish.append(_salient_rel(sums, r1, reference, plan.saliency, plan.downsample))
            else:  # residual_tensor_rel_l1: distance from the residual of the last compute
                i, _ = sums.add((r1 - reference).abs().mean(-1), step=plan.downsample)
                j, _ = sums.add(reference.abs().mean(-1), step=plan.downsample)
                finish.append(lambda s, i=i, j=j: s[:, i] / (s[:, j] + EPS))
        # one reduction over the sequence (one collective when it is sharded) for every signal
        reduced = lay.token_sums(sums.columns) if sums.columns else None
        values = [f(reduced) for f in finish]
        if plan.scene_guard:  # the latent is whole on every shard: no reduction needed
            delta = _mean_abs(latent - previous) / (_mean_abs(previous) + EPS)
            values.append(delta.expand(x.shape[0]))
        signals = torch.stack(values, dim=1) if values else x.new_zeros((x.shape[0], 0))
        # the context goes on whole: each stage cuts it for its blocks, the head reads it whole
        return hidden, tuple(ctx), lay.gather_batch(signals), r1 if r1 is not None else x.new_zeros(())


def check_remodulate(model) -> None:
    """A remodulated residual needs gates whose time term every block shares. `model`: a
    model or its class."""
    cls = model if isinstance(model, type) else type(model)
    if not hasattr(cls, "block_gated") or getattr(cls, "time_gates", None) in (
            None, StagedDiT.time_gates):
        raise ValueError(
            f"--remodulate recombines the cached residual with each step's time gates, which "
            f"needs a model whose blocks share one time term in their gates (the Wan2.2 family); "
            f"{cls.__name__} derives each block's gates on its own: leave --remodulate off")


class Middle(_Stage):
    """Blocks [Fn, N - Bn): what a reuse step replaces with the cached residual.

    With `plan.remodulate` it returns (hidden, parts): parts = (r0, *sums), sums[k] the sum
    over the window of the outputs time gate k scales (before it), r0 the rest of the window's
    residual (hidden out - hidden in - sum_k gate_k * sums[k]). Each block step carries
    (hidden, *sums), so a scanned run (`tpu.scan`) carries them too."""

    embeddings = False

    def __init__(self, model, plan: SignalPlan):
        super().__init__(model)
        self.start, self.stop = plan.fn_blocks, model.num_blocks - plan.bn_blocks
        self.remodulate = plan.remodulate
        if self.remodulate:
            check_remodulate(model)

    def blocks_used(self):
        return set(range(self.start, self.stop))

    def begin(self, hidden, ctx):
        """The state a block step carries: hidden, or (hidden, a zero sum per time gate)."""
        if not self.remodulate:
            return hidden
        zero = torch.zeros_like(hidden, dtype=torch.float32)
        return (hidden, *(zero for _ in self.model.time_gates(ctx)))

    def block_step(self, i: int, state, ctx):
        if not self.remodulate:
            return run_block(self.model, i, state, ctx)
        hidden, *sums = state
        hidden, gated = with_block_weights(self.model, (i,), self.model.block_gated, i, hidden, ctx)
        return (hidden, *(s + y for s, y in zip(sums, gated, strict=True)))

    def finish(self, state, entry, ctx):
        if not self.remodulate:
            return state
        hidden, *sums = state
        r0 = hidden - entry
        for gate, total in zip(self.model.time_gates(ctx), sums, strict=True):
            r0 = r0 - gate * total
        return hidden, (r0, *sums)

    def forward(self, hidden, ctx):
        ctx = self._local_ctx(ctx)
        state = self.begin(hidden, ctx)
        for i in range(self.start, self.stop):
            state = self.block_step(i, state, ctx)
        return self.finish(state, hidden, ctx)


def remodulated(model, hidden, ctx, parts):
    """hidden + the middle's residual rebuilt from its parts with this step's time gates."""
    r0, *sums = parts
    out = hidden + r0
    for gate, total in zip(model.time_gates(ctx), sums, strict=True):
        out = out + gate * total
    return out


def _tree(fn, a, b):
    """fn leaf by leaf over a hidden state (HunyuanVideo's is the pair (img, txt))."""
    if isinstance(a, tuple):
        return tuple(fn(x, y) for x, y in zip(a, b, strict=True))
    return fn(a, b)


class Tail(_Stage):
    """Blocks [N - Bn, N), head and unpatchify, for one token grid.

    With `plan.tail_runs`, the full tail (cached=False) returns (output, residuals of the runs),
    and the cached tail takes those residuals after (hidden, ctx) and runs only the other blocks.
    With `plan.remodulate`, the cached tail takes the middle's parts first (`Middle`) and adds
    the residual they rebuild with this call's time gates to the probe's hidden state.
    """

    def __init__(self, model, plan: SignalPlan, grid: tuple[int, int, int], cached: bool = False):
        super().__init__(model)
        self.start, self.grid = model.num_blocks - plan.bn_blocks, tuple(grid)
        self.runs = {self.start + a: self.start + b for a, b in plan.tail_runs}
        self.cached = cached
        self.remodulate = cached and plan.remodulate

    def blocks_used(self):
        used = set(range(self.start, self.model.num_blocks))
        if self.cached:
            for a, b in self.runs.items():
                used -= set(range(a, b))
        return used

    def forward(self, hidden, ctx, *residuals):
        ctx = self._ctx(ctx)
        local = local_context(ctx)
        stored, given = [], iter(residuals)
        if self.remodulate:
            hidden = remodulated(self.model, hidden, local, next(given))
        i = self.start
        while i < self.model.num_blocks:
            stop = self.runs.get(i)
            if stop is not None and self.cached:
                hidden = _tree(torch.add, hidden, next(given))
                i = stop
                continue
            before = hidden
            for j in range(i, stop or i + 1):
                hidden = run_block(self.model, j, hidden, local)
            if stop is not None:
                stored.append(_tree(torch.sub, hidden, before))
            i = stop or i + 1
        lay = layout.current()
        hidden = _tree_map(lay.gather_tokens, hidden)
        out = lay.gather_batch(self.model.final(hidden, ctx, self.grid))
        # A batched (fused CFG) call hands back one output per sample, so the loop combines
        # them without slicing on the device.
        out = out if out.shape[0] == 1 else tuple(out.split(1))
        return (out, tuple(stored)) if self.runs and not self.cached else out


STAGES = ("probe", "middle", "tail", "cached_tail")


def stages_for(model, plan: SignalPlan, cond_names, static: dict, grid) -> dict[str, _Stage]:
    """name -> stage of one model for one input shape: what every backend runs. `cached_tail`
    exists only with bn_ids or remodulate (otherwise a reuse step runs the same tail as a
    compute step)."""
    out = {"probe": Probe(model, plan, cond_names, static), "middle": Middle(model, plan),
           "tail": Tail(model, plan, grid)}
    if plan.cached_tail:
        out["cached_tail"] = Tail(model, plan, grid, cached=True)
    return out
