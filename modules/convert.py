"""Key conversion between the official layouts (our parameter names) and diffusers' layouts.

Rules are written once as (official, diffusers) prefix pairs and applied in either direction;
the few transforms that are not renames (HunyuanVideo-1.5 refiner qkv split, final-layer
shift/scale half swap; model_spec 2.8, 3.8) are explicit functions. Works on any mapping of
tensors, including meta tensors built from safetensors headers, so a checkpoint can be checked
before its data is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

OFFICIAL, DIFFUSERS = "official", "diffusers"
LAYOUTS = (OFFICIAL, DIFFUSERS)

# `{i}` is a block index; a rule ending in "." renames a prefix, otherwise the whole key.
WAN_RULES = (
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
)

_REFINER = "txt_in.individual_token_refiner.blocks.{i}."
_REFINER_D = "context_embedder.token_refiner.refiner_blocks.{i}."
HUNYUAN_RULES = (
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
)


def _compile(rules, forward: bool):
    compiled = []
    for official, diffusers in rules:
        src, dst = (official, diffusers) if forward else (diffusers, official)
        pattern = re.escape(src).replace(re.escape("{i}"), r"(\d+)")
        pattern = "^" + pattern + ("" if src.endswith(".") else "$")
        compiled.append((re.compile(pattern), dst))
    return compiled


def _renamer(rules, forward: bool) -> Callable[[str], str | None]:
    compiled = _compile(rules, forward)

    def rename(key: str) -> str | None:
        for pattern, dst in compiled:
            m = pattern.match(key)
            if m:
                new = dst.replace("{i}", m.group(1)) if m.groups() else dst
                return new + key[m.end():]
        return None

    return rename


def _rename_all(sd: Mapping[str, torch.Tensor], rename) -> dict[str, torch.Tensor]:
    """Renamed dict; keys no rule knows are kept as they are, so the strict check names them."""
    out = {}
    for key, value in sd.items():
        new = rename(key)
        out[key if new is None else new] = value
    return out


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


_FINAL_MOD = ("final_layer.adaLN_modulation.1.", "norm_out.linear.")
_QKV = re.compile(r"^txt_in\.individual_token_refiner\.blocks\.(\d+)\.self_attn_qkv\.(weight|bias)$")
_QKV_SPLIT = re.compile(
    r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.attn\.to_([qkv])\.(weight|bias)$")

_wan_to = _renamer(WAN_RULES, True)
_wan_from = _renamer(WAN_RULES, False)
_hy_to = _renamer(HUNYUAN_RULES, True)
_hy_from = _renamer(HUNYUAN_RULES, False)


def wan_to_diffusers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return _rename_all(sd, _wan_to)


def wan_from_diffusers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return _rename_all(sd, _wan_from)


def hunyuan_to_diffusers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    rest, out = {}, {}
    for key, value in sd.items():
        m = _QKV.match(key)
        if m:  # fused refiner qkv rows are q, k, v in that order (T18)
            for part, chunk in zip("qkv", value.chunk(3, dim=0), strict=True):
                out[f"{_REFINER_D.format(i=m.group(1))}attn.to_{part}.{m.group(2)}"] = chunk
        elif key.startswith(_FINAL_MOD[0]):  # official [shift; scale], diffusers [scale; shift]
            rest[key] = _swap_halves(value)
        else:
            rest[key] = value
    out.update(_rename_all(rest, _hy_to))
    return out


def hunyuan_from_diffusers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    rest = {}
    for key, value in sd.items():
        m = _QKV_SPLIT.match(key)
        if m:
            parts.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = value
        elif key.startswith(_FINAL_MOD[1]):
            rest[key] = _swap_halves(value)
        else:
            rest[key] = value
    out = _rename_all(rest, _hy_from)
    for (block, kind), qkv in parts.items():
        if set(qkv) != set("qkv"):  # leave the incomplete triple for the strict check to name
            for part, value in qkv.items():
                out[f"{_REFINER_D.format(i=block)}attn.to_{part}.{kind}"] = value
            continue
        out[f"{_REFINER.format(i=block)}self_attn_qkv.{kind}"] = torch.cat(
            [qkv["q"], qkv["k"], qkv["v"]], dim=0)
    return out


CONVERTERS = {
    "wan": (wan_to_diffusers, wan_from_diffusers),
    "hunyuan_video15": (hunyuan_to_diffusers, hunyuan_from_diffusers),
}


def to_layout(family: str, sd: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Official-layout state dict -> `layout`."""
    return dict(sd) if layout == OFFICIAL else CONVERTERS[family][0](sd)


def from_layout(family: str, sd: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """`layout` state dict -> official layout (our parameter names)."""
    return dict(sd) if layout == OFFICIAL else CONVERTERS[family][1](sd)


def wan_diffusers_config(cfg) -> dict:
    """Constructor arguments of diffusers' WanTransformer3DModel for one of our Wan configs."""
    return dict(patch_size=cfg.patch_size, num_attention_heads=cfg.num_heads,
                attention_head_dim=cfg.head_dim, in_channels=cfg.in_dim, out_channels=cfg.out_dim,
                text_dim=cfg.text_dim, freq_dim=cfg.freq_dim, ffn_dim=cfg.ffn_dim,
                num_layers=cfg.num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                eps=cfg.eps, rope_max_seq_len=1024)


def hunyuan_diffusers_config(cfg) -> dict:
    """Constructor arguments of diffusers' HunyuanVideo15Transformer3DModel for one of ours (the
    input channels are [latent | image latent | mask], T9)."""
    return dict(in_channels=2 * cfg.in_channels + 1, out_channels=cfg.out_channels,
                num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim,
                num_layers=cfg.num_layers, num_refiner_layers=cfg.refiner_layers,
                mlp_ratio=cfg.mlp_ratio, patch_size=cfg.patch_size[1],
                patch_size_t=cfg.patch_size[0], text_embed_dim=cfg.text_dim,
                text_embed_2_dim=cfg.byt5_dim, image_embed_dim=cfg.vision_dim,
                rope_axes_dim=cfg.rope_axes, rope_theta=cfg.rope_theta,
                use_meanflow=cfg.use_meanflow)
