"""HunyuanVideo-1.5 checkpoints: config.json in the official
(`HunyuanVideo_1_5_DiffusionTransformer`) and diffusers (`HunyuanVideo15Transformer3DModel`)
vocabularies, and the official <-> diffusers keys: renames plus the two transforms that are not
(the refiner qkv split and the final-layer shift/scale half swap; model_spec 2.8, 3.8)."""

from __future__ import annotations

import re

import torch

from modules.hunyuan_video15 import HunyuanVideo15Config
from modules.layouts import (
    DIFFUSERS,
    OFFICIAL,
    CheckpointError,
    CheckpointFormat,
    KeyRules,
    StateDict,
    json_values,
    swap_halves,
)

_REFINER = "txt_in.individual_token_refiner.blocks.{i}."
_REFINER_D = "context_embedder.token_refiner.refiner_blocks.{i}."
RULES = KeyRules((
    ("img_in.proj.", "x_embedder.proj."),
    ("time_in.mlp.0.", "time_embed.timestep_embedder.linear_1."),
    ("time_in.mlp.2.", "time_embed.timestep_embedder.linear_2."),
    ("time_r_in.mlp.0.", "time_embed.timestep_embedder_r.linear_1."),
    ("time_r_in.mlp.2.", "time_embed.timestep_embedder_r.linear_2."),
    ("txt_in.t_embedder.mlp.0.", "context_embedder.time_text_embed.timestep_embedder.linear_1."),
    ("txt_in.t_embedder.mlp.2.", "context_embedder.time_text_embed.timestep_embedder.linear_2."),
    ("txt_in.c_embedder.linear_1.", "context_embedder.time_text_embed.text_embedder.linear_1."),
    ("txt_in.c_embedder.linear_2.", "context_embedder.time_text_embed.text_embedder.linear_2."),
    ("txt_in.input_embedder.", "context_embedder.proj_in."),
    (_REFINER + "norm1.", _REFINER_D + "norm1."),
    (_REFINER + "norm2.", _REFINER_D + "norm2."),
    (_REFINER + "self_attn_proj.", _REFINER_D + "attn.to_out.0."),
    (_REFINER + "mlp.fc1.", _REFINER_D + "ff.net.0.proj."),
    (_REFINER + "mlp.fc2.", _REFINER_D + "ff.net.2."),
    (_REFINER + "adaLN_modulation.1.", _REFINER_D + "norm_out.linear."),
    ("byt5_in.layernorm.", "context_embedder_2.norm."),
    ("byt5_in.fc1.", "context_embedder_2.linear_1."),
    ("byt5_in.fc2.", "context_embedder_2.linear_2."),
    ("byt5_in.fc3.", "context_embedder_2.linear_3."),
    ("vision_in.proj.0.", "image_embedder.norm_in."),
    ("vision_in.proj.1.", "image_embedder.linear_1."),
    ("vision_in.proj.3.", "image_embedder.linear_2."),
    ("vision_in.proj.4.", "image_embedder.norm_out."),
    ("cond_type_embedding.weight", "cond_type_embed.weight"),
    ("double_blocks.{i}.img_mod.linear.", "transformer_blocks.{i}.norm1.linear."),
    ("double_blocks.{i}.txt_mod.linear.", "transformer_blocks.{i}.norm1_context.linear."),
    *((f"double_blocks.{{i}}.img_attn_{p}.", f"transformer_blocks.{{i}}.attn.to_{p}.")
      for p in "qkv"),
    ("double_blocks.{i}.img_attn_q_norm.", "transformer_blocks.{i}.attn.norm_q."),
    ("double_blocks.{i}.img_attn_k_norm.", "transformer_blocks.{i}.attn.norm_k."),
    ("double_blocks.{i}.img_attn_proj.", "transformer_blocks.{i}.attn.to_out.0."),
    *((f"double_blocks.{{i}}.txt_attn_{p}.", f"transformer_blocks.{{i}}.attn.add_{p}_proj.")
      for p in "qkv"),
    ("double_blocks.{i}.txt_attn_q_norm.", "transformer_blocks.{i}.attn.norm_added_q."),
    ("double_blocks.{i}.txt_attn_k_norm.", "transformer_blocks.{i}.attn.norm_added_k."),
    ("double_blocks.{i}.txt_attn_proj.", "transformer_blocks.{i}.attn.to_add_out."),
    ("double_blocks.{i}.img_mlp.fc1.", "transformer_blocks.{i}.ff.net.0.proj."),
    ("double_blocks.{i}.img_mlp.fc2.", "transformer_blocks.{i}.ff.net.2."),
    ("double_blocks.{i}.txt_mlp.fc1.", "transformer_blocks.{i}.ff_context.net.0.proj."),
    ("double_blocks.{i}.txt_mlp.fc2.", "transformer_blocks.{i}.ff_context.net.2."),
    ("final_layer.adaLN_modulation.1.", "norm_out.linear."),  # plus the half swap below
    ("final_layer.linear.", "proj_out."),
))

