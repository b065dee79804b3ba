"""Print the error of our tiny DiTs against diffusers 0.42.1 (fp32), per case and op choice.

    python -m bench.studies.model_oracle

Relative error = max |ours - diffusers| / max |diffusers|; the tests assert 1e-5 (Wan) and
1e-6 (HunyuanVideo-1.5).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from modules import ops  # noqa: E402
from tests.model_inputs import hy_inputs, random_model, rel_err, wan_inputs  # noqa: E402
from tests.test_models_oracle import diffusers_hunyuan, diffusers_wan  # noqa: E402

FUSED = dict(rms_norm="fused", layer_norm="fused", layer_norm_modulate="fused", rope="fused",
             attention="reference")


def wan_case(name, per_token):
    model = random_model(name)
    ref = diffusers_wan(model)
    x, t, context, y = wan_inputs(model.config, per_token=per_token)
    padded = torch.nn.functional.pad(context, (0, 0, 0, model.config.text_len - context.shape[1]))
    theirs = ref(x if y is None else torch.cat([x, y], 1), t, padded, return_dict=False)[0]
    return model, (x, t, context, y), {}, theirs


def hy_case(name, i2v):
    model = random_model(name)
    ref = diffusers_hunyuan(model)
    kw = hy_inputs(model.config, i2v=i2v)
    cfg = model.config
    cond = kw.get("cond", torch.zeros(2, cfg.in_channels + 1, *kw["x"].shape[2:]))
    vision = kw.get("vision", torch.zeros(2, cfg.vision_len, cfg.vision_dim))
    theirs = ref(torch.cat([kw["x"], cond], 1), kw["t"], kw["text"], kw["text_mask"],
                 timestep_r=kw.get("timestep_r"), encoder_hidden_states_2=kw["byt5"],
                 encoder_attention_mask_2=kw["byt5_mask"], image_embeds=vision,
                 return_dict=False)[0]
    return model, (), kw, theirs


def main():
    cases = [("Wan TI2V per-token t", wan_case, ("wan-tiny-ti2v", True)),
             ("Wan I2V concat", wan_case, ("wan-tiny-i2v", False)),
             ("HunyuanVideo-1.5 T2V", hy_case, ("hunyuanvideo-tiny", False)),
             ("HunyuanVideo-1.5 I2V", hy_case, ("hunyuanvideo-tiny", True)),
             ("HunyuanVideo-1.5 meanflow I2V", hy_case, ("hunyuanvideo-tiny-meanflow", True))]
    print(f"{'case':32s} {'default ops':>12s} {'fused ops':>12s}")
    with torch.no_grad():
        for title, make, args in cases:
            model, pos, kw, theirs = make(*args)
            default = rel_err(model(*pos, **kw), theirs)
            with ops.use(**FUSED):
                fused = rel_err(model(*pos, **kw), theirs)
            print(f"{title:32s} {default:12.2e} {fused:12.2e}")
    print(f"torch {torch.__version__}, CPU, fp32; batch 2 with different text masks")


if __name__ == "__main__":
    main()
