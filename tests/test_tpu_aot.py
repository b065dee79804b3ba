"""Deviceless compiles for a real TPU target (libtpu's compile-only devices of a v6e:2x2 slice):
the tiny models' stage programs with the splash kernel lowered by Mosaic (not interpreted), on one
chip and on a sequence-parallel mesh, with replicated and FSDP weights; the memory plan and the
collective accounting; the command (`python -m commands.aot`), its request and its errors."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpu.hlo
from cache import CacheManager, CMConfig, DeepCacheConfig, TeaCacheConfig
from cache.flags import CacheFlags
from commands import aot as aot_command
from modules.checkpoint import cast_model
from modules.registry import build_model
from sampling.loop import denoise
from sampling.pipelines import get_pipeline
from sampling.run import make_sample, warm_up
from sampling.schedulers import make_scheduler
from sampling.stages import SignalPlan
from sharding.jax_sp import make_mesh
from tpu import aot_backend
from tpu import placement as tpu_placement
from tpu.aot import AotRequest
from tpu.topology import CHIPS, AotError, topology_devices, wraparound

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def slice_v6e():
    return topology_devices("v6e:2x2")


def _compile(devices, name, config, sp=1, weights=None):
    pipe = get_pipeline(name)
    models = {e: cast_model(build_model(c, meta=True), torch.bfloat16) for e, c in pipe.experts}
    plan = SignalPlan.from_config(config)
    mesh = make_mesh(sp, 1, devices) if sp > 1 else None
    backend = aot_backend.AotBackend(models, plan, devices=devices, mesh=mesh, weights=weights)
    shape = pipe.latent_shape(*pipe.size)
    image = pipe.task == "i2v"
    sample = make_sample(backend, pipe, pipe.synthesize(shape, True, image, 0), shape,
                         image=image, seed=0)
    warm_up(backend, plan, make_scheduler(pipe.solver, 6, pipe.shift), sample)
    return backend, models


def test_topology_gives_the_slice_and_its_chip(slice_v6e):
    chip, devices = slice_v6e
    assert chip.name == "v6e" and len(devices) == 4
    assert {d.device_kind for d in devices} == {chip.device_kind}
    assert {d.platform for d in devices} == {"tpu"}


def test_v7x_is_two_devices_a_chip_under_libtpus_name():
    """v7x:2x2x1 (v7x-8) is libtpu's tpu7x:2x2x1: 4 chips, each two TensorCore devices that
    share its coordinates; make_mesh runs one sp ring through all 8."""
    chip, devices = topology_devices("v7x:2x2x1")
    assert chip.name == "v7x" and chip.devices_per_chip == 2 and len(devices) == 8
    assert {d.device_kind for d in devices} == {chip.device_kind}
    coords = sorted((*d.coords, d.core_on_chip) for d in devices)
    assert coords == [(x, y, 0, c) for x in (0, 1) for y in (0, 1) for c in (0, 1)]
    ring = [(*d.coords, d.core_on_chip) for d in make_mesh(8, 1, devices).devices.flat]
    assert all(sum(abs(a - b) for a, b in zip(p, q, strict=True)) == 1
               for p, q in zip(ring, ring[1:] + ring[:1], strict=True))


@pytest.mark.parametrize("name", ["wan-tiny-i2v", "hunyuanvideo-tiny"])
def test_stage_programs_compile_for_tpu_with_the_splash_kernel(slice_v6e, name):
    _, devices = slice_v6e
    backend, models = _compile(devices, name, CMConfig(teacache=TeaCacheConfig()))
    names = {p.name for p in backend.records.values()}
    assert {"probe", "middle", "tail", "add", "sub"} <= names
    assert any(n.startswith("lincomb") for n in names)  # the scheduler's combinations
    middle = backend.program("middle")
    # Mosaic lowered the kernel (a custom call in the TPU executable); its work is counted
    # from its shapes, since XLA's cost analysis cannot see inside it
    assert middle.kernel_flops > 0 and middle.flops > middle.kernel_flops
    assert middle.temp_bytes > 0 and middle.argument_bytes > 0
    # replicated on one chip: the weights resident are every expert's parameters, as cast
    want = sum(p.numel() * p.element_size() for m in models.values() for p in m.parameters())
    assert sum(backend.expert_bytes.values()) == want
    assert backend.device_name().startswith("tpu:TPU v6 lite")


def test_sequence_parallel_mesh_compiles_with_one_signal_reduction(slice_v6e):
    _, devices = slice_v6e
    backend, _ = _compile(devices, "wan-tiny-i2v", CMConfig(teacache=TeaCacheConfig()), sp=4)
    probe, middle = backend.program("probe"), backend.program("middle")
    assert probe.collectives["all-reduce"]["count"] == 1  # the one psum of every signal
    # Ulysses: heads (2) do not divide sp 4, so K/V are gathered over the 4 chips
    assert middle.collectives["all-gather"]["count"] > 0
    assert "all-reduce" not in middle.collectives
    # every collective of the mesh's programs kept with its groups: the psum over all 4
    (psum,) = backend.collective_ops["probe"]
    assert psum.kind == "all-reduce" and psum.groups == ((0, 1, 2, 3),)


def test_fsdp_splits_block_weights_over_the_slice_and_gathers_them_per_block(slice_v6e,
                                                                            monkeypatch):
    """FSDP with the middle scanned (tpu/scan.py): the stacked weights stay split, and the loop
    gathers one block's slice of each per iteration, inside its body: every middle block's
    split weights are gathered whole once per call, and no stack is ever gathered whole."""
    _, devices = slice_v6e
    config = CMConfig(deepcache=DeepCacheConfig())
    whole, models = _compile(devices, "hunyuanvideo-tiny", config, sp=4, weights="replicated")
    texts, record = {}, aot_backend.AotBackend._record

    def keep(self, name, compiled, *rest):
        texts.setdefault(name, compiled.as_text())
        return record(self, name, compiled, *rest)
    monkeypatch.setattr(aot_backend.AotBackend, "_record", keep)
    split, _ = _compile(devices, "hunyuanvideo-tiny", config, sp=4)  # the default on a mesh
    assert split.weight_sharding == "fsdp" and whole.weight_sharding == "replicated"
    model = models[None]
    # 2-D block weights divisible by 4 chips lie split; everything else whole
    expected = sum(p.numel() * p.element_size() // (4 if n.startswith("double_blocks.")
                                                    and p.ndim == 2 and p.shape[0] % 4 == 0 else 1)
                   for n, p in model.named_parameters())
    assert split.expert_bytes[None] == expected < whole.expert_bytes[None]
    # the middle's blocks are one scanned run; its stacks keep each block's split, axis 0 whole
    (run,) = split.runs
    assert split.middle_blocks == [run] and run.stop - run.start == 3
    for key in run.keys:
        w = split.params[None][f"model.{key}"]
        if w.ndim == 3:
            assert w.sharding.spec[0] is None and w.sharding.shard_shape(w.shape)[1] == w.shape[1] // 4
    # per call: every middle block's split weights gathered whole once (beside the K/V gathers
    # both layouts make)
    per_block = [p for p in model.double_blocks[0].parameters() if p.ndim == 2]
    middle = run.stop - run.start
    s, w = split.program("middle").collectives["all-gather"], \
        whole.program("middle").collectives.get("all-gather", {"count": 0, "bytes": 0})
    assert s["count"] - w["count"] >= middle  # (XLA may combine a block's gathers)
    assert s["bytes"] - w["bytes"] == middle * sum(p.numel() * p.element_size() for p in per_block)
    # where: all inside the loop body, run once per block, each of one block's slice [1, ...]
    hlo = texts["middle"]
    (_, whiles), = tpu.hlo.loops(hlo).items()
    (body, trips), = whiles
    assert trips == middle
    gathers = [(c, line) for c, line in tpu.hlo._lines(hlo) if " all-gather(" in line
               or " all-gather-start(" in line]
    assert gathers and {c for c, _ in gathers} == {body}
    shapes = {tpu.hlo.ARRAY_SHAPE.search(line.split("=", 1)[1]).group(2) for _, line in gathers}
    assert all(d.split(",")[0] == "1" for d in shapes), shapes  # never a whole stack of 3


def test_collective_accounting_reads_every_replica_group_form():
    hlo = "\n".join([
        "%ag = bf16[1024,1024]{1,0} all-gather(%p), channel_id=1, replica_groups=mesh['axis_0'=8,"
        "'axis_1'=1] {'axis_0'}, dimensions={0}",
        "%a2a = f32[16,64]{1,0} all-to-all(%x), replica_groups=[2,4]<=[8], dimensions={0}",
        "%ars = (f32[8]{0}, f32[8]{0}) all-reduce-start(%y), replica_groups={{0,1},{2,3}}",
        "%ard = f32[8]{0} all-reduce-done(%ars)",
    ])
    c = tpu.hlo.collectives(hlo)
    assert c["all-gather"] == {"count": 1, "bytes": 2 * 2**20, "received": 2 * 2**20 * 7 / 8}
    assert c["all-to-all"]["received"] == 16 * 64 * 4 * 3 / 4
    assert c["all-reduce"]["count"] == 1 and c["all-reduce"]["bytes"] == 32  # -done not counted


def test_replica_groups_expand_every_form_into_partition_ids():
    groups = tpu.hlo.replica_groups
    # iota: 16 ids as [8,2], transposed: the even ids, then the odd ones
    assert groups("replica_groups=[2,8]<=[8,2]T(1,0), dimensions={0}") == \
        (tuple(range(0, 16, 2)), tuple(range(1, 16, 2)))
    assert groups("replica_groups=[2,4]<=[8]") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert groups("replica_groups=[4,2]<=[2,2,2]T(2,0,1)") == ((0, 2), (4, 6), (1, 3), (5, 7))
    assert groups("replica_groups={{0,2},{1,3}}, to_apply=%sum") == ((0, 2), (1, 3))
    assert groups("replica_groups={}, to_apply=%sum", partitions=4) == ((0, 1, 2, 3),)
    assert groups("replica_groups={}, to_apply=%sum") is None  # how many: not known
    # mesh axes: the other axes fixed, the named ones varying (in mesh order)
    mesh = "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=8] {%s}, dimensions={0}"
    assert groups(mesh % "'axis_0'") == tuple((i, i + 8) for i in range(8))
    assert groups(mesh % "'axis_2'") == (tuple(range(8)), tuple(range(8, 16)))
    assert groups(mesh % "'axis_2','axis_0'") == (tuple(range(16)),)
    # a sub-axis: axis_2 = 8 split as (1)2 x (2)4, the first part grouped
    assert groups(mesh % "'axis_2':(1)2") == tuple((i, i + 4) for i in (0, 1, 2, 3, 8, 9, 10, 11))
    assert groups(mesh % "'axis_2':(2)4") == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11),
                                             (12, 13, 14, 15))
    assert groups("source_target_pairs={{0,1},{1,2},{2,0}}, channel_id=3") == ((0, 1), (1, 2), (2, 0))
    assert groups("dimensions={0}") is None


def test_collective_ops_carry_kind_bytes_runs_and_groups():
    hlo = "\n".join([
        "HloModule m, num_partitions=4",
        "%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
        "  %ag = f32[8]{0} all-gather(%x), replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}",
        "}",
        "ENTRY %main (a: f32[8]) -> f32[8] {",
        "  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, "
        "backend_config={\"known_trip_count\":{\"n\":\"3\"}}",
        "  %ar = f32[4]{0} all-reduce(%y), replica_groups={}, to_apply=%sum",
        "  %cp = (f32[2]{0}, f32[2]{0}, u32[], u32[]) collective-permute-start(%z), "
        "source_target_pairs={{0,1},{1,0}}",
        "  %cpd = f32[2]{0} collective-permute-done(%cp)",
        "}",
    ])
    ag, ar, cp = tpu.hlo.collective_ops(hlo)
    assert ag == tpu.hlo.CollectiveOp("all-gather", 32, 16.0, 3, ((0, 2), (1, 3)))
    assert ar == tpu.hlo.CollectiveOp("all-reduce", 16, 2 * 16 * 3 / 4, 1, ((0, 1, 2, 3),))
    assert cp == tpu.hlo.CollectiveOp("collective-permute", 8, 8, 1, ((0, 1), (1, 0)))
    assert tpu.hlo.collectives(hlo)["all-gather"] == {"count": 3, "bytes": 96, "received": 48.0}


def test_wraparound_only_where_the_slice_has_it():
    """The Scaling Book: v5e/v6e wrap an axis of 16 only; v5p slices of whole cubes wrap."""
    assert wraparound(CHIPS["v5e"], (4, 4, 1)) == (False, False, False)
    assert wraparound(CHIPS["v6e"], (8, 16, 1)) == (False, True, False)
    assert wraparound(CHIPS["v5p"], (4, 4, 8)) == (True, True, True)
    assert wraparound(CHIPS["v5p"], (2, 2, 4)) == (False, False, False)
    # v7x taken as v5p (cubes joined by optical switches): an assumption, tpu/topology.py
    assert wraparound(CHIPS["v7x"], (4, 4, 8)) == (True, True, True)
    assert wraparound(CHIPS["v7x"], (2, 2, 1)) == (False, False, False)
    assert tpu_placement.hops((0, 0, 0), (3, 0, 0), (4, 4, 1), (False,) * 3) == 3
    assert tpu_placement.hops((0, 0, 0), (15, 3, 0), (16, 16, 1), (True, True, False)) == 4


def test_placement_maps_groups_to_chips_under_each_device_order():
    """v5e:4x4 as cfg 2 x sp 8: the mesh's rows are rings of 1-hop steps; the same partition ids
    on the devices in list order (two 2-wide hosts' columns) step 1,2,1,2,1,2,1,4."""
    chip, devices = topology_devices("v5e:4x4")
    mesh = make_mesh(8, 2, devices)
    sp_gather = tpu.hlo.CollectiveOp("all-gather", 1024, 896.0, 2, (tuple(range(8)), tuple(range(8, 16))))
    cfg_sum = tpu.hlo.CollectiveOp("all-reduce", 8, 8.0, 1, tuple((i, i + 8) for i in range(8)))
    ops = {"middle": [sp_gather], "probe": [cfg_sum]}
    orders = {"mesh": [tuple(d.coords) for d in mesh.devices.flat],
              "list_order": [tuple(d.coords) for d in devices]}
    p = tpu_placement.placement(ops, orders, extents=(4, 4, 1), wraps=(False,) * 3, sp=8)
    mesh_order, listed = p["orders"]["mesh"], p["orders"]["list_order"]
    assert mesh_order["sp_ring_steps"] == [[1] * 8] * 2 and mesh_order["sp_rings_closed"]
    assert listed["sp_ring_steps"] == [[1, 2, 1, 2, 1, 2, 1, 4]] * 2 and not listed["sp_rings_closed"]
    gather = mesh_order["collectives"]["all-gather"]
    assert gather["count"] == 2 and gather["groups"] == ["2x8"] and gather["programs"] == ["middle"]
    assert (gather["hops_min"], gather["hops_max"], gather["mean_hops"]) == (1, 1, 1.0)
    assert (gather["rings"], gather["rings_closed"]) == (2, 2)
    assert gather["byte_hops"] == gather["received"] == 2 * 896.0
    slow = listed["collectives"]["all-gather"]
    assert (slow["hops_max"], slow["rings_closed"], slow["mean_hops"]) == (4, 0, 14 / 8)
    assert slow["byte_hops"] == 2 * 896.0 * 14 / 8
    # the cfg pairs: each partition and its partner, on either order
    assert mesh_order["collectives"]["all-reduce"]["groups"] == ["8x2"]
    assert "sp rings closed (8/8 hops)" in tpu_placement.format_placement(p)


def test_the_same_program_compiles_to_the_same_hlo_under_either_device_order():
    """The HLO names partitions, not chips: a sharded program on v5e:4x4 compiles to the same text
    on the mesh's device order and on the list order, so one compile's collectives are placed
    under both (`tpu.aot.run_placement`). Its reversal is a collective-permute, its sums
    all-reduces over sp and over all 16."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from sharding.jax_sp import AXES

    _, devices = topology_devices("v5e:4x4")
    texts = []
    for grid in (make_mesh(8, 2, devices).devices, np.array(devices).reshape(2, 8)):
        sharding = NamedSharding(Mesh(grid, AXES), PartitionSpec("cfg", "sp"))
        x = jax.ShapeDtypeStruct((2, 64, 128), jnp.bfloat16, sharding=sharding)
        program = jax.jit(lambda x: jnp.sum(x, axis=1, keepdims=True) * jnp.mean(x) + x[:, ::-1])
        texts.append(program.lower(x).compile().as_text())
    assert texts[0] == texts[1]
    ops = {op.kind: op for op in tpu.hlo.collective_ops(texts[0])}
    assert ops["collective-permute"].groups[:2] == ((0, 7), (1, 6))  # the sp axis reversed
    assert {op.groups for op in tpu.hlo.collective_ops(texts[0]) if op.kind == "all-reduce"} == \
        {(tuple(range(16)),), (tuple(range(8)), tuple(range(8, 16)))}


def _loop_calls(backend, config, sample, scheduler):
    """(program name -> calls, per-step computed) of one real trajectory (sampling.loop.denoise)
    on the backend, which counts every program call (`calls`) as it compiles instead of runs."""
    before = dict(backend.calls)
    gate = CacheManager(config, backend.ops)
    gate.attach(len(scheduler.timesteps))
    _, stats = denoise(backend, gate, backend.plan, scheduler.fresh(), sample)
    calls = {n: c - before.get(n, 0) for n, c in backend.calls.items() if c != before.get(n, 0)}
    return calls, stats.step_computed


def test_run_plan_counts_what_the_run_holds(slice_v6e):
    """The plan of one trajectory against what is known without it: the weights are the torch
    models' parameter bytes, a residual is the hidden state worked out below, and the roofline
    seconds are the programs the real loop runs on this backend, each call priced at its
    program's own roofline."""
    chip, devices = slice_v6e
    # DeepCache start 1, end 5, interval 2 over 6 steps: steps 2 and 4 reused, 0, 1, 3, 5 computed
    config = CMConfig(deepcache=DeepCacheConfig(start=1, end=5, interval=2))
    backend, models = _compile(devices, "wan-tiny-i2v", config)
    plans = {swap: aot_backend.run_plan(backend, chip, config, steps=6, branches=2, helpers={},
                                        computed_fraction=None, swap_experts=swap)
             for swap in (False, True)}
    m, swap = plans[False].memory, plans[True].memory
    expert_bytes = [sum(p.numel() * p.element_size() for p in model.parameters())
                    for model in models.values()]  # bf16, the fp32 ones kept (modules.wan)
    assert len(expert_bytes) == m["experts_resident"] == 2
    assert m["weights"] == sum(expert_bytes) and swap["weights"] == max(expert_bytes)
    assert swap["switch_bytes"] == max(expert_bytes) and swap["experts_resident"] == 1
    # the residual is the hidden state [1, tokens, dim] in fp32: the i2v latent [1, 4, 3, 8, 12]
    # in patches of 1 x 2 x 2 is 3 * 4 * 6 = 72 tokens of dim 24, 72 * 24 * 4 = 6912 bytes; one
    # slot per CFG branch, no probe reference (DeepCache compares nothing)
    assert (m["residual_bytes"], m["slots"], m["residual_slots"]) == (6912, 2, 2 * 6912)
    assert m["probe_references"] == 0
    assert m["fits"] and m["total"] >= m["weights"] + m["residual_slots"]

    pipe = get_pipeline("wan-tiny-i2v")
    scheduler = make_scheduler(pipe.solver, 6, pipe.shift)
    shape = pipe.latent_shape(*pipe.size)
    sample = make_sample(backend, pipe, pipe.synthesize(shape, True, True, 0), shape, image=True,
                         seed=0)
    helpers = aot_backend.step_helpers(backend, scheduler.fresh(), sample, cfg_on=True)
    plan = aot_backend.run_plan(backend, chip, config, steps=6, branches=2, helpers=helpers,
                                computed_fraction=None, swap_experts=False)
    cached, computed = _loop_calls(backend, config, sample, scheduler)
    uncached, _ = _loop_calls(backend, CMConfig(), sample, scheduler)
    assert computed == [True, True, False, True, False, True]
    assert plan.schedule["computed_steps"] == sum(computed) == 4
    # 2 branches: 8 computed calls (probe, middle, the residual's sub, tail), 4 reused (probe,
    # the residual's add, tail); caching off, 12 of probe, middle, tail
    assert {n: cached[n] for n in ("probe", "middle", "sub", "add", "tail")} == \
        {"probe": 12, "middle": 8, "sub": 8, "add": 4, "tail": 12}
    assert {n: uncached.get(n, 0) for n in ("probe", "middle", "sub", "add", "tail")} == \
        {"probe": 12, "middle": 12, "sub": 0, "add": 0, "tail": 12}
    for calls in (cached, uncached):  # the scheduler's combinations: the helpers of 6 steps
        assert {n: c for n, c in calls.items() if n.startswith("lincomb")} == \
            {n: round(6 * k) for n, k in helpers.items()}

    def priced(calls, traffic):
        return sum(c * backend.program(n).seconds(chip, traffic)["roofline"] for n, c in calls.items())

    s, t = plan.seconds, plan.seconds["traffic"]
    assert s["run_cached"] == pytest.approx(priced(cached, False), rel=1e-12, abs=0)
    assert s["run_uncached"] == pytest.approx(priced(uncached, False), rel=1e-12, abs=0)
    assert t["run_cached"] == pytest.approx(priced(cached, True), rel=1e-12, abs=0)
    assert s["speedup"] == pytest.approx(priced(uncached, False) / priced(cached, False))
    assert 1 < s["speedup"] and s["reused_call"] < s["full_call"]
    # each program's HBM bound from its HBM traffic (tpu/hbm.py): the memory-space-aware count
    # never exceeds XLA's bytes accessed
    assert all(backend.program(n).hbm_bytes <= backend.program(n).bytes_accessed
               for n in ("probe", "middle", "tail"))
    assert 0 < t["run_cached"] <= s["run_cached"] and t["full_call"] <= s["full_call"]


def _cli(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "commands.aot", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_request_has_one_field_per_flag():
    """`request_of` is the one step from the command line to the library: each field of the
    request is the flag of its name (the cache flags grouped under `cache`), so a flag renamed
    or added without its field fails here."""
    parser = aot_command.build_parser()
    dests = set(vars(parser.parse_args(["--model", "wan-tiny-ti2v", "--topology", "v6e:1x1"])))
    fields = {f.name for f in dataclasses.fields(AotRequest)}
    assert "cache" in fields
    assert (fields - {"cache"}) | {f.name for f in dataclasses.fields(CacheFlags)} == dests
    request = aot_command.request_of(parser.parse_args(
        ["--model", "wan-tiny-ti2v", "--topology", "v6e:2x2", "--sp_size", "4", "--teacache",
         "--cache_warmup", "2", "--guidance_scale", "4.5", "--height", "64"]))
    assert (request.sp_size, request.height, request.guidance_scale) == (4, 64, 4.5)
    assert request.cache.teacache and request.cache.cache_warmup == (2,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.sp_size = 2


@pytest.mark.parametrize("old, new", [("tpu.aot", "commands.aot"),
                                      ("tpu.vae_aot", "commands.vae_aot")])
def test_the_old_module_names_the_command(old, new):
    out = subprocess.run([sys.executable, "-m", old, "--model", "wan-tiny-ti2v"], cwd=ROOT,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines()[-1] == \
        f"python -m {old} is now python -m {new} (the same flags)"


def test_command_prints_the_plan_and_refuses_bad_topologies(tmp_path):
    out = _cli("--model", "wan-tiny-ti2v", "--topology", "v6e:2x2", "--sp_size", "2",
               "--cfg_parallel", "--enable_cache", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "fits" in out.stdout and "middle" in out.stdout and "cached (" in out.stdout
    # where the collectives run: each cfg branch's sp pair is one ICI link (a closed ring)
    placement = json.loads((tmp_path / "r.json").read_text())["placement"]
    assert placement["extents"] == [2, 2, 1] and placement["wraparound"] == [False] * 3
    assert placement["orders"]["mesh"]["sp_ring_steps"] == [[1, 1], [1, 1]]
    assert "collectives on the 2x2x1 chips (no wraparound): mesh: sp rings closed" in out.stdout
    for args, message in [
        (("--topology", "v4:2x2x1"), "expected <generation>"),
        (("--topology", "v7x:2x2"), "3-dimensional"),
        (("--topology", "v6e:2x2x2"), "2-dimensional"),
        (("--topology", "v6e:2x2", "--sp_size", "8"), "topology v6e:2x2 has 4"),
        (("--topology", "v6e:2x4", "--sp_size", "4"), "has 8: give --sp_size 8"),
    ]:
        bad = _cli("--model", "wan-tiny-ti2v", *args)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr[-2000:]


def test_command_compiles_for_v7x_per_device(tmp_path):
    """v7x-8 runs sp 8 over its 4 chips' 8 devices; the report's figures are per device, and its
    sp ring alternates die-to-die steps (0 ICI hops) with 1-hop ones."""
    out = _cli("--model", "wan-tiny-ti2v", "--topology", "v7x:2x2x1", "--sp_size", "8",
               "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["chips"] == 8 and report["chip"]["devices_per_chip"] == 2
    assert report["memory"]["hbm"] == CHIPS["v7x"].hbm_bytes
    mesh = report["placement"]["orders"]["mesh"]
    assert sorted(mesh["sp_ring_steps"][0]) == [0] * 4 + [1] * 4 and mesh["sp_rings_closed"]
    assert '2 a chip; "per chip" below is per device' in out.stdout


def test_command_compiles_a_speech_to_video_clip(tmp_path):
    """S2V samples clip by clip: the command compiles one clip's programs (its audio window and
    motion history as the first clip takes them), which serve every clip."""
    out = _cli("--model", "wan-tiny-s2v", "--topology", "v6e:1x1", "--enable_cache",
               "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    pipe = get_pipeline("wan-tiny-s2v")
    assert report["latent_shape"] == list(pipe.latent_shape(*pipe.size))
    assert report["memory"]["fits"] and report["seconds"]["run_cached"] > 0


def test_missing_libtpu_is_named_with_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # import libtpu -> ImportError
    with pytest.raises(AotError, match=r'pip install "jax\[tpu\]'):
        topology_devices("v6e:2x2")


def test_fsdp_needs_a_mesh():
    from tpu.backend import JaxBackend
    model = build_model("wan-tiny-ti2v")
    with pytest.raises(ValueError, match="several devices"):
        JaxBackend({None: model}, SignalPlan(0, 1), weights="fsdp")


def test_splash_takes_the_block_sizes_of_the_generation_it_compiles_for(monkeypatch):
    """v5e gives a kernel 16 MiB of scoped VMEM: the stock 2048-row query blocks ran out of it in
    Wan2.2 TI2V-5B's real-size middle (E1001), so programs compiled for v5e trace splash with
    that generation's sizes, and every other generation keeps the stock ones."""
    from tpu import attention
    kinds = []
    real = attention.block_sizes

    def spy(kind=None):
        kinds.append(kind or attention._device_kind)
        return real(kind)
    monkeypatch.setattr(attention, "block_sizes", spy)
    _, devices = topology_devices("v5e:2x4")
    backend, _ = _compile(devices, "wan-tiny-ti2v", CMConfig(deepcache=DeepCacheConfig()), sp=2)
    assert backend.program("middle").kernel_flops > 0
    assert kinds and set(kinds) == {"TPU v5 lite"}
    assert real("TPU v5 lite") == (1024, attention.BLOCK_KV, attention.BLOCK_KV_COMPUTE)
    assert real("TPU v6 lite") == (attention.BLOCK_Q, attention.BLOCK_KV, attention.BLOCK_KV_COMPUTE)
    assert attention._device_kind is None  # restored after tracing


def test_a_scanned_middle_costs_what_the_unrolled_one_does(slice_v6e):
    """The middle's blocks as one loop (tpu/scan.py): XLA's analysis counts a loop body once,
    the accounting counts it once per iteration, so flops match the unrolled program's."""
    _, devices = slice_v6e
    config = CMConfig(deepcache=DeepCacheConfig())
    scanned, _ = _compile(devices, "hunyuanvideo-tiny", config, sp=4)
    original = aot_backend.AotBackend.__init__
    try:
        aot_backend.AotBackend.__init__ = lambda self, *a, **k: original(self, *a, scan_blocks=False, **k)
        unrolled, _ = _compile(devices, "hunyuanvideo-tiny", config, sp=4)
    finally:
        aot_backend.AotBackend.__init__ = original
    assert [(r.start, r.stop) for r in scanned.runs] == [(0, 3)] and unrolled.runs == []
    s, u = scanned.program("middle"), unrolled.program("middle")
    assert s.flops == pytest.approx(u.flops, rel=0.01)
    assert s.kernel_flops == u.kernel_flops > 0  # the splash kernel, once per block
    assert s.argument_bytes == pytest.approx(u.argument_bytes, rel=0.1)  # tiling of small stacks
    # FSDP: the loop gathers each block's weights in its body, as the unrolled blocks do
    assert s.collectives == u.collectives and s.collectives["all-gather"]["count"] > 0


def test_loop_accounting_counts_a_body_per_iteration():
    hlo = "\n".join([
        "HloModule m",
        "%cond (p: (s32[], f32[8])) -> pred[] {",
        "  %c = s32[] constant(5)",
        "  ROOT %lt = pred[] compare(%i, %c), direction=LT",
        "}",
        "%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
        "  %ag = f32[8]{0} all-gather(%x), replica_groups=[2,4]<=[8], dimensions={0}",
        "}",
        "ENTRY %main (a: f32[8]) -> f32[8] {",
        "  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body",
        "  %ag2 = f32[8]{0} all-gather(%y), replica_groups=[2,4]<=[8], dimensions={0}",
        "}",
    ])
    assert tpu.hlo.loops(hlo) == {"main": [("body", 5)]}
    assert tpu.hlo.collectives(hlo)["all-gather"]["count"] == 6


def test_loop_accounting_reads_v7x_sparsecore_computations_and_windowed_einsums():
    """libtpu for v7x closes a SparseCore computation with `}, execution_thread=...` ahead of the
    entry (read as a bare `}` only, the entry was lost in it), and runs an FSDP matmul as a
    windowed einsum: a u32 counter from 0 by 2 below 4, two iterations (counted once, half the
    matmul's flops were dropped)."""
    hlo = "\n".join([
        "HloModule m",
        "%offloaded (p: bf16[4]) -> bf16[8] {",
        "  %ag = bf16[8]{0} all-gather(%p), replica_groups=[1,2]<=[2], dimensions={0}",
        '}, execution_thread="sparsecore"',
        "%windowed_cond (p: (bf16[8], u32[])) -> pred[] {",
        "  %c = u32[]{:T(128)} constant(4), metadata={}",
        "  %p = (bf16[8], u32[]) parameter(0)",
        "  %i = u32[]{:T(128)} get-tuple-element(%p), index=1, metadata={}",
        "  ROOT %lt = pred[]{:T(512)} compare(%i, %c), direction=LT, metadata={}",
        "}",
        "%windowed_body (p: (bf16[8], u32[])) -> (bf16[8], u32[]) {",
        "  %two..sunk = u32[]{:T(128)} constant(2), metadata={}",
        "  %p = (bf16[8], u32[]) parameter(0)",
        "  %i = u32[]{:T(128)} get-tuple-element(%p), index=1",
        "  %x = bf16[8]{0} get-tuple-element(%p), index=0",
        "  %next = u32[]{:T(128)} add(%i, %two..sunk), metadata={}",
        "  ROOT %t = (bf16[8]{0}, u32[]{:T(128)}) tuple(%x, %next)",
        "}",
        "ENTRY %main (a: bf16[8]) -> bf16[8] {",
        "  %zero = u32[]{:T(128)} constant(0)",
        "  %start = u32[]{:T(128)} copy(%zero)",
        "  %init = (bf16[8]{0}, u32[]{:T(128)}) tuple(%a, /*index=1*/%start)",
        "  %w = (bf16[8]{0}, u32[]{:T(128)}) while(%init), condition=%windowed_cond, "
        "body=%windowed_body, backend_config={}",
        "}",
    ])
    assert tpu.hlo.computations(hlo)[1] == "main"
    assert tpu.hlo.loops(hlo) == {"main": [("windowed_body", 2)]}


def test_loop_accounting_reads_past_a_kernel_whose_text_runs_over_lines():
    """A Mosaic kernel's custom call carries metadata with newlines; a line of it starting `}}`
    does not end the computation (it did: the loop body's collectives after the splash kernel
    counted once, not once per iteration)."""
    hlo = "\n".join([
        "HloModule m",
        "%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
        "  %k = f32[8]{0} custom-call(%x), custom_call_target=\"tpu_custom_call\", "
        "frontend_attributes={kernel_metadata={",
        "\"xprof_metadata\":\"{\\\"block_q\\\": 128}\"",
        "}}, metadata={op_name=\"splash\"}",
        "  %ag = f32[8]{0} all-gather(%k), replica_groups=[2,4]<=[8], dimensions={0}",
        "}",
        "ENTRY %main (a: f32[8]) -> f32[8] {",
        "  %k2 = f32[8]{0} custom-call(%a), custom_call_target=\"tpu_custom_call\", x={",
        "}}",
        "  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, "
        "backend_config={\"known_trip_count\":{\"n\":\"7\"}}",
        "}",
    ])
    assert tpu.hlo.loops(hlo) == {"main": [("body", 7)]}
    assert tpu.hlo.collectives(hlo)["all-gather"]["count"] == 7
