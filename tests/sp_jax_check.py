"""Run by tests/test_sequence_parallel_jax.py in a fresh process with 8 emulated CPU devices
(the flag must be set before jax starts), one model family a process. Prints one JSON object of
measured facts."""

import os
import sys

os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           "--xla_backend_optimization_level=0")  # compiles faster
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402
import re  # noqa: E402

import torch  # noqa: E402

from cache import CMConfig, FBCacheConfig, TeaCacheConfig  # noqa: E402
from sampling.pipelines import get_pipeline  # noqa: E402
from sampling.run import make_sample, sample_once  # noqa: E402
from sampling.stages import SignalPlan  # noqa: E402
from sharding.jax_sp import make_mesh  # noqa: E402
from tests.model_inputs import random_model, rel_err  # noqa: E402
from tpu.backend import JaxBackend  # noqa: E402

CONFIGS = {
    "off": {},
    "teacache": dict(teacache=TeaCacheConfig(threshold=0.4)),
    "fbcache": dict(fbcache=FBCacheConfig(metric="residual_tensor_rel_l1", threshold=1.0)),
    # one collective for every signal of a call: TeaCache and FBCache (with its reference and
    # saliency) in one probe
    "both": dict(teacache=TeaCacheConfig(threshold=0.4),
                 fbcache=FBCacheConfig(metric="residual_tensor_rel_l1", threshold=1.0, saliency=0.2)),
}
# (config, sp, cfg, weights): the multi-device runs; each is compared with one device, same
# config. Every mesh shape once at least, FSDP on three; TeaCache alone, FBCache alone (under CFG
# parallel) and both at once (with and without it). A mesh run with FSDP weights is the
# replicated run plus each block's gathers, so sp 8 runs once, with FSDP. The two "both" runs on
# sp 4 compiled the probe and middle programs whose collectives are counted (counting them
# compiles nothing more).
CASES = [("teacache", 2, 1, "replicated"), ("both", 4, 1, "replicated"), ("both", 4, 1, "fsdp"),
         ("off", 8, 1, "fsdp"), ("both", 4, 2, "replicated"), ("fbcache", 2, 2, "fsdp")]
# hunyuanvideo-tiny has 60 tokens and 2 heads: sp 3 divides the tokens (and the latent's 3
# frames), 7 divides nothing (padded shards, gathered K/V; nor any weight, so FSDP would leave
# every weight whole: replicated says so)
EXTRA_CASES = {"hunyuanvideo-tiny": [("teacache", 3, 1, "fsdp"), ("teacache", 7, 1, "replicated")]}
# wan-tiny-s2v is wan-tiny-i2v's transformer with audio and motion frames in front: the shapes
# and configs above run on wan-tiny-i2v; for S2V the two counted runs and CFG parallel suffice
FAMILY_CASES = {"wan-tiny-s2v": [("both", 4, 1, "replicated"), ("both", 4, 1, "fsdp"),
                                 ("both", 4, 2, "replicated")]}
COUNTED = {"replicated": ("both", 4, 1, "replicated"), "fsdp": ("both", 4, 1, "fsdp")}
STEPS = 10
COLLECTIVE = re.compile(r"\b(all-reduce|all-to-all|all-gather|collective-permute|reduce-scatter)"
                        r"(-start|-done)?\(")


def collectives(text: str) -> dict:
    out = {}
    for op, suffix in COLLECTIVE.findall(text):
        if suffix != "-done":
            out[op] = out.get(op, 0) + 1
    return out


def main(name: str):
    pipe = get_pipeline(name)
    models = {e: random_model(c, seed=i, std=0.2) for i, (e, c) in enumerate(pipe.experts)}
    shape = pipe.latent_shape(*pipe.size)
    image = pipe.task == "i2v"
    tensors = pipe.synthesize(shape, True, image, 0)
    if pipe.task == "s2v":  # one clip (the clip loop only swaps tensors), its history shown
        history = torch.randn(1, 16, 19, *shape[3:], generator=torch.Generator().manual_seed(1))
        tensors = pipe.clip_inputs(tensors, 1, history, shape)

    def run(config, backend):
        fused = config.cfg_mode == "fused"
        sample = make_sample(backend, pipe, tensors, shape, image=image, seed=0, fused_cfg=fused)
        traj = sample_once(backend, config, sample, solver=pipe.solver, steps=STEPS, shift=pipe.shift)
        trace = [(r["step"], r["branch"], r["action"], r["reason"]) for r in traj.gate.telemetry.trace]
        return sample, backend.get(traj.latents), trace, traj.loop_compiles.lowered

    facts, baselines, one_device, kept = {"cases": []}, {}, {}, {}
    for case in FAMILY_CASES.get(name, CASES) + EXTRA_CASES.get(name, []):
        cname, sp, cfg, weights = case
        mode = "fused" if cfg > 1 else "cond_authoritative"
        config = CMConfig(**CONFIGS[cname], cfg_mode=mode)
        if (cname, mode) not in baselines:
            # one device: caching off runs on any plan's programs (the gate always computes), so
            # it shares the single-device backend of "both"
            plan_of = "both" if cname == "off" else cname
            if (plan_of, mode) not in one_device:
                plan = SignalPlan.from_config(CMConfig(**CONFIGS[plan_of], cfg_mode=mode))
                one_device[(plan_of, mode)] = JaxBackend(models, plan)
            baselines[(cname, mode)] = run(config, one_device[(plan_of, mode)])[1:3]
        ref, ref_trace = baselines[(cname, mode)]
        backend = JaxBackend(models, SignalPlan.from_config(config), mesh=make_mesh(sp, cfg),
                             weights=weights)
        sample, out, trace, loop = run(config, backend)
        if case in COUNTED.values():
            kept[case] = backend, sample
        reused = sum(action == "skip" for _, _, action, _ in trace)
        split = sum(len(a.sharding.device_set) > 1 and not a.sharding.is_fully_replicated
                    for a in backend.params[pipe.experts[0][0]].values())
        facts["cases"].append(dict(config=cname, sp=sp, cfg=cfg, weights=weights,
                                   split_weights=split, rel_err=rel_err(out, ref),
                                   trace_equal=trace == ref_trace, reused=reused,
                                   loop_compiles=loop, device=backend.device_name()))
    # the collectives of the programs those runs compiled (the same arguments: no new compile)
    expert = pipe.experts[0][0]
    for weights, case in COUNTED.items():
        backend, sample = kept[case]
        conds = sample.conds["cond"]
        t = backend.put(pipe.timestep_input(999.0, shape, image))
        args = (backend._weights_of["probe"][expert], sample.noise, t, *backend.rope,
                backend.zero_reference, sample.noise, *(conds[n] for n in backend.cond_names))
        hidden, ctx, signals, _ = backend.probe(expert, sample.noise, t, conds, None)
        mid = (backend._weights_of["middle"][expert], hidden, ctx)
        middle = collectives(backend.programs()["middle"].lower(*mid).compile().as_text())
        if weights == "fsdp":  # the middle gathers each block's split weights, nothing else changes
            facts["fsdp_middle_collectives"] = middle
            continue
        facts["middle_collectives"] = middle
        facts["probe_signal_columns"] = int(signals.shape[1])
        facts["probe_collectives"] = collectives(
            backend.programs()["probe"].lower(*args).compile().as_text())
        facts["traced_signal_psums"] = backend.layout.signal_collectives
    print(json.dumps(facts))


if __name__ == "__main__":
    main(sys.argv[1])
