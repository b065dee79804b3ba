"""How the stages see the token axis: whole on one device (the default), or split over a
sequence-parallel group by a backend's layout.

The stages call `current()` while they run (or are traced) and use three things from it:
`shard_tokens(h)` on the image stream right after prepare, `token_sums(columns)` for every
per-token signal at once, and `gather_tokens(h)` before the head. A backend installs its
layout with `use(...)` around tracing or running the stages. Nothing here imports a backend.

A global-view layout (JAX: the compiler partitions one program) needs nothing else, unless it
keeps the block weights split over the devices (FSDP): then `block_weights` hands each block its
weights whole, just before the block runs. A local-view
layout (torch.distributed: each rank runs its own shard eagerly) also cuts the other per-token
tensors a block reads (`local_rows`), says which rows of a signal column count (`token_mask`),
and with CFG parallel keeps one sample of a fused pair (`local_batch`, `gather_batch`). Those
hooks are identities here.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch


class Layout:
    """One device, or a backend whose compiler partitions the program itself: identity sharding
    and plain local sums."""

    sp_size = 1

    def shard_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def gather_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def token_sums(self, columns: list[torch.Tensor]) -> torch.Tensor:
        """[B, L_i] columns -> [B, K] sums over the tokens."""
        return torch.stack([c.sum(1) for c in columns], dim=1)

    def token_mask(self, length: int, step: int = 1, stride: int = 1,
                   device=None) -> tuple[torch.Tensor | None, int]:
        """Which rows of a [B, length] signal column count, and how many count over the whole
        sequence: (bool [length] mask or None for all, count). Row j of the column is token
        j * step of the stream (step > 1: a strided residual); only tokens at multiples of
        `stride` count."""
        every = stride // math.gcd(step, stride)
        if every == 1:
            return None, length
        return torch.arange(length, device=device) % every == 0, math.ceil(length / every)

    def local_rows(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        """A per-token tensor other than the hidden stream (RoPE tables, per-token modulation),
        cut to the rows of this shard along `axis`."""
        return tensor

    def local_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """A model-call input cut to this rank's sample of a fused CFG pair."""
        return tensor

    def gather_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """Per-sample results (signals, outputs) of every rank of a fused CFG pair, in batch
        order."""
        return tensor

    splits_weights = False  # block weights live split over the devices (FSDP)

    def block_weights(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One block's parameters (name -> tensor) as its math reads them: whole. Called just
        before the block runs, and only when `splits_weights`."""
        return params


_CURRENT: Layout = Layout()


def current() -> Layout:
    return _CURRENT


@contextmanager
def use(new: Layout) -> Iterator[Layout]:
    global _CURRENT
    before, _CURRENT = _CURRENT, new
    try:
        yield new
    finally:
        _CURRENT = before
