"""The stages of `sampling.stages` run in torch, behind the loop's Backend interface.

Eager by default. `compile=True` wraps each stage (probe, middle, tail) in `torch.compile` with
static shapes: the gate decides between the calls, so graphs break only at the gate and a step
never recompiles (counted from dynamo's frame counter). `offload_model=True` keeps each model on
the host until its expert runs, and moves the other expert off the device at the Wan2.2 switch.
`layout=TorchSequenceLayout(...)` (`sharding.torch_sp`) runs this rank's part of a sequence- and
CFG-parallel call: cached residuals stay shard-local, and every rank takes the same decisions
because the signals it reads are reduced over its sequence group.
"""

from __future__ import annotations

import contextlib
import math

import torch

from modules import ops
from sampling.loop import CompileCounts
from sampling.stages import SignalPlan, reference_shape, replicated_key_lengths, stages_for
from sharding import layout as layouts
from sharding import torch_sp

HOST = torch.device("cpu")  # where offloaded models wait


def _map(fn, *xs):
    if isinstance(xs[0], tuple):
        return tuple(fn(*parts) for parts in zip(*xs, strict=True))
    return fn(*xs)


def _leaves(x):
    return x if isinstance(x, tuple) else (x,)


class TorchOps:
    """TensorOps for torch tensors and tuples of them (HunyuanVideo's hidden pair)."""

    def __init__(self, device="cpu"):
        self.compute_device = torch.device(device)
        self.host = torch.device("cpu")

    def add(self, a, b):
        return _map(torch.add, a, b)

    def sub(self, a, b):
        return _map(torch.sub, a, b)

    def shape(self, x):
        return tuple(tuple(t.shape) for t in _leaves(x))

    def dtype(self, x):
        return tuple(t.dtype for t in _leaves(x))

    def device(self, x):
        return tuple(t.device for t in _leaves(x))

    def move(self, x, device):
        device = device[0] if isinstance(device, tuple) else torch.device(device)
        # Pinned host memory makes the way back to the device an async copy.
        pin = device.type == "cpu" and self.compute_device.type == "cuda"
        return _map(lambda t: t.to(device, non_blocking=True).pin_memory() if pin
                    else t.to(device, non_blocking=True), x)

    def cast(self, x, dtype):
        if isinstance(x, tuple):
            return tuple(t.to(d) for t, d in zip(x, dtype, strict=True))
        return x.to(dtype[0])

    def can_cast(self, src, dst):
        return len(src) == len(dst) and all(d.is_floating_point for d in (*src, *dst))

    def is_oom(self, exc):
        return isinstance(exc, (torch.OutOfMemoryError, MemoryError))

    def combine(self, terms):
        def one(*xs):
            return sum(w * x for (w, _), x in zip(terms, xs, strict=True))
        return _map(one, *(x for _, x in terms))

    def memory_fraction(self):
        if self.compute_device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.compute_device)
            return 1.0 - free / total
        return None


def _dynamo_frames() -> int:
    from torch._dynamo.utils import counters
    return sum(counters["frames"].get(k, 0) for k in ("ok",))


