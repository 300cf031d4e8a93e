"""Top-k positions per (layer, sequence, group) by radix select, for rows of at most
RESIDENT_MAX_WIDTH scores: quest's choice of pages inside every draft step, and vegas's and
lastq's ranking of their verify scores up to that width (the Triton backend's `topk`).

Oracle: `vegas_spec.ops.topk_positions` (same signature and output: the k[b] best positions
< rankable[b] in ascending order, -1 padding, width max(k) or kmax).

`_topk_resident_kernel` runs one program per score row of W <= RESIDENT_MAX_WIDTH floats
(quest's 2048 pages of a 32K context), loaded once into registers (BLOCK_W = W rounded up
to a power of two, keys as uint32). Each float maps to a 32-bit key whose unsigned order is
the float order. The k-th largest key T is found most significant digit first,
RESIDENT_RADIX_BITS bits per pass: each pass is a histogram of the digit of the keys that
still match the prefix so far, the count for digit d is the keys already above the prefix
plus the bins >= d, and the pass keeps the largest digit whose count is at least k. A final
pass compacts, in position order, every key > T and the first (k - #keys > T) keys == T, so
the output is already sorted ascending. Ties at the threshold go to the lowest positions,
where torch.topk may pick others. Global reads: the row's 4 W bytes, once.

Wider rows (vegas's and lastq's token scores of contexts past 8K) are refused here: the
backend's `topk` hands them to the reference (torch.topk and a sort). A streaming kernel
that re-read the row in each radix pass ran them and lost to the reference, on an H200
(benchmarks/step_profile.py --brief, select_ms against select_reference_ms): a round's whole
selection at the Llama-3.1-8B shape, 16 rows x 32K, took 1.52-1.77 ms with it against
0.68-1.01 ms with the reference, while at SmolLM2's 64 x 7.5K (resident rows) this kernel
takes 0.47 ms against the reference's 0.68 ms.

Pages (quest): with `page` > 1 a score is a page's and the kernel writes, for the i-th chosen
page u, the token positions u * page + j (j < page) at i * page + j, -1 where they reach
`limit[b]` (the rankable tokens), as `ops.expand_pages` does: the row a quest selector
hands to sparse attention, with no elementwise kernels after the top-k. Each chosen page
costs page * 8 bytes of output instead of 8."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The widest row `topk_positions_triton` takes (wider rows: the reference, through the
# backend's `topk`; see above). The kernel runs BLOCK_W / 256 warps within [4, 16]: 8 uint32
# keys a thread up to 4096 scores, 16 at 8192, which ptxas fits in 128 registers for sm_90
# without spilling.
RESIDENT_MAX_WIDTH = 8192
# Warps of the resident top-k: one per RESIDENT_KEYS_PER_WARP scores, RESIDENT_MIN_WARPS to
# 16 (benchmarks/tile_sweep.py --kernel quest).
RESIDENT_KEYS_PER_WARP = 256
RESIDENT_MIN_WARPS = 4
# Bits per radix pass of the resident top-k (32 / bits passes, one 2^bits-bin histogram each).
RESIDENT_RADIX_BITS = 4


@triton.jit
def _keys32(x):
    """float32 -> uint32 whose unsigned order is the float order (the sign-magnitude flip)."""
    bits = x.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648  # all bits for a negative float, else the sign bit
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def _store_units(out_row, slot, unit, take, limit, PAGE: tl.constexpr):
    """Units [BLOCK] at their slots where `take`: unit u -> u * PAGE + j at slot * PAGE + j for
    j < PAGE, -1 from `limit` on (PAGE 1: the unit itself). One [BLOCK] store per j, not a
    [BLOCK, PAGE] tile: only k of the row's units are taken, and the tile would hold PAGE
    int64 per unit in registers."""
    base = unit.to(tl.int64) * PAGE
    for j in tl.static_range(PAGE):
        pos = base + j
        tl.store(out_row + slot * PAGE + j, tl.where(pos < limit, pos, -1), mask=take)


@triton.jit
def _pad_from(out_row, first, total, BLOCK: tl.constexpr):
    """-1 into out_row[first:total]."""
    for start in range(0, total, BLOCK):
        j = start + tl.arange(0, BLOCK)
        tl.store(out_row + j, tl.full([BLOCK], -1, tl.int64), mask=(j >= first) & (j < total))


@triton.jit
def _row_bounds(rankable_ptr, k_ptr, limit_ptr, b, width, HAS_LIMIT: tl.constexpr):
    """(length, want, limit) of sequence b: units ranked, units taken, tokens kept."""
    length = tl.minimum(tl.load(rankable_ptr + b).to(tl.int32), width)
    length = tl.maximum(length, 0)
    want = tl.minimum(tl.load(k_ptr + b).to(tl.int32), length)
    want = tl.maximum(want, 0)
    if HAS_LIMIT:
        limit = tl.load(limit_ptr + b).to(tl.int64)
    else:
        limit = tl.full([], 9223372036854775807, tl.int64)
    return length, want, limit


@triton.jit
def _topk_resident_kernel(scores_ptr, rankable_ptr, k_ptr, limit_ptr, out_ptr, B, G, width,
                          out_width, BLOCK_W: tl.constexpr, BLOCK: tl.constexpr,
                          RADIX_BITS: tl.constexpr, PAGE: tl.constexpr,
                          HAS_LIMIT: tl.constexpr):
    row = tl.program_id(0)
    b = (row // G) % B
    length, want, limit = _row_bounds(rankable_ptr, k_ptr, limit_ptr, b, width, HAS_LIMIT)
    w = tl.arange(0, BLOCK_W)
    ok = w < length
    key = _keys32(tl.load(scores_ptr + row.to(tl.int64) * width + w, mask=ok, other=0.0))
    digits = tl.arange(0, 1 << RADIX_BITS)
    # Invariant: above (keys past the prefix's digits so far) + the keys that match them is
    # at least `want`, so digit 0 always qualifies.
    prefix = tl.zeros([], tl.uint32)
    above = tl.zeros([], tl.int32)
    for p in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (p + 1)
        same = ok
        if p > 0:  # the digits above this one match the prefix's (a shift by 32 is undefined)
            same = ok & ((key >> (shift + RADIX_BITS)) == (prefix >> (shift + RADIX_BITS)))
        digit = ((key >> shift) & ((1 << RADIX_BITS) - 1)).to(tl.int32)
        hist = tl.histogram(digit, 1 << RADIX_BITS, mask=same)
        at_least = above + tl.cumsum(hist, 0, reverse=True)  # keys >= prefix + digit << shift
        best = tl.sum((at_least >= want).to(tl.int32), axis=0) - 1
        above += tl.sum(tl.where(digits > best, hist, 0), axis=0)
        prefix += best.to(tl.uint32) << shift
    is_tie = ok & (key == prefix)
    tie_rank = tl.cumsum(is_tie.to(tl.int32), axis=0)  # 1-based
    take = ok & ((key > prefix) | (is_tie & (tie_rank <= want - above))) & (want > 0)
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    out_row = out_ptr + row.to(tl.int64) * (out_width * PAGE)
    _store_units(out_row, slot, w, take, limit, PAGE)
    _pad_from(out_row, want * PAGE, out_width * PAGE, BLOCK)


def resident_warps(block_w: int) -> int:
    """Warps of the resident kernel for rows of BLOCK_W (a power of two) scores."""
    return min(max(block_w // RESIDENT_KEYS_PER_WARP, RESIDENT_MIN_WARPS, 1), 16)


def topk_positions_triton(scores: torch.Tensor, rankable: torch.Tensor, k: torch.Tensor,
                          kmax: int | None = None, page: int = 1,
                          limit: torch.Tensor | None = None) -> torch.Tensor:
    """scores [..., B, G, W] float32 -> the k[b] best positions < rankable[b], ascending, -1
    padded: [..., B, G, max(k)] int64 (at least width 1, at most W), or [..., min(kmax, W)]
    given kmax, a host bound on k (no host sync: capturable). rankable [B], k [B].
    k[b] is capped at rankable[b]; scores must not be NaN. With page > 1 or a limit [B]
    (tokens), each chosen unit u becomes u * page + j for j < page, -1 from limit[b] on:
    [..., B, G, width * page], as `ops.expand_pages` gives. W must be at most
    RESIDENT_MAX_WIDTH (wider rows: `ops.topk_positions`, as the Triton backend's `topk`)."""
    assert scores.dim() >= 3 and scores.dtype == torch.float32 and page >= 1
    bsz, groups, width = scores.shape[-3:]
    if width > RESIDENT_MAX_WIDTH:
        raise ValueError(f"top-k rows of {width} scores: the kernel takes at most "
                         f"RESIDENT_MAX_WIDTH = {RESIDENT_MAX_WIDTH} (wider rows: the "
                         "reference, vegas_spec.ops.topk_positions)")
    assert rankable.shape == (bsz,) and k.shape == (bsz,)
    assert not rankable.is_floating_point() and not k.is_floating_point()
    assert scores.device == rankable.device == k.device
    if limit is not None:
        assert limit.shape == (bsz,) and not limit.is_floating_point()
        assert limit.device == scores.device
    if kmax is None:
        out_width = min(max(int(k.max()), 1), width)  # a host sync, as in the reference
    else:
        out_width = min(kmax, width)
    flat = scores.reshape(-1, width).contiguous()
    out = torch.empty(flat.shape[0], out_width * page, dtype=torch.int64, device=scores.device)
    if flat.shape[0] == 0:
        return out.view(*scores.shape[:-1], out_width * page)
    block = 1024 if scores.is_cuda else 256
    rankable = rankable.contiguous()
    args = (flat, rankable, k.contiguous(), rankable if limit is None else limit.contiguous(),
            out, bsz, groups, width, out_width)
    block_w = triton.next_power_of_2(width)
    warps = resident_warps(block_w)
    _topk_resident_kernel[(flat.shape[0],)](*args, BLOCK_W=block_w, BLOCK=block,
                                            RADIX_BITS=RESIDENT_RADIX_BITS, PAGE=page,
                                            HAS_LIMIT=limit is not None, num_warps=warps)
    return out.view(*scores.shape[:-1], out_width * page)
