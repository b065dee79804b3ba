"""Every fail-safe: inject the fault, show the run goes on (compute) and its counter moves."""

import math

import numpy as np
import pytest

from cache import CacheManager, CMConfig, NumpyOps, Signals, TeaCacheConfig
from tests.gate_driver import call, middle_blocks


class Tensor:
    """An array with a device label, for a backend double with two devices."""

    def __init__(self, array, device="dev"):
        self.array, self.device = np.asarray(array), device


class TwoDeviceOps(NumpyOps):
    """TensorOps with a compute device 'dev' and a host 'cpu'; faults can be switched on."""

    host = "cpu"

    def __init__(self):
        self.oom_on = set()  # devices whose moves run out of memory
        self.fail_add = False
        self.used = 0.0

    def add(self, a, b):
        if self.fail_add:
            raise ValueError("injected backend failure")
        assert a.device == b.device, "the gate must move residuals before adding"
        return Tensor(a.array + b.array, a.device)

    def sub(self, a, b):
        return Tensor(a.array - b.array, a.device)

    def shape(self, x):
        return x.array.shape

    def dtype(self, x):
        return x.array.dtype

    def device(self, x):
        return x.device

    def move(self, x, device):
        if device in self.oom_on:
            raise MemoryError(f"out of memory on {device}")
        return Tensor(x.array, device)

    def cast(self, x, dtype):
        return Tensor(x.array.astype(dtype), x.device)

    def memory_fraction(self):
        return self.used


def make(steps=6, ops=None, **kw):
    kw.setdefault("teacache", TeaCacheConfig(threshold=0.5))
    kw.setdefault("offload", "gpu")
    g = CacheManager(CMConfig(**kw), ops or TwoDeviceOps())
    g.attach(steps)
    return g


def step(g, branch="cond", sig=1.0, x=None, **kw):
    """One call with device tensors; returns the final decision."""
    g.begin_step(branch)
    d = g.decide(kw.get("signals", Signals(teacache=sig)))
    x = x if x is not None else Tensor(np.zeros(3, np.float32))
    out, _, d, _ = g.apply(d, x)
    if not d.skip:
        g.update(d, x, Tensor(x.array + 1, x.device))
    return d


def counts(g):
    return g.summary()["failsafes"]


def test_invalid_metric_nan_and_inf_and_missing():
    g = make(steps=8)
    reasons = [step(g, sig=s).reason for s in (1.0, 1.0, math.nan, 1.0, 1.0, math.inf, None, 1.0)]
    assert reasons[2] == reasons[5] == reasons[6] == "invalid_metric"
    assert counts(g)["invalid_metric"] == 3
    assert reasons[4] == "below_threshold"  # the run recovered between faults


def test_invalid_metric_after_rescaling():
    # a polynomial profile overflows to inf on a huge rel
    g = make(teacache=TeaCacheConfig(threshold=0.5, policy="poly:wan2.1-t2v-14b-e"))
    step(g, sig=1.0)
    assert step(g, sig=1e300).reason == "invalid_metric"
    assert counts(g)["invalid_metric"] == 1


def test_reduce_error_and_world_size_disagreement():
    g = make()
    g.attach(6, sp_world_size=4)
    step(g)
    assert step(g, signals=Signals(teacache=1.0, reduce_error=True)).reason == "reduce_error"
    assert step(g, signals=Signals(teacache=1.0, reduced_over=2)).reason == "reduce_error"
    # the signals start afresh: nothing to compare with, then reuse again
    assert step(g, signals=Signals(teacache=1.0, reduced_over=4)).reason == "no_reference"
    assert step(g, signals=Signals(teacache=1.0, reduced_over=4)).skip
    assert counts(g)["reduce_error"] == 2


def test_a_failed_reduction_leaves_no_shard_specific_state():
    """Shards that saw different local values at a failed reduction decide alike afterwards:
    the local values are not measured (they would become each shard's reference)."""
    traces = []
    for local in (1.0, 50.0):
        g = make()
        g.attach(6, sp_world_size=2)
        actions = [step(g, signals=Signals(teacache=1.0)).action]
        actions.append(step(g, signals=Signals(teacache=local, reduce_error=True)).action)
        for value in (1.01, 1.02, 1.03, 1.04):
            actions.append(step(g, signals=Signals(teacache=value)).action)
        traces.append((actions, [r["rel"] for r in g.telemetry.trace]))
    assert traces[0] == traces[1]


def test_shape_mismatch():
    g = make()
    step(g)
    d = step(g, x=Tensor(np.zeros(5, np.float32)))
    assert not d.skip and d.failsafe == "shape_mismatch"
    assert counts(g)["shape_mismatch"] == 1
    assert step(g, x=Tensor(np.zeros(5, np.float32))).skip  # the fresh residual is used again


