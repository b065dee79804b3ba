"""Eager torch execution of the stages of `sampling.stages`, behind the loop's Backend interface."""

from __future__ import annotations

import torch

from sampling.stages import Middle, Probe, SignalPlan, Tail, reference_shape


def _map(fn, *xs):
    if isinstance(xs[0], tuple):
        return tuple(fn(*parts) for parts in zip(*xs, strict=True))
    return fn(*xs)


def _leaves(x):
    return x if isinstance(x, tuple) else (x,)


class TorchOps:
    """TensorOps for torch tensors and tuples of them (HunyuanVideo's hidden pair)."""

    host = torch.device("cpu")

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
        return _map(lambda t: t.to(device), x)

    def cast(self, x, dtype):
        if isinstance(x, tuple):
            return tuple(t.to(d) for t, d in zip(x, dtype, strict=True))
        return x.to(dtype[0])

    def can_cast(self, src, dst):
        return len(src) == len(dst) and all(d.is_floating_point for d in (*src, *dst))

    def is_oom(self, exc):
        return isinstance(exc, (torch.OutOfMemoryError, MemoryError))

    def memory_fraction(self):
        return None


class TorchBackend:
    def __init__(self, models: dict, plan: SignalPlan, device="cpu"):
        self.models, self.plan, self.device = models, plan, torch.device(device)
        self.template = next(iter(models.values()))
        self.ops = TorchOps()

    def prepare(self, cond_names, static: dict, latent_shape) -> None:
        grid = self.template.grid(latent_shape)
        self.cond_names = tuple(cond_names)
        self.rope = tuple(self.put(r) for r in self.template.rope(grid))
        self.zero_reference = torch.zeros(
            reference_shape(self.template, latent_shape[0], grid, self.plan), device=self.device)
        self.stages = {e: (Probe(m, self.plan, self.cond_names, static), Middle(m, self.plan),
                           Tail(m, self.plan, grid)) for e, m in self.models.items()}

    def put(self, tensor):
        return tensor.to(self.device)

    def get(self, x):
        return x.float().cpu()

    def sync(self, x):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def probe(self, expert, x, t, conds, reference):
        ref = self.zero_reference if reference is None else reference
        return self.stages[expert][0](x, t, *self.rope, ref, *(conds[n] for n in self.cond_names))

    @torch.no_grad()
    def middle(self, expert, hidden, ctx):
        return self.stages[expert][1](hidden, ctx)

    @torch.no_grad()
    def tail(self, expert, hidden, ctx):
        return self.stages[expert][2](hidden, ctx)

    def read_signals(self, signals):
        return signals.tolist()

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
        return None  # eager: nothing is compiled
