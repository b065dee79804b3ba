"""Stage 3 on JAX: the diffusers video VAEs' decoders as static programs, traced through torchax
from the same torch modules, a latent frame per call (Wan: or a few) with the causal caches
carried between calls as explicit inputs and outputs.

`JaxVaeDecoder` places the weights, plans the mesh, compiles ahead of the loop (`prepare`) and
keeps the compiled programs; what differs by VAE is its decode plan (tpu/vae_plan.py), found by
the VAE's class in `PLANS`:

    Wan2.1 / Wan2.2 (AutoencoderKLWan, tpu/vae_wan.py): diffusers' feat_cache made fixed-shape,
        a first call and a steady one of `frames_per_call` latent frames, each a chain of block
        programs that blocks alike share (tpu/vae_chain.py); conv operands rounded to bfloat16
        on a TPU (`conv_operands`); each device's band of the frame cut into strips on the batch
        axis (`strips`, tpu/vae_strips.py).
    HunyuanVideo-1.5 (AutoencoderKLHunyuanVideo15, tpu/vae_hunyuan.py): a first call and a
        steady one, each a chain of block programs, the causal convs' last frames and the
        mid-block K/V of every earlier frame carried, in buffers of `kv_frames` latent frames.
    PixelLatents (the pixel-space tiny models, tpu/vae_pixels.py): the clamp, one program of the
        whole clip.

A clip of any length runs the first call once and the steady one F - 1 times (Wan: per
`frames_per_call`); the loop calls the compiled executables, so it can compile nothing. On a mesh
the frame's rows, or columns, are split over the devices (`split_plan`), the weights replicated.
"""

from __future__ import annotations

import jax
import numpy as np
import torch
from jax.sharding import Mesh

from compat.torchax_compat import import_torchax

from .compile import compile_counts
from .vae_hunyuan import HunyuanPlan, kv_frames
from .vae_pixels import PixelsPlan
from .vae_plan import ROWS, DecodePlan, Placement, TracedVae, split_plan
from .vae_wan import WanPlan

__all__ = ["PLANS", "JaxVaeDecoder", "family", "plan_for"]

# the decode plan of each VAE class, by its class name
PLANS: dict[str, type[DecodePlan]] = {plan.vae_class: plan
                                      for plan in (WanPlan, HunyuanPlan, PixelsPlan)}
# The compiled programs of this process, by architecture (class, config, dtype), devices and
# shape: the weights are arguments, so another decoder of the same VAE (the next run of a job,
# another checkpoint) reuses them and compiles nothing.
_COMPILED: dict = {}
_ENCODER = ("vae.encoder.", "vae.quant_conv.")  # weights no decode reads


def plan_for(vae) -> type[DecodePlan]:
    """The decode plan of `vae`'s class (`PLANS`)."""
    name = type(vae).__name__
    if name not in PLANS:
        *others, last = PLANS
        raise ValueError(f"no JAX decode for {name}; expected {', '.join(others)} or {last}")
    return PLANS[name]


def family(vae) -> str:
    """The family of `vae`'s decode plan: "wan", "hunyuan" or "pixels"."""
    return plan_for(vae).family


