"""How a latent frame is split over ranks: a rows x cols grid of patches, sizes as even as the
frame allows (the first `remainder` rows/columns get one more). Rank r sits at row r // cols,
column r % cols. Pure arithmetic, no torch.distributed."""

from __future__ import annotations

from dataclasses import dataclass


class PatchGridError(ValueError):
    """A split the frame or the model cannot take; the message says what would fit."""


def split_sizes(total: int, parts: int) -> tuple[int, ...]:
    """`parts` sizes summing to `total`, differing by at most one."""
    base, extra = divmod(total, parts)
    return tuple(base + (i < extra) for i in range(parts))


@dataclass(frozen=True)
class PatchGrid:
    rows: tuple[int, ...]  # latent rows held by each grid row, top to bottom
    cols: tuple[int, ...]  # latent columns held by each grid column, left to right

    def __post_init__(self):
        if not self.rows or not self.cols or min(self.rows + self.cols) < 1:
            raise PatchGridError(f"grid rows {self.rows} x cols {self.cols}: every patch needs at "
                                 "least one latent row and column")

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows), len(self.cols)

    @property
    def world_size(self) -> int:
        return len(self.rows) * len(self.cols)

    @property
    def height(self) -> int:
        return sum(self.rows)

    @property
    def width(self) -> int:
        return sum(self.cols)

    def position(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise PatchGridError(f"rank {rank} is outside the {self.shape[0]}x{self.shape[1]} grid")
        return divmod(rank, len(self.cols))

    def rank_at(self, row: int, col: int) -> int:
        return row * len(self.cols) + col

    def bounds(self, rank: int, scale: int = 1) -> tuple[int, int, int, int]:
        """(top, bottom, left, right) of the rank's patch, in latent pixels times `scale`."""
        r, c = self.position(rank)
        top, left = sum(self.rows[:r]), sum(self.cols[:c])
        return (scale * top, scale * (top + self.rows[r]), scale * left,
                scale * (left + self.cols[c]))

    def local(self, frame, rank: int):
        """The rank's patch of a [..., H, W] tensor of the grid's size."""
        top, bottom, left, right = self.bounds(rank)
        return frame[..., top:bottom, left:right]

    def neighbours(self, rank: int) -> dict[str, int | None]:
        """Ranks above, below, left and right (None at the frame's border)."""
        r, c = self.position(rank)
        n_rows, n_cols = self.shape
        return {"up": self.rank_at(r - 1, c) if r > 0 else None,
                "down": self.rank_at(r + 1, c) if r + 1 < n_rows else None,
                "left": self.rank_at(r, c - 1) if c > 0 else None,
                "right": self.rank_at(r, c + 1) if c + 1 < n_cols else None}

    def min_patch(self) -> int:
        return min(self.rows + self.cols)


def plan_grid(world_size: int, height: int, width: int,
              shape: tuple[int, int] | None = None) -> PatchGrid:
    """The grid for `world_size` ranks over a height x width latent. Without `shape`, the
    factorisation rows x cols with the smallest halo per patch (height/rows + width/cols, the
    patch's half perimeter) whose patches are at least one latent pixel wide."""
    if world_size < 1:
        raise PatchGridError(f"world size {world_size}: expected >= 1")
    if shape is not None:
        n_rows, n_cols = shape
        if n_rows * n_cols != world_size:
            raise PatchGridError(f"grid {n_rows}x{n_cols} has {n_rows * n_cols} patches; expected "
                                 f"{world_size}, one per rank")
        if n_rows > height or n_cols > width:
            raise PatchGridError(f"grid {n_rows}x{n_cols} does not fit a {height}x{width} latent; "
                                 "expected at most one grid row per latent row and one column per "
                                 "latent column")
    else:
        options = [(n, world_size // n) for n in range(1, world_size + 1)
                   if world_size % n == 0 and n <= height and world_size // n <= width]
        if not options:
            raise PatchGridError(f"{world_size} ranks cannot split a {height}x{width} latent (at "
                                 f"most {height * width} patches of one latent pixel); use fewer")
        n_rows, n_cols = min(options, key=lambda rc: (height / rc[0] + width / rc[1], rc[0]))
    return PatchGrid(split_sizes(height, n_rows), split_sizes(width, n_cols))
