"""Stage 2's report: the figures of a run (decisions per branch, expert and clip, compiles, step
times, speedups against the schedule's ideal, the budget's promise, --compare's fidelity), the
causes of a speedup off its ideal, and the summary printed at the end of the run."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from cache import CMConfig
from sampling.fidelity import fidelity
from sampling.run import layer_ideal
from sampling.run_spec import RunSpec
from sampling.sinks import format_histograms, histograms
from sampling.units import size_text


def compile_counts(c):
    return None if c is None else c.to_dict()


def estimate_speedup(step_seconds, step_computed, loop_seconds) -> float | None:
    """The loop's speedup over running every step as a computed one: steps x the median computed
    step over the loop's wall time (speech-to-video: every clip's steps over every clip's loop).
    The median, not the mean: one slow computed step (a stall of the host) would otherwise count
    once in the loop's time but steps / computed times over in the uncached estimate."""
    full = [s for s, c in zip(step_seconds, step_computed, strict=True) if c]
    if not full or loop_seconds <= 0:
        return None
    return median(full) * len(step_seconds) / loop_seconds


@dataclass(frozen=True, kw_only=True)
class Stage2Report:
    """A run's figures: printed (`format_summary` of `as_dict()`), written as telemetry, and
    read field by field by the prompt-to-video command. Built once, after the run; `outputs`
    (the stage files written) is added by the writer."""

    model: str
    steps: int
    solver: str
    shift: float
    guidance: object  # one scale, a (high, low) pair, or None
    latent_shape: list
    tokens: int
    num_clips: int | None
    # where the stage-1 inputs came from: this prompt encoded here, synthetic, or given
    prompt: str | None
    synthetic_inputs: bool
    attention: str
    device: str
    backend: str
    cache: dict  # modes, preset, probe/tail blocks, the gate's config
    branches: dict  # branch -> {computed, reused}
    experts: dict  # expert -> branch -> {computed, reused}
    failsafes: dict  # reason -> count (the nonzero ones)
    # warmup, loop, warmup_seconds; process: everything this process compiled so far, whose
    # `compiled` (not served by the persistent cache) a second run keeps at 0
    compiles: dict
    time: dict  # loop, steps, stage seconds; signal reads
    speedup: dict  # schedule_ideal, reused_step_share, estimated
    budget: dict | None
    clips: list | None  # speech-to-video: computed/reused per clip and branch
    warnings: list
    summary: dict
    histograms: dict
    trace: list  # per model call: step, branch, expert, action, signals
    compare: dict | None = None  # --compare: the uncached run against this one
    load: dict | None = None  # the JAX backend's sharded load
    writer: bool = True
    outputs: dict | None = None

    @property
    def calls(self) -> tuple[int, int]:
        """(computed, all) model calls of the run, over its branches."""
        computed = sum(v["computed"] for v in self.branches.values())
        return computed, computed + sum(v["reused"] for v in self.branches.values())

    def as_dict(self) -> dict:
        """The report as printed and written (the optional parts a run did not fill left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not (f.name in ("compare", "load", "outputs") and getattr(self, f.name) is None)}


def build_report(spec: RunSpec, traj, backend, seconds: float, *, warnings=(), compare=None,
                 process=None, load=None, writer: bool = True) -> Stage2Report:
    """The run's figures; `warnings`: what opening the backend found (profiles' fingerprints),
    `compare`: compare_report's, `process`: the process's compile counts, `load`: what opening
    the backend read. The causes of a speedup off its ideal are added to the warnings."""
    stats, gate, plan = traj.stats, traj.gate, backend.plan
    full = [s for s, c in zip(stats.step_seconds, stats.step_computed, strict=True) if c]
    cached = [s for s, c in zip(stats.step_seconds, stats.step_computed, strict=True) if not c]
    summary = gate.summary()
    blocks = backend.template.num_blocks
    report = Stage2Report(
        model=spec.pipe.name, steps=spec.steps, solver=spec.solver, shift=spec.shift,
        guidance=spec.shown_guidance, latent_shape=list(spec.latent_shape), tokens=spec.tokens,
        num_clips=spec.clips, prompt=spec.prompt, synthetic_inputs=spec.synthetic,
        attention=backend.attention, device=backend.device_name(), backend=spec.launch.backend,
        cache={"modes": list(gate.config.modes), "preset": spec.preset,
                  "probe_blocks": plan.fn_blocks,
                  "tail_blocks": plan.bn_blocks, "reuse_tail_blocks": plan.reuse_tail_blocks,
                  "config": gate.config.to_dict()},
        branches={b: {"computed": s["total"] - s["skipped"], "reused": s["skipped"]}
                  for b, s in summary["branches"].items()},
        experts={e: {b: {"computed": s["total"] - s["skipped"], "reused": s["skipped"]}
                     for b, s in br.items()} for e, br in summary.get("experts", {}).items()},
        failsafes={k: v for k, v in summary["failsafes"].items() if v},
        compiles={"warmup": compile_counts(traj.warmup_compiles),
                  "loop": compile_counts(traj.loop_compiles),
                  "warmup_seconds": traj.warmup_seconds, "process": process},
        time={"loop_seconds": stats.wall_seconds, "full_step_seconds": median(full),
                 "cached_step_seconds": median(cached), "full_steps": len(full),
                 "cached_steps": len(cached), "signal_reads": stats.signal_reads,
                 "stage_seconds": seconds,
                 # what the estimate is computed from (every clip's steps, one after another)
                 "step_seconds": list(stats.step_seconds),
                 "step_computed": list(stats.step_computed)},
        speedup={
            "schedule_ideal": layer_ideal(blocks, len(full), len(cached), plan.fn_blocks,
                                          plan.reuse_tail_blocks),
            # what the ideal counts a reused step as: its blocks (probe, tail, head as one) of
            # a computed step's
            "reused_step_share": (plan.fn_blocks + plan.reuse_tail_blocks + 1) / (blocks + 1),
            "estimated": estimate_speedup(stats.step_seconds, stats.step_computed,
                                          stats.wall_seconds),
        },
        budget=spec.budget, clips=summary.get("clips"),
        warnings=list(warnings) + profile_warnings(gate.config, summary, gate.telemetry.trace),
        summary=summary, histograms=histograms(gate.telemetry.trace, spec.steps),
        trace=gate.telemetry.trace, compare=compare, load=load, writer=writer)
    return dataclasses.replace(report, warnings=report.warnings
                               + speedup_remarks(report.as_dict()))


def compare_report(traj, base, latents, reference, noise) -> dict:
    """--compare: the uncached run `base` (its latents `reference`) against the cached one."""
    return {
        "uncached_loop_seconds": base.stats.wall_seconds,
        "speedup": base.stats.wall_seconds / traj.stats.wall_seconds,
        "loop_compiles_uncached": compile_counts(base.loop_compiles),
        **fidelity(latents, reference, noise),
    }


NOISE = 0.15  # a speedup off its schedule ideal by more than this has its cause stated


def speedup_remarks(report: dict) -> list[str]:
    """Why a speedup is off what the schedule allows: the estimate when it is more than NOISE
    above or below the ideal, and a --compare run's measured speedup when it is below 1 or more
    than NOISE above the ideal (a cached run cannot save more than the blocks it skips)."""
    remarks = _estimate_remarks(report)
    if "compare" not in report:
        return remarks
    t, ideal = report["time"], report["speedup"]["schedule_ideal"]
    measured = report["compare"]["speedup"]
    steps = t["full_steps"] + t["cached_steps"]
    uncached_step = report["compare"]["uncached_loop_seconds"] / steps
    if measured < 1:
        cached = t["cached_step_seconds"]
        cost = (f"a reused step took {_ms(cached)} against {_ms(t['full_step_seconds'])} for a "
                f"computed one" if cached is not None else "no step was reused")
        return remarks + [
            f"measured speedup {measured:.2f}x is below 1, slower than uncached: {cost}, and "
            f"{t['cached_steps']} of {steps} steps were reused (schedule ideal {ideal:.2f}x); "
            "the probe, signal reads and tail that every step runs outweigh the skipped "
            "blocks here (small models, busy hosts); reuse more (a larger --budget_speedup "
            "or threshold) or run uncached"]
    if measured > ideal * (1 + NOISE):
        return remarks + [
            f"measured speedup {measured:.2f}x is above the schedule ideal {ideal:.2f}x, "
            f"which bounds what skipping blocks can save: the uncached run's steps took "
            f"{_ms(uncached_step)} on average against {_ms(t['full_step_seconds'])} for the "
            "cached run's computed ones, so the host's speed changed between the runs "
            "(timing noise); trust the ideal and the estimate"]
    return remarks


def _estimate_remarks(report: dict) -> list[str]:
    """The estimate's cause when it is more than NOISE off the schedule ideal, from the run's
    recorded step times: loop compiles, the cost of a reused step against what the ideal counts
    for it, or steps whose times spread (the host's speed changed during the loop)."""
    t, s = report["time"], report["speedup"]
    est, ideal, share = s.get("estimated"), s["schedule_ideal"], s.get("reused_step_share")
    if est is None or ideal * (1 - NOISE) <= est <= ideal * (1 + NOISE):
        return []
    above = est > ideal
    head = (f"estimated speedup {est:.2f}x is {'above' if above else 'below'} the schedule ideal "
            f"{ideal:.2f}x by more than {NOISE:.0%}")
    loop = (report.get("compiles") or {}).get("loop") or {}
    if loop.get("lowered"):
        return [f"{head}: {loop['lowered']} program(s) compiled inside the timed loop's steps "
                "(the warm-up missed them), which the computed steps' times include; trust the "
                "ideal, and report the compile"]
    full, cached = t["full_step_seconds"], t["cached_step_seconds"]
    full_times = [x for x, c in zip(t.get("step_seconds", ()), t.get("step_computed", ()),
                                    strict=True) if c]
    spread = (f"computed steps took {_ms(min(full_times))} to {_ms(max(full_times))}"
              if full_times else "")
    if cached is None or share is None or not full:
        return [f"{head}: {spread or 'no step time recorded'} (timing noise)"]
    measured = cached / full
    cost = (f"a reused step took {_ms(cached)} against {_ms(full)} for a computed one "
            f"({measured:.0%}), where the ideal counts {share:.0%} (its probe and tail blocks, "
            "the head as one block)")
    if above and measured < share:
        return [f"{head}: {cost}: the embeddings and head cost less than a block here, so the "
                "ideal understates what a reuse saves"]
    if not above and measured > share:
        return [f"{head}: {cost}: the probe, signal reads and per-step dispatch that every step "
                "runs cost more than the blocks the ideal counts (small models, host-bound "
                "loops)"]
    return [f"{head}: {cost}; {spread}, so the host's speed changed during the loop (timing "
            "noise)"]


def profile_warnings(config: CMConfig, summary: dict, trace) -> list[str]:
    """One line when a poly: profile was evaluated outside the rel range it was fitted on (its
    polynomial extrapolates there), or when a rescaled change came out negative (counted as 0)."""
    notes = summary.get("notes", {})
    below, above = notes.get("profile_below_range", 0), notes.get("profile_above_range", 0)
    clamped = notes.get("rescale_clamped", 0)
    if not (below or above or clamped) or config.teacache is None:
        return []
    profile = config.teacache.profile
    measured = sum(row["rel"] is not None for row in trace)
    parts = []
    if below or above:
        low, high = profile.rel_range or next(iter(profile.expert_ranges.values()))
        parts.append(f"TeaCache profile {config.teacache.policy} was evaluated outside the rel "
                     f"range it was fitted on [{low:.3g}, {high:.3g}] on {below + above} of "
                     f"{measured} measured calls ({below} below, {above} above): its rescaled "
                     "change there is extrapolated; recalibrate on runs like this one")
    if clamped:
        parts.append(f"{clamped} rescaled changes came out negative and counted as 0")
    return ["; ".join(parts)]


def median(xs):
    return statistics.median(xs) if xs else None


def _ms(seconds):
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"



def format_summary(report: dict) -> str:
    t, s, c = report["time"], report["speedup"], report["compiles"]
    lines = [
        f"stage 2: {report['model']}  {report['steps']} steps {report['solver']} "
        f"(shift {report['shift']})  guidance {report['guidance']}  latents "
        f"{report['latent_shape']} ({report['tokens']} tokens)"
        + (f" x {report['num_clips']} clips" if report.get("num_clips") else "")
        + f"  {report['device']}, "
        f"attention {report['attention']}",
        *([f"inputs: prompt {report['prompt']!r} (encoded here)"] if report.get("prompt") else
          ["inputs: synthetic stage-1 tensors drawn from the seed (no prompt)"]
          if report.get("synthetic_inputs") else []),
        f"cache: {', '.join(report['cache']['modes']) or 'off'}"
        + (f"  preset {report['cache']['preset']}" if report["cache"]["preset"] else "")
        + f"  (probe {report['cache']['probe_blocks']} blocks, tail {report['cache']['tail_blocks']}"
        + (f", {report['cache']['reuse_tail_blocks']} of them on reuse (bn_ids)"
           if report["cache"]["reuse_tail_blocks"] != report["cache"]["tail_blocks"] else "") + ")",
    ]
    for b, v in report["branches"].items():
        lines.append(f"  {b:7s} computed {v['computed']:3d}  reused {v['reused']:3d}")
    for e, br in report["experts"].items():
        lines.append(f"  expert {e}: " + "; ".join(f"{b} {v['computed']}/{v['reused']}"
                                                    for b, v in br.items()))
    for i, br in enumerate(report.get("clips") or ()):
        lines.append(f"  clip {i}: " + "; ".join(f"{b} {v['computed']}/{v['reused']}"
                                                 for b, v in br.items()) + " (computed/reused)")
    if report["cache"]["preset"] or report["cache"]["config"].get("dry_run"):
        cfg = report["cache"]["config"]
        shown = {k: cfg[k] for k in ("teacache", "fbcache", "deepcache", "bn_blocks", "forecast",
                                     "noise_adapt", "cfg_sep_diff", "dry_run") if cfg.get(k)}
        lines.append(f"  resolved: {shown}, limits {cfg['limits']}")
    if report["failsafes"]:
        lines.append(f"  fail-safes: {report['failsafes']}")
    lines += [f"  warning: {w}" for w in report.get("warnings", [])]
    lines += format_histograms(report.get("histograms", {}))
    if report.get("load"):
        ld = report["load"]
        lines.append(f"weights: read {size_text(ld['bytes_read'])} of the checkpoint's "
                     f"{size_text(ld['checkpoint_bytes'])} (this host's shards) in {ld['seconds']:.1f} s")
    w, lp = c["warmup"], c["loop"]
    if w is None:
        lines.append(f"compiles: none (eager); warm-up {c['warmup_seconds']:.1f} s")
    else:
        lines.append(f"compiles: warm-up {w['lowered']} ({c['warmup_seconds']:.1f} s, "
                     f"{w['cache_hits']} from the persistent cache), loop {lp['lowered']}"
                     + (f"; {c['process']['compiled']} compiled by XLA in all"
                        if c.get("process") else ""))
    lines.append(f"time: loop {t['loop_seconds']:.2f} s; full step {_ms(t['full_step_seconds'])} "
                 f"x{t['full_steps']}, cached step {_ms(t['cached_step_seconds'])} x{t['cached_steps']}"
                 f"; signal reads {t['signal_reads']}")
    est = s["estimated"]
    lines.append(f"speedup: {'-' if est is None else f'{est:.2f}x'} estimated (full-step rate), "
                 f"schedule ideal {s['schedule_ideal']:.2f}x (blocks run)")
    if report.get("budget"):
        b = report["budget"]
        target = (f"rel L2 <= {b['rel_err']:g}" if b["rel_err"] is not None
                  else f"speedup {b['speedup']:g}x")
        if b["choice"] is None:
            lines.append(f"budget: {target} -> no calibrated configuration promises it; "
                         "uncached")
        else:
            lines.append(f"budget: {target} -> {b['choice']} (calibration: rel L2 "
                         f"{b['typical_rel_err']:.2e} typical, <= {b['bound_rel_err']:.2e} on an "
                         f"unseen draw, computed "
                         f"{b['predicted_computed_fraction']:.3f} of the blocks); --compare "
                         "measures it")
    if "compare" in report:
        cmp = report["compare"]
        lines.append(f"compare: uncached loop {cmp['uncached_loop_seconds']:.2f} s -> speedup "
                     f"{cmp['speedup']:.2f}x; PSNR {cmp['psnr_db']:.1f} dB, rel L2 "
                     f"{cmp['rel_l2']:.2e}, vs displacement {cmp['rel_to_displacement']:.2e}")
    if "outputs" in report:
        lines.append("wrote " + ", ".join(report["outputs"].values()))
    return "\n".join(lines)