_FINAL_MOD = ("final_layer.adaLN_modulation.1.", "norm_out.linear.")
_QKV = re.compile(r"^txt_in\.individual_token_refiner\.blocks\.(\d+)\.self_attn_qkv\.(weight|bias)$")
_QKV_SPLIT = re.compile(
    r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.attn\.to_([qkv])\.(weight|bias)$")


def to_diffusers(sd: StateDict) -> dict[str, torch.Tensor]:
    rest, out = {}, {}
    for key, value in sd.items():
        m = _QKV.match(key)
        if m:  # fused refiner qkv rows are q, k, v in that order (T18)
            for part, chunk in zip("qkv", value.chunk(3, dim=0), strict=True):
                out[f"{_REFINER_D.format(i=m.group(1))}attn.to_{part}.{m.group(2)}"] = chunk
        elif key.startswith(_FINAL_MOD[0]):  # official [shift; scale], diffusers [scale; shift]
            rest[key] = swap_halves(value)
        else:
            rest[key] = value
    out.update(RULES.to_diffusers(rest))
    return out


def from_diffusers(sd: StateDict) -> dict[str, torch.Tensor]:
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    rest = {}
    for key, value in sd.items():
        m = _QKV_SPLIT.match(key)
        if m:
            parts.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = value
        elif key.startswith(_FINAL_MOD[1]):
            rest[key] = swap_halves(value)
        else:
            rest[key] = value
    out = RULES.from_diffusers(rest)
    for (block, kind), qkv in parts.items():
        if set(qkv) != set("qkv"):  # leave the incomplete triple for the strict check to name
            for part, value in qkv.items():
                out[f"{_REFINER_D.format(i=block)}attn.to_{part}.{kind}"] = value
            continue
        out[f"{_REFINER.format(i=block)}self_attn_qkv.{kind}"] = torch.cat(
            [qkv["q"], qkv["k"], qkv["v"]], dim=0)
    return out


def diffusers_config(c: HunyuanVideo15Config) -> dict:
    """Constructor arguments of diffusers' HunyuanVideo15Transformer3DModel for one of ours (the
    input channels are [latent | image latent | mask], T9)."""
    return dict(in_channels=2 * c.in_channels + 1, out_channels=c.out_channels,
                num_attention_heads=c.num_heads, attention_head_dim=c.head_dim,
                num_layers=c.num_layers, num_refiner_layers=c.refiner_layers,
                mlp_ratio=c.mlp_ratio, patch_size=c.patch_size[1],
                patch_size_t=c.patch_size[0], qk_norm="rms_norm", text_embed_dim=c.text_dim,
                text_embed_2_dim=c.byt5_dim, image_embed_dim=c.vision_dim,
                rope_theta=c.rope_theta, rope_axes_dim=c.rope_axes, use_meanflow=c.use_meanflow)


def config_to_json(c: HunyuanVideo15Config, layout: str) -> dict:
    if layout != OFFICIAL:
        return {"_class_name": "HunyuanVideo15Transformer3DModel",
                **json_values(diffusers_config(c))}
    return dict(_class_name="HunyuanVideo_1_5_DiffusionTransformer",
                patch_size=list(c.patch_size), in_channels=c.in_channels,
                concat_condition=True, out_channels=c.out_channels,
                hidden_size=c.hidden_size, heads_num=c.num_heads,
                mlp_width_ratio=c.mlp_ratio, mm_double_blocks_depth=c.num_layers,
                mm_single_blocks_depth=0, rope_dim_list=list(c.rope_axes),
                rope_theta=c.rope_theta, text_states_dim=c.text_dim,
                vision_states_dim=c.vision_dim, use_meanflow=c.use_meanflow)


# Architecture switches of the official HunyuanVideo-1.5 config that every release shares.
_FIXED = {"mm_single_blocks_depth": 0, "guidance_embed": False, "concat_condition": True,
          "glyph_byT5_v2": True, "text_states_dim_2": None, "use_cond_type_embedding": True,
          "text_projection": "single_refiner", "vision_projection": "linear"}


def config_from_json(values: dict) -> HunyuanVideo15Config | None:
    g = values.get
    cls_name = g("_class_name", "")
    if cls_name == "HunyuanVideo_1_5_DiffusionTransformer" or "mm_double_blocks_depth" in values:
        unsupported = {k: g(k) for k, want in _FIXED.items() if k in values and g(k) != want}
        if unsupported:
            raise CheckpointError(f"config.json sets {unsupported}; every released "
                                  f"HunyuanVideo-1.5 variant has {_FIXED}")
        return HunyuanVideo15Config(
            hidden_size=g("hidden_size"), num_heads=g("heads_num"),
            num_layers=g("mm_double_blocks_depth"), in_channels=g("in_channels"),
            out_channels=g("out_channels"), patch_size=tuple(g("patch_size", (1, 1, 1))),
            rope_axes=tuple(g("rope_dim_list", (16, 56, 56))), rope_theta=g("rope_theta", 256.0),
            mlp_ratio=g("mlp_width_ratio", 4.0), text_dim=g("text_states_dim", 3584),
            vision_dim=g("vision_states_dim", 1152), use_meanflow=bool(g("use_meanflow")))
    if cls_name == "HunyuanVideo15Transformer3DModel":
        return HunyuanVideo15Config(
            hidden_size=g("num_attention_heads") * g("attention_head_dim"),
            num_heads=g("num_attention_heads"), num_layers=g("num_layers"),
            in_channels=(g("in_channels") - 1) // 2, out_channels=g("out_channels"),
            patch_size=(g("patch_size_t", 1), g("patch_size", 1), g("patch_size", 1)),
            rope_axes=tuple(g("rope_axes_dim")), rope_theta=g("rope_theta", 256.0),
            mlp_ratio=g("mlp_ratio", 4.0), refiner_layers=g("num_refiner_layers", 2),
            text_dim=g("text_embed_dim"), byt5_dim=g("text_embed_2_dim"),
            vision_dim=g("image_embed_dim"), use_meanflow=bool(g("use_meanflow")))
    return None


FORMAT = CheckpointFormat(
    markers={OFFICIAL: "double_blocks.0.img_attn_q.weight",
             DIFFUSERS: "transformer_blocks.0.attn.add_q_proj.weight"},
    config_to_json=config_to_json, config_from_json=config_from_json,
    to_diffusers=to_diffusers, from_diffusers=from_diffusers, diffusers_config=diffusers_config)
