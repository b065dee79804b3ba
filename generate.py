#!/usr/bin/env python
"""Prompt(s) to mp4(s) in one process: stage 1 (encoders), stage 2 (the DiT with feature
caching), stage 3 (decode).

    python generate.py --prompt "red circle moves right on blue" --enable_cache

Argument parsing and wiring are in commands/generate.py.
"""

from __future__ import annotations

import sys

from commands.generate import main

if __name__ == "__main__":
    sys.exit(main())
