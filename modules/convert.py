"""Key conversion between the official layouts (our parameter names) and diffusers' layouts, by
family name. Each family writes its mapping once, in its format module (`wan_format.py`,
`hunyuan_video15_format.py`), found through `modules.registry`; a caller that knows the family
imports that module's own functions.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from modules.registry import FAMILIES

__all__ = ["from_layout", "to_layout"]


def to_layout(family: str, sd: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Official-layout state dict -> `layout`."""
    return FAMILIES[family].format.to_layout(sd, layout)


def from_layout(family: str, sd: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """`layout` state dict -> official layout (our parameter names)."""
    return FAMILIES[family].format.from_layout(sd, layout)
