"""The CFG guidance a command takes (`--guidance_scale`): one scale, or for the two experts of
Wan2.2 I2V-A14B a 'low,high' pair, parsed and checked alike by every command that takes it
(stage 2, the deviceless compile)."""

from __future__ import annotations

from .cli import as_number
from .errors import UsageError
from .pipelines import MAX_GUIDANCE, Pipeline


def parse_guidance(text, pipe: Pipeline, label: str = "--guidance_scale"):
    """None (the pipeline's), one scale, or (low, high) for the two experts of Wan2.2 I2V-A14B;
    each a finite number >= 0. `text` as the flag gave it (a string), or a number or a (low,
    high) pair read back from a config file."""
    if text is None:
        return None
    if isinstance(text, list | tuple):  # a (low, high) pair read back from a config file
        text = ",".join(str(v) for v in text)
    want = f"a number in [0, {MAX_GUIDANCE:g}]" + (" or 'low,high'" if pipe.moe else "")
    try:
        values = tuple(float(v) for v in str(text).split(","))
    except ValueError:
        raise UsageError(f"{label} {text!r}: expected {want}") from None
    if len(values) not in ((1, 2) if pipe.moe else (1,)):
        raise UsageError(f"{label} {text!r}: expected {want}")
    for v in values:
        as_number(label, v, minimum=0.0, maximum=MAX_GUIDANCE, expected=want)
    return values if len(values) == 2 else values[0]
