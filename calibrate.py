#!/usr/bin/env python
"""Calibrate a model for caching: a TeaCache profile (rescaling polynomial) or, with --budget, the
error/speed table of every cache configuration that budgeted runs choose from.

    python calibrate.py --model wan-tiny-i2v --samples 3 --out profile.json
    python calibrate.py --model wan-tiny-ti2v --samples 3 --budget --out profile.json

Argument parsing and wiring are in commands/calibrate.py (also `python -m commands.calibrate`).
"""

from __future__ import annotations

import sys

from commands.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
