"""Key conversion between the official layouts (our parameter names) and diffusers' layouts, by
family name. Each family writes its mapping once, in its format module (`wan_format.py`,
`hunyuan_video15_format.py`), found through `modules.registry`; the per-family names below are
those modules' functions under the names callers import from here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from modules.hunyuan_video15_format import diffusers_config as hunyuan_diffusers_config
from modules.hunyuan_video15_format import from_diffusers as hunyuan_from_diffusers
from modules.hunyuan_video15_format import to_diffusers as hunyuan_to_diffusers
from modules.layouts import DIFFUSERS, LAYOUTS, OFFICIAL
from modules.registry import FAMILIES
from modules.wan_format import diffusers_config as wan_diffusers_config
from modules.wan_format import from_diffusers as wan_from_diffusers
from modules.wan_format import to_diffusers as wan_to_diffusers

__all__ = ["DIFFUSERS", "LAYOUTS", "OFFICIAL", "from_layout", "hunyuan_diffusers_config",
           "hunyuan_from_diffusers", "hunyuan_to_diffusers", "to_layout", "wan_diffusers_config",
           "wan_from_diffusers", "wan_to_diffusers"]


def to_layout(family: str, sd: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Official-layout state dict -> `layout`."""
    return FAMILIES[family].format.to_layout(sd, layout)


def from_layout(family: str, sd: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """`layout` state dict -> official layout (our parameter names)."""
    return FAMILIES[family].format.from_layout(sd, layout)
