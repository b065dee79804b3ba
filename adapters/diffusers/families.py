"""Which diffusers transformers the gate knows, as what staged model, and which of our pipelines
each one's architecture is (for profiles: one calibrated for another model is refused)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from modules.checkpoint import fingerprint
from modules.registry import FAMILIES as OUR_FAMILIES
from sampling.pipelines import PIPELINES

from .hunyuan import HunyuanStaged
from .settings import CacheSettingsError
from .wan import WanStaged


@dataclass(frozen=True)
class Family:
    name: str  # our family (modules.registry)
    staged: type  # the staged model over the diffusers transformer


FAMILIES = {"WanTransformer3DModel": Family("wan", WanStaged),
            "HunyuanVideo15Transformer3DModel": Family("hunyuan_video15", HunyuanStaged)}


def family_of(transformer) -> Family:
    name = type(transformer).__name__
    if name not in FAMILIES:
        raise CacheSettingsError(f"transformer {name}: the gate knows "
                                 f"{', '.join(sorted(FAMILIES))}; expected a pipeline of one "
                                 "of them (Wan2.2, HunyuanVideo-1.5)")
    return FAMILIES[name]


def _plain(value):
    return json.loads(json.dumps(value, default=list))


def our_models(transformer, family: Family) -> tuple[str, ...]:
    """Our pipelines whose model has this transformer's architecture (its config's values of
    every constructor argument our conversion gives diffusers)."""
    diffusers_config = OUR_FAMILIES[family.name].format.diffusers_config
    theirs = {k: _plain(v) for k, v in dict(transformer.config).items()}
    found = []
    for name, pipe in PIPELINES.items():
        if pipe.family != family.name or pipe.task == "s2v":
            continue
        want = _plain(diffusers_config(pipe.config))
        if all(theirs.get(k) == v for k, v in want.items()):
            found.append(name)
    return tuple(found)


def weights_fingerprint(transformer, family: Family) -> str | None:
    """The fingerprint our checkpoints give the same weights (modules.checkpoint), read off the
    transformer's parameters renamed to our layout: a profile our calibrate command wrote for
    these weights holds for this transformer, and the other way round. None where the
    parameters cannot be read (offloaded to the meta device)."""
    params = OUR_FAMILIES[family.name].format.from_diffusers(dict(transformer.named_parameters()))
    if any(p.is_meta for p in params.values()):
        return None
    return fingerprint({n: tuple(p.shape) for n, p in params.items()}, lambda n: params[n][:1])