class _Decode(torch.nn.Module):
    """The VAE as one module, so that functional_call binds its weights by name ("vae.*")."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, fn, *args):
        return fn(self.vae, *args)


class JaxVaeDecoder:
    """Decodes [1, C, F, H, W] VAE latents (already de-normalised: `modules.vae.to_vae_latents`)
    into the video [1, 3, 4(F-1)+1, H*s, W*s] as float32 numpy, on JAX.

    vae: a diffusers AutoencoderKLWan / AutoencoderKLHunyuanVideo15 or PixelLatents, on the
    host in the dtype to compute in (its weights are copied to the devices once).
    mesh: a 1-D mesh (`make_mesh`) to split the frame's rows over; None: one device.
    abstract: hold the weights as shapes only (a VAE built on the meta device, a mesh of
    compile-only TPU devices): `prepare` then compiles for that slice and nothing can run
    (`tpu.vae_aot`).
    conv_operands: the dtype the Wan decoders round conv operands to (see tpu/vae_wan.py),
    None for as stored; "auto": `conv_operand_dtype` for the mesh's platform.
    strips: (rows, columns) of strips the Wan decoders cut each device's band of the frame into
    (`tpu.vae_strips.Strips`); "auto": `strip_grid` for the mesh's platform.
    frames_per_call: latent frames each steady call of a Wan decoder decodes (the last call's
    missing ones zeros, their video dropped: the convs are causal); "auto": WAN_FRAMES_PER_CALL.
    """

    def __init__(self, vae, mesh: Mesh | None = None, *, abstract: bool = False,
                 conv_operands: torch.dtype | None | str = "auto",
                 strips: tuple[int, int] | str = "auto", frames_per_call: int | str = "auto"):
        self.torchax = import_torchax()
        self.env = self.torchax.default_env()
        plan = plan_for(vae)
        self.vae, self.mesh, self.abstract = vae, mesh, abstract
        self.split = ROWS  # set per latent shape by `prepare` (`split_plan`)
        if abstract and mesh is None:
            raise ValueError("an abstract decoder compiles for a mesh; expected mesh= (one device "
                             "or more)")
        self.module = _Decode(vae)
        self.dtype = next(iter(vae.parameters()), torch.zeros(())).dtype
        self.platform = (mesh.devices.flat[0] if mesh is not None
                         else jax.local_devices()[0]).platform
        self.plan = plan(vae, self.dtype, self.platform, conv_operands=conv_operands,
                         strips=strips, frames_per_call=frames_per_call)
        self.strips = None  # set per latent shape by `prepare`
        rounded = self.plan.rounded_weights(vae)
        tensors = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        # the decoder's side only: the encoder's weights (a third of the Wan2.2 VAE's) would sit
        # on every device unused
        replicated = Placement(mesh).replicated()
        self.params = {name: self._put(t.to(self.operands) if name in rounded else t, replicated)
                       for name, t in tensors.items() if not name.startswith(_ENCODER)}
        devices = tuple((d.platform, d.device_kind, d.id) for d in mesh.devices.flat) \
            if mesh is not None else None
        config = sorted((k, repr(v)) for k, v in dict(getattr(vae, "config", {})).items())
        self._arch = (type(vae).__name__, tuple(config), str(self.dtype), str(self.operands),
                      devices, strips)
        # the plan's key of a latent shape -> its compiled (first, steady)
        self._programs = _COMPILED.setdefault(self._arch, {})

    @property
    def operands(self) -> torch.dtype | None:
        """The dtype the convs' operands are rounded to (None: as stored)."""
        return self.plan.operands

    @property
    def per_call(self) -> int:
        """Latent frames a steady call decodes."""
        return self.plan.per_call

    def _put(self, tensor: torch.Tensor, sharding):
        if self.abstract:
            dtype = jax.dtypes.canonicalize_dtype(str(tensor.dtype).removeprefix("torch."))
            return jax.ShapeDtypeStruct(tuple(tensor.shape), dtype, sharding=sharding)
        if tensor.dtype == torch.bfloat16:  # numpy has no bf16: through torchax's mapping
            array = self.env.t2j_copy(tensor.detach().contiguous())
            return array if sharding is None else jax.device_put(array, sharding)
        return jax.device_put(tensor.detach().cpu().numpy(), sharding)

    def _trace(self, fn, module=None):
        """fn(module, *args) as a jax function of (params, *args), the params bound to
        `module`'s names (default: the VAE's, "vae.*")."""
        module, env = self.module if module is None else module, self.env

        def traced(params, *args):
            with env, torch.no_grad():
                return torch.func.functional_call(module, params, (fn, *args))

        return self.torchax.interop.jax_view(traced)

    def _traced(self) -> TracedVae:
        """The traced VAE on its devices, placed for the latent shape `prepare` planned last."""
        dtype = jax.numpy.dtype(str(self.dtype).removeprefix("torch."))
        return TracedVae(self._trace, self.params, dtype, self._put,
                         Placement(self.mesh, self.split, self.strips), self.vae)

    def kv_frames(self, frames: int) -> int:
        """The latent frames a HunyuanVideo-1.5 clip's K/V buffers hold (a multiple of KV_BUCKET)."""
        return kv_frames(frames)

    def prepare(self, latent_shape) -> tuple:
        """Compile (once per frame size and K/V bucket) the first and steady programs for
        latents of `latent_shape`; returns the compiled pair."""
        b, c, frames, h, w = latent_shape
        if self.mesh is not None:
            n, self.split = split_plan(h, w, self.mesh.size)
            if n != self.mesh.size:
                raise ValueError(f"a latent of {h} x {w} splits over no {self.mesh.size} devices "
                                 f"by rows or columns; use {n} (tpu.vae_plan.split_plan)")
        self.strips = self.plan.strips(h, w, self.mesh, self.split)
        key = self.plan.key(tuple(latent_shape))
        if key not in self._programs:
            self._programs[key] = self.plan.compile(self._traced(), tuple(latent_shape))
        return self._programs[key]

    def decode(self, z: torch.Tensor) -> np.ndarray:
        """The video, float32 [1, 3, frames, height, width] in the VAE's output range."""
        if self.abstract:
            raise RuntimeError("an abstract decoder holds no weights; it can only compile")
        programs = self.prepare(tuple(z.shape))
        return self.plan.run(programs, self._traced(), z.to(self.dtype))

    def compile_counts(self):
        return compile_counts()
