"""The middle stage's blocks as rolled loops: `jax.lax.scan` over weights stacked per run of
identical blocks, so the compiler sees one block per run instead of every block.

A run is a range of consecutive blocks whose parameters agree in name (up to the block index),
shape and dtype. The staged API's `block(i, ...)` reads `i` only to pick block i's weights
(Wan S2V: also whether an audio injector follows, and that injector's parameters belong to
block i, so such a block differs from its neighbours and ends a run). A run of one block stays
unrolled. Each parameter of a run is stacked along a new leading axis at placement time (the
per-block sharding with the new axis whole, so FSDP still gathers one block per iteration); the
per-block copies of those blocks are never placed. Nothing here changes the models.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import torch


class Run(NamedTuple):
    start: int
    stop: int
    names: tuple[tuple[str, ...], ...]  # per block of the run: its parameter names, aligned

    def stacked(self, k: int) -> str:
        """The key of the stacked k-th parameter (named after block `start`'s)."""
        return f"{self.names[0][k]}[{self.start}:{self.stop}]"

    @property
    def members(self) -> set[str]:
        """Every parameter name of every block of the run (placed only stacked)."""
        return {n for names in self.names for n in names}

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.stacked(k) for k in range(len(self.names[0])))


def _masked(name: str, i: int) -> str:
    """A parameter name with block i's index (its first occurrence) masked: blocks.7.ffn.0.weight
    -> blocks.#.ffn.0.weight."""
    parts = name.split(".")
    if str(i) in parts:
        parts[parts.index(str(i))] = "#"
    return ".".join(parts)


def block_runs(model, start: int, stop: int, min_length: int = 2,
               unrolled: frozenset[int] = frozenset()) -> list[Run | int]:
    """Blocks [start, stop) in order as runs (to scan) and single block indices (unrolled; also
    every block of `unrolled`: those whose weights another stage reads too)."""
    params = dict(model.named_parameters())
    names: dict[int, list[str]] = {i: [] for i in range(start, stop)}
    for name in params:
        b = model.block_of(name)
        if b is not None and start <= b < stop:
            names[b].append(name)
    groups: list[list[int]] = []
    last = None
    for i in range(start, stop):
        names[i].sort(key=lambda n, i=i: _masked(n, i))
        key = tuple((_masked(n, i), tuple(params[n].shape), params[n].dtype) for n in names[i])
        if i in unrolled:
            key = None
        if groups and key == last and key:
            groups[-1].append(i)
        else:
            groups.append([i])
        last = key
    out: list[Run | int] = []
    for g in groups:
        if len(g) >= min_length:
            out.append(Run(g[0], g[-1] + 1, tuple(tuple(names[i]) for i in g)))
        else:
            out.extend(g)
    return out


def scan_run(model, run: Run, stacked: list, hidden, call):
    """`call(hidden)` (model.block(run.start, hidden, ...)) once per block of the run, each time
    with that block's slice of the stacked weights bound to block `start`'s parameters. hidden
    and the result: torch views (a tensor or a tuple of them); stacked: torch views."""
    from compat.torchax_compat import import_torchax
    from tpu import attention
    interop = import_torchax().interop
    names = [f"model.{n}" for n in run.names[0]]
    holder = OnModel(model, call)

    def body(h, ws):
        params = dict(zip(names, interop.torch_view(list(ws)), strict=True))
        out = torch.func.functional_call(holder, params, (interop.torch_view(h),))
        return interop.jax_view(out), None

    h, ws = interop.jax_view(hidden), interop.jax_view(list(stacked))
    length = run.stop - run.start
    with attention.kernel_costs():  # a shape check: its kernels are not the program's
        out = jax.eval_shape(body, h, [w[0] for w in ws])[0]
    if jax.tree.map(lambda a: (a.shape, a.dtype), out) != jax.tree.map(lambda a: (a.shape, a.dtype), h):
        # the run's input is not a block output (another dtype): its first block runs unrolled
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
