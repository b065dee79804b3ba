"""The middle stage's blocks as rolled loops: `jax.lax.scan` over weights stacked per run of
repeating blocks, so the compiler sees one period of blocks per run instead of every block.

A run is a range of consecutive blocks made of a period of p blocks repeated: block i's
parameters agree with block i + p's in name (up to the block index), shape and dtype. Most runs
have p = 1 (identical blocks). The staged API's `block(i, ...)` reads `i` only to pick block i's
weights (Wan S2V: also whether an audio injector follows, and that injector's parameters belong to
block i, so such a block differs from its neighbours; S2V's injections every 4th and then every
3rd block make two runs of periods 4 and 3, where identical blocks alone made 11 runs and 13
single blocks, and the middle's compile traced 24 blocks instead of 7). A block that repeats
nothing stays unrolled. Each parameter of a run is stacked along a new leading axis at placement
time (the per-block sharding with the new axis whole, so FSDP gathers one period's blocks per
iteration); the per-block copies of those blocks are never placed. Nothing here changes the
models.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import torch


class Run(NamedTuple):
    start: int
    stop: int
    names: tuple[tuple[str, ...], ...]  # per block of the run: its parameter names, aligned
    # with those of the block a period earlier
    period: int = 1

    @property
    def groups(self) -> int:
        """Iterations of the loop: repeats of the period."""
        return (self.stop - self.start) // self.period

    def stacks(self) -> list[tuple[str, tuple[str, ...]]]:
        """(key, members) per parameter of one period, in the loop body's order: the stacked
        weight's key (named after the first period's parameter) and the parameter it stacks from
        each repeat."""
        span = f"{self.start}:{self.stop}" + (f":{self.period}" if self.period > 1 else "")
        return [(f"{name}[{span}]",
                 tuple(self.names[j + g * self.period][k] for g in range(self.groups)))
                for j in range(self.period) for k, name in enumerate(self.names[j])]

    @property
    def members(self) -> set[str]:
        """Every parameter name of every block of the run (placed only stacked)."""
        return {n for names in self.names for n in names}

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.stacks())


def _masked(name: str, i: int) -> str:
    """A parameter of block i with its index masked: the first occurrence of i
    (blocks.7.ffn.0.weight -> blocks.#.ffn.0.weight), else the first index (a part block i owns
    by another numbering, S2V's audio_injector.injector.3.norm_q.weight ->
    audio_injector.injector.#.norm_q.weight). A wrong mask only stops blocks from matching."""
    parts = name.split(".")
    at = parts.index(str(i)) if str(i) in parts else \
        next((k for k, part in enumerate(parts) if part.isdigit()), None)
    if at is not None:
        parts[at] = "#"
    return ".".join(parts)


MAX_PERIOD = 8  # the longest period looked for: a loop body of up to 8 blocks


def block_runs(model, start: int, stop: int, min_length: int = 2,
               unrolled: frozenset[int] = frozenset()) -> list[Run | int]:
    """Blocks [start, stop) in order as runs (to scan) and single block indices (unrolled; also
    every block of `unrolled`: those whose weights another stage reads too). From each block on,
    the run kept is the one that leaves the fewest blocks to trace: among periods p <= MAX_PERIOD
    repeated r >= min_length times, the most p * (r - 1) blocks saved (the shorter period on a
    tie)."""
    params = dict(model.named_parameters())
    names: dict[int, list[str]] = {i: [] for i in range(start, stop)}
    for name in params:
        b = model.block_of(name)
        if b is not None and start <= b < stop:
            names[b].append(name)
    keys: list = []
    for i in range(start, stop):
        names[i].sort(key=lambda n, i=i: _masked(n, i))
        key = tuple((_masked(n, i), tuple(params[n].shape), params[n].dtype) for n in names[i])
        keys.append(key if key and i not in unrolled else object())  # unique: matches nothing
    out: list[Run | int] = []
    at = 0
    while at < len(keys):
        best = (0, 1, 1)  # (blocks saved, period, repeats)
        for p in range(1, MAX_PERIOD + 1):
            pattern = keys[at:at + p]
            if len(pattern) < p:
                break
            r = 1
            while keys[at + r * p:at + (r + 1) * p] == pattern:
                r += 1
            if r >= min_length and p * (r - 1) > best[0]:
                best = (p * (r - 1), p, r)
        _, p, r = best
        if best[0]:
            first = start + at
            out.append(Run(first, first + p * r,
                           tuple(tuple(names[i]) for i in range(first, first + p * r)), p))
            at += p * r
        else:
            out.append(start + at)
            at += 1
    return out


def scan_run(model, run: Run, stacked: list, hidden, call):
    """The run's blocks in order: per iteration, `call(i, hidden)` (model.block(i, hidden, ...))
    for each block i of the first period, with that repeat's slice of the stacked weights (in
    `run.stacks()`'s order) bound to the first period's parameters. hidden and the result: torch
    views (a tensor or a tuple of them); stacked: torch views."""
    from compat.torchax_compat import import_torchax
    from tpu import attention
    interop = import_torchax().interop
    names = [f"model.{members[0]}" for _, members in run.stacks()]  # the first period's, in order

    def period(h):
        for i in range(run.start, run.start + run.period):
            h = call(i, h)
        return h
    holder = OnModel(model, period)

    def body(h, ws):
        params = dict(zip(names, interop.torch_view(list(ws)), strict=True))
        out = torch.func.functional_call(holder, params, (interop.torch_view(h),))
        return interop.jax_view(out), None

    h, ws = interop.jax_view(hidden), interop.jax_view(list(stacked))
    length = run.groups
    with attention.kernel_costs():  # a shape check: its kernels are not the program's
        out = jax.eval_shape(body, h, [w[0] for w in ws])[0]
    if jax.tree.map(lambda a: (a.shape, a.dtype), out) != jax.tree.map(lambda a: (a.shape, a.dtype), h):
        # the run's input is not a block output (another dtype): its first period runs unrolled
        h, _ = body(h, [w[0] for w in ws])
        ws, length = [w[1:] for w in ws], length - 1
    with attention.repeated(length):
        h, _ = jax.lax.scan(body, h, ws)
    return interop.torch_view(h)


class OnModel(torch.nn.Module):
    """fn(*args) as a module holding the model (params named model.*), for functional_call."""

    def __init__(self, model, fn):
        super().__init__()
        self.model = model
        object.__setattr__(self, "fn", fn)

    def forward(self, *args):
        return self.fn(*args)
