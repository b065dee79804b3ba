"""Where a run's decision trace goes besides the console: histograms, TensorBoard, a PNG plot.

The trace is the gate's per-call rows (`cache.telemetry.TRACE_COLUMNS`). Histograms are plain
host maths and live in the telemetry JSON; TensorBoard and matplotlib are optional installs
(requirements-dev.txt), imported only when their sink is asked for, with a clear error if absent.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict

from .journal import atomic_write


class SinkUnavailable(RuntimeError):
    """A sink was asked for whose optional package does not import; says how to install it."""


def _missing(flag: str, package: str, exc: BaseException) -> SinkUnavailable:
    return SinkUnavailable(f"{flag} needs the {package} package, which does not import here "
                           f"({exc}); install it: pip install {package} (or pip install -r "
                           "requirements-dev.txt), or leave the flag out")


def require_tensorboard(flag: str = "--tensorboard_dir"):
    """torch's SummaryWriter (it needs the tensorboard package), or SinkUnavailable."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise _missing(flag, "tensorboard", exc) from None
    return SummaryWriter


def require_pyplot(flag: str = "--plot_png"):
    """matplotlib.pyplot on the file-only Agg backend, or SinkUnavailable."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise _missing(flag, "matplotlib", exc) from None
    return plt


# Edges of the relative-change histogram (log-spaced; thresholds of every peer fall inside).
REL_EDGES = (0.0, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, math.inf)
THIRDS = ("first", "middle", "last")


def third_of(step: int, num_steps: int) -> str:
    """Which third of the schedule a step falls in (seed 002: first/median/last thirds)."""
    return THIRDS[min(2, 3 * step // max(num_steps, 1))]


def histograms(trace, num_steps: int, edges=REL_EDGES) -> dict:
    """branch -> third -> {"edges", "counts", "n", "mean", "max"} of the measured rel values
    (calls without a rel, such as warm-up and schedule-only steps, are left out)."""
    values = defaultdict(lambda: defaultdict(list))
    for row in trace:
        if row.get("rel") is not None:
            values[row["branch"]][third_of(row["step"], num_steps)].append(row["rel"])
    out = {}
    for branch, thirds in values.items():
        out[branch] = {}
        for third in THIRDS:
            rels = thirds.get(third, [])
            counts = [0] * (len(edges) - 1)
            for v in rels:
                for k in range(len(edges) - 1):
                    if edges[k] <= v < edges[k + 1]:
                        counts[k] += 1
                        break
            out[branch][third] = {"edges": list(edges), "counts": counts, "n": len(rels),
                                  "mean": sum(rels) / len(rels) if rels else None,
                                  "max": max(rels) if rels else None}
    return out


def format_histograms(hist: dict) -> list[str]:
    """One console line per branch: mean and max rel per third of the schedule."""
    lines = []
    for branch, thirds in hist.items():
        parts = []
        for third in THIRDS:
            h = thirds[third]
            parts.append(f"{third} -" if not h["n"] else
                         f"{third} {h['mean']:.3g}/{h['max']:.3g} (n={h['n']})")
        lines.append(f"  rel {branch:7s} mean/max by third: " + ", ".join(parts))
    return lines


def write_tensorboard(logdir: str, trace, num_steps: int, tag: str = "cache") -> str:
    """Per-step scalars (rel, rescaled, accumulator, signals, computed 0/1) per branch, and the
    rel histograms per branch and third. Returns the event file's folder."""
    SummaryWriter = require_tensorboard()
    # tensorboard writes from a thread of its own; a failure there (a full disk) would print
    # that thread's traceback and leave the writer silent: keep it and raise it here
    failed: list[BaseException] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: failed.append(args.exc_value)
    try:
        _write_events(SummaryWriter(log_dir=logdir), trace, num_steps, tag)
    finally:
        threading.excepthook = hook
    if failed:
        raise failed[0]
    return logdir


def _write_events(writer, trace, num_steps: int, tag: str) -> None:
    import numpy as np

    try:
        for row in trace:
            prefix = f"{tag}/{row['branch']}" + (f"/{row['expert']}" if row.get("expert") else "")
            writer.add_scalar(f"{prefix}/computed", float(row["action"] == "compute"), row["step"])
            for key in ("rel", "rescaled", "accum", "signal_teacache", "signal_fbcache",
                        "signal_latent_delta", "signal_control_delta"):
                if row.get(key) is not None:
                    writer.add_scalar(f"{prefix}/{key}", float(row[key]), row["step"])
        values = defaultdict(list)
        for row in trace:
            if row.get("rel") is not None:
                values[(row["branch"], third_of(row["step"], num_steps))].append(row["rel"])
        for (branch, third), rels in values.items():
            writer.add_histogram(f"{tag}/{branch}/rel_{third}_third", np.asarray(rels),
                                 THIRDS.index(third))
    finally:
        writer.close()


def plot_traces(traces: dict, path, thresholds: dict | None = None):
    """A PNG with one panel per trace (title -> rows): the leader branch's rel and accumulator
    per step, its threshold if given, and a tick per reused step, so a person sees where the
    gate skipped and why. `path`: a file name (written atomically) or an open binary file."""
    plt = require_pyplot()
    titles = list(traces)
    if not titles:
        raise ValueError("plot_traces needs at least one trace")
    fig, axes = plt.subplots(len(titles), 1, figsize=(9, 2.3 * len(titles)), sharex=True,
                             squeeze=False)
    for ax, title in zip(axes[:, 0], titles, strict=True):
        rows = traces[title]
        branch = next((b for b in ("cond", "pair", "uncond") if any(r["branch"] == b for r in rows)),
                      rows[0]["branch"] if rows else "cond")
        rows = [r for r in rows if r["branch"] == branch]
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["rel"] if r["rel"] is not None else math.nan for r in rows],
                label="rel", lw=1.2)
        ax.plot(steps, [r["accum"] if r["accum"] is not None else math.nan for r in rows],
                label="accumulator", lw=1.0)
        for key, style in (("signal_latent_delta", ":"), ("signal_control_delta", "--")):
            if any(r.get(key) is not None for r in rows):
                ax.plot(steps, [r.get(key) if r.get(key) is not None else math.nan for r in rows],
                        style, label=key.removeprefix("signal_"), lw=1.0)
        if any(r.get("threshold") is not None for r in rows):  # per call (relative, noise_adapt)
            ax.plot(steps, [r.get("threshold") if r.get("threshold") is not None else math.nan
                            for r in rows], color="grey", lw=0.8, ls="--", label="threshold")
        elif thresholds and thresholds.get(title) is not None:
            ax.axhline(thresholds[title], color="grey", lw=0.8, ls="--", label="threshold")
        reused = [r["step"] for r in rows if r["action"] == "skip"]
        ax.scatter(reused, [0.0] * len(reused), marker="|", color="k", s=60, label="reused")
        ax.set_title(f"{title} ({branch}: {len(rows) - len(reused)} computed, "
                     f"{len(reused)} reused)", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    try:
        if isinstance(path, str):
            atomic_write(path, lambda f: fig.savefig(f, dpi=110, format="png"), mode="wb")
        else:  # an open binary file
            fig.savefig(path, dpi=110, format="png")
    finally:
        plt.close(fig)
    return path