class TorchBackend:
    """models: expert -> torch module; device: where the stages run (cuda, npu, cpu);
    layout: a `sharding.torch_sp.TorchSequenceLayout` for this rank of a sequence/CFG-parallel
    run (None: one process)."""

    def __init__(self, models: dict, plan: SignalPlan, device="cpu", *, compile: bool = False,
                 offload_model: bool = False, ops_impl: TorchOps | None = None, layout=None):
        self.models, self.plan = models, plan
        self.device = torch.device(device)
        self.template = next(iter(models.values()))
        self.ops = ops_impl or TorchOps(self.device)
        self.compile, self.offload_model = compile, offload_model
        if self.device.type in ("cuda", "npu"):
            ops.accelerate(self.device.type)  # SDPA/flash on CUDA, torch_npu kernels on Ascend
        self.attention = ops.active()["attention"]
        self.layout = layout
        if layout is not None:
            if compile:
                # dynamo would have to trace the collectives of every attention; untested
                raise ValueError("compile=True with a sequence/CFG-parallel layout is not "
                                 "supported; run the parallel stages eagerly")
            torch_sp.install()
            if layout.base_attention is None:
                layout.base_attention = self.attention
        self.moves = 0  # model moves between host and device (offload telemetry)
        self._on_device = set()  # with offload, the models start on the host
        if not offload_model:
            for expert in models:
                self._place(expert, self.device)

    def _place(self, expert, device):
        self.models[expert].to(device)
        self.moves += 1
        (self._on_device.add if device == self.device else self._on_device.discard)(expert)

    def activate(self, expert) -> None:
        """With offload, only the running expert's weights are on the device."""
        if expert in self._on_device:
            return
        for other in list(self._on_device):
            self._place(other, HOST)
        self._place(expert, self.device)

    def release(self) -> None:
        """Offload: every model back to the host at the end of sampling."""
        if self.offload_model:
            for expert in list(self._on_device):
                self._place(expert, HOST)

    def prepare(self, cond_names, static: dict, latent_shape) -> None:
        grid = self.template.grid(latent_shape)
        self.cond_names = tuple(cond_names)
        self.rope = tuple(self.put(r) for r in self.template.rope(grid))
        shape = reference_shape(self.template, latent_shape[0], grid, self.plan)
        lay = self.layout
        if lay is not None:
            if lay.cfg_size > 1 and latent_shape[0] != lay.cfg_size:
                raise ValueError("CFG parallel runs the fused [uncond, cond] call: build the "
                                 "sample with fused_cfg=True (cfg_mode 'fused') and guidance != 1")
            # a strided first-block residual needs every shard to start on a counted token
            align = self.plan.downsample if self.plan.needs_residual else 1
            lay.set_tokens(math.prod(grid), align, replicated_key_lengths(self.template))
            shape = lay.local_reference_shape(shape, self.plan.downsample)
        self.zero_reference = torch.zeros(shape, device=self.device)
        wrap = (lambda m: torch.compile(m, dynamic=False)) if self.compile else (lambda m: m)
        self.stages = {e: {name: wrap(s) for name, s in
                           stages_for(m, self.plan, self.cond_names, static, grid).items()}
                       for e, m in self.models.items()}

    def platform(self) -> str:
        """Where the stages run: "cpu", "cuda", "npu"."""
        return self.device.type

    def device_name(self) -> str:
        name = str(self.device)
        if self.device.type == "cuda":
            name = f"cuda:{torch.cuda.get_device_name(self.device)}"
        lay = self.layout
        if lay is not None:
            name += f" (rank {lay.rank}: sp {lay.sp_size}, cfg {lay.cfg_size})"
        return name

    def _parallel(self):
        """This rank's view of the tokens and the attention over its group, while a stage runs."""
        if self.layout is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(layouts.use(self.layout))
        stack.enter_context(ops.use(attention=torch_sp.ATTENTION))
        return stack

    def put(self, tensor):
        return tensor.to(self.device)

    def get(self, x):
        return x.float().cpu()

    def sync(self, x):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def probe(self, expert, x, t, conds, reference, previous=None):
        ref = self.zero_reference if reference is None else reference
        prev = x if previous is None else previous
        if self.layout is not None:
            self.layout.reduce_failed = False  # reported for this call only
        with self._parallel():
            return self.stages[expert]["probe"](x, t, *self.rope, ref, prev,
                                                *(conds[n] for n in self.cond_names))

    @torch.no_grad()
    def middle(self, expert, hidden, ctx):
        with self._parallel():
            return self.stages[expert]["middle"](hidden, ctx)

    @torch.no_grad()
    def tail(self, expert, hidden, ctx):
        with self._parallel():
            return self.stages[expert]["tail"](hidden, ctx)

    @torch.no_grad()
    def cached_tail(self, expert, hidden, ctx, residuals):
        with self._parallel():
            return self.stages[expert]["cached_tail"](hidden, ctx, *residuals)

    def read_signals(self, signals):
        return signals.tolist()

    def reduce_failed(self) -> bool:
        """Whether the last probe's signals are shard-local because their reduction failed."""
        return self.layout is not None and self.layout.reduce_failed

    def relative_change(self, new, old) -> float:
        num = sum((a.float() - b.float()).abs().sum() for a, b in zip(new, old, strict=True))
        return float(num / (sum(b.float().abs().sum() for b in old) + 1e-8))

    def lincomb(self, terms):
        out = None
        for w, x in terms:
            out = w * x.float() if out is None else out + w * x.float()
        return out

    def replace_first_frame(self, x, frame):
        x = x.clone()
        x[:, :, :1] = frame.to(x.dtype)
        return x

    def compile_counts(self):
        """Frames dynamo compiled (None when eager: nothing compiles)."""
        if not self.compile:
            return None
        frames = _dynamo_frames()
        return CompileCounts(lowered=frames, backend=frames)
