"""Flow-matching schedulers against diffusers as the numerical oracle (model_spec 4.3), on a toy ODE.

Trajectories run in float64 through a smooth velocity field, so any wrong coefficient or history
slot shows far above rounding. diffusers' schedulers hold sigmas in float32 and its DPM-Solver and
Euler steps compute in float32, which sets the tolerances.
"""

import warnings

import numpy as np
import pytest
import torch

from sampling.schedulers import (
    SOLVERS,
    WAN_SIGMA_MAX,
    FlowDPMSolver,
    FlowEuler,
    FlowUniPC,
    SchedulerError,
    make_scheduler,
    shift_sigmas,
)

diffusers = pytest.importorskip("diffusers")

SHAPE = (1, 4, 3, 4, 4)
CASES = [(8, 1.0), (8, 7.0), (40, 5.0), (50, 1.0), (50, 7.0)]


def lincomb(terms):
    return sum(w * t for w, t in terms)


def _tensors():
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    start = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    return noise, start


NOISE, START = _tensors()


def velocity(x, t):
    """A smooth toy flow field v(x, t): linear in x, with a t-dependent pull towards fixed noise."""
    s = float(t) / 1000.0
    return x * (0.3 + 0.5 * s) + (1.0 - 2.0 * s + 0.7 * s * s) * NOISE


def run_ours(sched):
    x = START.clone()
    for i, t in enumerate(sched.timesteps):
        x = sched.step(i, velocity(x, t), x, lincomb)
    return x


def run_diffusers(sched):
    x = START.clone()
    for t in sched.timesteps:
        x = sched.step(velocity(x, t), t, x, return_dict=False)[0]
    return x


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def wan_sigmas(start, num_steps, shift):
    """Wan's grid written out from the spec: shift(linspace(start, 0, N + 1)[:N])."""
    sig = np.linspace(start, 0.0, num_steps + 1)[:num_steps]
    return shift * sig / (1 + (shift - 1) * sig)


@pytest.mark.parametrize("num_steps, shift", CASES)
def test_unipc_matches_diffusers(num_steps, shift):
    ours = make_scheduler("unipc", num_steps, shift)
    ref = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                            num_train_timesteps=1000, flow_shift=shift)
    # diffusers applies flow_shift once to the sigmas passed in, which gives Wan's grid. Wan starts at
    # float32(0.999) read back as a float: a literal 0.999 truncates e.g. N=3, shift 1 to 665, not 666.
    ref.set_timesteps(sigmas=np.linspace(WAN_SIGMA_MAX, 0, num_steps + 1)[:-1])
    assert ours.timesteps == tuple(float(t) for t in ref.timesteps.tolist())
    assert ours.sigmas == tuple(ref.sigmas.tolist())
    assert rel_err(run_ours(ours), run_diffusers(ref)) < 5e-7  # measured 9.7e-8


# diffusers 0.42.1 calls np.array() on a torch tensor in DPMSolverMultistepScheduler.set_timesteps.
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy:DeprecationWarning")
@pytest.mark.parametrize("num_steps, shift", CASES)
def test_dpm_matches_diffusers_on_wan_grid(num_steps, shift):
    ours = make_scheduler("dpm++", num_steps, shift)
    ref = diffusers.DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                flow_shift=shift, algorithm_type="dpmsolver++",
                                                solver_order=2)
    ref.set_timesteps(num_steps)
    # diffusers' own flow grid is Wan's unipc grid (first t 999); Wan dpm++ starts at sigma 1 (t 1000).
    sig = wan_sigmas(1.0, num_steps, shift)
    ref.sigmas = torch.from_numpy(np.append(sig, 0.0).astype(np.float32))
    ref.timesteps = torch.from_numpy((sig * 1000).astype(np.int64))
    assert ours.timesteps == tuple(float(t) for t in ref.timesteps.tolist())
    assert ours.sigmas == tuple(ref.sigmas.tolist())
    assert rel_err(run_ours(ours), run_diffusers(ref)) < 1e-6  # measured 3.6e-7 (diffusers steps in float32)


