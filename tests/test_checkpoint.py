"""Checkpoints: layout round trips, shards, dtype casting, and one clear error per bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from modules.checkpoint import INDEX_NAME, WEIGHTS_NAME, config_to_json, load_model, save_checkpoint
from modules.layouts import DIFFUSERS, OFFICIAL, CheckpointError
from tests.model_inputs import hy_inputs, random_model, wan_inputs

FAMILIES = ["wan-tiny-i2v", "hunyuanvideo-tiny-meanflow"]


def _run(model):
    with torch.no_grad():
        if model.config.__class__.__name__ == "WanConfig":
            return model(*wan_inputs(model.config, per_token=False))
        return model(**hy_inputs(model.config, i2v=True))


@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip_official_diffusers_official(tmp_path, name):
    model = random_model(name)
    official = save_checkpoint(model, tmp_path / "official")
    first, info = load_model(official)
    assert info["layout"] == OFFICIAL
    diff = save_checkpoint(first, tmp_path / "diffusers", layout=DIFFUSERS)
    second, info = load_model(diff)
    assert info["layout"] == DIFFUSERS
    assert torch.equal(_run(second), _run(model))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  second.state_dict().values(), strict=True))


@pytest.mark.parametrize("name", FAMILIES)
def test_sharded_and_single_file_agree(tmp_path, name):
    model = random_model(name)
    single = save_checkpoint(model, tmp_path / "single", layout=DIFFUSERS)
    sharded = save_checkpoint(model, tmp_path / "sharded", layout=DIFFUSERS, max_shard_bytes=20_000)
    index = json.loads((sharded / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 2
    a, _ = load_model(single)
    b, info = load_model(sharded)
    assert len(info["files"]) > 2
    assert torch.equal(_run(a), _run(b))
    # the index JSON itself and a bare .safetensors file are accepted paths too
    assert torch.equal(_run(load_model(sharded / INDEX_NAME)[0]), _run(a))
    assert torch.equal(_run(load_model(single / WEIGHTS_NAME)[0]), _run(a))


def test_diffusers_layout_fits_diffusers_classes(tmp_path):
    """Our diffusers layout and config.json load into the diffusers classes themselves."""
    diffusers = pytest.importorskip("diffusers")
    classes = {"wan-tiny-i2v": diffusers.WanTransformer3DModel,
               "hunyuanvideo-tiny-meanflow": diffusers.HunyuanVideo15Transformer3DModel}
    for name, cls in classes.items():
        out = save_checkpoint(random_model(name), tmp_path / name, layout=DIFFUSERS)
        config = json.loads((out / "config.json").read_text())
        ref = cls.from_config({k: v for k, v in config.items() if k != "static_dit"})
        ref.load_state_dict(load_file(out / WEIGHTS_NAME), strict=True)


def test_diffusers_config_json_holds_the_diffusers_constructor_arguments():
    """One mapping per family: the diffusers config.json we write is `_class_name` plus the
    arguments the diffusers oracles are built with (tuples written as lists)."""
    from modules.hunyuan_video15_format import diffusers_config as hunyuan_diffusers_config
    from modules.registry import get_config
    from modules.wan_format import diffusers_config as wan_diffusers_config
    for name, arguments in (("wan2.2-ti2v-5b", wan_diffusers_config),
                            ("wan2.2-i2v-a14b-low", wan_diffusers_config),
                            ("hunyuanvideo-1.5-480p_i2v_step_distilled", hunyuan_diffusers_config)):
        config = config_to_json(get_config(name), DIFFUSERS)
        del config["_class_name"], config["static_dit"]
        assert config == {k: list(v) if isinstance(v, tuple) else v
                          for k, v in arguments(get_config(name)).items()}


def test_released_config_json_without_our_fields(tmp_path):
    """A config.json as the official repos ship it (no static_dit) gives the named config."""
    from modules.checkpoint import config_from_json
    from modules.registry import build_model, get_config
    for name, layout in (("wan2.2-ti2v-5b", OFFICIAL), ("wan2.2-i2v-a14b-high", DIFFUSERS),
                         ("hunyuanvideo-1.5-720p_t2v", OFFICIAL),
                         ("hunyuanvideo-1.5-480p_i2v_step_distilled", DIFFUSERS)):
        config = config_to_json(build_model(name, meta=True).config, layout)
        del config["static_dit"]
        assert config_from_json(config) == get_config(name)


# As the released repositories ship them (model_spec 2.8, 3.8).
OFFICIAL_WAN_TI2V = {"_class_name": "WanModel", "_diffusers_version": "0.33.0", "dim": 3072,
                     "eps": 1e-06, "ffn_dim": 14336, "freq_dim": 256, "in_dim": 48,
                     "model_type": "ti2v", "num_heads": 24, "num_layers": 30, "out_dim": 48,
                     "text_len": 512}
OFFICIAL_HY_720P_T2V = {
    "_class_name": "HunyuanVideo_1_5_DiffusionTransformer", "concat_condition": True,
    "glyph_byT5_v2": True, "guidance_embed": False, "heads_num": 16, "hidden_size": 2048,
    "ideal_resolution": "720p", "ideal_task": "t2v", "in_channels": 32,
    "is_reshape_temporal_channels": False, "mlp_act_type": "gelu_tanh", "mlp_width_ratio": 4,
    "mm_double_blocks_depth": 54, "mm_single_blocks_depth": 0, "out_channels": 32,
    "patch_size": [1, 1, 1], "qk_norm": True, "qk_norm_type": "rms", "qkv_bias": True,
    "rope_dim_list": [16, 56, 56], "rope_theta": 256, "text_pool_type": None,
    "text_projection": "single_refiner", "text_states_dim": 3584, "text_states_dim_2": None,
    "use_attention_mask": True, "use_cond_type_embedding": True, "use_meanflow": False,
    "vision_projection": "linear", "vision_states_dim": 1152}


def test_official_config_json_files():
    from modules.checkpoint import config_from_json
    from modules.registry import get_config
    assert config_from_json(OFFICIAL_WAN_TI2V) == get_config("wan2.2-ti2v-5b")
    assert config_from_json(OFFICIAL_HY_720P_T2V) == get_config("hunyuanvideo-1.5-720p_t2v")
    with pytest.raises(CheckpointError, match="mm_single_blocks_depth"):
        config_from_json({**OFFICIAL_HY_720P_T2V, "mm_single_blocks_depth": 20})
    with pytest.raises(CheckpointError, match="Wan2.1 I2V model"):
        config_from_json({"_class_name": "WanTransformer3DModel", "image_dim": 1280,
                          "added_kv_proj_dim": 5120})
    with pytest.raises(CheckpointError, match="expected a Wan2.2 or HunyuanVideo-1.5"):
        config_from_json({"_class_name": "FluxTransformer2DModel"})


def test_dtype_cast_keeps_fp32_islands(tmp_path):
    model = random_model("wan-tiny-ti2v")
    out = save_checkpoint(model, tmp_path / "m", layout=DIFFUSERS)
    bf16, _ = load_model(out, dtype=torch.bfloat16)
    dtypes = {k: v.dtype for k, v in bf16.state_dict().items()}
    assert dtypes["time_projection.1.weight"] == torch.float32
    assert dtypes["blocks.0.modulation"] == torch.float32
    assert dtypes["head.modulation"] == torch.float32
    assert dtypes["blocks.0.self_attn.q.weight"] == torch.bfloat16
    ref = _run(model)
    got = _run(bf16)
    assert got.dtype == torch.float32
    assert ((got - ref).norm() / ref.norm()).item() < 0.05


def test_loaded_parameters_are_real_tensors(tmp_path):
    out = save_checkpoint(random_model("hunyuanvideo-tiny"), tmp_path / "m")
    model, _ = load_model(out)
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("layout", [OFFICIAL, DIFFUSERS])
def test_headers_only_load_gives_the_loaded_shapes_and_dtypes(tmp_path, monkeypatch, layout):
    out = save_checkpoint(random_model("wan-tiny-ti2v"), tmp_path / "m", layout=layout,
                          dtype=torch.bfloat16)
    loaded, _ = load_model(out, dtype=torch.bfloat16)
    import modules.safetensors_reader as reader
    monkeypatch.setattr(reader, "safe_open", None)  # no tensor data may be read
    meta, info = load_model(out, dtype=torch.bfloat16, meta=True)
    assert all(p.is_meta for p in meta.parameters())
    want = {k: (v.shape, v.dtype) for k, v in loaded.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in meta.state_dict().items()} == want
    stored, _ = load_model(out, meta=True)  # no dtype asked: the checkpoint's own
    assert stored.blocks[0].self_attn.q.weight.dtype == torch.bfloat16


# --- one clear error per bad input --------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    return save_checkpoint(random_model("wan-tiny-i2v"), tmp_path / "wan")


def test_corrupt_file(saved):
    (saved / WEIGHTS_NAME).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_model(saved)
    (saved / WEIGHTS_NAME).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_model(saved)


def test_truncated_file(saved):
    weights = saved / WEIGHTS_NAME
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(saved)


def test_missing_shard(tmp_path):
    out = save_checkpoint(random_model("wan-tiny-i2v"), tmp_path / "s", max_shard_bytes=20_000)
    (out / "diffusion_pytorch_model-00002-of-00009.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"1 of 9 shards are missing: \['diffusion_pytorch"):
        load_model(out)


def test_wrong_family(tmp_path):
    out = save_checkpoint(random_model("hunyuanvideo-tiny"), tmp_path / "hy")
    with pytest.raises(CheckpointError, match="holds a HunyuanVideo-1.5 DiT checkpoint; the "
                                              "requested model is a Wan2.2 DiT"):
        load_model(out, "wan-tiny-i2v")


def test_not_a_dit(tmp_path):
    save_file({"encoder.weight": torch.zeros(2)}, tmp_path / "vae.safetensors")
    with pytest.raises(CheckpointError, match="not a Wan2.2 or HunyuanVideo-1.5 DiT"):
        load_model(tmp_path / "vae.safetensors", "wan-tiny-i2v")


def test_misshaped_missing_and_unexpected_listed_together(saved):
    sd = load_file(saved / WEIGHTS_NAME)
    sd["blocks.0.self_attn.q.weight"] = torch.zeros(24, 12)
    del sd["blocks.1.norm3.bias"]
    sd["blocks.0.extra.weight"] = torch.zeros(3)
    save_file(sd, saved / WEIGHTS_NAME)
    with pytest.raises(CheckpointError) as err:
        load_model(saved)
    text = str(err.value)
    assert "missing (1): blocks.1.norm3.bias" in text
    assert "unexpected (1): blocks.0.extra.weight" in text
    assert "mis-shaped (1): blocks.0.self_attn.q.weight: checkpoint [24, 12], model [24, 24]" in text


def test_config_mismatch_is_a_shape_error(saved):
    with pytest.raises(CheckpointError, match="mis-shaped"):
        load_model(saved, "wan-tiny-ti2v")  # in_dim 4 instead of 12


def test_wan21_i2v_is_refused(saved):
    sd = load_file(saved / WEIGHTS_NAME)
    sd["blocks.0.cross_attn.k_img.weight"] = torch.zeros(24, 24)
    save_file(sd, saved / WEIGHTS_NAME)
    with pytest.raises(CheckpointError, match="Wan2.1 I2V checkpoint"):
        load_model(saved)


def test_paths(tmp_path, saved):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        load_model(tmp_path / "nowhere", "wan-tiny-i2v")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no .safetensors file and no index JSON"):
        load_model(tmp_path / "empty", "wan-tiny-i2v")
    (saved / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json beside the weights; name the model"):
        load_model(saved)
    pt = tmp_path / "model.pth"
    pt.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="pickles are not loaded"):
        load_model(pt, "wan-tiny-i2v")


def test_save_never_overwrites(tmp_path, saved):
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    with pytest.raises(CheckpointError, match="already exists"):
        save_checkpoint(random_model("wan-tiny-i2v", seed=9), saved)
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wan"]  # no temporary left behind
