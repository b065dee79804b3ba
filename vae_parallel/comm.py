"""The collectives of spatial patch parallelism over torch.distributed (gloo on CPU, NCCL/HCCL
on devices): halo exchange with the four neighbours, all-gather of variable-length token blocks
(attention K/V), a float64 all-reduce (norm statistics), and the two-stage gather of the output.

The grid spans the default process group: rank r of the group holds patch r of the grid.
Tensor legend: [..., H, W] with H, W the rank's patch (plus halos where said)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .grid import PatchGrid, PatchGridError

BORDERS = ("zeros", "replicate")  # what lies beyond the frame's edge


class PatchComm:
    """One rank's view of the grid and the process groups the gather needs."""

    def __init__(self, grid: PatchGrid):
        if not dist.is_initialized():
            raise PatchGridError("patch parallel needs torch.distributed initialised (torchrun, "
                                 "or vae_parallel.launch for local CPU ranks)")
        if dist.get_world_size() != grid.world_size:
            raise PatchGridError(f"grid {grid.shape[0]}x{grid.shape[1]} needs {grid.world_size} "
                                 f"ranks; the process group has {dist.get_world_size()}")
        self.grid = grid
        self.rank = dist.get_rank()
        self.row, self.col = grid.position(self.rank)
        self.neighbours = grid.neighbours(self.rank)
        n_rows, n_cols = grid.shape
        # Every rank creates every group, in the same order (new_group is collective).
        self.row_group = None
        if n_cols > 1:
            for r in range(n_rows):
                group = dist.new_group([grid.rank_at(r, c) for c in range(n_cols)])
                if r == self.row:
                    self.row_group = group
        self.leader_group = None
        if n_rows > 1:
            self.leader_group = dist.new_group([grid.rank_at(r, 0) for r in range(n_rows)])

    # --- halos ----------------------------------------------------------------------------------

    def halo(self, x: torch.Tensor, top: int, bottom: int, left: int, right: int,
             border: str = "zeros") -> torch.Tensor:
        """x [..., H, W] -> [..., top+H+bottom, left+W+right]: the neighbours' edge rows and
        columns, or `border` padding at the frame's edge. Rows first, then columns of the
        row-extended tensor, so corners come from the diagonal neighbour."""
        x = self._exchange(x, -2, top, bottom, self.neighbours["up"], self.neighbours["down"], border)
        return self._exchange(x, -1, left, right, self.neighbours["left"], self.neighbours["right"],
                              border)

    def _exchange(self, x, dim, before, after, prev, nxt, border):
        if before == 0 and after == 0:
            return x
        n = x.shape[dim]
        if n < max(before, after):
            raise PatchGridError(f"a patch {n} pixels wide cannot lend a halo of "
                                 f"{max(before, after)}; use fewer ranks along this axis")
        ops, from_prev, from_next = [], None, None
        if prev is not None:
            if before:
                from_prev = x.new_empty(_with(x.shape, dim, before))
                ops.append(dist.P2POp(dist.irecv, from_prev, prev))
            if after:  # prev's bottom/right halo is my first rows/columns
                ops.append(dist.P2POp(dist.isend, x.narrow(dim, 0, after).contiguous(), prev))
        if nxt is not None:
            if after:
                from_next = x.new_empty(_with(x.shape, dim, after))
                ops.append(dist.P2POp(dist.irecv, from_next, nxt))
            if before:
                ops.append(dist.P2POp(dist.isend, x.narrow(dim, n - before, before).contiguous(), nxt))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        lo = from_prev if prev is not None else _border(x, dim, before, 0, border)
        hi = from_next if nxt is not None else _border(x, dim, after, n - 1, border)
        return torch.cat([t for t in (lo, x, hi) if t is not None and t.shape[dim]], dim)

    # --- collectives ----------------------------------------------------------------------------

    def all_gather_varlen(self, x: torch.Tensor, dim: int) -> list[torch.Tensor]:
        """Every rank's x, which may differ in size along `dim` only (padded for the collective,
        trimmed after)."""
        length = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
        lengths = [torch.empty_like(length) for _ in range(self.grid.world_size)]
        dist.all_gather(lengths, length)
        lengths = [int(n) for n in lengths]
        padded = _pad_to(x, dim, max(lengths))
        parts = [torch.empty_like(padded) for _ in lengths]
        dist.all_gather(parts, padded)
        return [p.narrow(dim, 0, n) for p, n in zip(parts, lengths, strict=True)]

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def gather_frame(self, y: torch.Tensor, scale: int, dst: int = 0) -> torch.Tensor | None:
        """Two-stage gather of the patches [..., h, w] (h, w = the patch's latent size x `scale`)
        into the whole frame on rank `dst` (None elsewhere): first along W within each grid
        row to the row's first rank, then along H among those to `dst`. Patches of unequal size
        travel padded to the largest one."""
        if dst != 0:
            raise PatchGridError("the frame is assembled on rank 0 (the first row's leader)")
        grid = self.grid
        if self.row_group is not None:
            widths = [scale * w for w in grid.cols]
            y = self._gather_dim(y, -1, widths, self.col, self.row_group, grid.rank_at(self.row, 0))
        if self.col != 0:
            return None
        if self.leader_group is not None:
            heights = [scale * h for h in grid.rows]
            y = self._gather_dim(y, -2, heights, self.row, self.leader_group, dst)
        return y if self.rank == dst else None

    def _gather_dim(self, y, dim, sizes, index, group, leader):
        if y.shape[dim] != sizes[index]:
            raise PatchGridError(f"a patch of {y.shape[dim]} pixels along dim {dim}; the grid "
                                 f"expects {sizes}")
        padded = _pad_to(y, dim, max(sizes))
        parts = [torch.empty_like(padded) for _ in sizes] if self.rank == leader else None
        dist.gather(padded, parts, dst=leader, group=group)
        if self.rank != leader:
            return None
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim)


def _with(shape, dim, n):
    shape = list(shape)
    shape[dim] = n
    return shape


def _border(x, dim, n, edge, border):
    if n == 0:
        return None
    if border == "zeros":
        return x.new_zeros(_with(x.shape, dim, n))
    if border == "replicate":
        return x.narrow(dim, edge, 1).expand(_with(x.shape, dim, n))
    raise PatchGridError(f"border {border!r}: expected one of {BORDERS}")


def _pad_to(x, dim, n):
    if x.shape[dim] == n:
        return x.contiguous()
    return torch.cat([x, x.new_zeros(_with(x.shape, dim, n - x.shape[dim]))], dim)
