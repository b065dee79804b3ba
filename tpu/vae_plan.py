"""What every VAE family's decode plan shares (tpu/vae.py runs the plans): the mesh and how a
latent frame splits over it, where a decode's arrays live (`Placement`), module routing for the
trace, the plan's interface (`DecodePlan`), and the chunked decode that Wan and HunyuanVideo-1.5
share (`ChunkedPlan`: a first program and a steady one, the causal state carried from call to
call).

On a mesh of several devices (1-D, axis "s") the latent frame, every cached frame and the video
are split by rows, or by columns where the rows do not divide (`split_plan`), the weights
replicated. The mesh takes a divisor of the device count: a TPU compile refuses collectives over
groups that do not tile the devices (libtpu: "total_device_count % num_participants_per_group ==
0"), so Wan2.2 I2V-A14B's 90 latent rows at 720p split over 8 chips by their 160 columns, not
over 6 by rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.device_order import device_grid

AXIS = "s"  # the mesh axis the frame's rows (or columns) are split over
ROWS, COLUMNS = 3, 4  # the split dimension of [B, C, T, H, W]


def make_mesh(devices: int | None = None) -> Mesh:
    """A 1-D mesh over the first `devices` of this process's devices (default: all of them), on a
    TPU in ICI-neighbour order, so the shards that trade rows sit on neighbouring chips."""
    devs = jax.local_devices()[: devices or len(jax.local_devices())]
    return Mesh(device_grid((len(devs),), devs), (AXIS,))


def split_plan(latent_height: int, latent_width: int, devices: int) -> tuple[int, int]:
    """(devices to use, ROWS or COLUMNS): the largest divisor of `devices` that splits the
    latent rows or columns evenly, rows when both do."""
    for n in sorted((d for d in range(1, devices + 1) if devices % d == 0), reverse=True):
        if latent_height % n == 0:
            return n, ROWS
        if latent_width % n == 0:
            return n, COLUMNS
    raise AssertionError("unreachable: 1 divides everything")


def mesh_size(latent_height: int, latent_width: int, devices: int) -> int:
    return split_plan(latent_height, latent_width, devices)[0]


@contextlib.contextmanager
def routed(module, routes: dict):
    """Each submodule of a type in `routes` runs `routes[type](submodule, *args)` instead of its
    forward, inside the block (the trace); the class code is untouched."""
    patched = []
    for m in module.modules():
        route = routes.get(type(m))
        if route is not None:
            m.forward = types.MethodType(route, m)
            patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a decode's arrays live: on `mesh` (None: one device) a [B, C, T, H, W] array split
    by `split` (ROWS or COLUMNS), anything else replicated; `strips`: the frame cut into strips
    on the batch axis (tpu.vae_strips.Strips, Wan), None for the frame whole."""

    mesh: Mesh | None
    split: int = ROWS
    strips: Any = None

    def replicated(self):
        return None if self.mesh is None else NamedSharding(self.mesh, P())

    def rows(self, ndim=5):
        """The sharding of a [B, C, T, H, W] array: split by rows or columns (`split`)."""
        if self.mesh is None or ndim != 5:
            return None
        spec = [None] * 5
        spec[self.split] = AXIS
        return NamedSharding(self.mesh, P(*spec))

    def state(self, abstract):
        """Cached frames split like the activations (strips: by the batch axis); K/V buffers
        replicated."""
        if self.strips is not None and self.mesh is not None:
            return jax.tree.map(lambda a: NamedSharding(self.mesh, P(AXIS)), abstract)
        return jax.tree.map(lambda a: self.rows(a.ndim) or self.replicated(), abstract)


@dataclasses.dataclass(frozen=True)
class TracedVae:
    """What a plan compiles and runs with: `trace` (a torch function of (vae, *args) and
    optionally another module to bind instead of the VAE -> a jax function of (params, *args)),
    the weights on the devices, the latents' jax dtype, `put` (a host tensor and a sharding ->
    a device array), the placement, and the VAE (on the host or the meta device)."""

    trace: Callable
    params: dict
    dtype: Any
    put: Callable
    placement: Placement
    vae: Any = None


