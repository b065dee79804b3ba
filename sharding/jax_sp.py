"""Sequence and CFG parallelism for the JAX backend: a ("cfg", "sp") mesh, the layout the stages
use under it, and Ulysses attention written with `jax.shard_map`.

The stage programs stay global-view jitted programs (GSPMD): the weights and inputs are
replicated, the probe pins the image tokens to the `sp` axis (and the batch of a fused CFG
call to `cfg`), and XLA propagates that through the per-token work of every block. Two places
need explicit collectives, written with shard_map:
  - attention: Ulysses all-to-all (heads divisible by sp: each device attends the whole sequence
    for 1/sp of the heads), or gathered K/V otherwise;
  - the gate's signals: every per-token signal column is summed locally and reduced with one
    `psum` over `sp` (the valid-token-count-weighted mean is that sum over the true count, so
    padded or unequal shards are exact).
Sequences that do not divide sp are padded inside those two places (masked keys, dropped
queries, zero signal rows).

Weights are replicated by default. With `weights="fsdp"` every 2-D block weight (the Linear
layers: 97-99 % of a DiT's bytes) lives split over all the mesh's devices, and each block
gathers its own weights right before it runs (`block_weights`), so a device holds 1/n of the
blocks plus one block whole at a time: how Wan2.2 I2V-A14B's two experts fit one v6e-8 slice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from compat.torchax_compat import import_torchax
from modules import ops

from . import layout
from .device_order import device_grid
from .layout import Layout

_interop = import_torchax().interop
AXES = ("cfg", "sp")
WEIGHT_SHARDINGS = ("replicated", "fsdp")
# `token_sums` stacks every signal column into one psum: a probe that reads signals adds this
# many collectives (the layout counts what it traced in `signal_collectives`)
SIGNAL_PSUMS_PER_PROBE = 1


def default_weights(mesh) -> str:
    """The weight layout when none is asked for: FSDP on a mesh of several devices (a chip then
    holds 1/n of the blocks: Wan2.2 I2V-A14B's two experts take 8.1 GiB of a v6e-8 chip, not
    54 GiB; the per-block gathers cost ~0.1 s of ICI against ~0.9 s of compute per call,
    bench/results/tpu_aot.md), replicated on one device."""
    return "fsdp" if mesh is not None and mesh.size > 1 else "replicated"


def make_mesh(sp: int = 1, cfg: int = 1, devices=None) -> Mesh:
    """A (cfg, sp) mesh of Auto axes over the first cfg * sp devices, on a TPU slice laid out by
    the chips' coordinates so each sp ring runs over ICI neighbours (`device_order.device_grid`)."""
    job = devices is None
    devices = list(jax.devices() if devices is None else devices)
    for name, size in (("sp", sp), ("cfg", cfg)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} size must be an integer >= 1, got {size!r}")
    if cfg not in (1, 2):
        raise ValueError(f"cfg size is 1 or 2 (the two guidance branches), got {cfg}")
    if sp * cfg > len(devices):
        hint = (" (on CPU, emulate devices with XLA_FLAGS=--xla_force_host_platform_device_count=N "
                "set before jax starts)") if jax.default_backend() == "cpu" else ""
        raise ValueError(f"a mesh of sp={sp} x cfg={cfg} needs {sp * cfg} devices; "
                         f"{len(devices)} are visible ({jax.default_backend()}){hint}")
    if job and jax.process_count() > 1 and sp * cfg != len(devices):
        # a host with no device in the mesh holds no shard of its arrays: JAX fails placing them
        raise ValueError(f"a job of {jax.process_count()} hosts runs one mesh over all "
                         f"{len(devices)} of their devices; sp={sp} x cfg={cfg} covers "
                         f"{sp * cfg}: expected sp x cfg = {len(devices)}")
    return Mesh(device_grid((cfg, sp), devices[: sp * cfg]), AXES)


def _pad_to(x, axis: int, multiple: int, value=0):
    n = x.shape[axis]
    extra = (-n) % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


