#!/usr/bin/env python
"""Stage 1: prompt (image, speech) -> stage1_embeddings.safetensors + generation_config.json.

    python stage1_encode.py --prompt "red circle moves right on blue"

Argument parsing and wiring are in commands/stage1.py.
"""

from __future__ import annotations

import sys

from commands.stage1 import main

if __name__ == "__main__":
    sys.exit(main())
