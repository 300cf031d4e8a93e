"""Top-k positions per (layer, sequence, group) by radix select: quest's choice of pages inside
every draft step (the Triton backend's `topk`).

Oracle: `vegas_spec.speculative.policies.topk_positions` (same signature and output: the k[b]
best positions < rankable[b] in ascending order, -1 padding, width max(k) or kmax).

One program per score row of W floats. Each float maps to a 32-bit key whose unsigned order
is the float order. The k-th largest key T is found most significant digit first, 4 bits per
pass: a pass counts, for the 16 candidate digits at once, how many keys are >= the candidate
prefix, and keeps the largest digit whose count still reaches k (8 passes over the row, which
is only L floats and stays in cache). A final pass compacts, in position order, every key > T
and the first (k - #keys > T) keys == T, so the output is already sorted ascending. Ties at
the threshold go to the lowest positions, where torch.topk may pick others."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RADIX_BITS = 4


@triton.jit
def _keys(x):
    """float32 -> int64 in [0, 2^32) with the same order (the sign-magnitude flip)."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return ordered.to(tl.int64) + 2147483648


@triton.jit
def _count_at_least(row_ptr, length, prefix, shift, BLOCK: tl.constexpr, RADIX: tl.constexpr):
    """[RADIX] counts of keys >= prefix + digit << shift over the first `length` scores."""
    digits = tl.arange(0, RADIX).to(tl.int64)
    cand = prefix + (digits << shift)
    counts = tl.zeros([RADIX], tl.int32)
    for start in range(0, length, BLOCK):
        w = start + tl.arange(0, BLOCK)
        ok = w < length
        key = _keys(tl.load(row_ptr + w, mask=ok, other=0.0))
        hit = ok[:, None] & (key[:, None] >= cand[None, :])
        counts += tl.sum(hit.to(tl.int32), axis=0)
    return counts


@triton.jit
def _topk_kernel(scores_ptr, rankable_ptr, k_ptr, out_ptr, B, G, width, out_width,
                 BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr):
    row = tl.program_id(0)
    b = (row // G) % B
    row_ptr = scores_ptr + row.to(tl.int64) * width
    length = tl.minimum(tl.load(rankable_ptr + b).to(tl.int32), width)
    length = tl.maximum(length, 0)
    want = tl.minimum(tl.load(k_ptr + b).to(tl.int32), length)
    want = tl.maximum(want, 0)
    # Invariant: at least `want` keys are >= prefix (digit 0 always qualifies).
    prefix = tl.zeros([], tl.int64)
    for p in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (p + 1)
        counts = _count_at_least(row_ptr, length, prefix, shift, BLOCK, 1 << RADIX_BITS)
        best = tl.sum((counts >= want).to(tl.int32), axis=0) - 1
        prefix += best.to(tl.int64) << shift
    above = tl.sum(_count_at_least(row_ptr, length, prefix + 1, 0, BLOCK, 1), axis=0)
    ties = want - above  # keys == prefix to take, lowest positions first
    out_row = out_ptr + row.to(tl.int64) * out_width
    taken = tl.zeros([], tl.int32)
    tied = tl.zeros([], tl.int32)
    for start in range(0, length, BLOCK):
        w = start + tl.arange(0, BLOCK)
        ok = w < length
        key = _keys(tl.load(row_ptr + w, mask=ok, other=0.0))
        is_tie = ok & (key == prefix)
        tie_rank = tied + tl.cumsum(is_tie.to(tl.int32), axis=0)  # 1-based
        take = ok & ((key > prefix) | (is_tie & (tie_rank <= ties))) & (want > 0)
        slot = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out_row + slot, w.to(tl.int64), mask=take)
        taken += tl.sum(take.to(tl.int32), axis=0)
        tied += tl.sum(is_tie.to(tl.int32), axis=0)
    for start in range(0, out_width, BLOCK):
        j = start + tl.arange(0, BLOCK)
        tl.store(out_row + j, tl.full([BLOCK], -1, tl.int64), mask=(j >= want) & (j < out_width))


def topk_positions_triton(scores: torch.Tensor, rankable: torch.Tensor, k: torch.Tensor,
                          kmax: int | None = None) -> torch.Tensor:
    """scores [..., B, G, W] float32 -> the k[b] best positions < rankable[b], ascending, -1
    padded: [..., B, G, max(k)] int64 (at least width 1, at most W), or [..., min(kmax, W)]
    given kmax, a host bound on k (no host sync: capturable). rankable [B], k [B].
    k[b] is capped at rankable[b]; scores must not be NaN."""
    assert scores.dim() >= 3 and scores.dtype == torch.float32
    bsz, groups, width = scores.shape[-3:]
    assert rankable.shape == (bsz,) and k.shape == (bsz,)
    assert not rankable.is_floating_point() and not k.is_floating_point()
    assert scores.device == rankable.device == k.device
    if kmax is None:
        out_width = min(max(int(k.max()), 1), width)  # a host sync, as in the reference
    else:
        out_width = min(kmax, width)
    flat = scores.reshape(-1, width).contiguous()
    out = torch.empty(flat.shape[0], out_width, dtype=torch.int64, device=scores.device)
    if flat.shape[0] == 0:
        return out.view(*scores.shape[:-1], out_width)
    block = 1024 if scores.is_cuda else 256
    _topk_kernel[(flat.shape[0],)](flat, rankable.contiguous(), k.contiguous(), out, bsz,
                                   groups, width, out_width, BLOCK=block,
                                   RADIX_BITS=RADIX_BITS, num_warps=4)
    return out.view(*scores.shape[:-1], out_width)