class DecodePlan:
    """One VAE family's decode: its options checked and resolved (conv operand rounding, strips,
    frames per call), the weights it stores rounded, the strips of a latent frame, and the
    programs it compiles for a latent shape and the loop that runs them. The defaults are a
    family that convolves as stored, keeps the frame whole and decodes one latent frame a call.

    vae_class: the class name of the VAE it decodes (tpu.vae's registry); family: a short name.
    """

    vae_class: str
    family: str

    def __init__(self, vae, dtype: torch.dtype, platform: str, *,
                 conv_operands: torch.dtype | None | str = "auto",
                 strips: tuple[int, int] | str = "auto", frames_per_call: int | str = "auto"):
        self.operands = self.resolve_operands(type(vae).__name__, conv_operands, dtype, platform)
        self.check_strips(strips)
        self.grid, self.platform = strips, platform
        self.per_call = self.resolve_frames_per_call(frames_per_call)

    def resolve_operands(self, name, conv_operands, dtype, platform):
        """The dtype conv operands are rounded to (None: as stored) for `conv_operands`."""
        if conv_operands != "auto" and conv_operands is not None:
            raise ValueError(f"conv_operands rounds the Wan decoders' convs; {name} convolves as "
                             "stored (expected conv_operands=None or 'auto')")
        return None

    def check_strips(self, strips):
        if strips != "auto":
            raise ValueError(f"strips={strips!r}: expected 'auto' or (rows, columns) of at least "
                             "1 each, for a Wan VAE")

    def resolve_frames_per_call(self, frames_per_call) -> int:
        frames_per_call = 1 if frames_per_call == "auto" else frames_per_call
        if not isinstance(frames_per_call, int) or frames_per_call != 1:
            raise ValueError(f"frames_per_call={frames_per_call!r}: expected 'auto' or a positive "
                             "integer (above 1 for a Wan VAE only)")
        return frames_per_call

    def rounded_weights(self, vae) -> set[str]:
        """The names (`tpu.vae`'s "vae.*") of the weights its convs read rounded to
        `self.operands`: they are stored rounded."""
        return set()

    def strips(self, latent_height: int, latent_width: int, mesh: Mesh | None, split: int):
        """The strips a latent frame is cut into on `mesh` (None: the frame whole)."""
        return None

    def key(self, latent_shape) -> tuple:
        """What the compiled programs depend on, beside the decoder's architecture and mesh."""
        raise NotImplementedError

    def compile(self, traced: TracedVae, latent_shape) -> tuple:
        """The compiled (first, steady) programs for latents of `latent_shape` (steady None for
        a plan of one program)."""
        raise NotImplementedError

    def run(self, programs: tuple, traced: TracedVae, z: torch.Tensor) -> np.ndarray:
        """The video of the latents `z` (in the VAE's dtype), by the compiled `programs`."""
        raise NotImplementedError


class ChunkedPlan(DecodePlan):
    """Two calls compiled ahead of the loop: the first latent frame (it decodes to one video
    frame: the temporal upsamplers skip it) and a steady call of `per_call` latent frames (four
    video frames each), the causal state passed from call to call as explicit inputs and outputs.
    Each call is a chain of block programs (`tpu.vae_chain`), the family's `steps`. A clip of F
    latent frames runs the first call once and the steady one F - 1 times (per call): the loop
    calls the compiled executables, so it can compile nothing."""

    steady_extra_names: tuple[str, ...] = ()  # what steps read the `steady_extras` as

    def steps(self, vae, placement: Placement, latent_shape, first: bool) -> tuple[list, int]:
        """The call as `tpu.vae_chain.Step`s and its number of state slots."""
        raise NotImplementedError

    def between(self, placement: Placement) -> Callable:
        """abstract -> the sharding of an activation or state entry between block programs."""
        return placement.state

    def steady_extras(self, placement: Placement, frame: int | None) -> tuple:
        """The arguments a steady call takes after the state: their shapes for the compile
        (frame None), or their values for the call that starts at latent frame `frame`."""
        return ()

    def key(self, latent_shape) -> tuple:
        b, c, _, h, w = latent_shape
        return (b, c, h, w), 0, self.per_call

    def compile(self, traced: TracedVae, latent_shape) -> tuple:
        """The first and steady chains, the distinct programs of both compiled together."""
        from .vae_chain import ChainBuilder

        b, c, _, h, w = latent_shape
        placement = traced.placement
        builder = ChainBuilder(traced.vae, lambda module, fn: traced.trace(fn, module),
                               traced.params, self.between(placement), placement.rows())

        def z(frames):
            return jax.ShapeDtypeStruct((b, c, frames, h, w), traced.dtype,
                                        sharding=placement.rows())

        steps, slots = self.steps(traced.vae, placement, latent_shape, first=True)
        first, _, state = builder.chain(steps, z(1), [None] * slots)
        extras = dict(zip(self.steady_extra_names, self.steady_extras(placement, None),
                          strict=True))
        steps, _ = self.steps(traced.vae, placement, latent_shape, first=False)
        steady, _, _ = builder.chain(steps, z(self.per_call), state, extras)
        builder.compile()
        return first, steady

    def run(self, programs: tuple, traced: TracedVae, z: torch.Tensor) -> np.ndarray:
        first, steady = programs
        placement, params = traced.placement, traced.params
        chunks = []
        out, state = first(params, traced.put(z[:, :, :1], placement.rows()))
        k, frames = self.per_call, z.shape[2]
        for i in range(1, frames, k):  # host slices and transfers: no device op to compile
            part = z[:, :, i:i + k]
            if part.shape[2] < k:  # the clip's last frames: zeros after them change nothing
                part = torch.cat([part, part.new_zeros(*part.shape[:2], k - part.shape[2],
                                                       *part.shape[3:])], dim=2)
            previous, part = out, traced.put(part, placement.rows())
            out, state = steady(params, part, state, *self.steady_extras(placement, i))
            # the previous chunk comes to the host while this call runs: at most two video
            # chunks are ever on the device (tpu.vae_aot's memory plan counts them)
            chunks.append(np.asarray(previous))
        last = np.asarray(out)
        padded = -(frames - 1) % k  # the zero latent frames of the last call
        chunks.append(last[:, :, :last.shape[2] - padded * (last.shape[2] // k)])
        return np.concatenate(chunks, axis=2)