class JaxSequenceLayout(Layout):
    """The stages' view of a (cfg, sp) mesh while the JAX backend traces them."""

    def __init__(self, mesh: Mesh, base_attention: str, weights: str = "replicated"):
        if weights not in WEIGHT_SHARDINGS:
            raise ValueError(f"weight sharding {weights!r}: expected one of "
                             f"{', '.join(WEIGHT_SHARDINGS)}")
        self.mesh = mesh
        self.sp_size = mesh.shape["sp"]
        self.cfg_size = mesh.shape["cfg"]
        self.base_attention = base_attention
        self.weights = weights
        self.splits_weights = weights == "fsdp" and mesh.size > 1
        self.signal_collectives = 0  # psums traced for signals (tests count one per probe)

    def batch_axis(self, batch: int):
        """The fused CFG pair goes over `cfg`; anything else is replicated over it."""
        return "cfg" if self.cfg_size > 1 and batch % self.cfg_size == 0 else None

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    # --- weights ---------------------------------------------------------------------------

    def weight_spec(self, shape: tuple[int, ...], in_block: bool) -> P:
        """Where one weight lives: whole on every device, or (FSDP, a 2-D block weight) split
        over all of them along its first dimension that divides evenly."""
        if not self.splits_weights or not in_block or len(shape) != 2:
            return P()
        for dim in (0, 1):
            if shape[dim] % self.mesh.size == 0:
                return P(*([None] * dim), AXES)
        return P()  # neither dimension divides: kept whole (and counted whole)

    def weight_sharding(self, shape: tuple[int, ...], in_block: bool) -> NamedSharding:
        return NamedSharding(self.mesh, self.weight_spec(shape, in_block))

    def block_weights(self, params: dict) -> dict:
        """Each weight of one block whole on every device (an all-gather of the split ones; the
        whole ones pass through), placed just before the block by the stage's loop."""
        whole = self.replicated()
        return {name: _interop.torch_view(jax.lax.with_sharding_constraint(
                    _interop.jax_view(p), whole)) for name, p in params.items()}

    def shard_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        def constrain(h):
            spec = P(self.batch_axis(h.shape[0]), "sp", *([None] * (h.ndim - 2)))
            return jax.lax.with_sharding_constraint(h, NamedSharding(self.mesh, spec))
        return _interop.torch_view(constrain(_interop.jax_view(hidden)))

    def gather_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """A call's results (signals, model output) whole on every device. Left to propagation,
        an output could come back split (with sp 3, the unpatchified [B, C, F, H, W] took the
        token axis's split onto F = 3), and the latent it feeds back would reach the next
        step's programs with a sharding warm-up never compiled for."""
        whole = self.replicated()
        return _interop.torch_view(jax.lax.with_sharding_constraint(_interop.jax_view(tensor), whole))

    def token_sums(self, columns: list[torch.Tensor]) -> torch.Tensor:
        cols = [_pad_to(c, 1, self.sp_size) for c in _interop.jax_view(list(columns))]
        bax = self.batch_axis(cols[0].shape[0])

        def local(*shards):
            return jax.lax.psum(jnp.stack([s.sum(1) for s in shards], axis=1), "sp")

        self.signal_collectives += 1
        summed = jax.shard_map(local, mesh=self.mesh, in_specs=tuple(P(bax, "sp") for _ in cols),
                               out_specs=P(bax, None), check_vma=False)(*cols)
        return _interop.torch_view(summed)

    # --- attention --------------------------------------------------------------------------

    def attention(self, q_BLNH, k_BSNH, v_BSNH, key_mask_BS=None):
        """`ops.attention` over the sp axis: global shapes in and out (GSPMD), shard_map inside."""
        base = ops.implementation("attention", self.base_attention)
        q, k, v = _interop.jax_view((q_BLNH, k_BSNH, v_BSNH))
        batch, q_len, heads, _ = q.shape
        kv_len, sp = k.shape[1], self.sp_size
        mask = jnp.ones((batch, kv_len), jnp.bool_) if key_mask_BS is None \
            else _interop.jax_view(key_mask_BS).astype(jnp.bool_)
        q, k, v = _pad_to(q, 1, sp), _pad_to(k, 1, sp), _pad_to(v, 1, sp)
        mask = _pad_to(mask, 1, sp, False)  # padded keys never receive weight
        bax = self.batch_axis(batch)

        def attend(q, k, v, m):
            out = base(*_interop.torch_view((q, k, v, m)))
            return _interop.jax_view(out)

        if heads % sp == 0:  # Ulysses: all-to-all to whole sequences of heads/sp heads
            def local(q, k, v, m):
                q, k, v = (jax.lax.all_to_all(t, "sp", 2, 1, tiled=True) for t in (q, k, v))
                out = attend(q, k, v, m)
                return jax.lax.all_to_all(out, "sp", 1, 2, tiled=True)
        else:  # gathered K/V: local queries against the whole key sequence
            def local(q, k, v, m):
                k, v = (jax.lax.all_gather(t, "sp", axis=1, tiled=True) for t in (k, v))
                return attend(q, k, v, m)

        seq = P(bax, "sp", None, None)
        out = jax.shard_map(local, mesh=self.mesh, in_specs=(seq, seq, seq, P(bax, None)),
                            out_specs=seq, check_vma=False)(q, k, v, mask)
        return _interop.torch_view(out[:, :q_len])


def _attention(q_BLNH, k_BSNH, v_BSNH, key_mask_BS=None):
    return layout.current().attention(q_BLNH, k_BSNH, v_BSNH, key_mask_BS)


ATTENTION = "sequence_parallel"


def install() -> None:
    """Register `ops.attention` "sequence_parallel": the active layout's attention (idempotent)."""
    ops.register("attention", ATTENTION, _attention)
