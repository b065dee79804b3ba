"""Speech-to-video, clip by clip (official `WanS2V.generate`): each clip is one trajectory of the
per-step loop (`loop.denoise`), conditioned on its window of the audio and on the motion history
the clips before it left; each clip draws its noise from seed + clip, as the official code does.

The gate starts afresh for every clip (a new trajectory from noise: nothing of the last one may
be reused), and every clip runs the programs the first one built and compiled: the shapes are
the same, only the tensors change. A clip's audio may also change while it is sampled
(`audio_updates`, e.g. speech revised by a streaming front end): the change goes to the gate's
control guard through `Sample.cond_updates`, so with `ctrl_guard` no reuse spans it.

The motion history: the official pipeline decodes every clip and re-encodes the last 73 frames
with the VAE; stage 2 holds no VAE, so the history is carried in latent space, the last 19 latent
frames of [history | new clip] (`carry_motion`). A caller that has the VAE passes `next_motion`.

Stage 3 decodes the clips as the official pipeline does, each with its history in front
(`clip_decodes`), rebuilding the histories stage 2 carried from the written latents and what
stage 2 records beside them (`decode_inputs`, `decode_metadata`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from cache import CMConfig

from .loop import Backend, LoopStats
from .pipelines import Pipeline
from .run import Trajectory, make_sample, noise_for, put_conditions, sample_once, warm_up
from .schedulers import make_scheduler


def motion_frames(pipe: Pipeline) -> int:
    return pipe.config.motion_latent_frames


def fit_motion(motion: torch.Tensor | None, frames: int) -> torch.Tensor | None:
    """The last `frames` latent frames of a history, zero frames in front of a shorter one (what
    the model's frame packer does): one shape for every clip, so nothing recompiles."""
    if motion is None:
        return None
    have = motion.shape[2]
    if have >= frames:
        return motion[:, :, have - frames:]
    return torch.nn.functional.pad(motion, (0, 0, 0, 0, frames - have, 0))


def carry_motion(motion: torch.Tensor | None, latents: torch.Tensor, frames: int) -> torch.Tensor:
    """The next clip's motion history in latent space: the last `frames` frames of
    [history | this clip's latents] (after a first clip without history: zeros in front)."""
    history = latents if motion is None else torch.cat([motion, latents], dim=2)
    return fit_motion(history, frames)


@dataclass
class Clips:
    latents: torch.Tensor  # [1, C, clips * F, H, W] on the host, clip after clip
    trajectories: list[Trajectory]

    def merged(self) -> Trajectory:
        """The clips read as one run: summed counts and times, the traces one after another
        (each row tagged with its clip), warm-up from the first clip, the loop's compiles of all."""
        trajs = self.trajectories
        stats = LoopStats()
        for t in trajs:
            stats.step_seconds += t.stats.step_seconds
            stats.step_computed += t.stats.step_computed
            stats.step_expert += t.stats.step_expert
            stats.signal_reads += t.stats.signal_reads
            stats.model_calls += t.stats.model_calls
            stats.wall_seconds += t.stats.wall_seconds
        loop = trajs[0].loop_compiles
        for t in trajs[1:]:
            loop = None if loop is None else loop + t.loop_compiles
        return Trajectory(None, stats, ClipGates([t.gate for t in trajs]), trajs[0].warmup_compiles,
                          loop, trajs[0].warmup_seconds)


class ClipGates:
    """The gates of a clip run, read as one gate by the stage-2 report."""

    def __init__(self, gates):
        self.gates = gates
        self.config = gates[0].config
        self.telemetry = _Trace([{**row, "clip": i} for i, g in enumerate(gates)
                                 for row in g.telemetry.trace])

    def summary(self) -> dict:
        parts = [g.summary() for g in self.gates]
        out = dict(parts[0])
        branches = {}
        for part in parts:
            for name, s in part["branches"].items():
                acc = branches.setdefault(name, {"total": 0, "skipped": 0, "compute_reasons": {}})
                acc["total"] += s["total"]
                acc["skipped"] += s["skipped"]
                for reason, n in s["compute_reasons"].items():
                    acc["compute_reasons"][reason] = acc["compute_reasons"].get(reason, 0) + n
        out["branches"] = branches
        out["failsafes"] = {k: sum(p["failsafes"][k] for p in parts) for k in parts[0]["failsafes"]}
        out["failsafe_count"] = sum(p["failsafe_count"] for p in parts)
        out["pair"] = {k: sum(p["pair"][k] for p in parts) for k in parts[0]["pair"]}
        out["notes"] = {k: sum(p["notes"][k] for p in parts) for k in parts[0].get("notes", {})}
        out["clips"] = [{b: {"computed": s["total"] - s["skipped"], "reused": s["skipped"]}
                         for b, s in p["branches"].items()} for p in parts]
        return out


@dataclass
class _Trace:
    trace: list


def sample_clips(backend: Backend, config: CMConfig, pipe: Pipeline, tensors: dict, latent_shape,
                 *, seed: int, solver: str, steps: int, shift: float, guidance=None,
                 fused_cfg: bool = False, clips: int | None = None, progress=None,
                 warmup_rounds: int = 1, step_sync: bool = True, audio_updates: dict | None = None,
                 next_motion=carry_motion) -> Clips:
    """Sample `clips` clips (default: all the audio holds) from stage-1 tensors.

    audio_updates: clip -> step -> that clip's audio window [1, layers, dim, frames] replacing
    the one it was sampled with from that step on (the conditional branch's; the unconditional
    one has no speech). next_motion(history, clip latents, frames) -> the next history.
    """
    available = pipe.clip_count(tensors, latent_shape)
    clips = available if clips is None else clips
    if not 1 <= clips <= available:
        raise ValueError(f"{clips} clips asked; the audio holds {available}")
    audio_updates = audio_updates or {}
    unknown = sorted(set(audio_updates) - set(range(clips)))
    if unknown:
        raise ValueError(f"audio_updates names clips {unknown}; this run has clips 0..{clips - 1}")
    frames = motion_frames(pipe)
    motion = fit_motion(tensors.get("motion_latents"), frames)
    kw = dict(image=False, guidance=guidance, fused_cfg=fused_cfg)
    sample, out, trajectories = None, [], []
    for clip in range(clips):
        inputs = pipe.clip_inputs(tensors, clip, motion, latent_shape)
        if sample is None:  # builds the programs, once for every clip
            sample = make_sample(backend, pipe, inputs, latent_shape, seed=seed, **kw)
        else:
            conds, _ = put_conditions(backend, pipe, inputs, latent_shape, **kw)
            sample = replace(sample, noise=backend.put(noise_for(latent_shape, seed + clip)),
                             conds=conds)
        sample.cond_updates = _cond_updates(backend, sample, audio_updates.get(clip, {}))
        if clip == 0:
            warmup = _warm_up(backend, sample, audio_updates, warmup_rounds, solver, steps, shift)
        traj = sample_once(backend, config, sample, solver=solver, steps=steps, shift=shift,
                           progress=progress, warmup_rounds=0, step_sync=step_sync)
        if clip == 0:
            traj.warmup_compiles, traj.warmup_seconds = warmup
        latents = backend.get(traj.latents)
        motion = next_motion(motion, latents, frames)
        out.append(latents)
        trajectories.append(traj)
    return Clips(torch.cat(out, dim=2), trajectories)


def _cond_updates(backend, sample, updates: dict) -> dict:
    """step -> branch -> {"audio": device tensor} for one clip's audio updates."""
    out = {}
    for step, audio in updates.items():
        audio = audio.float()
        if "pair" in sample.conds:  # fused CFG: [uncond (no speech), cond]
            out[step] = {"pair": {"audio": backend.put(torch.cat([torch.zeros_like(audio), audio]))}}
        else:
            out[step] = {"cond": {"audio": backend.put(audio)}}
    return out


def _warm_up(backend, sample, audio_updates, rounds, solver, steps, shift):
    """Warm-up on the first clip, with the control guard's change measure when any clip has an
    audio update, so no later clip compiles; returns (compile counts, seconds) it took."""
    any_updates = next((u for u in audio_updates.values() if u), None)
    warm = sample if sample.cond_updates or any_updates is None else \
        replace(sample, cond_updates=_cond_updates(backend, sample, {0: next(iter(any_updates.values()))}))
    before, began = backend.compile_counts(), time.perf_counter()
    scheduler = make_scheduler(solver, steps, shift)
    for _ in range(rounds):
        warm_up(backend, backend.plan, scheduler, warm)
    after = backend.compile_counts()
    return (None if after is None else after - before), time.perf_counter() - began


# --- stage 3: each clip decoded with its history in front (official WanS2V.generate) ------------

# official: the first clip without a motion history (drop_first_motion) loses 3 more video frames
DROPPED_FIRST_FRAMES = 3


@dataclass(frozen=True)
class ClipDecode:
    """One clip's decode: the VAE decodes `latents` [1, C, H_f + F, H, W] (DiT latents: the
    clip's history, or for the first clip without one the reference latent, then the clip), and
    the clip's video is the last `keep` frames of the result."""

    latents: torch.Tensor
    keep: int


def decode_metadata(pipe: Pipeline, latent_shape, clips: int, motion_given: bool) -> dict:
    """What stage 2 records for stage 3 to rebuild the clips' histories."""
    return {"num_clips": clips, "clip_latent_frames": latent_shape[2],
            "motion_latent_frames": motion_frames(pipe), "motion_history_given": motion_given}


def decode_inputs(pipe: Pipeline, tensors: dict) -> dict[str, torch.Tensor]:
    """The stage-1 tensor stage 3 decodes the first clip with (`clip_decodes`): the motion
    history as the first clip continued it (fitted to its frames), or without one the
    reference latent."""
    motion = fit_motion(tensors.get("motion_latents"), motion_frames(pipe))
    return {"ref_latents": tensors["ref_latents"]} if motion is None else {"motion_latents": motion}


def clip_decodes(latents: torch.Tensor, clips: int, history_frames: int, temporal_stride: int,
                 *, ref_latents: torch.Tensor | None = None,
                 motion_latents: torch.Tensor | None = None) -> list[ClipDecode]:
    """Each clip's decode (official WanS2V.generate), over `latents` [1, C, clips * F, H, W]:
    [history | clip] keeping its last `temporal_stride` * F frames, the history carried as stage
    2 carries it (`carry_motion`). The first clip without a history (official
    drop_first_motion) decodes [reference | clip] and keeps its last stride * F - 3 frames."""
    if latents.shape[2] % clips:
        raise ValueError(f"{latents.shape[2]} latent frames do not split into {clips} clips")
    if (ref_latents is None) == (motion_latents is None):
        raise ValueError("expected one of ref_latents (no motion history) and motion_latents")
    frames = latents.shape[2] // clips
    motion = fit_motion(motion_latents, history_frames)
    out = []
    for clip in range(clips):
        x = latents[:, :, clip * frames: (clip + 1) * frames]
        if motion is None:
            out.append(ClipDecode(torch.cat([ref_latents, x], dim=2),
                                  temporal_stride * frames - DROPPED_FIRST_FRAMES))
        else:
            out.append(ClipDecode(torch.cat([motion, x], dim=2), temporal_stride * frames))
        motion = carry_motion(motion, x, history_frames)
    return out
