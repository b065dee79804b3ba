"""Flow-matching samplers of Wan2.2 (`unipc`, `dpm++`) and HunyuanVideo-1.5 (`euler`), as host maths.

Schedules and step coefficients are Python floats (numpy float64 where the official code uses
numpy); tensors are never touched here. Every tensor result comes from the injected
`lincomb(terms)`, which returns sum(weight * tensor) over `(float, tensor)` pairs (the backend
computes it in fp32), so one scheduler drives torch, torchax and JAX alike. Tensors the solver
remembers (earlier x0 predictions, the last corrected sample) are kept as opaque objects.

The model predicts the flow velocity v, so x0 = sample - sigma * v (`flow_prediction`).

lincomb arities (number of terms) each solver uses; the JAX backend compiles one program per arity:

    euler  2     x + (sigma_next - sigma) * v                             one call a step
    dpm++  2, 3  x0 (2); first-order update (2); second-order update (3)  two calls a step
    unipc  2, 3, 4  x0 (2); predictor order 1 (2) / order 2 (3);
                 corrector UniC order 1 (3) / order 2 (4)                 up to three calls a step

The last step of every solver lands on sigma 0, where the official update reduces to exactly x0
(or x + (0 - sigma) * v for euler); dpm++ and unipc return that x0 without a further call, and
unipc skips the last corrector, whose result the official update multiplies by 0.

Sources (facts, not code): Wan-Video/Wan2.2 `wan/utils/fm_solvers_unipc.py`,
`wan/utils/fm_solvers.py`, `wan/image2video.py`; Tencent-Hunyuan/HunyuanVideo-1.5
`hyvideo/schedulers/scheduling_flow_match_discrete.py`; model_spec.md sections 2.7, 3.7, 4.3, T6, T12.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

SOLVERS = ("euler", "unipc", "dpm++")

NUM_TRAIN_TIMESTEPS = 1000

# Wan's training grid is sigma = 1 - linspace(1, 1/1000, 1000)[::-1], held in float32; its first
# value, read back with .item(), is where the unipc inference grid starts (0.9990000128746033,
# not 0.999: it decides int truncations such as 999 * 2/3 -> 666 rather than 665).
WAN_SIGMA_MAX = float(np.float32(1.0 - 1.0 / NUM_TRAIN_TIMESTEPS))

Tensor = Any  # whatever the backend's lincomb takes and returns: never inspected here
Lincomb = Callable[[Sequence[tuple[float, Tensor]]], Tensor]


class SchedulerError(ValueError):
    """A scheduler was asked for something it cannot do: bad solver, steps, shift or step order."""


def _check_num_steps(num_steps) -> int:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int | np.integer) or num_steps < 1:
        raise SchedulerError(f"num_steps must be an integer >= 1, got {num_steps!r}")
    return int(num_steps)


def _check_shift(shift) -> float:
    ok = isinstance(shift, int | float | np.floating) and not isinstance(shift, bool)
    if not (ok and math.isfinite(shift) and shift > 0):
        raise SchedulerError(f"shift must be a finite number > 0 (1.0 = no shift), got {shift!r}")
    return float(shift)


def shift_sigmas(sigmas, shift) -> list[float]:
    """sigma' = shift * sigma / (1 + (shift - 1) * sigma), in float64 with the official op order."""
    shift = _check_shift(shift)
    s = np.asarray(sigmas, dtype=np.float64)
    return [float(v) for v in shift * s / (1 + (shift - 1) * s)]


def _log_snr(sigma: float) -> float:
    """lambda = log(alpha) - log(sigma) with alpha = 1 - sigma; -inf at sigma 1, +inf at sigma 0."""
    if sigma <= 0.0:
        return math.inf
    if sigma >= 1.0:
        return -math.inf
    return math.log1p(-sigma) - math.log(sigma)


