"""Attention lowerings for the JAX backend, registered as implementations of `ops.attention`.

`dot_product_attention` goes through `jax.nn.dot_product_attention` (CPU/GPU, and the
reference-like fallback); `splash_attention` through the Pallas TPU splash kernel. Both take
and return torch-facing (torchax) tensors, so the models call them through `ops.attention`
unchanged, inside torchax-jitted programs (tracers) or eagerly.

Layout legend: B batch, L query tokens, S key tokens, N heads, H head dim; the `p` suffix
(`Lp`, `Sp`) marks a length padded up to a whole number of kernel blocks.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import torch
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from compat.torchax_compat import import_torchax
from modules import ops

torchax = import_torchax()
_interop = torchax.interop

# The stock-kernel block sizes of the HunyuanVideo TPU scripts (tpu_notes 1.6); each is an upper
# bound, lowered for short sequences so that padding stays under one 128-row tile per block.
BLOCK_Q = 2048
BLOCK_KV = 2048
BLOCK_KV_COMPUTE = 1024
_LANES = 128  # splash blocks must be multiples of the TPU lane count

# Largest blocks per TPU generation (jax device_kind), where the stock ones do not fit: inside
# Wan2.2 TI2V-5B's real-size middle program the stock kernel asks 17.5 MiB (v5e, sp 8) and
# 21.6 MiB (v5p, sp 4) of scoped VMEM, over the 16 MiB both give a kernel (libtpu E1001
# CompileTimeScopedVmemOom, found with `python -m commands.aot --model wan2.2-ti2v-5b --topology
# v5e:2x4 --sp_size 8`); half-height query blocks fit. v6e compiles the stock sizes at every
# size in bench/results/tpu_aot.md.
BLOCKS_BY_KIND = {"TPU v5 lite": (1024, BLOCK_KV, BLOCK_KV_COMPUTE),
                  "TPU v5": (1024, BLOCK_KV, BLOCK_KV_COMPUTE)}
_device_kind: str | None = None  # the device kind programs are being traced for


@contextmanager
def tracing_for(device_kind: str | None):
    """Trace attention inside the block for programs compiled for `device_kind`: the splash
    kernel takes that generation's block sizes."""
    global _device_kind
    previous, _device_kind = _device_kind, device_kind
    try:
        yield
    finally:
        _device_kind = previous


def block_sizes(device_kind: str | None = None) -> tuple[int, int, int]:
    """(block_q, block_kv, block_kv_compute) upper bounds for a device kind (default: the one
    being traced for); the stock sizes unless BLOCKS_BY_KIND names a smaller set."""
    return BLOCKS_BY_KIND.get(device_kind or _device_kind, (BLOCK_Q, BLOCK_KV, BLOCK_KV_COMPUTE))


# --- jax.nn.dot_product_attention ---------------------------------------------------------------

# cuDNN's fused flash kernel takes half-precision q/k/v with a head dim it tiles (a multiple of
# 8, at most 128; the Wan and HunyuanVideo-1.5 DiTs use 128) and no general mask.
FUSED_DTYPES = (jnp.bfloat16, jnp.float16)
FUSED_MAX_HEAD_DIM = 128
fused_on_gpu = True  # bench.gpu turns it off (--no_fused) where its smoke phase finds it failing


def implementation_for(q_BLNH, key_mask_BS, platform: str | None = None) -> str | None:
    """`jax.nn.dot_product_attention`'s implementation for these operands: "cudnn" (the fused
    flash kernel) on a GPU for an unmasked half-precision call it supports, else None (XLA's,
    which holds every score). A masked call (text keys with padding) stays on XLA: cuDNN's
    masks are prefix lengths, and HunyuanVideo's valid keys are not a prefix."""
    platform = platform or jax.default_backend()
    head_dim = q_BLNH.shape[-1]
    if (platform == "gpu" and fused_on_gpu and key_mask_BS is None
            and q_BLNH.dtype in FUSED_DTYPES and head_dim % 8 == 0
            and head_dim <= FUSED_MAX_HEAD_DIM):
        return "cudnn"
    return None


@functools.partial(jax.jit, static_argnames=("implementation",))
def _dot_product_attention_jax(q_BLNH, k_BSNH, v_BSNH, key_mask_BS, implementation=None):
    # A general boolean mask, not key_value_seq_lengths: the latter keeps a prefix of the keys,
    # and HunyuanVideo's valid keys are [image | vision | byT5 | text], each with its own padding.
    mask_B11S = None if key_mask_BS is None else key_mask_BS.astype(jnp.bool_)[:, None, None, :]
    out = jax.nn.dot_product_attention(q_BLNH, k_BSNH, v_BSNH, mask=mask_B11S,
                                       implementation=implementation)
    return out.astype(q_BLNH.dtype)


