"""Counters, pair statistics and the per-step trace of one run, exportable as JSON and CSV."""

from __future__ import annotations

import csv
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from .decision import SKIP, Decision, FailSafe, Note

TRACE_COLUMNS = ("step", "phase_step", "expert", "branch", "mode", "action", "reason", "failsafe",
                 "rel", "rescaled", "accum", "signal_teacache", "signal_fbcache",
                 "signal_latent_delta", "signal_control_delta", "notes", "threshold",
                 "clip")  # clip: which trajectory of a clip-by-clip run (S2V); empty otherwise


@dataclass
class BranchStats:
    total: int = 0
    skipped: int = 0
    count_rel: int = 0
    sum_rel: float = 0.0
    max_rel: float = 0.0
    sum_rescaled: float = 0.0
    max_rescaled: float = -math.inf
    compute_reasons: Counter = field(default_factory=Counter)
    failsafes: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        n = self.count_rel
        return {
            "total": self.total,
            "skipped": self.skipped,
            "skip_rate": 100.0 * self.skipped / self.total if self.total else 0.0,
            "avg_rel": self.sum_rel / n if n else None,
            "max_rel": self.max_rel if n else None,
            "avg_rescaled": self.sum_rescaled / n if n else None,
            "max_rescaled": self.max_rescaled if n else None,
            "compute_reasons": dict(self.compute_reasons),
            "failsafes": dict(self.failsafes),
            "notes": dict(self.notes),
        }


class Telemetry:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.branches: dict[str, BranchStats] = defaultdict(BranchStats)
        self.experts: dict[str, dict[str, BranchStats]] = defaultdict(lambda: defaultdict(BranchStats))
        self.failsafes: Counter = Counter()
        self.notes: Counter = Counter()
        self.pair = {"pair_total": 0, "pair_skipped": 0, "pair_forced_compute": 0,
                     "pair_divergence_failsafes": 0}
        self.expert_switches = 0
        self.offload_switches = 0
        self.trace: list[dict] = []

    def _stats(self, decision: Decision):
        yield self.branches[decision.branch]
        if decision.expert is not None:
            yield self.experts[decision.expert][decision.branch]

    def record(self, decision: Decision, *, phase_step: int, accum, signals,
               notes: tuple[Note, ...] = (), threshold: float | None = None) -> dict:
        self.notes.update(str(n) for n in notes)
        for stats in self._stats(decision):
            stats.notes.update(str(n) for n in notes)
            stats.total += 1
            if decision.skip:
                stats.skipped += 1
            else:
                stats.compute_reasons[str(decision.failsafe or decision.reason)] += 1
            if decision.rel is not None:
                stats.count_rel += 1
                stats.sum_rel += decision.rel
                stats.max_rel = max(stats.max_rel, decision.rel)
                rescaled = decision.rel_rescaled if decision.rel_rescaled is not None else decision.rel
                stats.sum_rescaled += rescaled
                stats.max_rescaled = max(stats.max_rescaled, rescaled)
        if decision.failsafe is not None:
            self.count_failsafe(decision.failsafe, decision)
        row = {
            "step": decision.step, "phase_step": phase_step, "expert": decision.expert,
            "branch": decision.branch, "mode": decision.mode, "action": decision.action,
            "reason": str(decision.reason),
            "failsafe": str(decision.failsafe) if decision.failsafe else None,
            "rel": decision.rel, "rescaled": decision.rel_rescaled, "accum": accum,
            "signal_teacache": getattr(signals, "teacache", None),
            "signal_fbcache": getattr(signals, "fbcache", None),
            "signal_latent_delta": getattr(signals, "latent_delta", None),
            "signal_control_delta": getattr(signals, "control_delta", None),
            "notes": "+".join(notes) or None,
            "threshold": threshold,
        }
        self.trace.append(row)
        return row

    def count_failsafe(self, reason: FailSafe, decision: Decision | None) -> None:
        self.failsafes[str(reason)] += 1
        if decision is not None:
            for stats in self._stats(decision):
                stats.failsafes[str(reason)] += 1

    def convert_to_compute(self, before: Decision, after: Decision, row: dict | None) -> None:
        """A guard in apply() turned a recorded skip into a compute."""
        for stats in self._stats(before):
            stats.skipped -= 1
            stats.compute_reasons[str(after.failsafe)] += 1
        self.count_failsafe(after.failsafe, after)
        if row is not None:
            row.update(action=after.action, reason=str(after.reason), failsafe=str(after.failsafe))

    def record_pair(self, leader_action: str, follower: Decision) -> None:
        self.pair["pair_total"] += 1
        if leader_action == SKIP and follower.skip:
            self.pair["pair_skipped"] += 1
        elif leader_action == SKIP:
            self.pair["pair_forced_compute"] += 1

    def count_pair_divergence(self, follower: Decision, *, recorded_as_skip: bool) -> None:
        """A follower could not follow its leader's skip (it computes instead)."""
        if recorded_as_skip:
            self.pair["pair_skipped"] -= 1
            self.pair["pair_forced_compute"] += 1
        self.pair["pair_divergence_failsafes"] += 1
        self.count_failsafe(FailSafe.PAIR_DIVERGENCE, follower)

    def summary(self) -> dict:
        out = {
            "branches": {name: stats.as_dict() for name, stats in self.branches.items()},
            "failsafe_count": sum(self.failsafes.values()),
            "failsafes": {str(r): self.failsafes.get(str(r), 0) for r in FailSafe},
            "notes": {str(n): self.notes.get(str(n), 0) for n in Note},
            "pair": dict(self.pair),
            "expert_switches": self.expert_switches,
            "offload_switches": self.offload_switches,
        }
        if self.experts:
            out["experts"] = {e: {b: s.as_dict() for b, s in br.items()} for e, br in self.experts.items()}
        return out


def trace_csv(f, trace) -> None:
    """The per-call trace as CSV into an open text file, one row per model call (the gate writes
    no file: a command writes it, through its own atomic writer)."""
    writer = csv.DictWriter(f, fieldnames=TRACE_COLUMNS)
    writer.writeheader()
    writer.writerows(trace)
