"""Sharded loading (issue 24): the JAX backend reads from the checkpoint only the rows each device
keeps (`modules.checkpoint.open_checkpoint` + `tpu.loading`), with the checks and the layout
conversion of `load_model`, and gets bit for bit the weights and latents of the old path (the
whole model read first, each weight placed whole and then resharded). The mesh cases run on 8
emulated CPU devices in their own process (tests/sharded_load_check.py)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modules import checkpoint
from modules.checkpoint import WEIGHTS_NAME, load_model, open_checkpoint, save_checkpoint
from modules.layouts import CheckpointError
from modules.safetensors_reader import read_header
from tests.model_inputs import random_model
from tpu import loading

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def facts():
    # torch on one thread in the child (it writes and reads the checkpoints): on busy cores a
    # second OpenMP thread spin-waits for its turn
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "sharded_load_check.py")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_on_8_devices_the_weights_and_latents_equal_the_old_path_bit_for_bit(facts):
    assert facts["devices"] == 8
    cases = facts["cases"]
    assert {c["weights"] for c in cases} == {"fsdp", "replicated"}
    for case in cases:
        assert case["meta_models"], case  # the backend got no host copy of any weight
        # > 50: a scanned run counts each of its stacked weights once (tpu/scan.py)
        assert case["weights_differ"] == [] and case["weights_compared"] > 50, case
        assert (case["split"] > 0) == (case["weights"] == "fsdp"), case
        # one process holding every device reads every byte once: never a row twice
        assert case["bytes_read"] == case["checkpoint_bytes"], case
        assert case["latents_equal"] and case["finite"], case
        assert case["computed"][0] == case["computed"][1] < case["steps"], case  # TeaCache skipped


# --- the reader, in this process ------------------------------------------------------------------

@pytest.mark.parametrize("name,layout", [("hunyuanvideo-tiny", "diffusers"),
                                         ("hunyuanvideo-tiny", "official"),
                                         ("wan-tiny-i2v", "diffusers"),
                                         ("wan-tiny-s2v", "official")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
def test_any_rows_of_any_parameter_are_those_load_model_gives(tmp_path, name, layout, dtype):
    saved = save_checkpoint(random_model(name, std=0.2), tmp_path / "ckpt", layout=layout,
                            max_shard_bytes=32 * 1024)
    whole, info = load_model(saved, name, dtype=dtype)
    model, reader, opened = open_checkpoint(saved, name, dtype=dtype)
    assert opened == info
    with reader:
        for key, p in whole.named_parameters():
            meta = model.get_parameter(key)
            assert meta.is_meta and meta.shape == p.shape and meta.dtype == p.dtype, key
            assert torch.equal(reader.read(key), p.detach()), key
            if p.ndim and p.shape[0] >= 3:
                n = p.shape[0]
                assert torch.equal(reader.read(key, 1, n - 1), p.detach()[1:-1]), key
                assert torch.equal(reader.read(key, n // 2, n // 2 + 1), p.detach()[n // 2:n // 2 + 1])


def test_a_slice_reads_only_its_rows_bytes(tmp_path):
    saved = save_checkpoint(random_model("wan-tiny-ti2v"), tmp_path / "ckpt")
    _, reader, _ = open_checkpoint(saved, "wan-tiny-ti2v", dtype=torch.bfloat16)
    with reader:
        rows = reader.read("blocks.0.ffn.0.weight", 8, 16)  # [32, 24] fp32 stored
        assert rows.shape == (8, 24) and rows.dtype == torch.bfloat16
        assert reader.bytes_read == 8 * 24 * 4
        island = reader.read("blocks.0.modulation")  # an fp32 island stays fp32
        assert island.dtype == torch.float32


def _poison_row(saved: Path, key: str, row: int) -> Path:
    weights = saved / WEIGHTS_NAME
    info = read_header(weights)[key]
    row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
    with open(weights, "r+b") as fh:
        fh.seek(info.offset + row * row_bytes)
        fh.write(torch.tensor([math.nan], dtype=info.dtype).numpy().tobytes())
    return weights


def test_a_non_finite_value_stops_the_rows_that_hold_it_with_the_load_message(tmp_path):
    saved = save_checkpoint(random_model("wan-tiny-ti2v"), tmp_path / "ckpt")
    weights = _poison_row(saved, "blocks.1.ffn.0.weight", 20)
    with pytest.raises(CheckpointError) as whole:
        load_model(saved, "wan-tiny-ti2v")
    _, reader, _ = open_checkpoint(saved, "wan-tiny-ti2v")
    with reader:
        assert torch.isfinite(reader.read("blocks.1.ffn.0.weight", 0, 16)).all()
        with pytest.raises(CheckpointError) as rows:
            reader.read("blocks.1.ffn.0.weight", 16, 32)
        with pytest.raises(CheckpointError) as all_rows:
            reader.read("blocks.1.ffn.0.weight")
    assert str(all_rows.value) == str(whole.value)
    assert str(rows.value).startswith(f"{weights}: tensor 'blocks.1.ffn.0.weight' rows 16-31 "
                                      "holds 1 NaN")


def test_placing_stops_at_a_bad_weight_from_any_reading_thread(tmp_path):
    saved = save_checkpoint(random_model("wan-tiny-ti2v"), tmp_path / "ckpt")
    _poison_row(saved, "blocks.3.cross_attn.v.weight", 0)
    model, reader, _ = open_checkpoint(saved, "wan-tiny-ti2v")
    specs = {n: loading.WeightSpec(tuple(p.shape), p.dtype, None)
             for n, p in model.named_parameters()}
    with reader, pytest.raises(CheckpointError, match="blocks.3.cross_attn.v.weight' holds 1 NaN"):
        loading.place_all(specs, reader.read, threads=4)


def test_open_checkpoint_makes_every_check_of_a_load(tmp_path):
    from safetensors.torch import load_file, save_file
    saved = save_checkpoint(random_model("wan-tiny-ti2v"), tmp_path / "ckpt")
    sd = load_file(saved / WEIGHTS_NAME)
    sd["blocks.0.self_attn.q.weight"] = torch.zeros(24, 12)
    del sd["blocks.1.norm3.bias"]
    save_file(sd, saved / WEIGHTS_NAME)
    with pytest.raises(CheckpointError) as loaded:
        load_model(saved, "wan-tiny-ti2v")
    with pytest.raises(CheckpointError) as opened:
        open_checkpoint(saved, "wan-tiny-ti2v")
    assert str(opened.value) == str(loaded.value)
    assert "missing (1): blocks.1.norm3.bias" in str(opened.value)


def test_a_file_cut_short_after_its_header_was_checked_is_an_error(tmp_path):
    saved = save_checkpoint(random_model("wan-tiny-ti2v"), tmp_path / "ckpt")
    _, reader, _ = open_checkpoint(saved, "wan-tiny-ti2v")
    weights = saved / WEIGHTS_NAME
    info = read_header(weights)["blocks.3.ffn.2.weight"]
    os.truncate(weights, info.offset + 10)
    with reader, pytest.raises(CheckpointError, match="truncated since its header was checked"):
        reader.read("blocks.3.ffn.2.weight")


def test_row_sources_follow_the_layout_conversion(tmp_path):
    """HunyuanVideo-1.5's diffusers layout splits the refiner's q/k/v and swaps the final
    modulation's halves: each is read as stored row ranges."""
    saved = save_checkpoint(random_model("hunyuanvideo-tiny"), tmp_path / "ckpt", layout="diffusers")
    _, reader, _ = open_checkpoint(saved, "hunyuanvideo-tiny")
    with reader:
        qkv = reader.sources["txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight"]
        assert [r.name.rsplit(".", 2)[-2] for r in qkv.parts] == ["to_q", "to_k", "to_v"]
        final = reader.sources["final_layer.adaLN_modulation.1.weight"]
        half = final.shape[0] // 2
        assert [(r.start, r.stop) for r in final.parts] == [(half, 2 * half), (0, half)]
        plain = reader.sources["double_blocks.0.img_attn_q.weight"]
        assert plain.parts == (checkpoint.Rows("transformer_blocks.0.attn.to_q.weight", 0,
                                               plain.shape[0]),)
