"""How the stages see the token axis: whole on one device (the default), or split over a
sequence-parallel group by a backend's layout.

The stages call `current()` while they run (or are traced) and use three things from it:
`shard_tokens(h)` on the image stream right after prepare, `token_sums(columns)` for every
per-token signal at once, and `gather_tokens(h)` before the head. A backend installs its
layout with `use(...)` around tracing or running the stages. Nothing here imports a backend.
"""

from __future__ import annotations

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
