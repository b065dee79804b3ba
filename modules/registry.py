"""Model families and named configs: one table from a name or config to a module class and to
the family's checkpoint format (config.json vocabularies, diffusers key mapping)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from modules import (
    hunyuan_video15,
    hunyuan_video15_format,
    wan,
    wan_format,
    wan_s2v,
    wan_s2v_format,
)
from modules.layers import ModelConfigError
from modules.layouts import CheckpointFormat


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    config_cls: type
    model_cls: type
    configs: dict
    keep_fp32: tuple[str, ...]
    format: CheckpointFormat


FAMILIES = {
    "wan": Family("wan", "Wan2.2 DiT", wan.WanConfig, wan.WanDiT, wan.CONFIGS, wan.KEEP_FP32,
                  wan_format.FORMAT),
    "wan_s2v": Family("wan_s2v", "Wan2.2 S2V DiT", wan_s2v.WanS2VConfig, wan_s2v.WanS2VDiT,
                      wan_s2v.CONFIGS, wan_s2v.KEEP_FP32, wan_s2v_format.FORMAT),
    "hunyuan_video15": Family("hunyuan_video15", "HunyuanVideo-1.5 DiT",
                              hunyuan_video15.HunyuanVideo15Config,
                              hunyuan_video15.HunyuanVideo15DiT, hunyuan_video15.CONFIGS,
                              hunyuan_video15.KEEP_FP32, hunyuan_video15_format.FORMAT),
}
MODEL_NAMES = tuple(n for fam in FAMILIES.values() for n in fam.configs)


def get_config(name: str):
    for fam in FAMILIES.values():
        if name in fam.configs:
            return fam.configs[name]
    raise ModelConfigError(f"unknown model {name!r}; expected one of {', '.join(MODEL_NAMES)}")


def family_of(config) -> Family:
    for fam in FAMILIES.values():
        if isinstance(config, fam.config_cls):
            return fam
    raise ModelConfigError(f"{type(config).__name__} is not a model config; expected one of "
                           f"{[f.config_cls.__name__ for f in FAMILIES.values()]}")


def resolve_config(config):
    """A config object, or the config of a named model."""
    return get_config(config) if isinstance(config, str) else config


def build_model(config, *, meta: bool = False) -> nn.Module:
    """Instantiate a model; `meta=True` allocates nothing (shapes only, for loading or counting)."""
    config = resolve_config(config)
    cls = family_of(config).model_cls
    if meta:
        with torch.device("meta"):
            return cls(config).eval()
    return cls(config).eval()


def config_dict(config) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(config).items()}


def config_from_dict(family: Family, values: dict):
    fields = {f.name: f for f in dataclasses.fields(family.config_cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ModelConfigError(f"unknown {family.config_cls.__name__} fields {unknown}")
    return family.config_cls(**{k: tuple(v) if isinstance(v, list) else v
                                for k, v in values.items()})