@pytest.mark.parametrize("num_steps, shift", CASES)
def test_euler_matches_diffusers(num_steps, shift):
    ours = make_scheduler("euler", num_steps, shift)
    ref = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
    ref.set_timesteps(sigmas=np.linspace(1, 0, num_steps + 1)[:-1])
    # Both do the shift and t = sigma * 1000 in float32 from the float64 linspace: identical values
    # (the official torch float32 linspace differs from both by up to 3 ulps, 1.9e-4 in t).
    assert ours.timesteps == tuple(ref.timesteps.tolist())
    assert ours.sigmas == tuple(ref.sigmas.tolist())
    assert ours.timesteps[0] == 1000.0 and ours.sigmas[-1] == 0.0
    assert rel_err(run_ours(ours), run_diffusers(ref)) < 1e-6  # measured 2.3e-7 (diffusers steps in float32)


def test_schedule_facts():
    assert make_scheduler("unipc", 50, 5.0).timesteps[0] == 999
    assert make_scheduler("dpm++", 50, 5.0).timesteps[0] == 1000
    assert make_scheduler("euler", 50, 5.0).timesteps[0] == 1000.0
    for solver in SOLVERS:
        sched = make_scheduler(solver, 8, 3.0)
        assert len(sched.sigmas) == 9 and len(sched.timesteps) == 8 and sched.sigmas[-1] == 0.0
        assert all(a > b for a, b in zip(sched.sigmas[:-1], sched.sigmas[1:], strict=True))
    # Wan2.2 I2V-A14B: 40 unipc steps at shift 5 put 15 steps on the high-noise expert (t >= 900).
    assert sum(t >= 900 for t in make_scheduler("unipc", 40, 5.0).timesteps) == 15
    # Wan truncates from its float32 sigma_max, so 999 * 2/3 lands on 666 (official code, checked).
    assert make_scheduler("unipc", 3, 1.0).timesteps == (999.0, 666.0, 333.0)
    assert make_scheduler("unipc", 40, 5.0).timesteps[:4] == (999.0, 994.0, 989.0, 983.0)
    assert all(float(t).is_integer() for t in make_scheduler("dpm++", 40, 5.0).timesteps)
    assert shift_sigmas([1.0, 0.5, 0.0], 3.0) == [1.0, 0.75, 0.0]
    assert shift_sigmas([0.25], 1.0) == [0.25]


def test_make_scheduler_classes():
    assert type(make_scheduler("euler", 4, 1.0)) is FlowEuler
    assert type(make_scheduler("unipc", 4, 1.0)) is FlowUniPC
    assert type(make_scheduler("dpm++", 4, 1.0)) is FlowDPMSolver
    sched = make_scheduler("unipc", 4, 5)
    assert (sched.solver, sched.num_steps, sched.shift) == ("unipc", 4, 5.0)


@pytest.mark.parametrize("build, words", [
    (lambda: make_scheduler("ddim", 10, 5.0), ["'ddim'", "'euler'", "'unipc'", "'dpm++'"]),
    (lambda: make_scheduler("unipc", 0, 5.0), ["num_steps", ">= 1", "0"]),
    (lambda: make_scheduler("unipc", 2.5, 5.0), ["num_steps", "integer", "2.5"]),
    (lambda: make_scheduler("euler", 10, 0.0), ["shift", "> 0", "0.0"]),
    (lambda: make_scheduler("dpm++", 10, -1.0), ["shift", "> 0", "-1.0"]),
    (lambda: make_scheduler("dpm++", 10, float("nan")), ["shift", "finite", "nan"]),
    (lambda: shift_sigmas([0.5], 0), ["shift", "> 0"]),
])
def test_invalid_arguments_name_the_value(build, words):
    with pytest.raises(SchedulerError) as err:
        build()
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("solver", SOLVERS)
def test_steps_out_of_order(solver):
    sched = make_scheduler(solver, 3, 5.0)
    x = START.clone()
    with pytest.raises(SchedulerError, match="index 1 is out of order: expected step 0"):
        sched.step(1, velocity(x, 1000), x, lincomb)
    x = sched.step(0, velocity(x, 1000), x, lincomb)
    with pytest.raises(SchedulerError, match="index 0 is out of order: expected step 1"):
        sched.step(0, velocity(x, 1000), x, lincomb)
    x = sched.step(1, velocity(x, 500), x, lincomb)
    x = sched.step(2, velocity(x, 100), x, lincomb)
    with pytest.raises(SchedulerError, match="index 3 is out of order: .*all 3 steps are done"):
        sched.step(3, velocity(x, 100), x, lincomb)


