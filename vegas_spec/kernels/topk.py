"""Top-k positions per (layer, sequence, group) by a threshold search, for rows of at most
RESIDENT_MAX_WIDTH scores: quest's choice of pages inside every draft step, and vegas's and
lastq's ranking of their verify scores up to that width (the Triton backend's `topk`).

Oracle: `vegas_spec.ops.topk_positions` (same signature and output: the k[b] best positions
< rankable[b] in ascending order, -1 padding, width max(k) or kmax).

`_topk_resident_kernel` runs one program per score row of W <= RESIDENT_MAX_WIDTH floats
(quest's 2048 pages of a 32K context), loaded once into registers (BLOCK_W = W rounded up to
a power of two, keys as uint32). Each float maps to a 32-bit key whose unsigned order is the
float order. The threshold T (the k-th largest key, or any key with exactly k keys at or
above it) is found most significant bit first, by bisection: one compare and one block sum a
bit, stopping once exactly k keys lie at or above the candidate. The kernel is bound by the
instructions it issues (one program of 16 warps an SM at 8,192 scores). A final scan
compacts, in position order, every key > T and the first (k - #keys > T) keys == T, so the
output is already sorted ascending. Ties at the threshold go to the lowest positions, where
torch.topk may pick others. Global reads: the row's 4 W bytes, once.

vegas ranks the sum of its two collected rows: `topk_row_sum_triton` loads both rows and
adds them (one rounding, as torch's sum of two), so the summed scores are never written.

Wider rows (vegas's and lastq's token scores of contexts past 8K) are refused here: the
backend's `topk` hands them to the reference (torch.topk and a sort), which was faster than
a kernel that re-reads the row.

Pages (quest): with `page` > 1 a score is a page's and the kernel writes, for the i-th chosen
page u, the token positions u * page + j (j < page) at i * page + j, -1 where they reach
`limit[b]` (the rankable tokens), as `ops.expand_pages` does: the row a quest selector
hands to sparse attention, with no elementwise kernels after the top-k. Each chosen page
costs page * 8 bytes of output instead of 8."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vegas_spec.kernels import for_device

# The widest row `topk_positions_triton` takes (wider rows: the reference, through the
# backend's `topk`, which routes on it; see above). With sm_90's warps below (BLOCK_W / 256
# within [4, 16]: 8 uint32 keys a thread up to 4096 scores, 16 at 8192) ptxas fits the
# kernel in 128 registers without spilling. A bound of the kernel's (the final scan packs
# two counts into 16 bits each) that every device shares.
RESIDENT_MAX_WIDTH = 8192


@dataclass(frozen=True)
class TopkTuning:
    """The resident top-k's launch on one device class: one warp per `keys_per_warp` scores
    of the row (its power-of-two width), at least `min_warps`, at most `max_warps`; the
    output written `block` positions a step (the padding and the page expansion)."""

    keys_per_warp: int
    min_warps: int
    max_warps: int
    block: int


_SM90 = TopkTuning(keys_per_warp=256, min_warps=4, max_warps=16, block=1024)
# By device class (`kernels.device_class`). The interpreter: smaller output steps.
TUNING: dict[str, TopkTuning] = {
    "sm90": _SM90,
    "default": _SM90,
    "interpreter": TopkTuning(keys_per_warp=256, min_warps=4, max_warps=16, block=256),
}


def tuning(device: torch.device) -> TopkTuning:
    """The entry of `TUNING` that launches on `device` read."""
    return for_device(TUNING, device)


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
def _bisect_threshold(key, ok, want):
    """A key T with at least `want` of the `ok` keys >= T and fewer > T, or exactly
    `want` >= T, built bit by bit from the most significant: a candidate bit stays where
    the keys >= the candidate still number at least `want`, and the search stops early once
    they number exactly `want`: one compare and one block sum a bit."""
    t = tl.zeros([], tl.uint32)
    step = tl.full([], 2147483648, tl.uint32)
    exact = tl.zeros([], tl.int32)
    while (step > 0) & (exact == 0):
        cand = t | step
        count = tl.sum((ok & (key >= cand)).to(tl.int32), axis=0)
        t = tl.where(count >= want, cand, t)
        exact = (count == want).to(tl.int32)
        step = step >> 1
    return t


@triton.jit
def _topk_resident_kernel(scores_ptr, rankable_ptr, k_ptr, limit_ptr, out_ptr, B, G, width,
                          out_width, row_stride, BLOCK_W: tl.constexpr, BLOCK: tl.constexpr,
                          PAGE: tl.constexpr, HAS_LIMIT: tl.constexpr,
                          ROWS: tl.constexpr):
    row = tl.program_id(0)
    b = (row // G) % B
    length, want, limit = _row_bounds(rankable_ptr, k_ptr, limit_ptr, b, width, HAS_LIMIT)
    w = tl.arange(0, BLOCK_W)
    ok = w < length
    # ROWS score rows [.., b, r, g, :] (stride row_stride) summed in order; one: row `row`
    first = scores_ptr + ((row // G) * ROWS * G + row % G).to(tl.int64) * row_stride
    x = tl.load(first + w, mask=ok, other=0.0)
    for r in tl.static_range(1, ROWS):
        x += tl.load(first + r * G * row_stride + w, mask=ok, other=0.0)
    key = _keys32(x)
    threshold = _bisect_threshold(key, ok, want)
    # One scan gives both the keys above the threshold and the ties before each position
    # (counts below 2^16 each): the first `want - above` ties are taken, in position order.
    is_above = ok & (key > threshold)
    is_tie = ok & (key == threshold)
    counts = tl.cumsum(is_above.to(tl.int32) + (is_tie.to(tl.int32) << 16), axis=0)
    need = want - tl.sum(is_above.to(tl.int32), axis=0)  # ties to take
    tie_rank = counts >> 16  # inclusive, 1-based on a tie
    take = (is_above | (is_tie & (tie_rank <= need))) & (want > 0)
    slot = (counts & 0xFFFF) + tl.minimum(tie_rank, need) - 1
    out_row = out_ptr + row.to(tl.int64) * (out_width * PAGE)
    _store_units(out_row, slot, w, take, limit, PAGE)
    _pad_from(out_row, want * PAGE, out_width * PAGE, BLOCK)


def resident_warps(block_w: int, device: torch.device) -> int:
    """Warps of the resident kernel for rows of BLOCK_W (a power of two) scores on `device`."""
    tiles = tuning(device)
    return min(max(block_w // tiles.keys_per_warp, tiles.min_warps, 1), tiles.max_warps)


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
    assert scores.dim() >= 3
    return _launch(scores.unsqueeze(-3), rankable, k, kmax, page, limit)


def topk_row_sum_triton(scores: torch.Tensor, rankable: torch.Tensor, k: torch.Tensor,
                        kmax: int | None = None) -> torch.Tensor:
    """`topk_positions_triton(scores.sum(-3), rankable, k, kmax)` for scores [..., B, R, G, W]
    with R <= 2 (where the sum of two float32 is one rounding, as torch's): the rows are
    summed as the kernel loads them, so the summed scores are never written. The last dim
    may be a slice of a wider one (the rows' stride is read from the tensor)."""
    assert scores.dim() >= 4 and scores.shape[-3] <= 2
    return _launch(scores, rankable, k, kmax, 1, None)


def _row_stride(scores: torch.Tensor) -> int | None:
    """The stride between consecutive rows of the last dim when every dim before it steps
    as in a contiguous tensor of rows that long (a slice of the last dim of a contiguous
    tensor), else None."""
    if scores.stride(-1) != 1:
        return None
    stride = scores.stride(-2) if scores.dim() > 1 else scores.shape[-1]
    expected = stride
    for size, step in zip(reversed(scores.shape[:-1]), reversed(scores.stride()[:-1]),
                          strict=True):
        if size > 1 and step != expected:
            return None
        expected *= size
    return stride


def _launch(scores: torch.Tensor, rankable: torch.Tensor, k: torch.Tensor, kmax: int | None,
            page: int, limit: torch.Tensor | None) -> torch.Tensor:
    """The resident kernel on scores [..., B, R, G, W] (the R rows summed) -> [..., B, G, n]."""
    assert scores.dtype == torch.float32 and page >= 1
    bsz, rows, groups, width = scores.shape[-4:]
    if width > RESIDENT_MAX_WIDTH:
        raise ValueError(f"top-k rows of {width} scores: the kernel takes at most "
                         f"RESIDENT_MAX_WIDTH = {RESIDENT_MAX_WIDTH} (wider rows: the "
                         "reference, vegas_spec.ops.topk_positions)")
    assert RESIDENT_MAX_WIDTH < 1 << 16, "the final scan packs two counts into 16 bits each"
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
    lead = scores.shape[:-4]
    n_rows = math.prod(lead) * bsz * groups
    out = torch.empty(n_rows, out_width * page, dtype=torch.int64, device=scores.device)
    out_shape = (*lead, bsz, groups, out_width * page)
    if n_rows == 0:
        return out.view(out_shape)
    stride = _row_stride(scores)
    if stride is None:
        scores, stride = scores.contiguous(), width
    block = tuning(scores.device).block
    rankable = rankable.contiguous()
    args = (scores, rankable, k.contiguous(), rankable if limit is None else limit.contiguous(),
            out, bsz, groups, width, out_width, stride)
    block_w = triton.next_power_of_2(width)
    warps = resident_warps(block_w, scores.device)
    _topk_resident_kernel[(n_rows,)](*args, BLOCK_W=block_w, BLOCK=block, PAGE=page,
                                     HAS_LIMIT=limit is not None, ROWS=rows, num_warps=warps)
    return out.view(out_shape)
