"""The middle stage as rolled loops on the JAX backend (`tpu.scan`): the same latents as the
unrolled blocks, bit for bit on CPU in fp32 (the same ops in the same order, one block per
iteration), no compile in the loop, stacked weights in place of the per-block copies, and which
blocks of the real architectures form runs."""

import numpy as np
import pytest
import torch

from cache import CMConfig, DeepCacheConfig, TeaCacheConfig
from modules.registry import build_model
from tests.test_stage2_jax import run
from tpu.backend import JaxBackend
from tpu.scan import Run, block_runs


@pytest.mark.parametrize("name,config", [
    ("hunyuanvideo-tiny", CMConfig(deepcache=DeepCacheConfig())),  # middle [0, N - 1)
    ("wan-tiny-ti2v", CMConfig(teacache=TeaCacheConfig(threshold=0.2))),  # block 0 probe-read
], ids=["hunyuan-deepcache", "wan-teacache"])
def test_scanned_middle_gives_the_unrolled_latents_bit_for_bit(name, config):
    unrolled, traj_u, backend_u = run(JaxBackend, name, config, steps=6, scan_blocks=False)
    scanned, traj_s, backend = run(JaxBackend, name, config, steps=6)
    assert backend_u.runs == [] and len(backend.runs) == 1
    run_ = backend.runs[0]
    assert run_.stop - run_.start >= 2
    assert torch.equal(scanned, unrolled)
    assert traj_s.stats.step_computed == traj_u.stats.step_computed
    assert traj_s.loop_compiles.lowered == 0 and traj_s.loop_compiles.backend == 0
    # the run's weights exist only stacked: no per-block copy is placed
    params = backend.params[None]
    for names in run_.names:
        assert not any(f"model.{n}" in params for n in names)
    for k, key in enumerate(run_.keys):
        stacked = np.asarray(params[f"model.{key}"])
        for j, names in enumerate(run_.names):
            assert np.array_equal(stacked[j], np.asarray(backend_u.params[None][f"model.{names[k]}"]))


def _runs(model, start, stop):
    return [(r.start, r.stop) + ((r.period,) if r.period > 1 else ()) if isinstance(r, Run) else r
            for r in block_runs(model, start, stop)]


def test_real_architectures_scan_their_identical_blocks():
    hy = build_model("hunyuanvideo-1.5-720p_t2v", meta=True)
    assert _runs(hy, 0, hy.num_blocks - 1) == [(0, hy.num_blocks - 1)]  # DeepCache's middle
    wan = build_model("wan2.2-ti2v-5b", meta=True)
    assert _runs(wan, 1, wan.num_blocks - 1) == [(1, wan.num_blocks - 1)]
    # Wan2.2 S2V: a block followed by an audio injector holds its parameters, so it differs
    # from its neighbours; injections after blocks 0, 4, ..., 24, then 27, ..., 39 make a period
    # of 4 blocks repeated 6 times and one of 3 repeated 5 times
    s2v = build_model("wan2.2-s2v-14b", meta=True)
    assert s2v.config.audio_inject_layers == (0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39)
    assert _runs(s2v, 0, s2v.num_blocks - 1) == [(0, 24, 4), (24, 39, 3)]
    # TeaCache reads block 0 in its probe: it stays unrolled and the periods shift by one
    assert [r if isinstance(r, int) else (r.start, r.stop, r.period) for r in
            block_runs(s2v, 0, s2v.num_blocks - 1, unrolled=frozenset({0}))] == \
        [0, (1, 25, 4), (25, 37, 3), (37, 39, 1)]
    hy_ = block_runs(hy, 0, hy.num_blocks - 1)[0]
    assert hy_.period == 1 and hy_.groups == hy.num_blocks - 1


@pytest.mark.parametrize("layers,inject,runs", [
    (6, (0, 4), [(1, 4, 1)]),  # middle [0, 5): block 0 injects, 1-3 do not, 4 injects
    (9, (0, 2, 4, 6, 8), [(0, 8, 2)]),  # middle [0, 8): inject, plain, four times
], ids=["between", "periodic"])
def test_s2v_scans_its_blocks_around_the_audio_injections(layers, inject, runs):
    """Wan S2V: an audio injector after a block makes that block differ from its neighbours, so
    the blocks between injections roll, or, where injections repeat, the period of blocks between
    them rolls as one loop body; clip after clip, the scanned middle gives the unrolled latents
    bit for bit and compiles nothing in the loop."""
    import dataclasses

    from modules.wan_s2v import CONFIGS
    from sampling.clips import sample_clips
    from sampling.pipelines import get_pipeline
    from sampling.stages import SignalPlan
    from tests.model_inputs import random_model

    base = get_pipeline("wan-tiny-s2v")
    config = dataclasses.replace(CONFIGS["wan-tiny-s2v"], num_layers=layers,
                                 audio_inject_layers=inject)

    class Deeper(type(base)):  # the tiny S2V pipeline on a deeper stack
        @property
        def config(self):
            return config

    pipe = Deeper(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    shape = pipe.latent_shape(*pipe.size)
    tensors = pipe.synthesize(shape, True, False, 0)
    tensors["audio_embeds"] = tensors["audio_embeds"][..., :32]  # two clips
    models = {None: random_model(config, std=0.2)}
    gate = CMConfig(deepcache=DeepCacheConfig(start=2, end=6, interval=2))
    out = {}
    for scan in (False, True):
        backend = JaxBackend(models, SignalPlan.from_config(gate), scan_blocks=scan)
        clips = sample_clips(backend, gate, pipe, tensors, shape, seed=0, solver=pipe.solver,
                             steps=6, shift=pipe.shift)
        out[scan] = (clips, backend)
    assert [(r.start, r.stop, r.period) for r in out[True][1].runs] == runs
    assert out[False][1].runs == []
    assert torch.equal(out[True][0].latents, out[False][0].latents)
    trajectories = out[True][0].trajectories
    assert len(trajectories) == 2 and all(t.loop_compiles.lowered == 0 for t in trajectories)
