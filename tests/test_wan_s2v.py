"""Wan2.2 S2V: each new part on a hand-worked small case, the staged API, the real-size model on
the meta device, and its checkpoints. (The tiny model was also compared with the official
WanModel_S2V on CPU, outside the repo: docs/s2v.md.)"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from modules.checkpoint import config_from_json, load_model, save_checkpoint
from modules.layers import ModelConfigError
from modules.layouts import DIFFUSERS, CheckpointError
from modules.registry import build_model, get_config
from modules.wan_s2v import (
    AudioAdaIN,
    CausalConv1d,
    WanS2VContext,
    s2v_positions,
)
from tests.model_inputs import Positional, random_model, rel_err

TINY = "wan-tiny-s2v"


def s2v_inputs(cfg, *, batch=1, frames=3, size=(8, 8), motion=19, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h, w = size
    return dict(
        x=torch.randn(batch, cfg.in_dim, frames, h, w, generator=gen),
        t=torch.tensor([873.0, 410.0])[:batch],
        context=torch.randn(batch, 7, cfg.text_dim, generator=gen),
        ref_latent=torch.randn(batch, cfg.in_dim, 1, h, w, generator=gen),
        motion_latents=torch.randn(batch, cfg.in_dim, motion, h, w, generator=gen),
        audio=torch.randn(batch, cfg.audio_layers, cfg.audio_dim, 4 * frames, generator=gen),
        motion_mask=torch.ones(batch))


# --- the sequence and its positions --------------------------------------------------------------

def test_sequence_is_noisy_reference_motion_with_official_positions():
    # grid (2, 4, 4): 32 noisy tokens, 16 reference, motion 16 (1x) + 4 (2x) + 4 (4x)
    model = build_model(TINY, meta=True)
    assert model.sequence_length((2, 4, 4)) == 32 + 16 + 24
    p = s2v_positions((2, 4, 4))
    assert p.shape == (72, 3)
    assert (p[:32, 0] == np.repeat([0, 1], 16)).all()  # noisy frames 0, 1
    assert (p[32:48, 0] == 30).all()  # the reference image sits at frame 30
    assert (p[48:64, 0] == -1).all()  # newest motion frame, full resolution, frame -1
    # 2x bucket: frames -2..-3 as one token row at -3; h, w = linspace(0, 3, 2) -> 0, 3
    assert p[64:68].tolist() == [[-3, 0, 0], [-3, 0, 3], [-3, 3, 0], [-3, 3, 3]]
    # 4x bucket: 16 frames in 4 token frames at -19, -14, -9, -4 (linspace(19, 4, 4)), one token each
    assert p[68:].tolist() == [[-19, 0, 0], [-14, 0, 0], [-9, 0, 0], [-4, 0, 0]]


def test_rope_of_negative_positions_is_the_conjugate_rotation():
    model = build_model(TINY)
    cos, sin = model.rope((1, 4, 4))
    # motion frame -1 against the noisy frame 0 tokens: same h, w; time pairs rotate by -1
    axes_t = model.config.rope_axes[0] // 2
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, 2 * axes_t, 2) / (2 * axes_t))
    assert np.allclose(cos[32:48, :axes_t].numpy(), np.cos(-inv_freq), atol=1e-7)
    assert np.allclose(sin[32:48, :axes_t].numpy(), np.sin(-inv_freq), atol=1e-7)
    assert torch.equal(cos[32:48, axes_t:], cos[:16, axes_t:])  # h, w as the noisy frame


# --- motion frames -------------------------------------------------------------------------------

def test_frame_packer_by_hand():
    """Frame i of the history holds the value i + 1 everywhere; all-ones kernels sum what they
    cover: 1x token = C*2*2*19, 2x = C*4*4*(17 + 18), 4x token j = C*8*8*sum(frames 4j+1..4j+4)."""
    model = build_model(TINY)
    c = model.config.in_dim
    packer = model.frame_packer
    with torch.no_grad():
        for conv in (packer.proj, packer.proj_2x, packer.proj_4x):
            conv.weight.fill_(1.0)
            conv.bias.zero_()
        m = torch.arange(1, 20, dtype=torch.float32).view(1, 1, 19, 1, 1).expand(1, c, 19, 8, 8)
        tokens = packer(m)[0, :, 0]
    assert tokens.shape == (16 + 4 + 4,)
    assert (tokens[:16] == c * 4 * 19).all()
    assert (tokens[16:20] == c * 16 * (17 + 18)).all()
    assert tokens[20:].tolist() == [c * 64 * sum(range(4 * j + 1, 4 * j + 5)) for j in range(4)]


def test_short_motion_history_is_zero_padded_in_front():
    model = random_model(TINY, std=0.2)
    kw = s2v_inputs(model.config, motion=19)
    short = kw["motion_latents"][:, :, -5:]
    padded = torch.cat([torch.zeros_like(kw["motion_latents"][:, :, :14]), short], dim=2)
    with torch.no_grad():
        assert torch.equal(model(**{**kw, "motion_latents": short}),
                           model(**{**kw, "motion_latents": padded}))
        # a longer history: only its last 19 frames count
        longer = torch.cat([torch.randn_like(short), kw["motion_latents"]], dim=2)
        assert torch.equal(model(**{**kw, "motion_latents": longer}), model(**kw))


def test_dropped_motion_is_invisible():
    """drop_first_motion: with motion_mask 0 no other token sees the motion tokens."""
    model = random_model(TINY, std=0.2)
    kw = s2v_inputs(model.config)
    other = torch.randn_like(kw["motion_latents"])
    with torch.no_grad():
        dropped = model(**{**kw, "motion_mask": torch.zeros(1)})
        assert torch.allclose(model(**{**kw, "motion_latents": other, "motion_mask": torch.zeros(1)}),
                              dropped, atol=1e-6, rtol=0)
        assert not torch.allclose(model(**kw), dropped, atol=1e-3)


# --- segmented modulation ------------------------------------------------------------------------

def test_segmented_modulation_by_hand():
    """Noisy rows take segment 0 (t), reference and motion rows segment 1 (t = 0)."""
    model = build_model(TINY)
    block, d = model.blocks[0], model.config.dim
    with torch.no_grad():
        block.modulation.zero_()
    e0 = torch.stack([torch.full((6, d), 1.0), torch.full((6, d), 2.0)])[None]  # [1, 2, 6, D]
    conditioning = (torch.arange(5) >= 3)[:, None]
    ctx = WanS2VContext(None, e0, None, None, None, conditioning, None, None, None)
    for chunk in block.modulation_chunks(ctx):
        assert chunk.shape == (1, 5, d)
        assert chunk[0, :, 0].tolist() == [1.0, 1.0, 1.0, 2.0, 2.0]


def test_reference_and_motion_rows_are_modulated_by_timestep_zero():
    model = random_model(TINY, std=0.2)
    kw = s2v_inputs(model.config)
    with torch.no_grad():
        h, ctx = model.prepare(**kw)
        h2, ctx2 = model.prepare(**{**kw, "t": torch.tensor([12.0])})
        _, ctx0 = model.prepare(**{**kw, "t": torch.tensor([0.0])})
        assert torch.equal(ctx.e0[:, 1], ctx2.e0[:, 1])  # segment 1 does not follow t
        assert torch.equal(ctx.e0[:, 1], ctx0.e0[:, 0])  # ... it is t = 0's modulation
        assert not torch.equal(ctx.e0[:, 0], ctx2.e0[:, 0])
        # so block 0's output on reference and motion rows depends on t only through attention
        noisy = 3 * 16
        sig, sig2 = model.signature("modulated_input", h, ctx), model.signature("modulated_input", h2, ctx2)
        assert (sig[:, noisy:] == 0).all() and not torch.equal(sig[:, :noisy], sig2[:, :noisy])


# --- audio ---------------------------------------------------------------------------------------

def test_causal_conv_repeats_the_first_frame_on_the_left():
    conv = CausalConv1d(1, 1, kernel=3, stride=2)
    with torch.no_grad():
        conv.conv.weight.copy_(torch.tensor([[[1.0, 0.0, 0.0]]]))  # picks x[t - 2]
        conv.conv.bias.zero_()
        out = conv(torch.tensor([[[5.0, 6.0, 7.0, 8.0, 9.0]]]))
    # outputs at t = 0, 2, 4 read x[t - 2]: x[-2] and x[0] are both x[0] (replicated), then x[2]
    assert out.tolist() == [[[5.0, 5.0, 7.0]]]


def test_audio_encoder_gives_one_token_set_per_latent_frame():
    model = random_model(TINY, std=0.2)
    kw = s2v_inputs(model.config, frames=5)
    with torch.no_grad():
        _, ctx = model.prepare(**kw)
    cfg = model.config
    assert ctx.audio.shape == (1, 5, cfg.num_audio_token + 1, cfg.dim)
    assert ctx.audio_global.shape == (1, 5, cfg.dim)
    # the learned padding token closes every frame's token set
    padding = model.casual_audio_encoder.encoder.padding_tokens[0, 0]
    assert torch.equal(ctx.audio[0, :, -1], padding.expand(5, -1))


def test_audio_layers_are_averaged_with_equal_weights():
    model = random_model(TINY, std=0.2)
    kw = s2v_inputs(model.config)
    layers = kw["audio"]
    with torch.no_grad():
        model.casual_audio_encoder.weights.fill_(0.7)  # any equal weights: a plain mean
        _, ctx = model.prepare(**kw)
        _, ctx_mean = model.prepare(**{**kw, "audio": layers.mean(1, keepdim=True).expand_as(layers)})
    assert torch.allclose(ctx.audio, ctx_mean.audio, atol=1e-5)


def test_adain_by_hand():
    ada = AudioAdaIN(4)
    with torch.no_grad():
        ada.linear.weight.zero_()
        ada.linear.bias.copy_(torch.tensor([1.0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5]))  # shift, scale
        x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
        out = ada(x, torch.zeros(1, 4))
    # LayerNorm with eps 1e-5 (diffusers' default, not the blocks' 1e-6): var 1.25
    norm = (torch.tensor([1.0, 2.0, 3.0, 4.0]) - 2.5) / math.sqrt(1.25 + 1e-5)
    assert torch.allclose(out[0, 0], norm * 1.5 + torch.tensor([1.0, 0, 0, 0]), atol=1e-6)


def test_audio_injection_by_hand():
    """Identity value/output projections and five equal audio tokens a_f per frame: attention
    returns a_f whatever the queries, so every token of frame f gains a_f; reference and motion
    rows are untouched."""
    model = build_model(TINY)
    d = model.config.dim
    attn = model.audio_injector.injector[1]  # block 2's injector
    with torch.no_grad():
        for lin in (attn.v, attn.o):
            lin.weight.copy_(torch.eye(d))
            lin.bias.zero_()
    frames, per_frame = 2, 16
    total = model.sequence_length((frames, 4, 4))
    a = torch.randn(1, frames, 1, d)
    ctx = WanS2VContext(None, None, None, None, None, None, None, a.expand(1, frames, 5, d),
                        torch.randn(1, frames, d))
    h = torch.randn(1, total, d)
    with torch.no_grad():
        out = model.audio_injector(2, h, ctx)
    want = h.clone()
    want[0, :per_frame] += a[0, 0, 0]
    want[0, per_frame: 2 * per_frame] += a[0, 1, 0]
    assert torch.allclose(out, want, atol=1e-5)
    assert torch.equal(out[:, 2 * per_frame:], h[:, 2 * per_frame:])


def test_a_frames_audio_reaches_that_frame_first():
    """After block 0 (self-attention, then the injection), changing frame 1's audio changes the
    rows of frame 1 only: the injection is per frame, and nothing mixed them yet."""
    model = random_model(TINY, std=0.2)
    kw = s2v_inputs(model.config, frames=3)
    audio = kw["audio"].clone()
    audio[..., 4:8] += 1.0  # the 4 audio frames of latent frame 1
    with torch.no_grad():
        h, ctx = model.prepare(**kw)
        h2, ctx2 = model.prepare(**{**kw, "audio": audio})
        assert torch.equal(h, h2)
        # the causal encoder: frame 0 ends before the change; frames 1 and 2 see it
        assert torch.equal(ctx.audio[:, 0], ctx2.audio[:, 0])
        out, out2 = model.block(0, h, ctx), model.block(0, h, ctx2)
    changed = (out - out2).abs().amax(-1)[0]
    assert (changed[:16] == 0).all() and (changed[16:48] > 0).all() and (changed[48:] == 0).all()


# --- the staged API ------------------------------------------------------------------------------

def test_forward_is_the_stages_in_order():
    model = random_model(TINY, std=0.2)
    kw = s2v_inputs(model.config, batch=2, size=(8, 16))
    with torch.no_grad():
        want = model(**kw)
        grid = model.grid(kw["x"].shape)
        h, ctx = model.prepare(**kw, rope=model.rope(grid))
        assert h.shape == (2, model.sequence_length(grid), 24) and ctx.e0.shape == (2, 2, 6, 24)
        for i in range(model.num_blocks):
            h = model.block(i, h, ctx)
        got = model.final(h, ctx, grid)
    assert got.shape == kw["x"].shape and torch.equal(got, want)


@pytest.mark.parametrize("change, message", [
    (dict(x=torch.zeros(1, 16, 3, 8, 12)), "multiples of 8"),
    (dict(audio=torch.zeros(1, 25, 16, 11)), r"audio has shape .*expected \[1, 25, 16, 12\]"),
    (dict(ref_latent=torch.zeros(1, 16, 2, 8, 8)), "ref_latent has shape"),
    (dict(motion_latents=torch.zeros(1, 16, 19, 8, 16)), "motion_latents has shape"),
    (dict(t=torch.zeros(1, 5)), r"expected \[1\]"),
])
def test_rejects_bad_shapes(change, message):
    model = build_model(TINY)
    with pytest.raises(ModelConfigError, match=message):
        model(**(s2v_inputs(model.config) | change))


def test_traces_under_torchax():
    from compat.torchax_compat import import_torchax
    torchax = import_torchax()
    env = torchax.default_env()
    model = random_model(TINY, std=0.2)
    kw = s2v_inputs(model.config)
    names = tuple(kw)
    module = Positional(model, names)
    with torch.no_grad():
        want = module(*kw.values())
    jitted = torchax.compile(module)
    with env, torch.no_grad():
        jitted.params, jitted.buffers = env.to_xla(jitted.params), env.to_xla(jitted.buffers)
        got = jitted(*env.to_xla(tuple(kw.values()))).torch()
    assert rel_err(got, want) < 1e-5


# --- real size and checkpoints -------------------------------------------------------------------

def test_real_size_on_meta_has_the_official_parameter_count():
    # 16,295,755,609 parameters in 1260 tensors: WanModel_S2V(**wan_s2v_14B) built on the meta
    # device from the official code (docs/s2v.md); 1095 of the keys are the A14B DiT's
    model = build_model("wan2.2-s2v-14b", meta=True)
    state = model.state_dict()
    assert len(state) == 1260
    assert sum(p.numel() for p in model.parameters()) == 16_295_755_609
    assert len(model.audio_injector.injector) == 12
    assert all(p.is_meta for p in model.parameters())


def test_official_checkpoint_round_trip_and_detection(tmp_path):
    model = random_model(TINY, std=0.2)
    path = save_checkpoint(model, tmp_path / "s2v")
    loaded, info = load_model(path)
    assert info["family"] == "wan_s2v" and info["layout"] == "official"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  loaded.state_dict().values(), strict=True))
    kw = s2v_inputs(model.config)
    with torch.no_grad():  # equal weights; BLAS may round differently on unaligned mmap'd ones
        assert rel_err(loaded(**kw), model(**kw)) < 1e-6
    with pytest.raises(CheckpointError, match="no diffusers layout"):
        save_checkpoint(model, tmp_path / "d", layout=DIFFUSERS)
    assert not (tmp_path / "d").exists()
    # an S2V checkpoint is not a plain Wan2.2 DiT
    with pytest.raises(CheckpointError, match="Wan2.2 S2V DiT checkpoint; the requested model"):
        load_model(path, "wan-tiny-i2v")


def test_missing_audio_branch_keys_are_named(tmp_path):
    from safetensors.torch import load_file, save_file
    model = random_model(TINY, std=0.2)
    path = save_checkpoint(model, tmp_path / "s2v")
    weights = path / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    del state["audio_injector.injector_adain_layers.2.linear.weight"]
    save_file(state, str(weights))
    with pytest.raises(CheckpointError, match=r"missing \(1\): audio_injector.injector_adain_layers.2"):
        load_model(path)


# WanModel_S2V's registered arguments (what its config.json holds) with the values of
# wan/configs/wan_s2v_14B.py; the released file itself was not at hand
RELEASED_CONFIG = {
    "_class_name": "WanModel_S2V", "adain_mode": "attn_norm", "add_last_motion": True,
    "audio_dim": 1024, "audio_inject_layers": [0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39],
    "cond_dim": 16, "dim": 5120, "enable_adain": True, "enable_framepack": True,
    "enable_motioner": False, "enable_tsm": False, "eps": 1e-06, "ffn_dim": 13824,
    "framepack_drop_mode": "padd", "freq_dim": 256, "in_dim": 16, "model_type": "s2v",
    "motion_token_num": 1024, "num_audio_token": 4, "num_heads": 40, "num_layers": 40,
    "out_dim": 16, "text_len": 512, "trainable_token_pos_emb": False, "zero_init": True,
    "zero_timestep": True}


def test_released_config_json_is_the_named_config():
    assert config_from_json(RELEASED_CONFIG) == get_config("wan2.2-s2v-14b")
    with pytest.raises(CheckpointError, match="enable_motioner"):
        config_from_json({**RELEASED_CONFIG, "enable_motioner": True})
    # the official constructor's defaults are not the released model's
    bare = {k: v for k, v in RELEASED_CONFIG.items() if k != "enable_framepack"}
    with pytest.raises(CheckpointError, match="enable_framepack"):
        config_from_json(bare)
    saved = json.loads(json.dumps(RELEASED_CONFIG))
    assert config_from_json(saved).audio_inject_layers[-1] == 39
