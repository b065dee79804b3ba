"""Checkpoint layouts: their names, the record each family fills in to read and write its
checkpoints (`CheckpointFormat`, one per family, found through `modules.registry`), and the
key-rename rules those records are written with.

Rules are written once as (official, diffusers) prefix pairs and applied in either direction;
they work on any mapping of tensors, including meta tensors built from safetensors headers, so
a checkpoint can be checked before its data is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

OFFICIAL, DIFFUSERS = "official", "diffusers"
LAYOUTS = (OFFICIAL, DIFFUSERS)

StateDict = Mapping[str, torch.Tensor]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message says what and where."""


def _no_check(keys: set[str]) -> None:
    return None


@dataclass(frozen=True)
class CheckpointFormat:
    """What one family's checkpoints look like in each layout it has.

    `markers`: layout -> one key that only this family's checkpoints in that layout hold.
    `extends`: a family whose checkpoints hold a subset of this one's keys (S2V is a Wan DiT with
    an audio branch), so that where both markers are found this family's wins.
    `config_to_json(config, layout)`: config.json in that layout's own vocabulary.
    `config_from_json(values)`: our config from a config.json, or None if it is not this family's.
    `check_keys(keys)`: raise CheckpointError for a look-alike the markers let through.
    `to_diffusers`, `from_diffusers`, `diffusers_config`: None where the family has no diffusers
    layout; `diffusers_config(config)` gives the diffusers model's constructor arguments.
    """

    markers: dict[str, str]
    config_to_json: Callable[[object, str], dict]
    config_from_json: Callable[[dict], object | None]
    to_diffusers: Callable[[StateDict], dict[str, torch.Tensor]] | None = None
    from_diffusers: Callable[[StateDict], dict[str, torch.Tensor]] | None = None
    diffusers_config: Callable[[object], dict] | None = None
    extends: str | None = None
    check_keys: Callable[[set[str]], None] = _no_check

    def to_layout(self, sd: StateDict, layout: str) -> dict[str, torch.Tensor]:
        """Official-layout state dict -> `layout`."""
        return dict(sd) if layout == OFFICIAL else _diffusers(self.to_diffusers)(sd)

    def from_layout(self, sd: StateDict, layout: str) -> dict[str, torch.Tensor]:
        """`layout` state dict -> official layout (our parameter names)."""
        return dict(sd) if layout == OFFICIAL else _diffusers(self.from_diffusers)(sd)


def _diffusers(convert):
    if convert is None:
        raise CheckpointError(f"this family has no {DIFFUSERS} layout; expected {OFFICIAL}")
    return convert


def json_values(values: dict) -> dict:
    """Constructor arguments as config.json writes them (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


class KeyRules:
    """(official, diffusers) rename rules applied in either direction. `{i}` is a block index; a
    rule ending in "." renames a prefix, otherwise the whole key. Keys no rule knows are kept as
    they are, so the strict check names them."""

    def __init__(self, rules: tuple[tuple[str, str], ...]):
        self.rules = rules
        self._to = self._compile(forward=True)
        self._from = self._compile(forward=False)

    def _compile(self, forward: bool):
        compiled = []
        for official, diffusers in self.rules:
            src, dst = (official, diffusers) if forward else (diffusers, official)
            pattern = re.escape(src).replace(re.escape("{i}"), r"(\d+)")
            pattern = "^" + pattern + ("" if src.endswith(".") else "$")
            compiled.append((re.compile(pattern), dst))
        return compiled

    def to_diffusers(self, sd: StateDict) -> dict[str, torch.Tensor]:
        return _rename_all(sd, self._to)

    def from_diffusers(self, sd: StateDict) -> dict[str, torch.Tensor]:
        return _rename_all(sd, self._from)


def _rename_all(sd: StateDict, compiled) -> dict[str, torch.Tensor]:
    return {_rename(key, compiled): value for key, value in sd.items()}


def _rename(key: str, compiled) -> str:
    for pattern, dst in compiled:
        m = pattern.match(key)
        if m:
            new = dst.replace("{i}", m.group(1)) if m.groups() else dst
            return new + key[m.end():]
    return key


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """The two halves of dim 0 swapped (the conversion is its own inverse)."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)