def dot_product_attention(q_BLNH: torch.Tensor, k_BSNH: torch.Tensor, v_BSNH: torch.Tensor,
                          key_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
    """`ops.attention` through `jax.nn.dot_product_attention`: the CPU/GPU lowering, cuDNN's
    fused kernel on a GPU where it applies (`implementation_for`), XLA's otherwise."""
    q, k, v, key_mask = _to_jax(q_BLNH, k_BSNH, v_BSNH, key_mask_BS)
    return _interop.torch_view(_dot_product_attention_jax(
        q, k, v, key_mask, implementation=implementation_for(q, key_mask)))


# --- splash attention (Pallas TPU kernel) -------------------------------------------------------

class SplashPlan(NamedTuple):
    """Block sizes the kernel runs with and the lengths the sequences are padded to."""

    block_q: int
    block_kv: int
    block_kv_compute: int
    padded_q_len: int
    padded_kv_len: int


def splash_plan(q_len: int, kv_len: int, *, block_q: int = BLOCK_Q, block_kv: int = BLOCK_KV,
                block_kv_compute: int = BLOCK_KV_COMPUTE) -> SplashPlan:
    """Blocks no larger than asked, sized so the padded lengths exceed the true ones by little.

    A sequence needing n blocks of the largest size is split into n equal blocks rounded up to
    a multiple of 128 (of block_kv_compute for keys), e.g. 3000 queries -> 2 x 1536, not 2 x 2048.
    """
    for name, size in (("block_q", block_q), ("block_kv", block_kv),
                       ("block_kv_compute", block_kv_compute)):
        if size <= 0 or size % _LANES:
            raise ValueError(f"{name}={size} must be a positive multiple of {_LANES} "
                             "(the splash kernel tiles sequences by TPU lanes)")
    if block_kv % block_kv_compute:
        raise ValueError(f"block_kv={block_kv} must be a multiple of block_kv_compute="
                         f"{block_kv_compute}; e.g. 2048 and 1024")
    if q_len <= 0 or kv_len <= 0:
        raise ValueError(f"empty sequence: q_len={q_len}, kv_len={kv_len}")
    kv_compute = min(block_kv_compute, _round_up(kv_len, _LANES))
    bq, padded_q = _even_blocks(q_len, block_q, _LANES)
    bkv, padded_kv = _even_blocks(kv_len, block_kv, kv_compute)
    return SplashPlan(bq, bkv, kv_compute, padded_q, padded_kv)


def _even_blocks(length: int, largest: int, granule: int) -> tuple[int, int]:
    count = -(-_round_up(length, granule) // largest)
    block = _round_up(-(-length // count), granule)
    return block, block * count


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("interpret", "block_q", "block_kv", "block_kv_compute"))
def _splash_attention_jax(q_BLNH, k_BSNH, v_BSNH, key_mask_BS, *, interpret, block_q, block_kv,
                          block_kv_compute):
    batch, q_len, heads, head_dim = q_BLNH.shape
    kv_len = k_BSNH.shape[1]
    plan = splash_plan(q_len, kv_len, block_q=block_q, block_kv=block_kv,
                       block_kv_compute=block_kv_compute)
    lp, sp = plan.padded_q_len, plan.padded_kv_len

    # The kernel has no scale argument: scale q (in fp32, then back to q's dtype).
    q_scaled = (q_BLNH.astype(jnp.float32) / math.sqrt(head_dim)).astype(q_BLNH.dtype)
    q_BNLpH = _pad_axis(q_scaled.transpose(0, 2, 1, 3), 2, lp)
    k_BNSpH = _pad_axis(k_BSNH.transpose(0, 2, 1, 3), 2, sp)
    v_BNSpH = _pad_axis(v_BSNH.transpose(0, 2, 1, 3), 2, sp)

    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([splash.FullMask((lp, sp))] * heads),
        block_sizes=splash.BlockSizes(block_q=plan.block_q, block_kv=plan.block_kv,
                                      block_kv_compute=plan.block_kv_compute),
        head_shards=1, q_seq_shards=1, interpret=interpret)

    if key_mask_BS is None and sp == kv_len:
        out_BNLpH = jax.vmap(kernel)(q_BNLpH, k_BNSpH, v_BNSpH)
    else:
        # Exact padding: every query (id 0) attends only to keys with id 0, i.e. valid keys;
        # masked and block-fill keys get id 1. Padded query rows are sliced off below.
        valid_BS = (jnp.ones((batch, kv_len), jnp.bool_) if key_mask_BS is None
                    else key_mask_BS.astype(jnp.bool_))
        kv_ids_BSp = _pad_axis(jnp.where(valid_BS, 0, 1).astype(jnp.int32), 1, sp, value=1)
        q_ids_BLp = jnp.zeros((batch, lp), jnp.int32)
        out_BNLpH = jax.vmap(kernel)(q_BNLpH, k_BNSpH, v_BNSpH,
                                     segment_ids=splash.SegmentIds(q=q_ids_BLp, kv=kv_ids_BSp))
    return out_BNLpH[:, :, :q_len].transpose(0, 2, 1, 3).astype(q_BLNH.dtype)


def _pad_axis(x, axis: int, length: int, value=0):
    if x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


class KernelCost(NamedTuple):
    """Work of one splash call that XLA's cost analysis cannot see (a Pallas custom call has no
    cost model): MXU flops over the padded blocks, exps, and the K/V re-reads of every q block
    beyond the operands' single read that the analysis does count."""

    flops: float
    transcendentals: float
    extra_bytes: float


_KERNEL_COSTS: list[KernelCost] | None = None
_REPEATS = 1  # times a kernel traced now runs per call (inside a scanned loop body: its length)


@contextmanager
def kernel_costs() -> Iterator[list[KernelCost]]:
    """Collect the KernelCost of every splash call traced inside the block (per device: under
    sequence parallelism the kernel is traced with each device's shapes)."""
    global _KERNEL_COSTS
    before, _KERNEL_COSTS = _KERNEL_COSTS, []
    try:
        yield _KERNEL_COSTS
    finally:
        _KERNEL_COSTS = before


@contextmanager
def repeated(times: int) -> Iterator[None]:
    """Kernels traced inside run `times` times per call (a loop body traced once)."""
    global _REPEATS
    before, _REPEATS = _REPEATS, _REPEATS * times
    try:
        yield
    finally:
        _REPEATS = before


def _record_kernel(q_BLNH, k_BSNH, plan: SplashPlan) -> None:
    batch, _, heads, head_dim = q_BLNH.shape
    lp, sp = plan.padded_q_len, plan.padded_kv_len
    rereads = (lp // plan.block_q - 1) * 2 * sp * head_dim * heads * batch * q_BLNH.dtype.itemsize
    _KERNEL_COSTS.append(KernelCost(_REPEATS * 4.0 * batch * heads * lp * sp * head_dim,
                                    _REPEATS * float(batch * heads * lp * sp),
                                    _REPEATS * float(rereads)))


def splash_attention(q_BLNH: torch.Tensor, k_BSNH: torch.Tensor, v_BSNH: torch.Tensor,
                     key_mask_BS: torch.Tensor | None = None, *, interpret: bool = False,
                     block_q: int | None = None, block_kv: int | None = None,
                     block_kv_compute: int | None = None) -> torch.Tensor:
    """`ops.attention` through the Pallas TPU splash kernel, vmapped over batch.

    Block sizes are upper bounds (multiples of 128; see `splash_plan`); None: the traced-for
    device generation's (`block_sizes`). Every query row must
    keep at least one valid key (the `ops.attention` contract): a row with none would average
    over the padding instead of over all keys. Forward only (no backward block sizes).
    `interpret=True` runs the kernel in the Pallas interpreter, e.g. on CPU for tests.
    """
    q, k, v, key_mask = _to_jax(q_BLNH, k_BSNH, v_BSNH, key_mask_BS)
    default_q, default_kv, default_kv_compute = block_sizes()
    block_q = block_q or default_q
    block_kv = block_kv or default_kv
    block_kv_compute = block_kv_compute or default_kv_compute
    if _KERNEL_COSTS is not None:
        _record_kernel(q, k, splash_plan(q.shape[1], k.shape[1], block_q=block_q,
                                         block_kv=block_kv, block_kv_compute=block_kv_compute))
    out = _splash_attention_jax(q, k, v, key_mask, interpret=interpret, block_q=block_q,
                                block_kv=block_kv, block_kv_compute=block_kv_compute)
    return _interop.torch_view(out)


def _splash_attention_interpret(q_BLNH, k_BSNH, v_BSNH, key_mask_BS=None):
    return splash_attention(q_BLNH, k_BSNH, v_BSNH, key_mask_BS, interpret=True)


# --- registration ------------------------------------------------------------------------------

IMPLEMENTATIONS = {
    "jax_dpa": dot_product_attention,
    "splash": splash_attention,
    "splash_interpret": _splash_attention_interpret,
}


def install() -> None:
    """Register the lowerings as implementations of op "attention" (idempotent)."""
    for name, fn in IMPLEMENTATIONS.items():
        ops.register("attention", name, fn)


def default_attention() -> str:
    """The lowering to select on this JAX backend: splash on TPU, XLA elsewhere."""
    return "splash" if jax.default_backend() == "tpu" else "jax_dpa"


def _to_jax(*tensors):
    for t in tensors:
        if t is not None and not isinstance(t, torchax.tensor.Tensor | torchax.view.View):
            raise TypeError(f"expected torchax tensors (got {type(t).__name__}); move inputs "
                            "with env.to_xla(...) or t.to('jax') inside `with env:`, or select "
                            "a torch implementation of ops.attention for CPU tensors")
    return _interop.jax_view(tensors)
