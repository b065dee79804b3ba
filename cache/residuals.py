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


def _each(fn, *xs):
    """fn leaf by leaf: a residual may be a tuple of arrays (HunyuanVideo's pair, remodulated
    parts)."""
    if isinstance(xs[0], tuple):
        return tuple(fn(*leaves) for leaves in zip(*xs, strict=True))
    return fn(*xs)


class NumpyOps:
    """TensorOps for numpy arrays (or tuples of them) on the host: one device, 'cpu'."""

    host = "cpu"

    def add(self, a, b):
        return _each(lambda x, y: x + y, a, b)

    def sub(self, a, b):
        return _each(lambda x, y: x - y, a, b)

    def shape(self, x):
        return _each(lambda a: tuple(a.shape), x)

    def dtype(self, x):
        return _each(lambda a: a.dtype, x)

    def device(self, x):
        return "cpu"

    def move(self, x, device):
        return x

    def cast(self, x, dtype):
        if isinstance(x, tuple):
            return tuple(a.astype(d) for a, d in zip(x, dtype, strict=True))
        return x.astype(dtype)

    def can_cast(self, src_dtype, dst_dtype):
        pairs = zip(src_dtype, dst_dtype, strict=True) if isinstance(src_dtype, tuple) \
            else ((src_dtype, dst_dtype),)
        return all(s.kind == "f" and d.kind == "f" for s, d in pairs)

    def is_oom(self, exc):
        return isinstance(exc, MemoryError)

    def memory_fraction(self):
        return None

    def combine(self, terms):
        return _each(lambda *xs: sum(w * x for (w, _), x in zip(terms, xs, strict=True)),
                     *(x for _, x in terms))


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


def forecast_order(steps: list[int], at: int, order: int, reach: float | None = None) -> int:
    """The order to forecast with at step `at` from tensors kept at `steps` (oldest first): at most
    `order` and what the history allows (len(steps) - 1). With `reach`, order 2 only while the
    gap since the last compute is at most `reach` times the spacing of the last two: a quadratic's
    Lagrange weights grow with the square of the gap over the spacing, so far out it amplifies
    the noise in the three points more than its curvature term removes (issue 17: on long reuse
    runs the quadratic forecast measured worse than the linear one)."""
    usable = max(0, min(order, len(steps) - 1))
    if usable >= 2 and reach is not None and at - steps[-1] > reach * (steps[-1] - steps[-2]):
        usable = 1
    return usable


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

    def fetch(self, ops: TensorOps, x, step: int | None = None, order: int = 0,
              reach: float | None = None):
        """The residual ready to add to x, or (None, fail-safe reason). Drops a residual it cannot
        use. With `order` > 0 and earlier residuals kept, the residual is forecast to `step` from
        the last order + 1 computed ones (plain reuse until enough are kept; the order is capped
        by `forecast_order`)."""
        residual, failure = self._latest(ops, x)
        if failure is not None or step is None:
            return residual, failure
        return self._extrapolate(ops, residual, ops.dtype(x), ops.device(x), step, order, reach), None

    def reference(self, ops: TensorOps, step: int, order: int, reach: float | None = None):
        """The stored tensor forecast to `step` as `fetch` would (same order, same weights), in
        its own dtype and place; the stored one itself when there is nothing to forecast from."""
        if self.residual is None:
            return None
        return self._extrapolate(ops, self.residual, self.dtype, ops.device(self.residual), step,
                                 order, reach)

    def history_steps(self) -> list[int]:
        """The steps of the kept tensors, oldest first (the newest is `step`)."""
        return [s for s, _ in self.earlier] + [self.step]

    def _extrapolate(self, ops: TensorOps, latest, dtype, device, step: int, order: int,
                     reach: float | None):
        if not order or not self.earlier or self.step is None:
            return latest
        order = forecast_order(self.history_steps(), step, order, reach)
        if not order:
            return latest
        points = self.earlier[-order:]
        values = []
        for _, r in points:
            if ops.shape(r) != self.shape or ops.dtype(r) != self.dtype:
                return latest  # cannot forecast from these: plain reuse
            if ops.device(r) != device:
                r, failure = move(ops, r, device)
                if failure is not None:
                    self.earlier = []
                    return latest
            values.append(ops.cast(r, dtype) if self.dtype != dtype else r)
        weights = extrapolation_weights([s for s, _ in points] + [self.step], step)
        return ops.combine(list(zip(weights, values + [latest], strict=True)))

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
