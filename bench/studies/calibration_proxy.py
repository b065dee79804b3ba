"""A calibration a real model can pay for (issue 60): how far an open-loop replay of one uncached
run predicts what each static schedule of budgeted mode errs, checked against the full
calibration of a committed trained page.

    python -m bench.studies.calibration_proxy [--checkpoint DIR --profile FILE] [--draws 1,2,3]

Budgeted mode's calibration runs every one of about 245 static schedules closed-loop on each
calibration draw: about 88 uncached runs' worth per draw at 50 steps
(bench/results/calibration_cost.md). The replay runs the uncached trajectory once per draw and
keeps, for every model call, what the block stack added to its input (the residual). A static
schedule is then replayed without any block: on a computed step the stack's output is the
input plus the uncached run's residual of that call (so the embedding, the head, the scheduler,
CFG and the gate's linear forecast of the reused residual all run on the schedule's own
trajectory), on a reused step the gate forecasts as it does in a real run. What it leaves out:
how the blocks would answer the schedule's drifted input on its computed steps (a real run's
feedback), which is what makes a fragile draw flip.

The page lists, per draw, the rank agreement of the replayed and the closed-loop errors over
the static schedules, their ratio, and, per target of the trained page, what each rule would
choose from the replayed errors against what the full calibration chose. Cost: one uncached
run per draw (the record), and per schedule its embedding and head calls only (no block).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.page import machine, write_page  # noqa: E402
from bench.pareto.workload import build_workload, trained_families  # noqa: E402
from cache import CMConfig  # noqa: E402
from cache.flags import config_from_fields  # noqa: E402
from sampling import (
    budget,  # noqa: E402
    budget_space,
)
from sampling.fidelity import fidelity  # noqa: E402
from sampling.run import make_sample, sample_once  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402
from torch_backend.backend import TorchBackend  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILE = os.path.join(ROOT, "bench", "results", "pareto", "trained", "budget_profile_wan.json")


class ReplayBackend(TorchBackend):
    """The torch backend whose block stack (`middle`) is recorded from one run and replayed in
    later ones: call k of a replay adds the record's residual of call k to its own input."""

    def __init__(self, models, plan, record: list | None):
        super().__init__(models, plan)
        self.record = record  # None: record; a list: replay it
        self.taken: list = []
        self.calls = 0

    def probe(self, expert, x, t, conds, reference, previous=None):
        self.calls += 1
        return super().probe(expert, x, t, conds, reference, previous)

    def middle(self, expert, hidden, ctx):
        if self.record is None:
            after = super().middle(expert, hidden, ctx)
            self.taken.append((self.calls, self.ops.sub(after, hidden)))  # tuples too (HunyuanVideo)
            return after
        return self.ops.add(hidden, self.record[self.calls])


def run(wl, config: CMConfig, record=None):
    """(final latents, the record of every call's residual, block evaluations per call)."""
    plan = SignalPlan.from_config(config)
    # a TorchBackend subclass (the middle replayed), which make_backend cannot build: left as it is
    backend = ReplayBackend({None: wl.model}, plan, record)
    sample = make_sample(backend, wl.pipe, wl.tensors, wl.shape, image=False, seed=wl.seed)
    traj = sample_once(backend, config, sample, solver=wl.pipe.solver, steps=wl.steps,
                       shift=wl.pipe.shift, warmup_rounds=0, step_sync=False)
    return backend.get(traj.latents), dict(backend.taken), len(backend.taken) / backend.calls


