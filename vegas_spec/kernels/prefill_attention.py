"""Prefill attention (FlashAttention-2 style) over the paged cache, for packed ragged prompts.

Oracle: `vegas_spec.attention.torch_backend.prefill_attention_ref`.

A prefill step packs pieces of several prompts end to end on one token axis (T tokens, no
padding). Piece s holds the queries of positions start[s] .. start[s] + len[s] - 1 of one
sequence; its keys 0 .. start[s] + len[s] - 1 are all in that sequence's pages when the
kernel runs: the earlier ones from an earlier chunk or a prefix-cache hit, the piece's own
ones written just before by the fused RoPE + KV store. So one kernel serves a whole prompt,
a later chunk of a prompt and a prompt whose prefix came from the cache.

Layout of the work: one program per (query head, query tile of BLOCK_M rows of one piece).
Consecutive programs are the heads of one tile, so the GROUP heads that share a kv head read
the same K/V blocks while they are in L2. Tiles are listed longest key range first (the
causal tail of a long prompt is the most work), which keeps the last wave short. A program
walks its keys in BLOCK_N blocks: the blocks every row of the tile sees in full without a
mask, then the few blocks on the diagonal with the causal mask. Scores stay in registers
(online softmax in base 2, float32 accumulator): memory grows with T, never with T x keys.

A row's result does not depend on how its prompt is cut into chunks or packed with others
(exact mode relies on it) as long as the key axis is not split: the tiles depend on the head
dim only, and every row walks its keys in BLOCK_N blocks at fixed offsets from key 0, the
same blocks with the same values whichever tile, chunk or piece it falls in. Whether a block
runs in the unmasked loop or the masked one changes nothing for a key the row sees (the mask
only replaces what it cannot see by -inf), and the blocks past the row's position add exact
zeros (p = 0, alpha = 1).

Split keys (`splits` > 1, flash-decoding for prefill). A small chunk late in a long prompt
has few query tiles, each with a long key range: at 1K tokens after 6.5K cached ones SmolLM2
makes 8 tiles x 9 heads = 72 programs, each walking 7.5K keys, and a GPU of 132 SMs sits
half idle while the kernel's time is one program's walk. With `splits` = S each tile's key
range is cut into S equal runs of whole key blocks, one program each (grid heads x tiles x
S), which write their partial softmax state (`split_merge.Partials`) for `merge_splits`.
The split points depend on the tile's key range, so a row's rounding then depends on its
chunk: exact mode keeps one split. `prefill_splits` picks S from the launch's programs.

Bytes and FLOPs of a piece of n queries after c cached tokens, per layer: Q and O once
(2·n·H·D·itemsize), K and V once per tile and kv head from L2 or HBM, and
4·H·D·(n·c + n²/2) FLOPs on tensor cores: the kernel is compute-bound for n >= a few
hundred."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from vegas_spec.kernels import for_device
from vegas_spec.kernels.split_merge import Partials, merge_splits, splits_to_fill

LOG2E = 1.4426950408889634
MAX_SPLITS = 16  # key splits a tile at most (`prefill_splits` and a caller's own)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # query rows per program
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class PrefillTuning:
    """The prefill kernel's tiles on one device class: `by_head_dim` those of the head dims up
    to each key (the smallest key at least the head dim), `wide` past the largest key; key
    splits (`prefill_splits`) that aim at `programs_per_sm` programs per SM."""

    by_head_dim: Mapping[int, PrefillConfig]
    wide: PrefillConfig
    programs_per_sm: int


# sm_90: 128 query rows x 64 keys, 8 warps up to head dim 64, 4 at 128 (docs/kernel-notes.md);
# 64 x 64 past 128, which would spill.
_SM90 = PrefillTuning(by_head_dim={64: PrefillConfig(128, 64, 8, 3),
                                   128: PrefillConfig(128, 64, 4, 3)},
                      wide=PrefillConfig(64, 64, 4, 2), programs_per_sm=2)
# By device class (`kernels.device_class`). The interpreter, whose cost is per program
# step: small tiles at every head dim.
TUNING: dict[str, PrefillTuning] = {
    "sm90": _SM90,
    "default": _SM90,
    "interpreter": PrefillTuning(by_head_dim={}, wide=PrefillConfig(32, 32, 1, 1),
                                 programs_per_sm=2),
}


def tuning(device: torch.device) -> PrefillTuning:
    """The entry of `TUNING` that launches on `device` read."""
    return for_device(TUNING, device)


def prefill_config(dim: int, gpu: bool) -> PrefillConfig:
    """Tiles for head dim `dim` (`PrefillTuning`; gpu: the current CUDA device's, else the
    interpreter's)."""
    tiles = tuning(torch.device("cuda" if gpu else "cpu"))
    fits = [bound for bound in tiles.by_head_dim if dim <= bound]
    return tiles.by_head_dim[min(fits)] if fits else tiles.wide


def prefill_splits(heads: int, num_tiles: int, device: torch.device) -> int:
    """Key splits per tile for a launch of heads x num_tiles programs: enough for about
    `PrefillTuning.programs_per_sm` programs per SM, at most MAX_SPLITS (1 off CUDA: the
    interpreter's tests ask for splits themselves)."""
    if device.type != "cuda":
        return 1
    per_sm = tuning(device).programs_per_sm
    return min(splits_to_fill(heads * num_tiles, device, per_sm), MAX_SPLITS)


def tile_list(lengths: list[int], starts: list[int], block_m: int) -> np.ndarray:
    """Host lengths/starts of the pieces -> [2, tiles] int32: the piece of each query tile
    and the tile's first row inside it, longest key range first."""
    tiles = [(start + min(first + block_m, n), piece, first)
             for piece, (n, start) in enumerate(zip(lengths, starts))
             for first in range(0, n, block_m)]
    tiles.sort(key=lambda t: -t[0])
    return np.array([[t[1] for t in tiles], [t[2] for t in tiles]], dtype=np.int32).reshape(2, -1)


def prefill_tiles(lengths: list[int], starts: list[int], block_m: int,
                  device: torch.device) -> torch.Tensor:
    """`tile_list` on the device."""
    host = torch.from_numpy(tile_list(lengths, starts, block_m))
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@triton.jit
def _load_kv(k_ptr, v_ptr, table_ptr, kpos, k_ok, kvh, d, d_ok, stride_cs, stride_ch,
             PAGE: tl.constexpr, MASK_K: tl.constexpr, EVEN_D: tl.constexpr):
    """K and V [BLOCK_N, BLOCK_D] of key positions kpos through the page table. Masks only
    where needed (MASK_K: keys past the end; not EVEN_D: head-dim padding), so that the
    unmasked loads stay vectorised."""
    if MASK_K:
        page = tl.load(table_ptr + kpos // PAGE, mask=k_ok, other=0)
    else:
        page = tl.load(table_ptr + kpos // PAGE)
    slot = page.to(tl.int64) * PAGE + kpos % PAGE
    off = slot[:, None] * stride_cs + kvh * stride_ch + d[None, :]
    if EVEN_D:
        if MASK_K:
            k = tl.load(k_ptr + off, mask=k_ok[:, None], other=0.0)
            v = tl.load(v_ptr + off, mask=k_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + off)
            v = tl.load(v_ptr + off)
    else:
        mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + off, mask=mask, other=0.0)
        v = tl.load(v_ptr + off, mask=mask, other=0.0)
    return k, v


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr, SAFE: tl.constexpr):
    """Online softmax in base 2; s [M, N] already scaled by scale·log2(e), -inf where masked.
    Unsplit, every row sees key 0 in the first block, so m_i is finite after it. SAFE (a
    split, where a row may see no key of a block nor of any before it in the split): such a
    row keeps m = -inf, l = 0, acc = 0 (m_use = 0 avoids inf - inf)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if SAFE:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, cu_ptr, start_ptr, tiles_ptr,
                    acc_ptr, m_ptr, l_ptr, sinks_ptr, num_tiles, num_tokens, qk_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch,
                    stride_tb,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr,
                    PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLITS: tl.constexpr,
                    SINKS: tl.constexpr, WINDOW: tl.constexpr):
    h = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = h // GROUP
    piece = tl.load(tiles_ptr + tile)
    first = tl.load(tiles_ptr + num_tiles + tile)
    q0 = tl.load(cu_ptr + piece)
    q_len = tl.load(cu_ptr + piece + 1) - q0
    ctx0 = tl.load(start_ptr + piece)
    m = first + tl.arange(0, BLOCK_M)
    m_ok = m < q_len
    qpos = ctx0 + m
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok = (q0 + m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    table = table_ptr + piece.to(tl.int64) * stride_tb
    # keys [0, last) for this tile; the first `full` of them are visible to all its rows
    last = ctx0 + tl.minimum(first + BLOCK_M, q_len)
    full = (ctx0 + first + 1) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if SINKS:  # the head's sink logit as a key of value 0 (split 0's): m = sink, l = 1
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        first_split = tl.program_id(2) == 0
        m_i = tl.where(first_split, tl.zeros([BLOCK_M], tl.float32) + sink, m_i)
        l_i = tl.where(first_split, l_i + 1.0, l_i)
    if SPLITS == 1:
        lo = 0
        hi = last
    else:  # this program's run of whole key blocks: split tl.program_id(2) of SPLITS
        per = tl.cdiv(tl.cdiv(last, SPLITS), BLOCK_N) * BLOCK_N
        lo = tl.program_id(2) * per
        hi = tl.minimum(lo + per, last)
    if WINDOW > 0:  # from the block of the tile's first row's first key, every block masked
        lo = tl.maximum(lo, tl.maximum(ctx0 + first - WINDOW + 1, 0) // BLOCK_N * BLOCK_N)
        full = lo
    for start in range(lo, tl.minimum(full, hi), BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k, v = _load_kv(k_ptr, v_ptr, table, kpos, kpos >= 0, kvh, d, d_ok, stride_cs,
                        stride_ch, PAGE, False, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION, False)
    for start in range(tl.maximum(full, lo), hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < last
        k, v = _load_kv(k_ptr, v_ptr, table, kpos, k_ok, kvh, d, d_ok, stride_cs,
                        stride_ch, PAGE, True, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = (kpos[None, :] <= qpos[:, None]) & k_ok[None, :]
        if WINDOW > 0:
            visible &= kpos[None, :] > qpos[:, None] - WINDOW
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION,
                                      SPLITS > 1 or (WINDOW > 0 and not SINKS))
    if SPLITS == 1:  # (rows past the piece may see no key in a window: l = 0, not stored)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    else:
        # partials in split_merge's natural-log units: m x ln 2 (acc and l are relative to it)
        base = (tl.program_id(2) * num_tokens + tok) * tl.num_programs(0) + h  # [S, T, H]
        tl.store(m_ptr + base, m_i * 0.6931471805599453, mask=m_ok)
        tl.store(l_ptr + base, l_i, mask=m_ok)
        live = m_ok & (l_i > 0)
        tl.store(acc_ptr + base[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=live[:, None] & d_ok[None, :])


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           page_table: torch.Tensor, cu_q: torch.Tensor, starts: torch.Tensor) -> None:
    assert q.dim() == 3 and k_cache.dim() == 3 and k_cache.shape == v_cache.shape
    assert q.shape[2] == k_cache.shape[2] and q.shape[1] % k_cache.shape[1] == 0
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype
    assert page_table.dim() == 2 and page_table.stride(-1) == 1
    assert not page_table.is_floating_point()
    pieces = page_table.shape[0]
    assert cu_q.shape == (pieces + 1,) and starts.shape == (pieces,)
    assert cu_q.dtype == starts.dtype == torch.int32
    assert q.device == k_cache.device == page_table.device == cu_q.device == starts.device


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      page_table: torch.Tensor, cu_q: torch.Tensor, starts: torch.Tensor,
                      tiles: torch.Tensor, page_size: int, scale: float, *,
                      config: PrefillConfig | None = None,
                      out: torch.Tensor | None = None, splits: int = 1,
                      sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention of packed prompt pieces over their pages.

    q [T, H, D] (RoPE applied); k_cache, v_cache [num_slots, Hkv, D], every key of every
    piece already stored; page_table [S, P]: the pages of piece s's sequence in row s;
    cu_q [S + 1] int32: piece s is q[cu_q[s]:cu_q[s + 1]]; starts [S] int32: the position of
    its first query (the keys before it are cached context); tiles: `prefill_tiles` of the
    same pieces for `config.block_m`. Query i of piece s (position starts[s] + i) sees keys
    0 .. starts[s] + i (window > 0: only the last `window` of them; a row's blocks before
    its first key add exact zeros, so its bits do not depend on its tile). sinks [H] (None:
    none): a logit per head in the softmax denominator, split 0's initial state. splits:
    programs per tile along its keys (> 1: float32 partials and a merge). Returns [T, H, D]
    in q's dtype (into `out` if given)."""
    _check(q, k_cache, v_cache, page_table, cu_q, starts)
    tokens, heads, dim = q.shape
    cfg = config or prefill_config(dim, q.is_cuda)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    num_tiles = tiles.shape[1]
    if tokens == 0 or num_tiles == 0:
        return out
    assert 1 <= splits <= MAX_SPLITS
    assert sinks is None or (sinks.shape == (heads,) and sinks.device == q.device)
    parts = Partials.empty(splits, tokens, heads, dim, q.device) if splits > 1 else None
    if parts is not None:
        assert out.is_contiguous(), "a split prefill merges into a contiguous out"
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    block_d = max(triton.next_power_of_2(dim), 16)
    _prefill_kernel[(heads, num_tiles, splits)](
        q, k_cache, v_cache, out, page_table, cu_q, starts, tiles,
        *((parts.acc, parts.m, parts.l) if parts is not None else (out, out, out)),
        out if sinks is None else sinks, num_tiles, tokens, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
        GROUP=heads // k_cache.shape[1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=block_d, HEAD_DIM=dim, EVEN_D=block_d == dim, PAGE=page_size,
        DOT_PRECISION=precision, SPLITS=splits, SINKS=sinks is not None, WINDOW=window,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if parts is not None:
        merge_splits(parts, out.view(1, tokens, heads, dim), None)
    return out


def prefill_flops(lengths: list[int], starts: list[int], heads: int, dim: int) -> float:
    """Attention FLOPs of the pieces (QK^T and PV, causal: each query over its visible keys)."""
    return sum(4.0 * heads * dim * n * (c + (n + 1) / 2) for n, c in zip(lengths, starts))
