"""Sequence (Ulysses) and CFG parallelism with torch.distributed: 2 and 4 gloo processes on the
CPU against one process, both families, caching off / TeaCache / FBCache.

Each world is launched once (tests/torch_dist_worker.py under torchrun's environment) and runs
every scenario of its list; the tests below read what each rank wrote. The ranks run one thread
each: the machine has two cores.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cache import CMConfig
from sampling.pipelines import get_pipeline
from sampling.run import make_sample
from sampling.stages import SignalPlan
from sharding.torch_sp import TorchSequenceLayout, init_torch_parallel, shard_length
from tests.model_inputs import random_model, rel_err
from tests.torch_dist_worker import run, scenario
from torch_backend.backend import TorchBackend

ROOT = Path(__file__).resolve().parents[1]
HY, WAN = "hunyuanvideo-tiny", "wan-tiny-ti2v"
HY45 = (48, 80, 9)  # 3 x 3 x 5 = 45 image tokens: padded shards for sp 2 and 4
WAN45 = (96, 160, 9)  # 3 x 3 x 5 = 45 tokens (patch 1 x 2 x 2)
WAN31 = (32, 32, 121)  # 31 x 1 x 1 tokens: 16 per shard at sp 2, Wan-tiny's text length

# Tiny models have 2 heads: sp 2 runs Ulysses all-to-all, sp 4 gathered K/V.
WORLDS = {
    2: ((2, 1), [
        scenario(HY, "off", grid=(2, 1)),
        scenario(HY, "teacache", grid=(2, 1)),
        scenario(HY, "fbcache", grid=(2, 1)),  # downsample 4: shards aligned to 32, padded
        scenario(WAN, "off", grid=(2, 1), size=WAN45, image=True),  # per-token timesteps
        scenario(WAN, "teacache_strided", grid=(2, 1), size=WAN45, image=True),
        scenario(WAN, "fbcache_salient", grid=(2, 1), size=WAN45, image=True),
        scenario(HY, "teacache_fn2bn1", grid=(2, 1)),  # probe 2 blocks, tail 1
        # Wan's time signals: one timestep (a per-sample value), per-token e0 (sharded rows)
        scenario(WAN, "teacache_time", grid=(2, 1), size=WAN45),
        scenario(WAN, "teacache_projection", grid=(2, 1), size=WAN45, image=True),
        scenario("wan-tiny-i2v", "teacache", grid=(2, 1)),  # two experts
        # I2V: the vision tokens join the text part of the joint attention; no CFG
        scenario("hunyuanvideo-tiny-meanflow", "teacache", grid=(2, 1), size=HY45),
        scenario(WAN, "off", grid=(2, 1), size=WAN31, image=True),
        scenario(WAN, "off", grid=(2, 1), size=WAN31, image=True, avoid=False),
        # from step 3 to the end every reduction fails: warm-up makes 3 (the probe on the noise,
        # then on the scheduler's latent with either previous latent), each step 2
        scenario(WAN, "teacache", grid=(2, 1), image=True, fail_at=range(9, 19)),
        scenario(HY, "teacache", grid=(1, 2), size=HY45, fused=True),
        scenario(WAN, "fbcache", grid=(1, 2), image=True, fused=True),
        scenario(HY, "off", grid=(1, 2), fused=True),
    ]),
    4: ((4, 1), [
        scenario(HY, "off", grid=(4, 1), size=HY45),
        scenario(HY, "teacache", grid=(4, 1), size=HY45),
        scenario(HY, "fbcache", grid=(4, 1), size=HY45),
        scenario(WAN, "off", grid=(4, 1), image=True),
        scenario(WAN, "teacache", grid=(4, 1), image=True),
        scenario(WAN, "fbcache", grid=(4, 1), image=True),  # 18 tokens a shard -> 20
        scenario(HY, "teacache", grid=(2, 2), fused=True),
        scenario(WAN, "fbcache", grid=(2, 2), size=WAN45, image=True, fused=True),
        scenario(WAN, "off", grid=(2, 2), image=True, fused=True),
    ]),
}
EQUAL = [(w, s) for w, (_, scenarios) in WORLDS.items() for s in scenarios
         if s["avoid"] and not s["fail_at"]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, out: Path) -> list[dict]:
    grid, scenarios = WORLDS[world]
    spec = out / "spec.json"
    spec.write_text(json.dumps({"grid": grid, "out": str(out), "scenarios": scenarios,
                                "watchdog_s": 150}))
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.torch_dist_worker", str(spec)],
                              cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=200)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
    assert not failed, f"ranks {failed} failed:\n" + "\n".join(log[-3000:] for log in logs)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


_RANKS: dict[int, list[dict]] = {}
_SINGLE: dict[str, dict] = {}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """world -> per-rank results, each world launched on first use."""
    def get(world):
        if world not in _RANKS:
            _RANKS[world] = _launch(world, tmp_path_factory.mktemp(f"world{world}"))
        return _RANKS[world]
    return get


def single(spec: dict, **change) -> dict:
    """The same trajectory in this process, no process group (memoised)."""
    spec = {**spec, **change}
    key = json.dumps(spec, sort_keys=True)
    if key not in _SINGLE:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # two threads on two busy cores cost 30x here
        try:
            _SINGLE[key] = run(spec)
        finally:
            torch.set_num_threads(threads)
    return _SINGLE[key]


def decisions(result) -> list[tuple]:
    return [(r["step"], r["branch"], r["action"], r["reason"]) for r in result["trace"]]


def signals(result) -> list:
    """What the gate read and measured at each call (NaN where there was nothing)."""
    return [float("nan") if r[k] is None else r[k] for r in result["trace"]
            for k in ("signal_teacache", "signal_fbcache", "rel")]


@pytest.mark.parametrize("world, spec", EQUAL, ids=[f"{w}proc-{s['id']}" for w, s in EQUAL])
def test_parallel_run_equals_one_process(ranks, world, spec):
    results = [r[spec["id"]] for r in ranks(world)]
    want = single(spec)
    for rank, got in enumerate(results):
        err = rel_err(got["latents"], want["latents"])
        assert err < 1e-5, f"rank {rank}: relative error {err}"
        assert decisions(got) == decisions(want), f"rank {rank}"
        assert signals(got) == pytest.approx(signals(want), rel=1e-4, abs=1e-6, nan_ok=True), f"rank {rank}"
        # the same reduced signals on every rank: the same trace, float for float
        assert got["trace"] == results[0]["trace"]
        assert torch.equal(got["latents"], results[0]["latents"])
    if spec["config"] != "off":
        assert {a for _, _, a, _ in decisions(want)} == {"compute", "skip"}


@pytest.mark.parametrize("world, sid, tokens", [
    (2, "hunyuanvideo-tiny-fbcache-sp2cfg1", (60, 32)),  # aligned to the stride 4: 4 padded
    (2, "wan-tiny-ti2v-off-sp2cfg1-96x160x9-image", (45, 23)),  # Ulysses, 1 padded
    (4, "hunyuanvideo-tiny-off-sp4cfg1-48x80x9", (45, 12)),  # gathered K/V, 3 padded
    (4, "wan-tiny-ti2v-fbcache-sp4cfg1-image", (72, 20)),  # 8 padded
])
def test_the_runs_above_had_padded_shards(ranks, world, sid, tokens):
    assert all(r[sid]["tokens"] == tokens for r in ranks(world))


@pytest.mark.parametrize("world", [2, 4])
def test_cfg_parallel_equals_the_sequential_branches(ranks, world):
    """Caching off, cond and uncond on two ranks (x sp) against one process running the two
    branches one after the other."""
    spec = next(s for s in WORLDS[world][1] if s["grid"][1] == 2 and s["config"] == "off")
    sequential = single(spec, fused=False)
    for got in (r[spec["id"]] for r in ranks(world)):
        assert rel_err(got["latents"], sequential["latents"]) < 1e-5


@pytest.mark.parametrize("world", [2, 4])
def test_one_all_reduce_per_model_call_over_the_sequence_group(ranks, world):
    for spec in WORLDS[world][1]:
        sp = spec["grid"][0]
        for got in (r[spec["id"]] for r in ranks(world)):
            # caching off reads nothing; a one-timestep time embedding is the same on every
            # shard (a per-sample value): nothing to reduce
            signals = spec["config"] not in ("off", "teacache_time")
            assert got["all_reduces"] == (got["probes"] if signals and sp > 1 else 0), spec["id"]
            # never the world group: the cfg x sp grid reduces within its sp ranks
            assert got["group_sizes"] == ([sp] if signals and sp > 1 else []), spec["id"]


def test_failed_reduction_falls_back_to_compute_and_is_counted(ranks):
    spec = next(s for s in WORLDS[2][1] if s["fail_at"])
    want = decisions(single(spec, fail_at=[]))
    failing = range(3, 8)  # the steps whose calls' reductions failed (2 calls a step)
    assert any(a == "skip" for step, _, a, _ in want if step in failing)
    results = [r[spec["id"]] for r in ranks(2)]
    for got in results:
        assert got["failsafes"]["reduce_error"] == len(spec["fail_at"])
        rows = decisions(got)
        assert rows[:6] == want[:6]  # steps 0-2: reduced as usual
        assert [(a, why) for step, _, a, why in rows if step in failing] == \
            [("compute", "reduce_error")] * len(spec["fail_at"])
        assert torch.isfinite(got["latents"]).all()
    assert decisions(results[0]) == decisions(results[1])


def test_shard_length_is_kept_apart_from_the_text_length(ranks):
    """31 tokens on 2 ranks would make 16-token shards, as long as Wan-tiny's text: its
    cross-attention could not be told from self-attention by shape, and the padded key would
    mask a text key. The layout takes 17; forced to 16, the result is wrong."""
    kept, collided = (next(s for s in WORLDS[2][1] if s["size"] == WAN31 and s["avoid"] is a)
                      for a in (True, False))
    want = single(kept)
    got = ranks(2)[0]
    assert got[kept["id"]]["tokens"] == (31, 17)
    assert got[collided["id"]]["tokens"] == (31, 16)
    assert rel_err(got[kept["id"]]["latents"], want["latents"]) < 1e-5
    assert rel_err(got[collided["id"]]["latents"], want["latents"]) > 1e-3


def test_shard_length():
    assert shard_length(60, 4) == 15
    assert shard_length(60, 4, align=4) == 16  # a residual strided by 4 starts on counted tokens
    assert shard_length(45, 2) == 23
    assert shard_length(31, 2, avoid=(16,)) == 17
    assert shard_length(31, 2, align=2, avoid=(16, 18)) == 20
    assert shard_length(31, 1, avoid=(31,)) == 31  # one shard: nothing to tell apart


def test_token_mask_counts_the_tokens_of_the_whole_sequence():
    layout = TorchSequenceLayout()
    layout.sp_size, layout.sp_rank = 4, 3  # the last of 4 shards of 45 tokens: 36..47
    layout.set_tokens(45)
    keep, count = layout.token_mask(12, stride=3)
    assert keep.nonzero().flatten().tolist() == [0, 3, 6]  # tokens 36, 39, 42; 45 is padding
    assert count == 15
    keep, count = layout.token_mask(12)
    assert keep.sum() == 9 and count == 45
    with pytest.raises(ValueError, match="not a shard"):
        layout.token_mask(1)  # a per-sample column would be counted once per rank


def test_init_torch_parallel_checks_the_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="needs 4: run `torchrun --nproc_per_node 4"):
        init_torch_parallel(2, cfg_parallel=True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_torch_parallel(1) is None
    with pytest.raises(ValueError, match="integer >= 1"):
        init_torch_parallel(0)


def test_cfg_parallel_needs_the_fused_pair():
    pipe = get_pipeline(HY)
    shape = pipe.latent_shape(*pipe.size)
    layout = TorchSequenceLayout()
    layout.cfg_size = 2  # as a rank of a cfg group sees it
    backend = TorchBackend({None: random_model(pipe.experts[0][1])},
                           SignalPlan.from_config(CMConfig()), layout=layout)
    with pytest.raises(ValueError, match="fused_cfg=True"):
        make_sample(backend, pipe, pipe.synthesize(shape, True, False, 0), shape, image=False,
                    seed=0)


def _stage2(cwd, *args, nproc=None):
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).resolve().parents[1] / "stage2_transformer_flax_deepcache.py")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(_free_port())] if nproc else [sys.executable]
    return subprocess.run([*launcher, script, "--backend", "torch", "--no_progress", *args],
                          cwd=cwd, capture_output=True, text=True)


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_under_torchrun_equals_one_process_and_rank_0_alone_writes(tmp_path):
    from safetensors.torch import load_file

    common = ("--teacache", "--num_inference_steps", "8")
    one = _stage2(tmp_path, *common, "--output_dir", "one")
    two = _stage2(tmp_path, *common, "--sp_size", "2", "--output_dir", "two", nproc=2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("stage 2:") == 1 and "rank 0: sp 2, cfg 1" in two.stdout
    a = load_file(str(tmp_path / "one" / "stage2_latents.safetensors"))["latents"]
    b = load_file(str(tmp_path / "two" / "stage2_latents.safetensors"))["latents"]
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5
    wrong = _stage2(tmp_path, *common, "--sp_size", "4", "--output_dir", "wrong", nproc=2)
    assert wrong.returncode != 0 and "--sp_size 4 needs 4" in wrong.stderr
    assert not (tmp_path / "wrong").exists()
