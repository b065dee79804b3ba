"""What budgeted mode chooses from (sampling/budget.py): SPACE, the techniques, forecast orders,
thresholds and limits we ship, and the static schedules of a run's sigmas (every n-th step, a
skipped window, paced in sigma), each a partial CMConfig with its label. `space()` is what
`python -m commands.calibrate --budget` measures for a run."""

from __future__ import annotations

import bisect


def _fb(threshold, *, forecast=0, gated=False, bn=0):
    fields = {"fbcache": {"threshold": threshold, "metric": "residual_tensor_rel_l1"},
              "forecast": forecast}
    if gated:  # reuse while block 0's summed forecast error stays under the threshold (issue 17)
        fields["fbcache"]["accumulate"] = True
        fields["forecast_gate"] = True
    if bn:
        fields["bn_blocks"] = bn
    return fields


def _tc(threshold, *, forecast=0):
    # relative thresholds: multiples of the run's own mean change, so they transfer (issue 16)
    fields = {"teacache": {"threshold": threshold, "relative": True}}
    if forecast:
        fields.update(forecast=forecast, limits={"max_continuous": 3})
    return fields


def _space():
    out = [(f"FBCache +forecast2 gated {t:g}", _fb(t, forecast=2, gated=True))
           for t in (0.005, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.3, 0.6)]
    out += [(f"FBCache +forecast1 gated {t:g}", _fb(t, forecast=1, gated=True))
            for t in (0.2, 0.4, 0.8)]
    # the cheap end (issue 17): linear forecast, forecast error weighted by the step's size, no
    # forced last compute
    out += [(f"FBCache +forecast1 gated step-weighted {t:g}",
             {**_fb(t, forecast=1, gated=True), "step_weight": 1.0, "last_steps": 0})
            for t in (0.05, 0.1, 0.3, 0.7, 1.2, 2.1)]
    out += [(f"FBCache +forecast2 {t:g}", _fb(t, forecast=2)) for t in (0.03, 0.05, 0.1, 0.2)]
    out += [(f"FBCache F1B2 +forecast1 {t:g}", _fb(t, forecast=1, bn=2)) for t in (0.1, 0.2)]
    out += [(f"FBCache {t:g}", _fb(t)) for t in (0.02, 0.05)]
    out += [(f"TeaCache relative {t:g}", _tc(t)) for t in (1.5, 3.0, 5.0)]
    out += [(f"TeaCache relative {t:g} +forecast2", _tc(t, forecast=2)) for t in (1.5, 3.0, 5.0)]
    return tuple(out)


# (label, partial CMConfig in the presets' format): what budgeted mode chooses from, besides
# the static schedules of the run's own sigma schedule (`space`)
SPACE = _space()

# Static schedules (issue 39). On trained weights a forecast holds for a step or two, and which
# steps a fixed budget computes moves the final error by several dB: on the trained tiny Wans,
# computing the last steps and spacing the others by the size of the steps in sigma kept far
# more than computing every n-th step at the same fraction, while on the trained HunyuanVideo-1.5
# twin evenly spaced steps with the last three computed did best (bench/results/
# static_schedules*.md). No one shape wins on every model, so budgeted mode measures a small
# family of both on its calibration draws and picks per model. A static schedule reads nothing
# from the device.
EVERY = (2, 3, 4, 5, 6)  # compute every n-th step...
FIRST = (1, 2, 3)  # ...after computing this many first steps...
LAST = (1, 2, 3)  # ...and this many last ones
# Which steps of the n-th the grid hits (its phase, so where its last step falls before the last
# ones) moved the final error as much as the fraction did on the trained tiny Wan: up to 13 dB
# between the phases of one n at the same count. So every phase is measured too, after 1 or 2
# first steps, and sparser grids for the cheapest end (bench/results/pareto/trained*).
PHASED_EVERY = EVERY + (7, 8)
PHASED_FIRST = (1, 2)
# The high end: skipping single steps spread over the middle of the schedule kept far more than
# skipping the small early steps (paced) or a threshold's choice at 0.74-0.9 computed on the
# trained tiny Wan (a reuse between two computes is forecast best; the first steps set the
# layout, the last the detail). Skip every k-th step from a to b (fractions of the steps).
SKIP_EVERY = (2, 3, 4)
SKIP_FROM = (0.1, 0.2, 0.3)
SKIP_TO = (0.6, 0.7, 0.8, 0.9)
PACE = (0.25, 0.5)  # paced: steps spaced evenly in the sum of |d sigma| ** pace
PACED_WARMUP = 2
# the high end too: skipping only the smallest early steps keeps far more than a threshold does
PACED_FRACTIONS = (0.24, 0.28, 0.32, 0.36, 0.40, 0.46, 0.52, 0.6, 0.7, 0.8, 0.9)


