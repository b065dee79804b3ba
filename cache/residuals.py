"""Cached residuals, kept opaque: the gate moves and checks them only through TensorOps.

A backend (torch, JAX) passes its own TensorOps; NumpyOps is the reference used by the tests and
by pure-host runs. Nothing here reads a tensor's values, so no call here syncs a device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    def combine(self, terms): ...  # sum(w * x) over (float, residual) pairs: forecasting


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

    def combine(self, terms):
        return sum(w * x for w, x in terms)


def extrapolation_weights(steps: list[int], at: int) -> list[float]:
    """Lagrange weights of the polynomial through (steps[i], r_i), evaluated at step `at`:
    two points extrapolate linearly, three quadratically (Taylor-style forecasting)."""
    weights = []
    for i, si in enumerate(steps):
        w = 1.0
        for j, sj in enumerate(steps):
            if j != i:
                w *= (at - sj) / (si - sj)
        weights.append(w)
    return weights


@dataclass
class Slot:
    """One branch's cached residual and the guards that decide whether it may be reused."""

    residual: Any = None
    shape: tuple | None = None
    dtype: Any = None
    step: int | None = None  # the step the residual was computed at
    earlier: list = field(default_factory=list)  # [(step, residual)] before it, for forecasting

    def store(self, ops: TensorOps, residual, step: int | None = None, keep: int = 0) -> None:
        """Keep `residual` (computed at `step`) and up to `keep` earlier ones."""
        if keep and self.residual is not None and None not in (self.step, step):
            self.earlier = (self.earlier + [(self.step, self.residual)])[-keep:]
        else:
            self.earlier = []
        self.residual, self.shape, self.dtype = residual, ops.shape(residual), ops.dtype(residual)
        self.step = step

    def drop(self) -> None:
        self.residual = self.shape = self.dtype = self.step = None
        self.earlier = []

    def fetch(self, ops: TensorOps, x, step: int | None = None, order: int = 0):
        """The residual ready to add to x, or (None, fail-safe reason). Drops a residual it cannot
        use. With `order` > 0 and earlier residuals kept, the residual is forecast to `step` from
        the last order + 1 computed ones (plain reuse until enough are kept)."""
        residual, failure = self._latest(ops, x)
        if failure is not None or not order or not self.earlier or step is None:
            return residual, failure
        points, device = self.earlier[-order:], ops.device(x)
        values = []
        for _, r in points:
            if ops.shape(r) != self.shape or ops.dtype(r) != self.dtype:
                return residual, None  # cannot forecast from these: plain reuse
            if ops.device(r) != device:
                r, failure = move(ops, r, device)
                if failure is not None:
                    self.earlier = []
                    return residual, None
            values.append(ops.cast(r, ops.dtype(x)) if self.dtype != ops.dtype(x) else r)
        weights = extrapolation_weights([s for s, _ in points] + [self.step], step)
        return ops.combine(list(zip(weights, values + [residual], strict=True))), None

    def _latest(self, ops: TensorOps, x):
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
