"""Sequence (Ulysses) and CFG parallelism for the torch backend with torch.distributed.

Local view: every rank runs the stages eagerly on its own shard. The world is cfg x sp ranks,
cfg-major (rank = cfg_rank * sp + sp_rank): each sequence group holds the sp ranks of one CFG
branch, each cfg group the two ranks (uncond, cond) that hold the same token shard.
  - tokens: after prepare (which every rank runs whole) the image stream is padded to sp equal
    shards and each rank keeps its own; per-token context fields are cut the same way
    (`local_rows`); `gather_tokens` all_gathers and drops the padding before the head.
  - attention: Ulysses all-to-all (heads divisible by sp: each rank attends the whole sequence
    for N/sp heads), gathered K/V otherwise; padded keys are masked; keys every rank holds whole
    (Wan's text) need no communication. HunyuanVideo's joint [image ; text] attention: see
    `TorchSequenceLayout.attention`.
  - signals: every per-token column is summed locally (padding rows masked out) and reduced
    with ONE all_reduce(SUM) over the sequence group, never the world. A failed reduction keeps
    the local estimate and raises `reduce_failed`, which the loop hands to the gate as
    `Signals.reduce_error` (computed, counted).
  - CFG parallel: each rank of a cfg group takes its sample of the fused [uncond, cond] call
    (`local_batch`); signals and outputs are all_gathered over the cfg group (`gather_batch`).

Tensor names: B batch, L image tokens, Ls tokens per shard (padded), P = sp * Ls, S text
tokens, N heads, n = N / sp, H head dim.
"""

from __future__ import annotations

import datetime
import logging
import math
import os

import torch
import torch.distributed as dist

from modules import ops

from . import layout
from .layout import Layout

log = logging.getLogger(__name__)
ATTENTION = "torch_sequence_parallel"


