"""Cached residuals, kept opaque: the gate moves and checks them only through TensorOps.

A backend (torch, JAX) passes its own TensorOps; NumpyOps is the reference used by the tests and
by pure-host runs. Nothing here reads a tensor's values, so no call here syncs a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .decision import FailSafe


class TensorOps(Protocol):
    host: Any  # where residuals go when offloaded

    def add(self, a, b): ...
    def sub(self, a, b): ...
    def shape(self, x) -> tuple: ...
    def dtype(self, x): ...
    def device(self, x): ...
    def move(self, x, device): ...
    def cast(self, x, dtype): ...
    def can_cast(self, src_dtype, dst_dtype) -> bool: ...
    def is_oom(self, exc: BaseException) -> bool: ...
    def memory_fraction(self) -> float | None: ...


class NumpyOps:
    """TensorOps for numpy arrays on the host: one device, 'cpu'."""

    host = "cpu"

    def add(self, a, b):
        return a + b

    def sub(self, a, b):
        return a - b

    def shape(self, x):
        return tuple(x.shape)

    def dtype(self, x):
        return x.dtype

    def device(self, x):
        return "cpu"

    def move(self, x, device):
        return x

    def cast(self, x, dtype):
        return x.astype(dtype)

    def can_cast(self, src_dtype, dst_dtype):
        return src_dtype.kind == "f" and dst_dtype.kind == "f"

    def is_oom(self, exc):
        return isinstance(exc, MemoryError)

    def memory_fraction(self):
        return None


@dataclass
class Slot:
    """One branch's cached residual and the guards that decide whether it may be reused."""

    residual: Any = None
    shape: tuple | None = None
    dtype: Any = None

    def store(self, ops: TensorOps, residual) -> None:
        self.residual, self.shape, self.dtype = residual, ops.shape(residual), ops.dtype(residual)

    def drop(self) -> None:
        self.residual = self.shape = self.dtype = None

    def fetch(self, ops: TensorOps, x):
        """The residual ready to add to x, or (None, fail-safe reason). Drops a residual it cannot use."""
        if self.residual is None:
            return None, FailSafe.MISSING_RESIDUAL
        if ops.shape(x) != self.shape:
            self.drop()
            return None, FailSafe.SHAPE_MISMATCH
        residual = self.residual
        want = ops.dtype(x)
        if want != self.dtype:
            if not ops.can_cast(self.dtype, want):
                self.drop()
                return None, FailSafe.DTYPE_MISMATCH
            residual = ops.cast(residual, want)
        device = ops.device(x)
        if ops.device(residual) != device:
            residual, failure = move(ops, residual, device)
            if failure is not None:
                self.drop()
                return None, failure
        return residual, None


def move(ops: TensorOps, x, device):
    """(moved x, None), or (None, OOM_ON_MOVE) when the target ran out of memory."""
    try:
        return ops.move(x, device), None
    except Exception as exc:  # noqa: BLE001 - only OOM is expected; anything else is re-raised
        if ops.is_oom(exc):
            return None, FailSafe.OOM_ON_MOVE
        raise
