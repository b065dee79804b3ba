"""Tier 2: tiny random-weight DiTs against diffusers 0.42.1 as a numerical oracle (fp32)."""

from __future__ import annotations

import pytest
import torch

from modules import ops
from modules.hunyuan_video15_format import diffusers_config as hunyuan_diffusers_config
from modules.hunyuan_video15_format import to_diffusers as hunyuan_to_diffusers
from modules.wan_format import diffusers_config as wan_diffusers_config
from modules.wan_format import to_diffusers as wan_to_diffusers
from tests.model_inputs import hy_inputs, random_model, rel_err, wan_inputs

diffusers = pytest.importorskip("diffusers")


def diffusers_wan(model):
    cfg = model.config
    ref = diffusers.WanTransformer3DModel(**wan_diffusers_config(cfg)).eval()
    ref.load_state_dict(wan_to_diffusers(model.state_dict()), strict=True)
    return ref


def diffusers_hunyuan(model):
    cfg = model.config
    ref = diffusers.HunyuanVideo15Transformer3DModel(**hunyuan_diffusers_config(cfg)).eval()
    ref.load_state_dict(hunyuan_to_diffusers(model.state_dict()), strict=True)
    return ref


@pytest.mark.parametrize("name, per_token", [("wan-tiny-ti2v", True), ("wan-tiny-i2v", False)])
def test_wan_matches_diffusers(name, per_token):
    model = random_model(name)
    ref = diffusers_wan(model)
    x, t, context, y = wan_inputs(model.config, per_token=per_token)
    with torch.no_grad():
        ours = model(x, t, context, y)
        xin = x if y is None else torch.cat([x, y], dim=1)
        # diffusers takes the text pre-padded to text_len and attends to the padding (T3).
        padded = torch.nn.functional.pad(context, (0, 0, 0, model.config.text_len - context.shape[1]))
        theirs = ref(xin, t, padded, return_dict=False)[0]
    assert ours.shape == theirs.shape == (2, model.config.out_dim, 3, 4, 6)
    assert rel_err(ours, theirs) <= 1e-5


@pytest.mark.parametrize("name, i2v", [("hunyuanvideo-tiny", False), ("hunyuanvideo-tiny", True),
                                       ("hunyuanvideo-tiny-meanflow", True)])
def test_hunyuan_matches_diffusers(name, i2v):
    model = random_model(name)
    ref = diffusers_hunyuan(model)
    kw = hy_inputs(model.config, i2v=i2v)
    with torch.no_grad():
        ours = model(**kw)
        cond = kw.get("cond", torch.zeros(2, model.config.in_channels + 1, *kw["x"].shape[2:]))
        vision = kw.get("vision", torch.zeros(2, model.config.vision_len, model.config.vision_dim))
        theirs = ref(torch.cat([kw["x"], cond], dim=1), kw["t"], kw["text"], kw["text_mask"],
                     timestep_r=kw.get("timestep_r"), encoder_hidden_states_2=kw["byt5"],
                     encoder_attention_mask_2=kw["byt5_mask"], image_embeds=vision,
                     return_dict=False)[0]
    assert ours.shape == theirs.shape == (2, model.config.out_channels, 3, 4, 5)
    assert rel_err(ours, theirs) <= 1e-6


def test_fused_formulations_keep_the_oracle_match():
    model = random_model("wan-tiny-ti2v")
    ref = diffusers_wan(model)
    x, t, context, y = wan_inputs(model.config, per_token=True, batch=1)
    with torch.no_grad():
        padded = torch.nn.functional.pad(context, (0, 0, 0, model.config.text_len - context.shape[1]))
        theirs = ref(x, t, padded, return_dict=False)[0]
        with ops.use(rms_norm="fused", layer_norm="fused", layer_norm_modulate="fused",
                     rope="fused", attention="reference"):
            ours = model(x, t, context, y)
    assert rel_err(ours, theirs) <= 1e-5
