"""What block 0's residual tells about the reused (middle) residual: the evidence for issue 17's
forecast-aware reuse, and against extrapolating the first reuse run from the probe.

    python -m bench.studies.forecast_signals [--families wan,hunyuan]
        [--out bench/results/forecast_signals.md]

On bench.pareto's workload (the same tiny-deep, smooth-in-t models, seed 0, 50 steps), one
uncached run keeps, per cond call, block 0's residual r1(s) and the middle's residual R(s) (image
stream on HunyuanVideo-1.5). It prints:

  forecast errors   for Lagrange forecasts of order 1 and 2 from computed steps `spacing` apart,
                    at gaps 1 to 6: the correlation (over all start steps and gaps, of the logs)
                    of r1's forecast error with R's, both relative L1 as the FBCache tensor
                    metric measures. A correlation near 1 means the probe measuring r1 against
                    its own forecast (--forecast_gate) measures how wrong the reused forecast is.
  probe direction   with one stored residual, the cosine between R(s) - R(s0) and
                    r1(s) - r1(s0): the best extrapolation R(s0) + k (r1(s) - r1(s0)) removes
                    at most cos^2 of plain reuse's squared error.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.page import machine, write_page  # noqa: E402
from bench.pareto import workload as pw
from cache import CMConfig, FBCacheConfig  # noqa: E402
from cache.manager import CacheManager  # noqa: E402
from cache.residuals import extrapolation_weights  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                   "forecast_signals.md")


def write_report(path: str, lines: list[str]) -> int:
    """Write a report's lines to `path` and say where; main's exit status."""
    write_page(path, lines)
    return 0


def image_stream(x) -> torch.Tensor:
    """HunyuanVideo-1.5 carries (image, text) streams; block 0's residual and the middle's are
    compared on the image tokens, which the two share."""
    return (x[0] if isinstance(x, (tuple, list)) else x).double().flatten()


def residuals(family) -> tuple[dict, dict]:
    """Per step of one uncached run (cond branch): R(s) and r1(s). An FBCache gate with
    threshold 0 never reuses but makes the loop hand both to gate.update, where they are kept."""
    kept = {}
    update = CacheManager.update

    def keep(self, decision, before, after, probe=None, tail=()):
        if decision.branch == "cond":
            kept[decision.step] = (image_stream(after) - image_stream(before), image_stream(probe))
        return update(self, decision, before, after, probe, tail)

    wl = pw.build_workload(family)
    CacheManager.update = keep
    try:
        pw.run_ours(wl, CMConfig(fbcache=FBCacheConfig(
            threshold=0.0, metric="residual_tensor_rel_l1")), pw.our_counter(wl))
    finally:
        CacheManager.update = update
    return {s: r for s, (r, _) in kept.items()}, {s: p for s, (_, p) in kept.items()}


def rel_l1(x, ref) -> float:
    return ((x - ref).abs().mean() / ref.abs().mean()).item()


def forecast_error(residuals, nodes: list[int], at: int) -> float:
    """rel L1 error of the Lagrange forecast at step `at` from the residuals kept at `nodes`."""
    w = extrapolation_weights(nodes, at)
    return rel_l1(sum(wi * residuals[n] for wi, n in zip(w, nodes, strict=True)), residuals[at])


def forecast_rows(big, small, steps) -> list[str]:
    rows = []
    for order in (1, 2):
        for spacing in (2, 4, 8):
            pairs = []
            for last in range(order * spacing, steps - 1):
                nodes = [last - spacing * i for i in range(order, -1, -1)]
                for gap in range(1, 7):
                    at = last + gap
                    if at >= steps:
                        break
                    pairs.append((forecast_error(small, nodes, at), forecast_error(big, nodes, at)))
            logs = torch.tensor(pairs).log()
            corr = torch.corrcoef(logs.T)[0, 1].item()
            ratio = (logs[:, 1] - logs[:, 0]).exp()
            rows.append(f"| {order} | {spacing} | {len(pairs)} | {corr:.3f} | "
                        f"{ratio.median().item():.2f} |")
    return rows


def direction_rows(big, small) -> list[str]:
    rows = []
    for start in (0, 5, 15, 30):
        for gap in (1, 3, 6, 12):
            d_big, d_small = big[start + gap] - big[start], small[start + gap] - small[start]
            cos = (d_big @ d_small / (d_big.norm() * d_small.norm())).item()
            rows.append(f"| {start} | {gap} | {cos:+.2f} | {cos * cos:.3f} | "
                        f"{rel_l1(big[start + gap], big[start]):.3f} | "
                        f"{rel_l1(small[start + gap], small[start]):.3f} |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="wan,hunyuan")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    fams = pw.families(30, 30)
    lines = ["# Block 0's residual as a stand-in for the reused residual (issue 17)", "",
             f"Reproduce: `python -m bench.studies.forecast_signals"
             f"{'' if args.families == 'wan,hunyuan' else ' --families ' + args.families}` "
             f"(bench.pareto's workload, one uncached run per family, cond branch; "
             f"{machine()}).", ""]
    for key in args.families.split(","):
        family = fams[key]
        big, small = residuals(family)
        steps = len(big)
        lines += [f"## {family.title}", "",
                  "Forecast error of block 0's residual against that of the middle's, same "
                  "forecast (relative L1, gaps 1 to 6 after the last node):", "",
                  "| order | spacing | forecasts | corr(log r1 error, log R error) | median R error "
                  "/ r1 error |", "|---|---|---|---|---|", *forecast_rows(big, small, steps), "",
                  "With one stored residual: the change of the middle's residual against the "
                  "change of block 0's since step s0 (cos^2 = the most of plain reuse's squared "
                  "error an extrapolation along block 0's change could remove):", "",
                  "| s0 | gap | cos | cos^2 | rel L1 change of R | rel L1 change of r1 |",
                  "|---|---|---|---|---|---|", *direction_rows(big, small), ""]
        print("\n".join(lines[-30:]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    return write_report(args.out, lines)


if __name__ == "__main__":
    sys.exit(main())
