"""Wan2.2 S2V checkpoints: config.json in the official (`WanModel_S2V`) vocabulary. S2V has no
diffusers layout; its official keys are a Wan DiT's and an audio branch's."""

from __future__ import annotations

from modules.layouts import OFFICIAL, CheckpointError, CheckpointFormat
from modules.wan_s2v import WanS2VConfig

# Switches of WanModel_S2V that the released S2V-14B sets and modules/wan_s2v.py builds; the
# official constructor's own defaults differ (motioner on, framepack off, no AdaIN).
_S2V_RELEASED = {"enable_adain": True, "adain_mode": "attn_norm", "enable_motioner": False,
                 "enable_framepack": True, "framepack_drop_mode": "padd", "add_last_motion": True,
                 "enable_tsm": False, "trainable_token_pos_emb": False}
_S2V_OFFICIAL_DEFAULTS = {"enable_adain": False, "enable_motioner": True,
                          "enable_framepack": False, "adain_mode": "attn_norm",
                          "framepack_drop_mode": "drop", "add_last_motion": True,
                          "enable_tsm": False, "trainable_token_pos_emb": False}


def config_to_json(c: WanS2VConfig, layout: str) -> dict:
    if layout != OFFICIAL:
        raise CheckpointError("Wan2.2 S2V has no diffusers layout; save it as official")
    return dict(_class_name="WanModel_S2V", model_type="s2v", **_S2V_RELEASED,
                audio_inject_layers=list(c.audio_inject_layers), zero_timestep=c.zero_timestep,
                cond_dim=c.cond_dim, audio_dim=c.audio_dim, num_audio_token=c.num_audio_token,
                motion_frames=c.motion_frames, patch_size=list(c.patch_size),
                text_len=c.text_len, in_dim=c.in_dim, dim=c.dim, ffn_dim=c.ffn_dim,
                freq_dim=c.freq_dim, text_dim=c.text_dim, out_dim=c.out_dim,
                num_heads=c.num_heads, num_layers=c.num_layers, eps=c.eps)


def config_from_json(values: dict) -> WanS2VConfig | None:
    g = values.get
    if g("_class_name", "") != "WanModel_S2V" and g("model_type") != "s2v":
        return None
    switches = {k: g(k, _S2V_OFFICIAL_DEFAULTS[k]) for k in _S2V_RELEASED}
    # with every motion bucket kept (add_last_motion), the two drop modes compute the same
    wrong = {k: v for k, v in switches.items() if v != _S2V_RELEASED[k]
             and not (k == "framepack_drop_mode" and v == "drop")}
    if wrong or not g("cond_dim"):
        raise CheckpointError(f"config.json sets {wrong or {'cond_dim': g('cond_dim')}}; the "
                              f"S2V model here is the released one: {_S2V_RELEASED}, cond_dim > 0")
    return WanS2VConfig(
        dim=g("dim"), ffn_dim=g("ffn_dim"), num_layers=g("num_layers"), num_heads=g("num_heads"),
        audio_inject_layers=tuple(g("audio_inject_layers", (0, 4, 8, 12, 16, 20, 24, 27))),
        in_dim=g("in_dim", 16), out_dim=g("out_dim", 16), cond_dim=g("cond_dim"),
        audio_dim=g("audio_dim", 5120), num_audio_token=g("num_audio_token", 4),
        motion_frames=g("motion_frames", 73), zero_timestep=bool(g("zero_timestep", False)),
        patch_size=tuple(g("patch_size", (1, 2, 2))), text_len=g("text_len", 512),
        text_dim=g("text_dim", 4096), freq_dim=g("freq_dim", 256), eps=g("eps", 1e-6))


FORMAT = CheckpointFormat(
    markers={OFFICIAL: "casual_audio_encoder.weights"},  # sic: the official key's spelling
    config_to_json=config_to_json, config_from_json=config_from_json, extends="wan")
