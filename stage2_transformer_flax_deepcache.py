#!/usr/bin/env python
"""Stage 2 (the denoising loop) of a video DiT with feature caching, on JAX through torchax.

    python stage2_transformer_flax_deepcache.py --enable_cache          # tiny HunyuanVideo-1.5
    python stage2_transformer_flax_deepcache.py --model wan2.2-ti2v-5b --model_path CKPT \
        --input_dir stage_outputs --enable_cache --cache_type teacache --compare

Argument parsing and wiring only; the work is in commands/stage2.py.
"""

from __future__ import annotations

import sys

from commands.stage2 import ERRORS, build_parser, format_summary, main, run  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