class Scheduler:
    """One sampling trajectory: the schedule plus the solver's history; `fresh()` starts another.

    Attributes:
        solver, num_steps, shift: what the scheduler was made with (shift applied exactly once).
        sigmas: N + 1 noise levels the solver steps through, as the official scheduler holds them
            (float32 values); the last is 0.0.
        timesteps: N values fed to the model (sigma * 1000: int-truncated for Wan, float32 for HY).
    """

    solver: ClassVar[str]

    def __init__(self, num_steps: int, shift: float):
        self.num_steps = _check_num_steps(num_steps)
        self.shift = _check_shift(shift)
        self.sigmas, self.timesteps = self._schedule(self.num_steps, self.shift)
        self._next_step = 0
        self._reset_history()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_steps={self.num_steps}, shift={self.shift})"

    def fresh(self) -> Scheduler:
        """The same schedule with an empty history, for a new trajectory."""
        return type(self)(self.num_steps, self.shift)

    def step(self, i: int, model_output: Tensor, sample: Tensor, lincomb: Lincomb) -> Tensor:
        """Advance `sample` from sigmas[i] to sigmas[i + 1] given the model's velocity at sigmas[i]."""
        if i != self._next_step or i >= self.num_steps:
            expected = (f"step {self._next_step}" if self._next_step < self.num_steps
                        else f"no further step: all {self.num_steps} steps are done")
            raise SchedulerError(
                f"{self.solver} step index {i!r} is out of order: expected {expected}. Steps run "
                f"0..{self.num_steps - 1} once each; call fresh() to start a new trajectory.")
        out = self._step(i, model_output, sample, lincomb)
        self._next_step += 1
        return out

    def _x0(self, i: int, model_output: Tensor, sample: Tensor, lincomb: Lincomb) -> Tensor:
        return lincomb(((1.0, sample), (-self.sigmas[i], model_output)))

    # Subclasses define the schedule, the history they keep, and one step.
    @staticmethod
    def _schedule(num_steps: int, shift: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
        raise NotImplementedError

    def _reset_history(self) -> None:
        pass

    def _step(self, i: int, model_output: Tensor, sample: Tensor, lincomb: Lincomb) -> Tensor:
        raise NotImplementedError


def _wan_schedule(shifted: list[float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Wan `set_timesteps`: int64-truncated sigma * 1000 from float64, sigmas stored as float32."""
    sigmas64 = np.asarray(shifted, dtype=np.float64)
    timesteps = (sigmas64 * NUM_TRAIN_TIMESTEPS).astype(np.int64)
    sigmas = np.concatenate([sigmas64, [0.0]]).astype(np.float32)
    return tuple(float(s) for s in sigmas), tuple(float(t) for t in timesteps)


class FlowEuler(Scheduler):
    """HunyuanVideo-1.5 `FlowMatchDiscreteScheduler(shift, reverse=True, solver="euler")`.

    The official schedule is torch float32 maths on the CPU: linspace(1, 0, N + 1), the shift, then
    t = sigma * 1000, all float32 (timesteps fed as float32, first t = 1000.0). Here the same float32
    shift and product run in numpy; only the linspace is numpy's (the float64 grid rounded once),
    since torch's float32 linspace rounding depends on the CPU's vector width. Values agree with the
    official ones to a few float32 ulps (<= 1.9e-4 in t) and with diffusers' schedule exactly.
    """

    solver = "euler"

    @staticmethod
    def _schedule(num_steps, shift):
        grid = np.linspace(1.0, 0.0, num_steps + 1).astype(np.float32)
        sigmas = np.float32(shift) * grid / (np.float32(1.0) + np.float32(shift - 1.0) * grid)
        timesteps = sigmas[:-1] * np.float32(NUM_TRAIN_TIMESTEPS)
        return tuple(float(s) for s in sigmas), tuple(float(t) for t in timesteps)

    def _step(self, i, model_output, sample, lincomb):
        dt = np.float32(self.sigmas[i + 1]) - np.float32(self.sigmas[i])  # float32, as the official step
        return lincomb(((1.0, sample), (float(dt), model_output)))


class FlowDPMSolver(Scheduler):
    """Wan `FlowDPMSolverMultistepScheduler` (dpmsolver++, order 2, midpoint, lower_order_final).

    Wan passes get_sampling_sigmas(N, shift) = shift(linspace(1, 0, N + 1)[:N]) to a scheduler
    built with shift=1, so the grid starts at sigma 1.0 (t = 1000), unlike unipc (t = 999).
    """

    solver = "dpm++"

    @staticmethod
    def _schedule(num_steps, shift):
        return _wan_schedule(shift_sigmas(np.linspace(1.0, 0.0, num_steps + 1)[:num_steps], shift))

    def _reset_history(self):
        self._prev_x0 = None  # x0 predicted at the previous step

    def _step(self, i, model_output, sample, lincomb):
        x0 = self._x0(i, model_output, sample, lincomb)
        out = self._update(i, sample, x0, self._prev_x0, lincomb)
        self._prev_x0 = x0
        return out

    def _update(self, i: int, sample: Tensor, x0: Tensor, prev_x0: Tensor | None, lincomb: Lincomb) -> Tensor:
        sigma_s0, sigma_t = self.sigmas[i], self.sigmas[i + 1]
        if sigma_t == 0.0:  # final step (lower_order_final): the update is exactly x0
            return x0
        h = _log_snr(sigma_t) - _log_snr(sigma_s0)
        data_weight = (1.0 - sigma_t) * math.expm1(-h)  # alpha_t * (exp(-h) - 1), <= 0
        sample_weight = sigma_t / sigma_s0
        # First order on the first step, and on the step after sigma 1.0: there lambda = -inf, so
        # the official D1 = (m0 - m1) / r0 gets weight 1 / r0 = 0 and the update is first order.
        if prev_x0 is None or self.sigmas[i - 1] >= 1.0:
            return lincomb(((sample_weight, sample), (-data_weight, x0)))
        r0 = (_log_snr(sigma_s0) - _log_snr(self.sigmas[i - 1])) / h
        # x_t = (sigma_t / sigma_s0) x - c m0 - c / 2 (m0 - m1) / r0, with c = alpha_t (e^-h - 1)
        return lincomb(((sample_weight, sample),
                        (-data_weight * (1.0 + 0.5 / r0), x0),
                        (0.5 * data_weight / r0, prev_x0)))


class FlowUniPC(Scheduler):
    """Wan `FlowUniPCMultistepScheduler` (order 2, bh2, predict_x0, lower_order_final, final sigma 0).

    The scheduler is built with shift=1 and set_timesteps applies the shift once to
    linspace(sigma_max, 0, N + 1)[:-1] (sigma_max = WAN_SIGMA_MAX): first t = 999. The corrector
    UniC runs on every step after the first, as in the official code (disable_corrector = []).
    """

    solver = "unipc"

    @staticmethod
    def _schedule(num_steps, shift):
        return _wan_schedule(shift_sigmas(np.linspace(WAN_SIGMA_MAX, 0.0, num_steps + 1)[:-1], shift))

    def _reset_history(self):
        self._x0s: list[Tensor] = []  # x0 predictions of the last (at most) two steps, newest last
        self._last_sample = None  # the sample the previous predictor started from (corrected)
        self._last_order = 0  # the previous predictor's order, which the corrector reuses

    def _order(self, i: int) -> int:
        # solver_order 2, warm-up from order 1, lower_order_final: min(2, N - i, i + 1)
        return min(2, self.num_steps - i, i + 1)

    def _step(self, i, model_output, sample, lincomb):
        x0 = self._x0(i, model_output, sample, lincomb)  # from the uncorrected sample, as official
        if self.sigmas[i + 1] == 0.0:
            # Final step: the order-1 predictor gives 0 * corrected + 1 * x0, so skip the corrector.
            return x0
        if i > 0:
            sample = self._correct(i, x0, lincomb)
        order = self._order(i)
        out = self._predict(i, order, sample, x0, self._x0s[-1] if order == 2 else None, lincomb)
        self._x0s = [*self._x0s[-1:], x0]
        self._last_sample = sample
        self._last_order = order
        return out

    def _bh2_terms(self, s1: int, s0: int, t: int):
        """alpha_t, h, h_phi_1 = expm1(-h), B_h (= h_phi_1 for bh2) and rk for the step s0 -> t."""
        lambda_s0 = _log_snr(self.sigmas[s0])
        h = _log_snr(self.sigmas[t]) - lambda_s0
        h_phi_1 = math.expm1(-h)
        rk = (_log_snr(self.sigmas[s1]) - lambda_s0) / h if s1 >= 0 else None
        return 1.0 - self.sigmas[t], h, h_phi_1, h_phi_1, rk

    def _predict(self, i: int, order: int, sample: Tensor, m0: Tensor, m1: Tensor | None,
                 lincomb: Lincomb) -> Tensor:
        """UniP-bh2 from sigmas[i] to sigmas[i + 1] with x0s m0 (step i) and m1 (step i - 1).

        Order 2 uses rhos_p = 0.5, the official shortcut.
        """
        alpha_t, _, h_phi_1, b_h, rk = self._bh2_terms(i - 1, i, i + 1)
        sample_weight = self.sigmas[i + 1] / self.sigmas[i]
        if order == 1:
            return lincomb(((sample_weight, sample), (-alpha_t * h_phi_1, m0)))
        # x_t = (sigma_t / sigma_s0) x - alpha_t h_phi_1 m0 - alpha_t B_h 0.5 (m1 - m0) / rk
        m1_weight = -alpha_t * b_h * 0.5 / rk
        return lincomb(((sample_weight, sample), (-alpha_t * h_phi_1 - m1_weight, m0), (m1_weight, m1)))

    def _correct(self, i: int, x0: Tensor, lincomb: Lincomb) -> Tensor:
        """UniC-bh2 of the sample at sigmas[i], from the previous (corrected) sample, the x0s of the
        previous steps and the new x0 (model_t), at the order of the previous predictor."""
        order = self._last_order
        alpha_t, h, h_phi_1, b_h, rk = self._bh2_terms(i - 2, i - 1, i)
        m0 = self._x0s[-1]
        sample_weight = self.sigmas[i] / self.sigmas[i - 1]
        if order == 1:
            rho_m1, rho_t = 0.0, 0.5  # the official order-1 shortcut rhos_c = [0.5]
        else:
            # rhos_c = solve([[1, 1], [rk, 1]], [b1, b2]) with b_k = k! h_phi_k(hh) / B_h, hh = -h
            hh = -h
            h_phi_k1 = h_phi_1 / hh - 1.0
            h_phi_k2 = h_phi_k1 / hh - 0.5
            b1, b2 = h_phi_k1 / b_h, 2.0 * h_phi_k2 / b_h
            rho_m1 = (b1 - b2) / (1.0 - rk)
            rho_t = b1 - rho_m1
        # x_c = (sigma_t / sigma_s0) x - alpha_t h_phi_1 m0
        #       - alpha_t B_h (rho_m1 (m1 - m0) / rk + rho_t (model_t - m0))
        scale = alpha_t * b_h
        t_weight = -scale * rho_t
        terms = [(sample_weight, self._last_sample), (-alpha_t * h_phi_1 - t_weight, m0), (t_weight, x0)]
        if order == 2:
            m1_weight = -scale * rho_m1 / rk
            terms[1] = (terms[1][0] - m1_weight, m0)
            terms.append((m1_weight, self._x0s[-2]))
        return lincomb(tuple(terms))


_SOLVER_CLASSES: dict[str, type[Scheduler]] = {
    cls.solver: cls for cls in (FlowEuler, FlowUniPC, FlowDPMSolver)}


def make_scheduler(solver: str, num_steps: int, shift: float) -> Scheduler:
    """The scheduler for `solver` (one of SOLVERS) with its schedule set for num_steps and shift."""
    if solver not in _SOLVER_CLASSES:
        raise SchedulerError(f"solver must be one of {', '.join(map(repr, SOLVERS))}, got {solver!r}")
    return _SOLVER_CLASSES[solver](num_steps, shift)