def spearman(a, b) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="a trained tiny model (default: the "
                    "built-in trained Wan)")
    ap.add_argument("--profile", default=PROFILE, help="the committed budget profile of the "
                    "same model: its closed-loop errors on the same draws")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "calibration_proxy.md"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    began = time.perf_counter()
    with open(args.profile) as f:
        block = json.load(f)["budget"]
    family = next(iter(trained_families(args.checkpoint).values()))
    wl = build_workload(family, block["steps"])
    static = dict(budget_space.run_static_schedules(wl.pipe.solver, wl.steps, wl.pipe.shift))
    closed = {c["label"]: c for c in block["candidates"] if c["label"] in static}
    labels = sorted(closed)
    replayed: dict[str, list[float]] = {label: [] for label in labels}
    rows, rhos, medians, highs = [], [], [], []
    for k, seed in enumerate(block["seeds"]):
        draw = wl.reseeded(seed)
        t0 = time.process_time()
        base, record, _ = run(draw, CMConfig())
        t_record = time.process_time() - t0
        t0 = time.process_time()
        for label in labels:
            latents, _, _ = run(draw, config_from_fields(static[label]), record)
            replayed[label].append(fidelity(latents, base)["rel_l2"])
        t_replay = (time.process_time() - t0) / len(labels)
        proxy = [replayed[label][k] for label in labels]
        truth = [closed[label]["rel_l2"][k] for label in labels]
        ratio = sorted(t / p for t, p in zip(truth, proxy, strict=True) if p > 0)
        rhos.append(spearman(proxy, truth))
        medians.append(statistics.median(ratio))
        highs.append(ratio[-1 - len(ratio) // 10])
        rows.append(f"| {seed} | {len(labels)} | {spearman(proxy, truth):.3f} | "
                    f"{ratio[len(ratio) // 10]:.2f} / {statistics.median(ratio):.2f} / "
                    f"{ratio[-1 - len(ratio) // 10]:.2f} | {t_record:.2f} s | {t_replay:.2f} s |")
        print(rows[-1], flush=True)
    lines = ["# Calibrating static schedules from one uncached run per draw (open-loop replay)",
             "", "Reproduce: `python -m bench.studies.calibration_proxy"
             + (f" --checkpoint {args.checkpoint}" if args.checkpoint else "")
             + (f" --profile {os.path.relpath(args.profile, ROOT)}" if args.profile != PROFILE
                else "") + f"` ({(time.perf_counter() - began) / 60:.1f} min; {machine()}). "
             f"TRAINED weights ({family.title}); closed-loop errors from "
             f"`{os.path.relpath(args.profile, ROOT)}`, the same draws.", "",
             __doc__.split("\n\n")[2].replace("\n", " "), "",
             "| draw | static schedules | Spearman rank correlation, replayed vs closed-loop "
             "rel L2 | closed / replayed rel L2 (10th percentile / median / 90th) | record "
             "(uncached) CPU | one replay CPU (no block) |", "|---|---|---|---|---|---|"] + rows
    lines += ["", "What each target would choose (the static schedules only, calibration draws "
              "only: no screening) from the closed-loop errors and from the replayed ones:", "",
              "| target | closed-loop choice (computed, bound) | replayed choice (computed, "
              "bound by the replay) | its closed-loop bound |", "|---|---|---|---|"]
    same = broken = 0
    targets = [("rel_err", e) for e in (0.01, 0.03, 0.1)] + \
              [("speedup", s) for s in (1.25, 1.6, 2.0, 2.5, 2.8, 3.3, 4.2)]
    closed_block = {**block, "candidates": [
        {k: closed[x][k] for k in ("label", "config", "rel_l2", "computed")} for x in labels]}
    replay_block = {**block, "candidates": [
        {"label": x, "config": closed[x]["config"], "rel_l2": replayed[x],
         "computed": closed[x]["computed"]} for x in labels]}
    for b in (closed_block, replay_block):
        for key in ("screen_seeds", "confirm_seeds", "chaotic"):
            b.pop(key, None)
    bound_of = dict(zip(labels, budget.bounds(closed_block["candidates"]), strict=True))
    for kind, value in targets:
        a = budget.choose(closed_block, **{kind: value})
        b = budget.choose(replay_block, **{kind: value})
        same += (a and a.label) == (b and b.label)
        broken += kind == "rel_err" and b is not None and bound_of[b.label] > value

        def show(c, bound):
            return "uncached" if c is None else f"{c.label} ({c.computed:.2f}, {bound:.1e})"
        lines.append(f"| {kind} {value:g} | {show(a, a.bound if a else 0)} | "
                     f"{show(b, b.bound if b else 0)} | "
                     f"{'-' if b is None else format(bound_of[b.label], '.1e')} |")
    lines += ["", f"The same choice at {same} of {len(targets)} targets. The replay ranks the "
              f"schedules much as the closed-loop runs do (rank correlation {min(rhos):.2f} to "
              f"{max(rhos):.2f} over the draws) but errs low by a factor that depends on the draw "
              f"and the schedule (median {min(medians):.1f} to {max(medians):.1f}, the 90th "
              f"percentile up to {max(highs):.0f}): the blocks' answer to a schedule's drifted "
              "input is where a draw flips, and the replay leaves it out. An error budget chosen "
              f"from replayed errors would break its budget in closed loop at {broken} of 3 "
              "targets, so the replay can shortlist schedules but cannot replace their "
              "closed-loop runs (bench/results/calibration_cost.md says what those cost)."]
    write_page(args.out, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
