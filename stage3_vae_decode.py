#!/usr/bin/env python
"""Stage 3 of the pipeline: decode stage-2 latents with the model's VAE into output_video.mp4.

    python stage3_vae_decode.py --input_dir stage_outputs                # tiny random VAE
    python stage3_vae_decode.py --input_dir D --vae_path /ckpts/Wan2.1_VAE.pth --fps 16
    torchrun --nproc_per_node 4 stage3_vae_decode.py --input_dir D --vae_path V --patch_parallel

Argument parsing and wiring only; the work is in commands/stage3.py.
"""

from __future__ import annotations

import sys

from commands.stage3 import ERRORS, build_parser, format_summary, main, run  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
