"""Wan2.2 TI2V/I2V checkpoints: config.json in the official (`WanModel`) and diffusers
(`WanTransformer3DModel`) vocabularies, and the official <-> diffusers key renames."""

from __future__ import annotations

import re

from modules.layouts import (
    DIFFUSERS,
    OFFICIAL,
    CheckpointError,
    CheckpointFormat,
    KeyRules,
    json_values,
)
from modules.wan import WanConfig

RULES = KeyRules((
    ("text_embedding.0.", "condition_embedder.text_embedder.linear_1."),
    ("text_embedding.2.", "condition_embedder.text_embedder.linear_2."),
    ("time_embedding.0.", "condition_embedder.time_embedder.linear_1."),
    ("time_embedding.2.", "condition_embedder.time_embedder.linear_2."),
    ("time_projection.1.", "condition_embedder.time_proj."),
    ("head.modulation", "scale_shift_table"),
    ("head.head.", "proj_out."),
    ("blocks.{i}.modulation", "blocks.{i}.scale_shift_table"),
    *((f"blocks.{{i}}.{ours}_attn.{p}.", f"blocks.{{i}}.{theirs}.to_{p}.")
      for ours, theirs in (("self", "attn1"), ("cross", "attn2")) for p in "qkv"),
    ("blocks.{i}.self_attn.o.", "blocks.{i}.attn1.to_out.0."),
    ("blocks.{i}.cross_attn.o.", "blocks.{i}.attn2.to_out.0."),
    *((f"blocks.{{i}}.{ours}_attn.norm_{p}.", f"blocks.{{i}}.{theirs}.norm_{p}.")
      for ours, theirs in (("self", "attn1"), ("cross", "attn2")) for p in "qk"),
    ("blocks.{i}.norm3.", "blocks.{i}.norm2."),  # cross-attention pre-norm: names swapped (T4)
    ("blocks.{i}.ffn.0.", "blocks.{i}.ffn.net.0.proj."),
    ("blocks.{i}.ffn.2.", "blocks.{i}.ffn.net.2."),
    ("patch_embedding.", "patch_embedding."),
))
to_diffusers = RULES.to_diffusers
from_diffusers = RULES.from_diffusers

# Wan2.1 I2V's CLIP branch, which Wan2.2 does not have (model_spec trap T8).
_WAN21_I2V = re.compile(r"(^img_emb\.|\.k_img\.|\.add_k_proj\.|^condition_embedder\.image_embedder\.)")


def check_keys(keys: set[str]) -> None:
    if any(_WAN21_I2V.search(k) for k in keys):
        raise CheckpointError("this is a Wan2.1 I2V checkpoint (CLIP image branch); Wan2.2 models "
                              "have no image cross-attention (model_spec trap T8)")


def diffusers_config(c: WanConfig) -> dict:
    """Constructor arguments of diffusers' WanTransformer3DModel for one of our Wan configs (no
    image branch: image_dim and added_kv_proj_dim are Wan2.1 I2V's, T8)."""
    return dict(patch_size=c.patch_size, num_attention_heads=c.num_heads, attention_head_dim=c.head_dim,
                in_channels=c.in_dim, out_channels=c.out_dim, text_dim=c.text_dim,
                freq_dim=c.freq_dim, ffn_dim=c.ffn_dim, num_layers=c.num_layers,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=c.eps,
                image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024)


def config_to_json(c: WanConfig, layout: str) -> dict:
    if layout != OFFICIAL:
        return {"_class_name": "WanTransformer3DModel", **json_values(diffusers_config(c))}
    return dict(_class_name="WanModel", model_type=c.model_type, patch_size=list(c.patch_size),
                text_len=c.text_len, in_dim=c.in_dim, dim=c.dim, ffn_dim=c.ffn_dim,
                freq_dim=c.freq_dim, text_dim=c.text_dim, out_dim=c.out_dim,
                num_heads=c.num_heads, num_layers=c.num_layers, window_size=[-1, -1],
                qk_norm=True, cross_attn_norm=True, eps=c.eps)


def config_from_json(values: dict) -> WanConfig | None:
    g = values.get
    cls_name = g("_class_name", "")
    if cls_name == "WanModel" or "dim" in values and "num_heads" in values:
        if g("model_type") not in ("ti2v", "i2v", "t2v"):
            raise CheckpointError(f"config.json model_type {g('model_type')!r}: expected a "
                                  "Wan2.2 ti2v, i2v or t2v model")
        return WanConfig(
            dim=g("dim"), ffn_dim=g("ffn_dim"), num_layers=g("num_layers"),
            num_heads=g("num_heads"), in_dim=g("in_dim"), out_dim=g("out_dim"),
            model_type=g("model_type"), patch_size=tuple(g("patch_size", (1, 2, 2))),
            text_len=g("text_len", 512), text_dim=g("text_dim", 4096),
            freq_dim=g("freq_dim", 256), eps=g("eps", 1e-6))
    if cls_name == "WanTransformer3DModel":
        if g("image_dim") or g("added_kv_proj_dim"):
            raise CheckpointError("config.json describes a Wan2.1 I2V model (image_dim / "
                                  "added_kv_proj_dim set); Wan2.2 has no CLIP branch (T8)")
        in_dim, out_dim = g("in_channels"), g("out_channels")
        heads = g("num_attention_heads")
        return WanConfig(
            dim=heads * g("attention_head_dim"), ffn_dim=g("ffn_dim"),
            num_layers=g("num_layers"), num_heads=heads, in_dim=in_dim, out_dim=out_dim,
            model_type="ti2v" if in_dim == out_dim else "i2v",
            patch_size=tuple(g("patch_size", (1, 2, 2))), text_dim=g("text_dim", 4096),
            freq_dim=g("freq_dim", 256), eps=g("eps", 1e-6))
    return None


FORMAT = CheckpointFormat(
    markers={OFFICIAL: "blocks.0.self_attn.q.weight", DIFFUSERS: "blocks.0.attn1.to_q.weight"},
    config_to_json=config_to_json, config_from_json=config_from_json,
    to_diffusers=to_diffusers, from_diffusers=from_diffusers, diffusers_config=diffusers_config,
    check_keys=check_keys)