def shard_length(tokens: int, sp: int, align: int = 1, avoid=()) -> int:
    """Tokens per shard: ceil(tokens / sp), rounded up to a multiple of `align` (a strided
    residual then starts every shard on a counted token), and different from every length in
    `avoid` (unmasked key sequences other than the image tokens, told apart by length)."""
    if sp == 1:
        return tokens
    length = -(-tokens // sp)
    length = -(-length // align) * align
    while length in set(avoid):
        length += align
    return length


class TorchSequenceLayout(Layout):
    """The stages' view of one rank of a cfg x sp process grid.

    sp_group / cfg_group: the process groups this rank belongs to; None for a size-1 axis.
    base_attention: the `ops.attention` implementation every rank runs on its part; None: the
    one the backend selects (sdpa, npu).
    """

    def __init__(self, sp_group=None, cfg_group=None, *, base_attention: str | None = None,
                 device=None):
        self.sp_group, self.cfg_group = sp_group, cfg_group
        self.sp_size = 1 if sp_group is None else dist.get_world_size(sp_group)
        self.sp_rank = 0 if sp_group is None else dist.get_rank(sp_group)
        self.cfg_size = 1 if cfg_group is None else dist.get_world_size(cfg_group)
        self.cfg_rank = 0 if cfg_group is None else dist.get_rank(cfg_group)
        if self.cfg_size not in (1, 2):
            raise ValueError(f"a cfg group holds the two guidance branches; got {self.cfg_size} ranks")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.base_attention = base_attention
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.tokens: int | None = None  # image tokens of the current input shape
        self.local_len: int | None = None  # Ls
        self.reduce_failed = False  # the last signal reduction failed (read by the backend)

    # --- geometry ---------------------------------------------------------------------------

    def set_tokens(self, tokens: int, align: int = 1, avoid=()) -> None:
        """Fix the shard geometry for one input shape (the same on every rank)."""
        self.tokens = tokens
        self.local_len = shard_length(tokens, self.sp_size, align, avoid)

    @property
    def padded(self) -> int:
        return self.local_len * self.sp_size

    def _start(self) -> int:
        return self.sp_rank * self.local_len

    def local_batch_size(self, batch: int) -> int:
        return 1 if self.cfg_size > 1 and batch == self.cfg_size else batch

    def local_reference_shape(self, shape, downsample: int) -> tuple[int, int, int]:
        """The shape of this rank's block-0 residual (FBCache tensor-metric reference)."""
        batch, rows, dim = shape
        if self.sp_size > 1:
            rows = self.local_len // downsample
        return self.local_batch_size(batch), rows, dim

    def _check(self, length: int, what: str) -> None:
        if self.tokens is None:
            raise RuntimeError("TorchSequenceLayout.set_tokens was not called for this shape")
        if length != self.tokens:
            raise ValueError(f"{what} has {length} tokens; the layout was set up for {self.tokens}")

    # --- tokens -----------------------------------------------------------------------------

    def _rows(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        """This shard's rows of a whole-sequence tensor, zero rows past the end."""
        start = self._start()
        stop = min(start + self.local_len, self.tokens)
        part = x.narrow(axis, start, max(stop - start, 0))
        missing = self.local_len - part.shape[axis]
        if missing:  # only the last shards copy: the others are views
            pad = list(x.shape)
            pad[axis] = missing
            part = torch.cat([part, x.new_zeros(pad)], dim=axis)
        return part

    def shard_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sp_size == 1:
            return hidden
        self._check(hidden.shape[1], "the image stream")
        return self._rows(hidden, 1)

    def local_rows(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        # a field with another length along the axis (one timestep for every token) is whole
        if self.sp_size == 1 or tensor.shape[axis] != self.tokens:
            return tensor
        return self._rows(tensor, axis)

    def gather_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sp_size == 1:
            return hidden
        return _all_gather(hidden, self.sp_group, dim=1)[:, : self.tokens]

    def local_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.cfg_size == 1 or tensor.ndim == 0 or tensor.shape[0] != self.cfg_size:
            return tensor
        return tensor[self.cfg_rank: self.cfg_rank + 1]

    def gather_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.cfg_size == 1:
            return tensor
        return _all_gather(tensor, self.cfg_group, dim=0)

    # --- signals ----------------------------------------------------------------------------

    def token_mask(self, length, step=1, stride=1, device=None):
        if self.sp_size == 1:
            return super().token_mask(length, step, stride, device)
        if length * step != self.local_len:
            # a column not cut from this shard would be summed sp times over
            raise ValueError(f"a signal column of {length} rows (token step {step}) is not a "
                             f"shard of {self.local_len} tokens")
        position = self._start() + torch.arange(length, device=device) * step
        keep = (position < self.tokens) & (position % stride == 0)
        every = step * stride // math.gcd(step, stride)
        return keep, math.ceil(self.tokens / every)

    def token_sums(self, columns):
        local = super().token_sums(columns)  # padding rows are already masked out
        if self.sp_size == 1:
            return local
        summed = local.clone()
        try:
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self.sp_group)
        except Exception as exc:  # noqa: BLE001 - invariant 5: a failed reduction never stops a run
            if not self.reduce_failed:
                log.warning("sequence-parallel signal reduction failed on rank %d (%s); using "
                            "the local estimate and computing this call", self.rank, exc)
            self.reduce_failed = True
            return local * self.sp_size  # this shard's estimate of the whole sequence's sums
        return summed

    # --- attention --------------------------------------------------------------------------

    def attention(self, q, k, v, key_mask=None):
        """`ops.attention` on this rank's shard. Which call it is, by shape:
          - no mask, q and k of Ls rows: image self-attention (Wan) -> Ulysses / gathered K/V;
          - a mask of L + S keys with q and k of Ls + S rows: HunyuanVideo's joint attention
            over [image shard ; text] -> the image part as above, the text part (the same on
            every rank) with no duplicate keys: under Ulysses each rank attends the text
            queries for its n heads over [all image keys ; text keys] and the text output is
            all_gathered over heads (xDiT's scheme); with gathered K/V every rank attends all
            of it;
          - anything else (Wan's cross-attention, HunyuanVideo's token refiner): keys every
            rank holds whole, attended locally.
        """
        base = ops.implementation("attention", self.base_attention)
        if self.sp_size == 1 or self.local_len is None:
            return base(q, k, v, key_mask)
        ls, q_len, k_len = self.local_len, q.shape[1], k.shape[1]
        if key_mask is None and q_len == k_len == ls:
            text = 0
        elif (key_mask is not None and q_len == k_len >= ls
              and key_mask.shape[1] - self.tokens == k_len - ls):
            text = k_len - ls
        else:
            return base(q, k, v, key_mask)
        mask = self._key_mask(key_mask, q.shape[0], text, q.device)
        heads = q.shape[2]
        if heads % self.sp_size == 0:
            return self._ulysses(base, q, k, v, mask, text)
        return self._gathered(base, q, k, v, mask, text)

    def _key_mask(self, key_mask, batch, text, device):
        """[B, P + S]: the image keys that exist (and the model's mask), then the text mask;
        None when every key counts (a mask keeps SDPA off its flash kernel on CUDA)."""
        if key_mask is None and self.padded == self.tokens:
            return None
        valid = torch.arange(self.padded, device=device) < self.tokens
        image = valid.expand(batch, -1)
        if key_mask is None:
            return image
        given = key_mask[:, : self.tokens].bool()
        given = torch.cat([given, given.new_zeros(batch, self.padded - self.tokens)], dim=1)
        return torch.cat([image & given, key_mask[:, self.tokens:].bool()], dim=1)

    def _ulysses(self, base, q, k, v, mask, text):
        ls, sp = self.local_len, self.sp_size
        n = q.shape[2] // sp
        q_i, k_i, v_i = _seq_to_heads(torch.stack([q[:, :ls], k[:, :ls], v[:, :ls]]),
                                      sp, self.sp_group)
        if text:  # this rank's heads of the text tokens, which it holds whole
            heads = slice(self.sp_rank * n, (self.sp_rank + 1) * n)
            q_i = torch.cat([q_i, q[:, ls:, heads]], dim=1)
            k_i = torch.cat([k_i, k[:, ls:, heads]], dim=1)
            v_i = torch.cat([v_i, v[:, ls:, heads]], dim=1)
        out = base(q_i, k_i, v_i, mask)  # [B, P + S, n, H]
        image = _heads_to_seq(out[:, : self.padded], sp, self.sp_group)
        if not text:
            return image
        return torch.cat([image, _all_gather(out[:, self.padded:], self.sp_group, dim=2)], dim=1)

    def _gathered(self, base, q, k, v, mask, text):
        ls = self.local_len
        kv = _all_gather(torch.stack([k[:, :ls], v[:, :ls]]), self.sp_group, dim=2)
        keys = torch.cat([kv[0], k[:, ls:]], dim=1)
        values = torch.cat([kv[1], v[:, ls:]], dim=1)
        return base(q, keys, values, mask)


# --- collectives ------------------------------------------------------------------------------

def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    # the list form: every backend (gloo, nccl, hccl) and torch version has it
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _seq_to_heads(x_KBLNH: torch.Tensor, sp: int, group) -> torch.Tensor:
    """[K, B, Ls, N, H] stacked tensors of a token shard -> [K, B, P, n, H]: the whole sequence
    for this rank's heads (one all_to_all for the K tensors)."""
    k_, b, ls, heads, h = x_KBLNH.shape
    send = x_KBLNH.reshape(k_, b, ls, sp, heads // sp, h).permute(3, 0, 1, 2, 4, 5).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: rank r's tokens, my heads
    return recv.permute(1, 2, 0, 3, 4, 5).reshape(k_, b, sp * ls, heads // sp, h)


def _heads_to_seq(x_BPnH: torch.Tensor, sp: int, group) -> torch.Tensor:
    """[B, P, n, H] for this rank's heads -> [B, Ls, N, H]: every head of its token shard."""
    b, p, n, h = x_BPnH.shape
    send = x_BPnH.reshape(b, sp, p // sp, n, h).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: my tokens, rank r's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, p // sp, sp * n, h)


def _attention(q_BLNH, k_BSNH, v_BSNH, key_mask_BS=None):
    return layout.current().attention(q_BLNH, k_BSNH, v_BSNH, key_mask_BS)


def install() -> None:
    """Register `ops.attention` "torch_sequence_parallel": the active layout's attention."""
    ops.register("attention", ATTENTION, _attention)


# --- launching --------------------------------------------------------------------------------

def make_groups(sp_size: int, cfg_size: int):
    """(sequence group, cfg group) of this rank in a cfg-major grid; None for a size-1 axis.
    Every rank creates every group, in the same order (dist.new_group is collective)."""
    rank, sp_group, cfg_group = dist.get_rank(), None, None
    if sp_size > 1:
        sp_group = _new_groups([[c * sp_size + s for s in range(sp_size)] for c in range(cfg_size)], rank)
    if cfg_size > 1:
        cfg_group = _new_groups([[c * sp_size + s for c in range(cfg_size)] for s in range(sp_size)], rank)
    return sp_group, cfg_group


def _new_groups(rank_lists: list[list[int]], rank: int):
    """Create a group of each rank list, in order; the one that holds `rank`."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _device_for(local_rank: int, kind: str | None) -> torch.device:
    """This rank's device: cuda/npu number LOCAL_RANK, or the CPU; kind None picks the first
    available of cuda, npu, cpu."""
    npu = getattr(torch, "npu", None)  # registered by torch_npu
    available = {"cuda": torch.cuda.is_available(), "npu": npu is not None and npu.is_available(),
                 "cpu": True}
    if kind is None:
        kind = next(k for k, ok in available.items() if ok)
    kind = torch.device(kind).type
    if not available.get(kind):
        raise ValueError(f"--device {kind}: not available on this machine (or not supported "
                         f"by the parallel path: cuda, npu, cpu)")
    if kind == "cpu":
        return torch.device("cpu")
    (torch.cuda if kind == "cuda" else npu).set_device(local_rank)
    return torch.device(kind, local_rank)


DIST_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def init_torch_parallel(sp_size: int = 1, cfg_parallel: bool = False, *, device: str | None = None,
                        timeout_s: float = 1800.0) -> TorchSequenceLayout | None:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT) and return this rank's layout; None for a single process with no parallelism.

    The world must be exactly sp_size x (2 if cfg_parallel else 1) ranks. The device (`device`:
    a type, None for the first available of cuda, npu, cpu) is cuda:LOCAL_RANK (nccl),
    npu:LOCAL_RANK (hccl) or the CPU (gloo): `layout.device`.
    """
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise ValueError(f"--sp_size must be an integer >= 1, got {sp_size!r}")
    cfg_size = 2 if cfg_parallel else 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != sp_size * cfg_size:
        raise ValueError(
            f"{world} process(es) were launched, but --sp_size {sp_size}"
            f"{' x --cfg_parallel 2' if cfg_parallel else ''} needs {sp_size * cfg_size}: run "
            f"`torchrun --nproc_per_node {sp_size * cfg_size} ...` or change --sp_size/--cfg_parallel")
    if world == 1:
        return None
    missing = [n for n in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if n not in os.environ]
    if missing:
        raise ValueError(f"WORLD_SIZE={world} but {', '.join(missing)} unset: launch with torchrun")
    device = _device_for(int(os.environ["LOCAL_RANK"]), device)
    if not dist.is_initialized():
        dist.init_process_group(DIST_BACKENDS[device.type], rank=int(os.environ["RANK"]),
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    sp_group, cfg_group = make_groups(sp_size, cfg_size)
    return TorchSequenceLayout(sp_group, cfg_group, device=device)


def close_torch_parallel() -> None:
    """Leave the process group (the end of a torchrun run)."""
    if dist.is_initialized():
        dist.destroy_process_group()