@pytest.mark.parametrize("solver", SOLVERS)
def test_fresh_repeats_the_trajectory(solver):
    sched = make_scheduler(solver, 8, 5.0)
    first = run_ours(sched)
    again = sched.fresh()
    assert again is not sched and again.timesteps == sched.timesteps and again.sigmas == sched.sigmas
    assert torch.equal(run_ours(again), first)


class Opaque:
    """A tensor the scheduler may hold and hand back but never compute with (no arithmetic)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


@pytest.mark.parametrize("solver, arities", [
    ("euler", {2}), ("dpm++", {2, 3}), ("unipc", {2, 3, 4}),
])
@pytest.mark.parametrize("num_steps", [1, 2, 3, 8])
def test_only_lincomb_touches_tensors_with_documented_arities(solver, arities, num_steps):
    seen = set()

    def opaque_lincomb(terms):
        seen.add(len(terms))
        assert all(type(w) is float for w, _ in terms)  # host floats, never numpy or tensor scalars
        return Opaque(sum(w * t.value for w, t in terms))

    sched = make_scheduler(solver, num_steps, 5.0)
    x = Opaque(START.clone())
    for i, t in enumerate(sched.timesteps):
        x = sched.step(i, Opaque(velocity(x.value, t)), x, opaque_lincomb)
    assert torch.equal(x.value, run_ours(sched.fresh()))
    assert seen <= arities and (num_steps < 8 or seen == arities)


@pytest.mark.parametrize("solver", SOLVERS)
def test_single_step_lands_on_x0(solver):
    # One step from the first sigma to 0 is exactly x0 = x - sigma * v for every solver.
    sched = make_scheduler(solver, 1, 5.0)
    v = velocity(START, sched.timesteps[0])
    out = sched.step(0, v, START, lincomb)
    assert torch.allclose(out, START - sched.sigmas[0] * v, rtol=0, atol=1e-12)


@pytest.mark.parametrize("solver", SOLVERS)
def test_no_warnings_from_schedule_maths(solver):
    """The schedule ends at sigma 0 (log-SNR +inf) and dpm++'s starts at sigma 1 (-inf), where a
    float log, division or numpy op would warn or give a nan/inf weight: short schedules step
    through both ends without one warning, every lincomb weight a finite Python float."""
    weights = []

    def finite_lincomb(terms):
        weights.extend(w for w, _ in terms)
        return lincomb(terms)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for steps, shift in [(1, 1.0), (2, 5.0), (3, 1.0), (3, 12.0)]:
            sched = make_scheduler(solver, steps, shift)
            x = START.clone()
            for i, t in enumerate(sched.timesteps):
                x = sched.step(i, velocity(x, t), x, finite_lincomb)
            assert torch.isfinite(x).all(), (solver, steps, shift)
            assert all(np.isfinite(v) for v in (*sched.sigmas, *sched.timesteps)), (solver, steps)
    assert [str(w.message) for w in caught] == []
    assert weights and all(type(w) is float and np.isfinite(w) for w in weights), weights
