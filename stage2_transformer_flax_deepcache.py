#!/usr/bin/env python
"""Stage 2 (the denoising loop) of a video DiT with feature caching, on JAX through torchax.

Argument parsing and wiring only. The gate is configured here today; the model programs, the
sampling loop and the stage files arrive with the stage-2 issue, so for now the command prints
the configuration it resolved (and the step plan, for schedule-only configurations).
"""

from __future__ import annotations

import argparse
import json
import sys

from cache import CacheManager, ConfigError
from cache.flags import add_cache_arguments, config_from_args

DEFAULT_STEPS = 50  # HunyuanVideo-1.5 and Wan2.2 both sample 50 steps by default


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_inference_steps", type=int, default=DEFAULT_STEPS,
                        help=f"denoising steps (default {DEFAULT_STEPS})")
    parser.add_argument("--ulysses_size", "--sp_size", dest="sp_size", type=int, default=1,
                        help="sequence-parallel group size (default 1)")
    add_cache_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        gate = CacheManager(config)
        gate.attach(args.num_inference_steps, args.sp_size)
    except ConfigError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    report = {
        "cache_enabled": config.enabled,
        "modes": list(config.modes),
        "signals_per_call": list(config.needs_signals),
        "probe_blocks": config.probe_blocks,
        "tail_blocks": config.tail_blocks,
        "config": config.to_dict(),
    }
    plan = gate.plan()
    if plan is not None:
        report["computed_steps"] = [step for step, computes in enumerate(plan) if computes]
        report["computed_fraction"] = sum(plan) / len(plan)
    print(json.dumps(report, indent=2, default=str))
    print("stage 2 sampling is not wired yet (stage-2 issue); configuration only.", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
