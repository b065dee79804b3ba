"""CacheManager: the gate every backend calls around each model call (seed 001's public API).

Per model call:
    gate.begin_step(branch, expert=None)      # cond/uncond (or PAIR when CFG is fused)
    signals = <probe program>                 # scalars already reduced over the sequence group
    decision = gate.decide(signals)
    h, resume, decision, tail = gate.apply(decision, h)   # skip: h + cached residual
    if not decision.skip: run blocks [resume, N - Bn); gate.update(decision, h_before, h_after)
    <tail program>      # with bn_ids: reused tail runs add `tail` (skip) or hand theirs to update

Each technique module (teacache, fbcache, magcache, deepcache) has the same parts: a config, a frozen state,
`measure(config, state, signal) -> (rel, state, invalid)`, `judge(config, state, rel, call) ->
(vote or None if invalid, state)` and `refresh(state)`. The manager composes them and never
special-cases a technique or a model. Nothing it does raises during sampling: every fault falls
back to compute and is counted by reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from . import limits, noise_adapt
from .config import CMConfig
from .decision import COMPUTE, PAIR, SKIP, Applied, Decision, FailSafe, Reason, Signals
from .residuals import NumpyOps, Slot, TensorOps, move
from .telemetry import Telemetry
from .validate import check_int

FUSED_BRANCHES = ("cond", "uncond")


@dataclass(frozen=True)
class Call:
    """The model call being decided: set by begin_step, consumed by decide."""

    branch: str
    step: int  # executed step of the run, 0-based
    phase_step: int  # executed step within the current expert phase
    expert: str | None
    threshold_scale: float = 1.0  # noise-phase adaptivity: multiplies the thresholds
    step_weight: float = 1.0  # CMConfig.step_weight: multiplies FBCache's metric of the call
    num_steps: int = 0  # of the run (MagCache reads its ratios by the run's length)


@dataclass
class BranchState:
    """What the gate keeps for one branch within one expert phase."""

    tech: dict[str, Any]
    limits: limits.LimitsState = field(default_factory=limits.LimitsState)
    slot: Slot = field(default_factory=Slot)
    tail: list[Slot] = field(default_factory=list)  # one per reused tail run (bn_ids)
    # first-block residual of the last computed step (residual_tensor_rel_l1), and with
    # forecast_gate the earlier ones its forecast needs
    probe: Slot = field(default_factory=Slot)
    row: dict | None = None  # its last trace row, amended if apply() turns a skip into a compute
    last: Decision | None = None


class CacheManager:
    def __init__(self, config: CMConfig, ops: TensorOps | None = None):
        if not isinstance(config, CMConfig):
            raise TypeError(f"CacheManager needs a CMConfig, got {type(config).__name__}")
        self.config = config
        self.ops = ops if ops is not None else NumpyOps()
        self.telemetry = Telemetry()
        self.num_steps: int | None = None
        self._step_weights: tuple[float, ...] | None = None
        self.sp_world_size = 1
        self.run_id = 0
        self.reset()

    # ---- lifecycle -------------------------------------------------------------------------

    def attach(self, num_steps: int, sp_world_size: int = 1) -> None:
        """Bind to a run of num_steps denoising steps; raises on bad values (before sampling)."""
        check_int("CacheManager.attach", "num_steps", num_steps, minimum=1)
        check_int("CacheManager.attach", "sp_world_size", sp_world_size, minimum=1)
        self.num_steps, self.sp_world_size = num_steps, sp_world_size
        self._step_weights = None
        self.reset()

    def set_schedule(self, sigmas) -> None:
        """The run's noise levels (num_steps + 1 floats, sigmas[i] -> sigmas[i + 1] is step i),
        read by CMConfig.step_weight: step i's weight is (|dsigma_i| / mean |dsigma|) ** p. Call
        after attach; a schedule of another length, or none, leaves every weight at 1."""
        self._step_weights = None
        p = self.config.step_weight
        sigmas = [float(s) for s in sigmas]
        if not p or self.num_steps is None or len(sigmas) != self.num_steps + 1:
            return
        steps = [abs(a - b) for a, b in zip(sigmas, sigmas[1:], strict=False)]
        mean = sum(steps) / len(steps)
        if not (mean > 0 and all(map(math.isfinite, steps))):
            return
        self._step_weights = tuple((d / mean) ** p for d in steps)

    def reset(self) -> None:
        """Forget every residual, signature, accumulator and counter: a new run starts."""
        self.run_id += 1
        self._branches: dict[str, BranchState] = {}
        self._expert: str | None = None
        self._phase_start = 0
        self._step = -1
        self._call: Call | None = None
        self._leader_rels: dict[str, float | None] = {}
        self._leader_decision: Decision | None = None
        self._offload = self.config.offload
        self.telemetry.reset()

    def begin_step(self, branch: str, expert: str | None = None) -> None:
        """Name the branch of the next model call. The leader branch (cond; uncond with
        cfg_compute_first; PAIR when fused) starts a new executed step; a new `expert` starts a
        new phase with fresh state. Misuse is not raised: the next decide() computes and counts it.
        """
        self._call = None
        cfg = self.config
        fused = cfg.cfg_mode == "fused"
        if self.num_steps is None or not isinstance(branch, str) or (branch == PAIR) != fused:
            return
        if branch == cfg.leader:
            step = self._step + 1
            if step >= self.num_steps:
                return
            if expert != self._expert:
                if self._step >= 0:
                    self.telemetry.expert_switches += 1
                self._branches = {}
                self._expert, self._phase_start = expert, step
            self._step = step
            self._leader_rels, self._leader_decision = {}, None
        elif self._step < 0 or expert != self._expert:
            return
        weights = self._step_weights
        self._call = Call(branch, self._step, self._step - self._phase_start, expert,
                          noise_adapt.factor(cfg.noise_adapt, self._step, self.num_steps),
                          weights[self._step] if weights is not None else 1.0, self.num_steps)

    # ---- decisions -------------------------------------------------------------------------

    def decide(self, signals: Signals | Mapping[str, Signals] | None = None) -> Decision:
        """Compute or reuse for the call named by begin_step. With cfg_mode='fused', pass
        {'cond': Signals, 'uncond': Signals}."""
        call, self._call = self._call, None
        try:
            if call is None:
                return self._fallback(None, FailSafe.LIFECYCLE_GUARD)
            return self._decide(call, signals)
        except Exception:  # noqa: BLE001 - a gate bug must not stop sampling
            return self._fallback(call, FailSafe.INTERNAL_ERROR)

    def _decide(self, call: Call, signals) -> Decision:
        cfg = self.config
        state = self._state(call.branch)
        if not cfg.enabled:
            return self._finish(call, state, COMPUTE, Reason.NO_MODE, None, {}, signals)
        is_leader = call.branch == cfg.leader
        follows = not is_leader and cfg.cfg_mode == "cond_authoritative"
        borrows_rel = not is_leader and (cfg.cfg_mode == "shared_diff" or (follows and not cfg.cfg_sep_diff))

        failsafe = None
        if cfg.cfg_mode == "fused":
            if not (isinstance(signals, Mapping) and all(b in signals for b in FUSED_BRANCHES)):
                signals = {b: None for b in FUSED_BRANCHES}
            per_branch = [signals[b] or Signals() for b in FUSED_BRANCHES]
        else:
            per_branch = [signals if isinstance(signals, Signals) else Signals()]
        if any(s.reduce_error or (s.reduced_over is not None and s.reduced_over != self.sp_world_size)
               for s in per_branch):
            # The values are this shard's own: measuring them would leave shard-specific
            # references (prev signature, accumulator) and later decisions could differ between
            # shards, which then wait on each other's collectives. Compute and start the
            # branch's signals afresh (seed 002: reset on a failed reduction).
            names = FUSED_BRANCHES if cfg.cfg_mode == "fused" else (call.branch,)
            for name in names:
                holder = self._state(name)
                holder.tech = {m: cfg.technique(m)[0].State() for m in cfg.modes}
            return self._finish(call, state, COMPUTE, FailSafe.REDUCE_ERROR, None, {}, signals,
                                failsafe=FailSafe.REDUCE_ERROR)

        # measure: signal -> rel, per mode; judge: rel -> vote, per mode
        rels, votes, invalid = {}, {}, False
        for mode in cfg.modes:
            module, tcfg = cfg.technique(mode)
            if borrows_rel:
                if self._leader_decision is None:
                    return self._fallback(call, FailSafe.LIFECYCLE_GUARD)
                rel = self._leader_rels.get(mode)
            else:
                found = []
                names = FUSED_BRANCHES if cfg.cfg_mode == "fused" else (call.branch,)
                for name, sig in zip(names, per_branch, strict=True):
                    holder = self._state(name)
                    value = getattr(sig, module.SIGNAL_FIELD) if module.SIGNAL_FIELD else None
                    rel_b, holder.tech[mode], bad = module.measure(tcfg, holder.tech[mode], value)
                    invalid |= bad
                    found.append(rel_b)
                rel = _combine(found, cfg.pair_reduce)
            rels[mode] = rel
            vote, state.tech[mode] = module.judge(tcfg, state.tech[mode], rel, call)
            invalid |= vote is None
            votes[mode] = vote
        if is_leader:
            self._leader_rels = rels

        if invalid:
            failsafe = FailSafe.INVALID_METRIC
        if failsafe is not None:
            return self._finish(call, state, COMPUTE, failsafe, None, votes, signals, failsafe=failsafe)
        if follows:
            lead = self._leader_decision
            if lead is None:
                return self._fallback(call, FailSafe.LIFECYCLE_GUARD)
            return self._finish(call, state, lead.action, Reason.FOLLOW_LEADER, lead.mode, votes, signals)

        forced = self._forced(call) or self._scene_change(per_branch) or \
            self._control_change(call, state, per_branch)
        if forced is not None:
            return self._finish(call, state, COMPUTE, forced, None, votes, signals)
        chosen = next((m for m in cfg.modes if votes[m].skip), None)
        if chosen is None:
            last = cfg.modes[-1]
            return self._finish(call, state, COMPUTE, votes[last].reason, last, votes, signals)
        blocked = limits.check(cfg.limits, state.limits)
        state.limits = limits.count_eligible(state.limits)
        if blocked is not None:
            return self._finish(call, state, COMPUTE, blocked, chosen, votes, signals)
        return self._finish(call, state, SKIP, votes[chosen].reason, chosen, votes, signals)

    def _scene_change(self, per_branch) -> Reason | None:
        guard = self.config.scene_guard
        deltas = [s.latent_delta for s in per_branch if s.latent_delta is not None]
        return Reason.SCENE_CHANGE if guard > 0 and deltas and max(deltas) > guard else None

    def _control_change(self, call: Call, state: BranchState, per_branch) -> Reason | None:
        guard = self.config.ctrl_guard
        deltas = [s.control_delta for s in per_branch if s.control_delta is not None]
        if not (guard > 0 and deltas and max(deltas) > guard):
            return None
        # a new condition restarts the alternating pattern (seed 002)
        state.limits = replace(state.limits, eligible=0)
        return Reason.CONTROL_CHANGE

    def _forced(self, call: Call) -> Reason | None:
        if call.phase_step < self.config.warmup:
            return Reason.WARMUP
        if call.step >= self.num_steps - self.config.last_steps:
            return Reason.LAST_STEPS
        return None

    def _finish(self, call, state, action, reason, mode, votes, signals, failsafe=None) -> Decision:
        cfg = self.config
        lead = self._leader_decision
        is_follower = call.branch != cfg.leader
        if action == SKIP and state.slot.residual is None:
            action, reason, failsafe = COMPUTE, FailSafe.MISSING_RESIDUAL, FailSafe.MISSING_RESIDUAL
        vote = votes.get(mode) if mode else None
        if vote is None and votes:
            vote = votes[cfg.modes[-1]]
        decision = Decision(
            action=action, reason=str(reason), branch=call.branch, step=call.step,
            expert=call.expert, mode=mode, resume_from_block=cfg.probe_blocks,
            rel=vote.rel if vote else None, rel_rescaled=vote.rescaled if vote else None,
            failsafe=failsafe, run=self.run_id)
        state.limits = limits.record(state.limits, skipped=action == SKIP)
        if action == COMPUTE:
            self._refresh(state)
        notes = tuple(n for v in votes.values() if v is not None for n in v.notes)
        state.row = self.telemetry.record(decision, phase_step=call.phase_step,
                                          accum=vote.accum if vote else None, signals=signals,
                                          notes=notes, threshold=vote.threshold if vote else None)
        state.last = decision
        if is_follower and lead is not None:
            self.telemetry.record_pair(lead.action, decision)
            if lead.skip and failsafe is not None:
                self.telemetry.count_pair_divergence(decision, recorded_as_skip=False)
        if not is_follower:
            self._leader_decision = decision
        if cfg.dry_run and decision.skip:
            # The state and the trace went on as if skipping (the prospective run); the caller
            # computes anyway and stores a fresh residual.
            return replace(decision, action=COMPUTE, reason=str(Reason.DRY_RUN))
        return decision

    def _fallback(self, call: Call | None, reason: FailSafe) -> Decision:
        """Compute, count the reason, and touch as little state as possible (it may be broken)."""
        decision = Decision(action=COMPUTE, reason=str(reason), failsafe=reason, run=self.run_id,
                            branch=call.branch if call else "?", step=call.step if call else self._step,
                            expert=call.expert if call else self._expert,
                            resume_from_block=self.config.probe_blocks)
        try:
            if call is not None:
                state = self._state(call.branch)
                self._refresh(state)
                state.last = decision
                state.row = None
                if call.branch == self.config.leader:
                    self._leader_decision = decision
            self.telemetry.record(decision, phase_step=call.phase_step if call else -1,
                                  accum=None, signals=None)
        except Exception:  # noqa: BLE001
            self.telemetry.count_failsafe(reason, None)
        return decision

    def _refresh(self, state: BranchState) -> None:
        for mode in self.config.modes:
            module, _ = self.config.technique(mode)
            state.tech[mode] = module.refresh(state.tech[mode])

    # ---- residuals -------------------------------------------------------------------------

    def apply(self, decision: Decision, x) -> Applied:
        """On skip: x + cached residual. A guard failure turns the decision into a compute."""
        if not decision.skip:
            return Applied(x, decision.resume_from_block, decision)
        try:
            state = self._current(decision)
            if state is None:
                after = self._convert(decision, None, FailSafe.LIFECYCLE_GUARD)
                return Applied(x, decision.resume_from_block, after)
            if len(state.tail) != len(self.config.tail_runs):
                return Applied(x, decision.resume_from_block,
                               self._convert(decision, state, FailSafe.MISSING_RESIDUAL))
            residuals = []
            # a remodulated residual is a tuple of parts, each shaped like x
            like = x if not self.config.remodulate or state.slot.residual is None else \
                (x,) * len(self.ops.shape(state.slot.residual))
            for slot, each in zip((state.slot, *state.tail), (like, *(x,) * len(state.tail)),
                                  strict=True):
                residual, failure = slot.fetch(self.ops, each, decision.step,
                                               self.config.forecast, self.config.forecast_reach)
                if failure is not None:
                    return Applied(x, decision.resume_from_block,
                                   self._convert(decision, state, failure))
                residuals.append(residual)
            if self.config.remodulate:  # the backend's cached tail rebuilds it with this step's gates
                return Applied(x, decision.resume_from_block, decision, tuple(residuals))
            return Applied(self.ops.add(x, residuals[0]), decision.resume_from_block, decision,
                           tuple(residuals[1:]))
        except Exception:  # noqa: BLE001
            return Applied(x, decision.resume_from_block,
                           self._convert(decision, self._current(decision), FailSafe.INTERNAL_ERROR))

    def _convert(self, decision: Decision, state: BranchState | None, reason: FailSafe) -> Decision:
        after = replace(decision, action=COMPUTE, reason=str(reason), failsafe=reason)
        self.telemetry.convert_to_compute(decision, after, state.row if state else None)
        if state is not None:
            state.limits = limits.unrecord_skip(state.limits)
            self._refresh(state)
            state.last = after
        lead = self._leader_decision
        if decision.branch == self.config.leader:
            if lead is not None and lead.step == decision.step:
                self._leader_decision = after
        elif lead is not None and lead.skip and lead.step == decision.step:
            self.telemetry.count_pair_divergence(after, recorded_as_skip=True)
        return after

    def update(self, decision: Decision, x_before, x_after, probe=None, tail=(),
               residual=None) -> None:
        """After a compute: cache x_after - x_before, or `residual` when the middle gave it
        (remodulate: its parts), and the probe's first-block residual, and with bn_ids the
        residual of each reused tail run, computed by the tail program."""
        try:
            state = self._current(decision)
            if state is None or decision.skip:
                self.telemetry.count_failsafe(FailSafe.LIFECYCLE_GUARD, decision)
                return
            keep = self.config.forecast
            if residual is None:
                residual = self.ops.sub(x_after, x_before)
            state.slot.store(self.ops, residual, decision.step, keep=keep)
            runs = len(self.config.tail_runs)
            if len(tail) != runs:  # a missing tail residual would let a skip reuse a stale one
                for slot in state.tail:
                    slot.drop()
                if runs:
                    self.telemetry.count_failsafe(FailSafe.MISSING_RESIDUAL, decision)
            else:
                while len(state.tail) < runs:
                    state.tail.append(Slot())
                for slot, residual in zip(state.tail, tail, strict=True):
                    slot.store(self.ops, residual, decision.step, keep=keep)
            if probe is not None:
                state.probe.store(self.ops, probe, decision.step,
                                  keep=keep if self.config.forecast_gate else 0)
            self._place(state)
        except Exception:  # noqa: BLE001
            self.telemetry.count_failsafe(FailSafe.INTERNAL_ERROR, decision)

    def probe_reference(self, branch: str):
        """The first-block residual stored at the branch's last computed step, or None. With
        forecast_gate, and called between begin_step and decide, that residual forecast to the
        call's step as a reuse would forecast the middle's: the probe's change metric then
        measures the forecast's own error at block 0, in the same programs and the same one
        scalar read (no extra device read, the gate stays backend-free)."""
        state = self._branches.get(branch)
        if state is None or state.probe.residual is None:
            return None
        call, cfg = self._call, self.config
        if not cfg.forecast_gate or call is None or call.branch != branch:
            return state.probe.residual
        try:
            return state.probe.reference(self.ops, call.step, cfg.forecast, cfg.forecast_reach)
        except Exception:  # noqa: BLE001 - the raw change still bounds plain reuse
            self.telemetry.count_failsafe(FailSafe.INTERNAL_ERROR, state.last)
            return state.probe.residual

    def _place(self, state: BranchState) -> None:
        """Apply the offload policy to a freshly stored residual."""
        if self._offload == "auto":
            used = self.ops.memory_fraction()
            if used is not None and used > self.config.offload_watermark:
                self._offload = "cpu"
                self.telemetry.offload_switches += 1
                self.move_cached_residuals_to(self.ops.host)
                return
        if self._offload == "cpu":
            self._move_state(state, self.ops.host)

    def move_cached_residuals_to(self, device) -> None:
        """Move every cached tensor (model offload/reload). An OOM drops that residual."""
        for state in self._branches.values():
            self._move_state(state, device)

    def _move_slot(self, slot: Slot, device, last: Decision | None) -> None:
        if slot.residual is None:
            return
        moved, failure = move(self.ops, slot.residual, device)
        if failure is not None:
            slot.drop()
            self.telemetry.count_failsafe(failure, last)
            return
        slot.residual = moved
        earlier = []
        for step, r in slot.earlier:
            r, failure = move(self.ops, r, device)
            if failure is not None:  # forecasting falls back to plain reuse
                earlier = []
                break
            earlier.append((step, r))
        slot.earlier = earlier

    def _move_state(self, state: BranchState, device) -> None:
        try:
            for slot in (state.slot, *state.tail, state.probe):
                self._move_slot(slot, device, state.last)
        except Exception:  # noqa: BLE001
            for slot in (state.slot, *state.tail, state.probe):
                slot.drop()
            self.telemetry.count_failsafe(FailSafe.INTERNAL_ERROR, state.last)

    # ---- helpers and reporting ---------------------------------------------------------------

    def _state(self, branch: str) -> BranchState:
        state = self._branches.get(branch)
        if state is None:
            state = BranchState(tech={m: self.config.technique(m)[0].State() for m in self.config.modes})
            self._branches[branch] = state
        return state

    def _current(self, decision: Decision) -> BranchState | None:
        """The branch state a decision belongs to, or None if the run or phase has moved on."""
        state = self._branches.get(decision.branch)
        if state is None or decision.run != self.run_id or state.last is None:
            return None
        last = state.last
        if (last.step, last.expert) != (decision.step, decision.expert):
            return None
        return state

    def plan(self) -> list[bool] | None:
        """For signal-free configs (DeepCache only): per step, whether the leader computes.
        Known before the loop, so a backend can prefetch or precompile by it."""
        if self.num_steps is None or self.config.needs_signals or not self.config.enabled:
            return None
        import numpy as np  # a stand-in residual for the dry run; nothing is read from a device

        dry = CacheManager(self.config, NumpyOps())
        dry.attach(self.num_steps, self.sp_world_size)
        zero = np.zeros(1)
        out = []
        for _ in range(self.num_steps):
            dry.begin_step(self.config.leader)
            decision = dry.decide({b: Signals() for b in FUSED_BRANCHES}
                                  if self.config.cfg_mode == "fused" else Signals())
            out.append(not decision.skip)
            if not decision.skip:
                dry.update(decision, zero, zero)
        return out

    def summary(self) -> dict:
        out = self.telemetry.summary()
        out.update(config=self.config.to_dict(), num_steps=self.num_steps,
                   sp_world_size=self.sp_world_size, run_id=self.run_id,
                   probe_blocks=self.config.probe_blocks,
                   tail_blocks=self.config.tail_blocks, offload_now=self._offload,
                   needs_signals=list(self.config.needs_signals))
        return out


def _combine(rels: list[float | None], how: str) -> float | None:
    if len(rels) == 1 or None in rels:
        return rels[0] if len(rels) == 1 else None
    return max(rels) if how == "max" else sum(rels) / len(rels)


