#!/usr/bin/env python
"""Host time the gate adds per model call (begin_step + decide + apply + update), in microseconds.

The gate runs in Python between jitted programs, so this is pure latency added to every call.
Tensors are tiny numpy arrays: the figure is the gate's bookkeeping, not tensor arithmetic.
Usage: python -m bench.studies.gate_overhead [--steps 50] [--repeats 20]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cache import (  # noqa: E402
    PAIR,
    CacheManager,
    CMConfig,
    DeepCacheConfig,
    FBCacheConfig,
    LimitsConfig,
    Signals,
    TeaCacheConfig,
)

CONFIGS = {
    "off": CMConfig(),
    "deepcache 11/45/4": CMConfig(deepcache=DeepCacheConfig()),
    "teacache linear": CMConfig(teacache=TeaCacheConfig()),
    "teacache poly": CMConfig(teacache=TeaCacheConfig(policy="poly:hunyuanvideo1.5-720p-t2v")),
    "fb + tc, limits": CMConfig(fbcache=FBCacheConfig(metric="residual_tensor_rel_l1"),
                                teacache=TeaCacheConfig(),
                                limits=LimitsConfig(max_continuous=3, max_cached=20)),
    "teacache separate": CMConfig(teacache=TeaCacheConfig(), cfg_mode="separate"),
    "teacache fused": CMConfig(teacache=TeaCacheConfig(), cfg_mode="fused"),
}


def one_run(config: CMConfig, steps: int) -> tuple[float, int, int]:
    gate = CacheManager(config)
    gate.attach(steps)
    h = np.zeros(8, np.float32)
    branches = (PAIR,) if config.cfg_mode == "fused" else ("cond", "uncond")
    calls = skipped = 0
    start = time.perf_counter()
    for step in range(steps):
        sig = Signals(teacache=1.0 + 0.01 * step, fbcache=0.01)
        for branch in branches:
            gate.begin_step(branch)
            decision = gate.decide({"cond": sig, "uncond": sig} if branch == PAIR else sig)
            out, _, decision, _ = gate.apply(decision, h)
            if not decision.skip:
                gate.update(decision, h, h)
            calls += 1
            skipped += decision.skip
    return time.perf_counter() - start, calls, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(f"{'config':<22}{'calls':>7}{'skipped':>9}{'median us/call':>16}{'min us/call':>13}")
    for name, config in CONFIGS.items():
        times = []
        for _ in range(args.repeats):
            seconds, calls, skipped = one_run(config, args.steps)
            times.append(seconds / calls * 1e6)
        print(f"{name:<22}{calls:>7}{skipped:>9}{statistics.median(times):>16.1f}{min(times):>13.1f}")


if __name__ == "__main__":
    main()
