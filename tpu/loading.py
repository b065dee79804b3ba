"""Weights onto the devices: each process reads only the rows its own devices hold.

A weight comes from a row source, `read(name, start, stop) -> torch.Tensor` in the dtype the
device keeps (a `modules.checkpoint.CheckpointReader`, which reads those rows' bytes from the
file and casts them on the host, or a model's host tensors). For each of this process's
devices the rows of its shard are read, once per distinct row range (a weight replicated over
the host's devices: once), and put on that device alone; the global array is assembled from
the per-device arrays (`jax.make_array_from_single_device_arrays`). So no chip holds more of a
weight than its shard, nothing crosses hosts (no equality check of a host value), a bf16
weight is never widened on the way, and the host holds one shard per reading thread at a time.
Weights are placed on a thread pool: the reads and casts release the GIL.

Shards that split dim 0 (FSDP's rule where it divides) read only their rows; a split of a
later dim reads the rows whole once per weight and cuts each device's columns from them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
import torch

from sampling import progress

ReadRows = Callable[[str, int | None, int | None], torch.Tensor]

# torch dtypes numpy has no type of its own for: the same bits through ml_dtypes
_BITS_AS = {torch.bfloat16: (torch.uint16, ml_dtypes.bfloat16),
            torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
            torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2)}


class WeightSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharding: jax.sharding.Sharding | None  # None: jax's default device, uncommitted


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array over the same memory (bf16 and float8 through ml_dtypes)."""
    if t.dtype in _BITS_AS:
        bits, np_dtype = _BITS_AS[t.dtype]
        return t.view(bits).numpy().view(np_dtype)
    return t.numpy()


def _row_range(index: tuple, rows: int) -> tuple[int, int]:
    start, stop, step = index[0].indices(rows)
    if step != 1:
        raise ValueError(f"a shard with row step {step}; expected contiguous rows")
    return start, stop


def place(name: str, spec: WeightSpec, read: ReadRows) -> jax.Array:
    """One weight on this process's devices of `spec.sharding`, from its rows."""
    return _place(name, spec, lambda start, stop: _checked(
        name, read(name, start, stop), _rows_shape(spec.shape, start, stop, 0), spec.dtype), 0)


def place_stacked(name: str, spec: WeightSpec, members: tuple[str, ...], read: ReadRows) -> jax.Array:
    """Weights of one shape stacked along a new leading axis (`spec.shape` = (len(members),
    *their shape); the sharding keeps that axis whole): each device's rows read from every
    member and stacked on the host, so no per-member copy is ever placed."""
    inner = tuple(spec.shape[1:])

    def rows(start, stop):
        return torch.stack([_checked(m, read(m, start, stop), _rows_shape(inner, start, stop, 0),
                                     spec.dtype) for m in members])
    return _place(name, spec, rows, 1 if inner else None)


def _rows_shape(shape, start, stop, axis) -> tuple:
    if start is None:
        return tuple(shape)
    return (*shape[:axis], stop - start, *shape[axis + 1:])


def _place(name: str, spec: WeightSpec, rows_of, axis: int | None) -> jax.Array:
    """Assemble a weight from `rows_of(start, stop)` (rows of dim `axis`; None, None: whole)."""
    shape = tuple(spec.shape)
    if spec.sharding is None or axis is None or len(shape) <= axis:
        whole = rows_of(None, None)
        if spec.sharding is None:
            return _put(whole, None)
        return jax.make_array_from_single_device_arrays(
            shape, spec.sharding, [_put(whole, d) for d in spec.sharding.addressable_devices])
    by_rows: dict[tuple[int, int], list] = {}
    for device, index in spec.sharding.addressable_devices_indices_map(shape).items():
        if any(index[a] != slice(None) and index[a].indices(shape[a]) != (0, shape[a], 1)
               for a in range(axis)):
            raise ValueError(f"{name}: a shard splits a dim before {axis}; expected it whole")
        by_rows.setdefault(_row_range(index[axis:], shape[axis]), []).append((device, index))
    arrays = []
    for (start, stop), members in by_rows.items():
        rows = rows_of(start, stop)
        for device, index in members:
            cut = (*index[:axis], slice(None), *index[axis + 1:])
            arrays.append(_put(rows[cut], device))
        del rows
    return jax.make_array_from_single_device_arrays(shape, spec.sharding, arrays)


def _put(t: torch.Tensor, device) -> jax.Array:
    """Host rows onto one device (None: jax's default device, uncommitted). On a CPU device jax
    may keep an aligned host buffer as the device buffer instead of copying it (may_alias=False
    does not stop it), so row sources hand out buffers nobody else writes."""
    return jax.device_put(host_array(t), device)


def _checked(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise RuntimeError(f"{name}: the row source gave {tuple(t.shape)} {t.dtype}; expected "
                           f"{shape} {dtype}")
    return t


def default_threads() -> int:
    return min(16, 4 * (os.cpu_count() or 1))


def place_all(specs: dict[str, WeightSpec], read: ReadRows,
              threads: int | None = None, stacks: dict[str, tuple[str, ...]] | None = None
              ) -> dict[str, jax.Array]:
    """Every weight of `specs` placed (see `place`; a name in `stacks` stacks those members, see
    `place_stacked`) on a pool of `threads` readers; returns once every transfer is done (the
    host buffers are free then)."""
    stacks = stacks or {}
    with ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="load") as pool, \
            progress.bar(len(specs), "loading weights", unit="tensor") as shown:
        futures = {name: pool.submit(place_stacked, name, spec, stacks[name], read)
                   if name in stacks else pool.submit(place, name, spec, read)
                   for name, spec in specs.items()}
        for f in futures.values():
            f.add_done_callback(lambda _: shown.update(1))
        try:
            return jax.block_until_ready({name: f.result() for name, f in futures.items()})
        except BaseException:
            for f in futures.values():
                f.cancel()  # a bad weight stops the load: the rest are not read
            raise


def host_rows(params: dict[str, torch.Tensor]) -> ReadRows:
    """A row source over a model's host tensors (weights already in memory). The rows are
    copied: a CPU device could otherwise keep the model's own memory, and see it change."""
    def read(name, start=None, stop=None):
        t = params[name].detach()
        return (t if start is None and stop is None else t[start:stop]).clone()
    return read
