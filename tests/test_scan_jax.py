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
    return [(r.start, r.stop) if isinstance(r, Run) else r for r in block_runs(model, start, stop)]


def test_real_architectures_scan_their_identical_blocks():
    hy = build_model("hunyuanvideo-1.5-720p_t2v", meta=True)
    assert _runs(hy, 0, hy.num_blocks - 1) == [(0, hy.num_blocks - 1)]  # DeepCache's middle
    wan = build_model("wan2.2-ti2v-5b", meta=True)
    assert _runs(wan, 1, wan.num_blocks - 1) == [(1, wan.num_blocks - 1)]
    # Wan2.2 S2V: a block followed by an audio injector holds its parameters, so it differs
    # from its neighbours and runs unrolled; the blocks between injections are scanned
    s2v = build_model("wan2.2-s2v-14b", meta=True)
    inject = s2v.config.audio_inject_layers
    items = _runs(s2v, 0, s2v.num_blocks - 1)
    assert [i for i in items if isinstance(i, int)] == [b for b in inject if b < s2v.num_blocks - 1]
    covered = sorted(b for i in items for b in ([i] if isinstance(i, int) else range(*i)))
    assert covered == list(range(s2v.num_blocks - 1))


def test_s2v_scans_the_blocks_between_its_audio_injections():
    """Wan S2V: an audio injector after a block ends a run, so only the blocks between
    injections roll; clip after clip, the scanned middle gives the unrolled latents bit for bit
    and compiles nothing in the loop."""
    import dataclasses

    from modules.wan_s2v import CONFIGS
    from sampling.clips import sample_clips
    from sampling.pipelines import get_pipeline
    from sampling.stages import SignalPlan
    from tests.model_inputs import random_model

    base = get_pipeline("wan-tiny-s2v")
    config = dataclasses.replace(CONFIGS["wan-tiny-s2v"], num_layers=6, audio_inject_layers=(0, 4))

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
    runs = out[True][1].runs
    # middle [0, 5): block 0 injects, blocks 1-3 do not, block 4 injects
    assert [(r.start, r.stop) for r in runs] == [(1, 4)] and out[False][1].runs == []
    assert torch.equal(out[True][0].latents, out[False][0].latents)
    trajectories = out[True][0].trajectories
    assert len(trajectories) == 2 and all(t.loop_compiles.lowered == 0 for t in trajectories)