def every_nth(steps: int, n: int, first: int, last: int, phase: int | None = None) -> tuple[int, ...]:
    """The first `first` steps, every n-th step from there (or the steps at `phase` mod n), and
    the last `last` steps."""
    chosen = set(range(min(first, steps))) | set(range(first if phase is None else phase, steps, n))
    return tuple(sorted(chosen | set(range(max(0, steps - last), steps))))


def skip_window(steps: int, k: int, start: float, end: float) -> tuple[int, ...]:
    """Every step computed but every k-th from `start` to `end` (fractions of the steps)."""
    skipped = set(range(round(start * steps), round(end * steps), k))
    return tuple(i for i in range(steps) if i not in skipped)


def paced(sigmas, count: int, pace: float, first: int, last: int) -> tuple[int, ...]:
    """`first` and `last` steps computed, and `count` steps from `first` to the end placed evenly
    in the running sum of |sigma_i - sigma_i+1| ** pace (0: evenly in steps; 1: evenly in sigma,
    which crowds the large late steps of a shifted schedule)."""
    steps = len(sigmas) - 1
    sizes = [abs(a - b) ** pace for a, b in zip(sigmas[first:-1], sigmas[first + 1:], strict=True)]
    total = sum(sizes)
    cum, run = [], 0.0
    for size in sizes:
        cum.append(run / total)
        run += size
    chosen = set(range(first)) | set(range(steps - last, steps))
    for k in range(count):
        target = k / (count - 1) if count > 1 else 0.0
        i = bisect.bisect_left(cum, target)  # cum rises: the nearest is i or the one before
        near = min((j for j in (i - 1, i) if 0 <= j < len(cum)), key=lambda j: abs(cum[j] - target))
        chosen.add(first + near)
    return tuple(sorted(chosen))


def static_schedules(sigmas) -> tuple:
    """(label, fields) of every static schedule budgeted mode measures for a run of these sigmas
    (len(sigmas) - 1 steps): the reused residual forecast linearly, no tail block, no probe."""
    steps = len(sigmas) - 1
    found = {}
    for n in EVERY:
        for first in FIRST:
            for last in LAST:
                found.setdefault(every_nth(steps, n, first, last),
                                 f"static every {n} after {first}, last {last}")
    for pace in PACE:
        for last in LAST:
            for fraction in PACED_FRACTIONS:
                want = round(fraction * steps)
                # the computed set grows with the count (placements can coincide): from the
                # count that cannot overshoot up to the first that reaches the fraction
                options = []
                for count in range(max(2, want - PACED_WARMUP - last), steps):
                    options.append(paced(sigmas, count, pace, PACED_WARMUP, last))
                    if len(options[-1]) >= want:
                        break
                best = min(options, key=lambda s: abs(len(s) - want))
                found.setdefault(best, f"static paced {pace:g}, last {last}, {len(best)} steps")
    for n in PHASED_EVERY:
        for phase in range(n):
            for first in PHASED_FIRST:
                for last in LAST:
                    found.setdefault(every_nth(steps, n, first, last, phase),
                                     f"static every {n} at {phase} mod {n}, after {first}, last {last}")
    for k in SKIP_EVERY:
        for start in SKIP_FROM:
            for end in SKIP_TO:
                found.setdefault(skip_window(steps, k, start, end),
                                 f"static skip every {k} from {start:g} to {end:g} of the steps")
    return tuple((label, static_fields(chosen))
                 for chosen, label in found.items() if len(chosen) < steps)


def static_fields(computed) -> dict:
    """The partial CMConfig of one static schedule: these steps computed, the reused residual
    forecast linearly, no probe or tail block."""
    return {"deepcache": {"steps": list(computed)}, "bn_blocks": 0, "forecast": 1}


def run_static_schedules(solver: str, steps: int, shift: float) -> tuple:
    """static_schedules of the sigmas a run of this solver, step count and shift steps through."""
    from .schedulers import make_scheduler
    return static_schedules([float(s) for s in make_scheduler(solver, steps, shift).sigmas])


def space(solver: str, steps: int, shift: float) -> tuple:
    """What `python -m commands.calibrate --budget` measures for a run of this schedule: SPACE
    and the static schedules of its sigmas."""
    return SPACE + run_static_schedules(solver, steps, shift)
