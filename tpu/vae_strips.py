"""Wan: the frame as strips on the batch axis (`Strips`). Each device's band of the frame is cut
into a grid of strips stacked on the batch axis, and the decoder runs on them as on a batch (all
but its 3x3 convs and its mid-block attention is per pixel); each conv's zero padding becomes the
strip's halo, its neighbours' border lines (collective-permute of those lines across a band's
edge), and the attention joins the strips into the frame. On a TPU a band is cut into at least 8
strips (`strip_grid`): of a conv with a batch under 8, libtpu's space-to-batch pass makes 8
batches of the width, and every conv's input is padded and relaid out into them and its output
copied back (about a quarter of the TI2V-5B decode's HBM traffic); one such conv with the width
taken off the pass (its spatial order changed) compiled 7x slower, as a batch of 8 strips it
compiles faster than before. Elsewhere a band is one strip (a grid of 1 x 1: on one device, the
whole frame).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .vae_plan import AXIS, COLUMNS, ROWS

# A TPU convolution of a batch of 8 or more runs as written; of fewer, libtpu's space-to-batch
# pass cuts the frame's width into 8 batches and every conv's input and output are padded and
# relaid out around it (measured on v6e-8: batches of 4 are cut, of 8 are not), so on a TPU the
# Wan decoders cut each device's band of the frame into at least 8 strips (`strip_grid`).
MIN_STRIPS = 8
WAN_UPSCALE = 8  # a Wan decoder's last convs run at 8x the latent's rows and columns


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def strip_grid(band_height: int, band_width: int, platform: str) -> tuple[int, int]:
    """(rows, columns) of strips each device cuts its band of the latent frame (band_height x
    band_width latent pixels) into for the Wan decoders: on a TPU the grid of at least
    MIN_STRIPS strips whose halos (one line around each strip, at the last convs' 8x size) add
    the fewest pixels, on a tie fewer strips, then wider ones; (1, 1) where none divides or
    off a TPU."""
    if platform != "tpu":
        return 1, 1
    best, best_cost = (1, 1), None
    for r in _divisors(band_height):
        for c in _divisors(band_width):
            if r * c < MIN_STRIPS:
                continue
            h, w = WAN_UPSCALE * band_height // r, WAN_UPSCALE * band_width // c
            cost = ((h + 2) * (w + 2) / (h * w), r * c, c)
            if best_cost is None or cost < best_cost:
                best, best_cost = (r, c), cost
    return best


@dataclasses.dataclass(frozen=True)
class Strips:
    """The frame over `n` devices (its rows or columns split: `split`), each device's band cut
    into `rows` x `cols` strips, all stacked on the batch axis: [n*rows*cols, C, T, h, w],
    device-major, sharded over the mesh by that axis. Every op of a Wan decoder but its 3x3
    convs and its mid-block attention is per pixel, so the decoder runs on the strips as on a
    batch; `halo` gives each conv its neighbours' border lines, `join`/`cut` give the attention
    the whole frame."""

    n: int
    split: int
    rows: int
    cols: int
    mesh: Mesh | None

    @property
    def batch(self) -> int:
        return self.n * self.rows * self.cols

    def _local(self, fn, band_in: bool, band_out: bool):
        """fn on each device's part: its band of a [1, C, T, H, W] frame, or its strips."""
        if self.mesh is None:
            return fn
        band = [None] * 5
        band[self.split] = AXIS

        def spec(is_band):
            return P(*band) if is_band else P(AXIS)

        return jax.shard_map(fn, mesh=self.mesh, in_specs=spec(band_in), out_specs=spec(band_out))

    def cut(self, x):
        """[1, C, T, H, W] (jax) -> the strips [B, C, T, h, w]."""
        def local(x):
            _, c, t, hh, ww = x.shape
            h, w = hh // self.rows, ww // self.cols
            g = x.reshape(c, t, self.rows, h, self.cols, w).transpose(2, 4, 0, 1, 3, 5)
            return g.reshape(self.rows * self.cols, c, t, h, w)
        return self._local(local, True, False)(x)

    def join(self, x):
        """The strips [B, C, T, h, w] (jax) -> [1, C, T, H, W]."""
        def local(x):
            _, c, t, h, w = x.shape
            g = x.reshape(self.rows, self.cols, c, t, h, w).transpose(2, 3, 0, 4, 1, 5)
            return g.reshape(1, c, t, self.rows * h, self.cols * w)
        return self._local(local, False, True)(x)

    def halo(self, x, ph: int, pw: int):
        """Strips [B, ..., h, w] (jax) -> each with `ph` rows and `pw` columns of its
        neighbours' around it, zeros at the frame's edges (a conv's zero padding); across a
        band's edge they come from the adjacent device (collective-permute of those lines
        only). The neighbours' lines are gathered by strip index from the border lines alone
        and the strip written once with them: the batch axis stays whole (split into the grid
        it is tiled with the channels on a TPU, and was relaid out, several times a conv)."""
        jnp = jax.numpy

        def local(x):
            left, right = self._lines(x, pw, -1, 1, self.split == COLUMNS)
            if pw:
                x = jnp.concatenate([left, x, right], axis=-1)
            # the rows' halo from the strips with their columns': the corners come with it
            up, down = self._lines(x, ph, -2, 0, self.split == ROWS)
            return x if ph == 0 else jnp.concatenate([up, x, down], axis=-2)
        return self._local(local, False, False)(x)

    def _lines(self, x, width: int, dim: int, along: int, across: bool):
        """(before, after): for each strip of x, the `width` lines of dimension `dim` in front
        of it (its previous neighbour's last ones) and behind it (the next one's first ones),
        the neighbours along the grid's columns (along=1) or rows (0); across: at the band's
        edge from the adjacent devices, else zeros."""
        jnp = jax.numpy
        if width == 0:
            return None, None
        size = x.shape[dim]
        first = jax.lax.slice_in_dim(x, 0, width, axis=dim)
        last = jax.lax.slice_in_dim(x, size - width, size, axis=dim)
        # strip ids [position along the neighbours' axis, the other axis]
        grid = np.arange(self.rows * self.cols).reshape(self.rows, self.cols)
        grid = grid if along == 0 else grid.T
        n, others = grid.shape
        b = first.shape[0]
        if across and self.mesh is not None and self.n > 1:  # the band's edge strips' lines
            into = jax.lax.ppermute(jnp.take(last, grid[n - 1], axis=0), AXIS,
                                    [(i, i + 1) for i in range(self.n - 1)])
            outof = jax.lax.ppermute(jnp.take(first, grid[0], axis=0), AXIS,
                                     [(i + 1, i) for i in range(self.n - 1)])
            edge = b + np.arange(others)  # their place in the stacks below
        else:  # the frame's edge: the zero line after the stacks
            into = outof = first[:0]
            edge = np.full(others, b)
        before = np.empty(b, dtype=np.int32)
        after = np.empty(b, dtype=np.int32)
        before[grid[0]], after[grid[n - 1]] = edge, edge
        before[grid[1:]], after[grid[:-1]] = grid[:-1], grid[1:]
        zero = jnp.zeros_like(first[:1])
        return (jnp.take(jnp.concatenate([last, into, zero]), before, axis=0),
                jnp.take(jnp.concatenate([first, outof, zero]), after, axis=0))

    @staticmethod
    def torch(fn, x, **kwargs):
        """fn (one of the above) on a torch tensor of the trace."""
        from torchax.interop import call_jax

        return call_jax(functools.partial(fn, **kwargs), x)


def frame_strips(latent_height: int, latent_width: int, mesh: Mesh | None, split: int,
                 platform: str, grid: tuple[int, int] | str = "auto") -> Strips | None:
    """The `Strips` of a latent frame of latent_height x latent_width over `mesh` split by
    `split`, each band cut into `grid` (rows, columns) or, "auto", `strip_grid`'s for
    `platform`; None: the frame whole on one device."""
    n = 1 if mesh is None else mesh.size
    band = (latent_height // n, latent_width) if split == ROWS else (latent_height, latent_width // n)
    rows, cols = strip_grid(*band, platform) if grid == "auto" else grid
    if band[0] % rows or band[1] % cols:
        raise ValueError(f"strips {rows} x {cols}: each device's band of the latent frame is "
                         f"{band[0]} x {band[1]}; expected divisors of those")
    if n * rows * cols == 1:
        return None
    return Strips(n, split, rows, cols, mesh)
