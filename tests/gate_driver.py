"""Plays the backend's part around the gate in tests: numpy 'hidden states', one residual per call.

The 'middle blocks' add a step-dependent offset, so a reused residual is observable in the output.
"""

from __future__ import annotations

import numpy as np

from cache import CacheManager, Signals


def middle_blocks(h, step):
    return h + (step + 1.0)


def call(gate: CacheManager, branch: str, signals=None, *, expert=None, h=None, step=0):
    """One model call through the gate; returns (decision, output)."""
    gate.begin_step(branch, expert=expert)
    decision = gate.decide(signals)
    h = np.zeros(4, np.float32) if h is None else h
    out, _, decision, _ = gate.apply(decision, h)
    if not decision.skip:
        out = middle_blocks(h, step)
        gate.update(decision, h, out)
    return decision, out


def run(gate: CacheManager, cond, uncond=None, *, experts=None):
    """Drive num_steps steps. cond/uncond: per-step teacache signatures (float) or Signals.
    uncond=None runs without CFG. Returns the per-step actions ('C'/'S') per branch."""
    def as_signals(value):
        if isinstance(value, Signals) or value is None:
            return value
        return Signals(teacache=value, fbcache=value)

    trace = {"cond": [], "uncond": []}
    for step in range(gate.num_steps):
        expert = experts[step] if experts else None
        d, _ = call(gate, "cond", as_signals(cond[step]), expert=expert, step=step)
        trace["cond"].append("S" if d.skip else "C")
        if uncond is not None:
            d, _ = call(gate, "uncond", as_signals(uncond[step]), expert=expert, step=step)
            trace["uncond"].append("S" if d.skip else "C")
    return {k: "".join(v) for k, v in trace.items() if v}
