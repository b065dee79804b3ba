"""Presets (seed 002): named starting points for the gate, kept as data in cache/presets/*.json.

A preset is a partial CMConfig: technique fields, top-level fields and limits. Explicit flags win
over the preset, field by field, and the result is one validated CMConfig.
"""

from __future__ import annotations

import json
import os

from .validate import ConfigError

PRESET_DIR = os.path.join(os.path.dirname(__file__), "presets")
PRESETS = tuple(sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".json")))
TECHNIQUE_KEYS = ("teacache", "fbcache", "deepcache")


def load_preset(name: str) -> dict:
    """The preset's fields (without its `about` line)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
    with open(os.path.join(PRESET_DIR, f"{name}.json")) as f:
        values = json.load(f)
    values.pop("about", None)
    return values
