"""PixelLatents (the pixel-space tiny models' latent mapping, modules.vae) decode plan
(`PixelsPlan`): the mapping inverted and clamped, one program of the whole clip."""

from __future__ import annotations

import jax
import numpy as np

from .vae_plan import DecodePlan, TracedVae


class PixelsPlan(DecodePlan):
    """One program per latent shape: it holds no causal state, so nothing is chunked."""

    vae_class, family = "PixelLatents", "pixels"

    def key(self, latent_shape) -> tuple:
        return tuple(latent_shape)

    def compile(self, traced: TracedVae, latent_shape) -> tuple:
        rows = traced.placement.rows()
        z = jax.ShapeDtypeStruct(tuple(latent_shape), traced.dtype, sharding=rows)
        program = jax.jit(traced.trace(lambda vae, z: vae.decode(z)[0].float()), out_shardings=rows)
        return program.lower(traced.params, z).compile(), None

    def run(self, programs, traced: TracedVae, z) -> np.ndarray:
        return np.asarray(programs[0](traced.params, traced.put(z, traced.placement.rows())))