def test_dtype_mismatch_casts_floats_and_refuses_ints():
    g = make()
    step(g)
    assert step(g, x=Tensor(np.zeros(3, np.float64))).skip  # float32 -> float64 cast is fine
    d = step(g, x=Tensor(np.zeros(3, np.int32)))
    assert not d.skip and d.failsafe == "dtype_mismatch"
    assert counts(g)["dtype_mismatch"] == 1


def test_missing_residual_when_the_backend_never_stored_one():
    g = make()
    g.begin_step("cond")
    g.decide(Signals(teacache=1.0))  # computes (warmup) but the backend "forgets" update()
    d = step(g)
    assert not d.skip and d.failsafe == "missing_residual"
    assert counts(g)["missing_residual"] == 1
    assert step(g).skip


def test_oom_on_move_in_apply_and_in_move_cached_residuals_to():
    ops = TwoDeviceOps()
    g = make(ops=ops, offload="cpu")  # residuals live on the host, come back on use
    step(g)
    assert g._branches["cond"].slot.residual.device == "cpu"
    assert step(g).skip  # moved back to 'dev' and added
    ops.oom_on.add("dev")
    d = step(g)
    assert not d.skip and d.failsafe == "oom_on_move"
    ops.oom_on.clear()
    step(g)  # refreshed after the fault
    ops.oom_on.add("cpu")
    g.move_cached_residuals_to("cpu")
    assert g._branches["cond"].slot.residual is None
    assert counts(g)["oom_on_move"] == 2


def test_offload_auto_moves_caches_to_host_past_the_watermark():
    ops = TwoDeviceOps()
    g = make(ops=ops, offload="auto")
    step(g)
    assert g._branches["cond"].slot.residual.device == "dev"
    ops.used = 0.95
    step(g, sig=100.0)  # computes (rel above threshold) and stores a new residual
    assert g._branches["cond"].slot.residual.device == "cpu"
    assert g.summary()["offload_switches"] == 1 and g.summary()["offload_now"] == "cpu"
    assert step(g, sig=100.0).skip


def test_lifecycle_guards():
    g = CacheManager(CMConfig(teacache=TeaCacheConfig()), TwoDeviceOps())
    g.begin_step("cond")  # before attach
    assert g.decide(Signals(teacache=1.0)).failsafe == "lifecycle_guard"
    assert counts(g)["lifecycle_guard"] == 1
    g.attach(2)  # a new run: counters start again
    assert g.decide(Signals(teacache=1.0)).failsafe == "lifecycle_guard"  # no begin_step
    g.begin_step("uncond")  # follower before any leader
    assert g.decide().failsafe == "lifecycle_guard"
    step(g), step(g)
    g.begin_step("cond")  # a third step in a 2-step run
    assert g.decide(Signals(teacache=1.0)).failsafe == "lifecycle_guard"
    assert counts(g)["lifecycle_guard"] == 3


def test_update_with_a_skip_decision_is_refused():
    g = make()
    step(g)
    g.begin_step("cond")
    d = g.decide(Signals(teacache=1.0))
    assert d.skip
    g.update(d, Tensor(np.zeros(3)), Tensor(np.ones(3)))
    assert counts(g)["lifecycle_guard"] == 1


def test_pair_divergence_when_uncond_cannot_follow_a_skip():
    g = make()
    step(g, "cond"), step(g, "uncond")
    assert step(g, "cond").skip
    d = step(g, "uncond", x=Tensor(np.zeros(7, np.float32)))  # its residual no longer fits
    assert not d.skip
    s = g.summary()
    assert s["failsafes"]["pair_divergence"] == 1 and s["failsafes"]["shape_mismatch"] == 1
    assert s["pair"]["pair_divergence_failsafes"] == 1 and s["pair"]["pair_forced_compute"] == 1


def test_internal_error_in_the_backend_ops():
    ops = TwoDeviceOps()
    g = make(ops=ops)
    step(g)
    ops.fail_add = True
    d = step(g)
    assert not d.skip and d.failsafe == "internal_error"
    ops.fail_add = False
    assert step(g).skip


def test_a_fault_never_raises_and_the_output_stays_computed():
    """End to end: outputs of a run with faults equal an uncached run at the faulted steps."""
    g = CacheManager(CMConfig(teacache=TeaCacheConfig(threshold=0.5)))
    g.attach(5)
    h = np.zeros(2, np.float32)
    outs = []
    for i, sig in enumerate([1.0, 1.0, math.nan, 1.0, 1.0]):
        d, out = call(g, "cond", Signals(teacache=sig), h=h, step=i)
        outs.append(out)
    np.testing.assert_array_equal(outs[2], middle_blocks(h, 2))  # NaN step computed
    np.testing.assert_array_equal(outs[1], middle_blocks(h, 0))  # skipped: step-0 residual


@pytest.mark.parametrize("bad", [object(), "not signals"])
def test_garbage_signals_compute(bad):
    g = make()
    g.begin_step("cond")
    assert not g.decide(bad).skip
