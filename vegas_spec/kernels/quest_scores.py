"""quest's page scores for one draft step, fused: the query's sign split, the product with
the page bounds and the sum over the kv head's query heads in one pass over the bounds.

Oracle: `vegas_spec.attention.torch_backend.quest_page_scores_ref`.

Quest scores a page by sum_d max(q_d lo_d, q_d hi_d), summed over the query heads of a kv
head. Since lo <= hi, max(q_d lo_d, q_d hi_d) is q_d hi_d where q_d >= 0 and q_d lo_d
elsewhere, so the score is up . hi + down . lo with up = sum over the group of max(q, 0)
and down = sum of min(q, 0): two dot products per page, the bounds read once.

Layout of the work: one program per (sequence, kv head, block of BLOCK_P pages). Bytes per
draft step and layer: the bounds, 2 · B · NP · Hkv · D · itemsize (an eighth of the keys'
bytes for 16-token pages), and 4 · B · Hkv · NP of scores; the query is negligible."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vegas_spec.kernels import topk
from vegas_spec.kernels.split_merge import sm_count
from vegas_spec.kernels.topk import resident_row_topk, topk_positions_triton

# Pages per program and warps on a GPU, by head dim (other dims: QUEST_TILE). Measured on an
# H200 (benchmarks/tile_sweep.py --kernel quest, µs per layer): Llama-3.1-8B shape at
# 16 x 32K 34.9 with 64 pages / 8 warps against 39.8 with 64 / 4; SmolLM2 at 64 x 7.5K 5.7
# with 128 / 2 against 7.1 with 64 / 4.
QUEST_TILES = {64: (128, 2), 128: (64, 8)}
QUEST_TILE = (64, 4)
# quest's selection of one layer as one kernel (`quest_select`): every page's score, then the
# row's top-k in the same program, one program per (sequence, kv head). It saves a launch
# and a kernel's fixed latency per layer, but one program walks all of a row's bounds, so
# "auto" takes it where a row fits the resident top-k and either the rows fill the SMs or a
# row's bounds are at most QUEST_ONE_KERNEL_ROW_BYTES; True / False force it either way.
QUEST_ONE_KERNEL: bool | str = "auto"
QUEST_ONE_KERNEL_ROW_BYTES = 256 * 1024
# Pages per step of the one kernel's score loop on a GPU: its [pages, D] bound tiles set its
# registers (sm_90, head dim 64, 4 warps: 88 at 32 pages, 160 at 64, 255 at 128).
QUEST_ONE_KERNEL_BLOCK_P = 64


@triton.jit
def _group_signs(q_ptr, b, kvh, stride_qb, stride_qh, d, d_ok, GROUP: tl.constexpr,
                 GROUP_PAD: tl.constexpr):
    """up, down [D]: the sums over the kv head's query heads of max(q, 0) and min(q, 0)."""
    g = tl.arange(0, GROUP_PAD)
    q = tl.load(q_ptr + b * stride_qb + (kvh * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=(g < GROUP)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    return tl.sum(tl.maximum(q, 0.0), axis=0), tl.sum(tl.minimum(q, 0.0), axis=0)


@triton.jit
def _page_scores(lo_ptr, hi_ptr, up, down, b, kvh, p, ranked, d, d_ok, stride_lb, stride_lp,
                 stride_lh):
    """Scores of pages p [BLOCK_P] of (b, kvh): up . hi + down . lo, -inf from `ranked` on."""
    ok = p < ranked
    off = b.to(tl.int64) * stride_lb + p[:, None] * stride_lp + kvh * stride_lh + d[None, :]
    mask = ok[:, None] & d_ok[None, :]
    hi = tl.load(hi_ptr + off, mask=mask, other=0.0).to(tl.float32)
    lo = tl.load(lo_ptr + off, mask=mask, other=0.0).to(tl.float32)
    score = tl.sum(hi * up[None, :] + lo * down[None, :], axis=1)
    return tl.where(ok, score, float("-inf"))


@triton.jit
def _quest_kernel(q_ptr, lo_ptr, hi_ptr, pages_ptr, out_ptr, Hkv, NP,
                  stride_qb, stride_qh, stride_lb, stride_lp, stride_lh, stride_ob, stride_oh,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    b = tl.program_id(0) // Hkv
    kvh = tl.program_id(0) % Hkv
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    up, down = _group_signs(q_ptr, b, kvh, stride_qb, stride_qh, d, d_ok, GROUP, GROUP_PAD)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    score = _page_scores(lo_ptr, hi_ptr, up, down, b, kvh, p, tl.load(pages_ptr + b), d, d_ok,
                         stride_lb, stride_lp, stride_lh)
    tl.store(out_ptr + b * stride_ob + kvh * stride_oh + p, score, mask=p < NP)


@triton.jit
def _quest_topk_kernel(q_ptr, lo_ptr, hi_ptr, pages_ptr, k_ptr, limit_ptr, sc_ptr, out_ptr,
                       Hkv, NP, out_width, stride_qb, stride_qh, stride_lb, stride_lp,
                       stride_lh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_W: tl.constexpr, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr,
                       PAGE: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """One (sequence, kv head): every page's score into its row of sc [B * Hkv, NP], then that
    row's top-k as `topk_positions_triton` makes it, in the same program."""
    row = tl.program_id(0)
    b = row // Hkv
    kvh = row % Hkv
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    up, down = _group_signs(q_ptr, b, kvh, stride_qb, stride_qh, d, d_ok, GROUP, GROUP_PAD)
    ranked = tl.load(pages_ptr + b)
    for start in range(0, NP, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        score = _page_scores(lo_ptr, hi_ptr, up, down, b, kvh, p, ranked, d, d_ok, stride_lb,
                             stride_lp, stride_lh)
        tl.store(sc_ptr + row.to(tl.int64) * NP + p, score, mask=p < NP)
    tl.debug_barrier()  # every thread's scores are in the row before any thread reads it
    resident_row_topk(sc_ptr, pages_ptr, k_ptr, limit_ptr, out_ptr, row, tl.num_programs(0)
                      // Hkv, Hkv, NP, out_width, BLOCK_W, BLOCK, RADIX_BITS, PAGE, HAS_LIMIT)


def _check(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, pages: torch.Tensor) -> None:
    assert q.dim() == 4 and q.shape[1] == 1 and q.stride(-1) == 1
    assert lo.shape == hi.shape and lo.dim() == 4 and lo.stride() == hi.stride()
    assert lo.stride(-1) == 1 and lo.shape[0] == q.shape[0] and lo.shape[3] == q.shape[3]
    assert q.shape[2] % lo.shape[2] == 0 and pages.shape == (q.shape[0],)
    assert q.device == lo.device == hi.device == pages.device


def _head_args(q: torch.Tensor, lo: torch.Tensor) -> dict[str, int]:
    group = q.shape[2] // lo.shape[2]
    dim = q.shape[3]
    return dict(GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
                BLOCK_D=max(triton.next_power_of_2(dim), 16), HEAD_DIM=dim)


def quest_page_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                      pages: torch.Tensor) -> torch.Tensor:
    """q [B, 1, H, D] (one draft row, RoPE applied); lo, hi [B, NP, Hkv, D] the elementwise
    min and max key of every page; pages [B]: pages of rankable positions. Returns page
    scores [B, Hkv, NP] float32, -inf for pages >= pages[b]."""
    _check(q, lo, hi, pages)
    bsz, dim = q.shape[0], q.shape[3]
    num_pages, hkv = lo.shape[1], lo.shape[2]
    out = torch.empty(bsz, hkv, num_pages, dtype=torch.float32, device=q.device)
    block_p, warps = QUEST_TILES.get(dim, QUEST_TILE) if q.is_cuda else (16, 4)
    _quest_kernel[(bsz * hkv, triton.cdiv(num_pages, block_p))](
        q, lo, hi, pages, out, hkv, num_pages,
        q.stride(0), q.stride(2), lo.stride(0), lo.stride(1), lo.stride(2),
        out.stride(0), out.stride(1), BLOCK_P=block_p, **_head_args(q, lo), num_warps=warps)
    return out


def one_kernel(rows: int, width: int, row_bytes: int, device: torch.device) -> bool:
    """Whether `quest_select` runs as one kernel (QUEST_ONE_KERNEL's rule)."""
    if QUEST_ONE_KERNEL != "auto":
        return bool(QUEST_ONE_KERNEL)
    if width > topk.RESIDENT_MAX_WIDTH:
        return False
    if row_bytes <= QUEST_ONE_KERNEL_ROW_BYTES:
        return True
    if device.type != "cuda":
        return False
    return rows >= sm_count(device.index if device.index is not None
                            else torch.cuda.current_device())


def quest_select(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, pages: torch.Tensor,
                 k: torch.Tensor, kmax: int | None, page: int,
                 limit: torch.Tensor | None) -> torch.Tensor:
    """quest's positions of one layer: `topk_positions_triton(quest_page_scores(q, lo, hi,
    pages), pages, k, kmax, page, limit)`, [B, Hkv, units * page] int64, in one kernel where
    `one_kernel` says so (the same scores, the same choice)."""
    _check(q, lo, hi, pages)
    bsz, dim = q.shape[0], q.shape[3]
    num_pages, hkv = lo.shape[1], lo.shape[2]
    row_bytes = 2 * num_pages * dim * lo.element_size()
    if (bsz * hkv == 0 or num_pages == 0
            or not one_kernel(bsz * hkv, num_pages, row_bytes, q.device)):
        return topk_positions_triton(quest_page_scores(q, lo, hi, pages), pages, k, kmax, page,
                                     limit)
    assert k.shape == (bsz,) and not k.is_floating_point() and k.device == q.device
    assert limit is None or (limit.shape == (bsz,) and not limit.is_floating_point())
    assert num_pages <= topk.RESIDENT_MAX_WIDTH, "one kernel holds a row in registers"
    units = topk.out_units(k, kmax, num_pages)
    scores = torch.empty(bsz * hkv, num_pages, dtype=torch.float32, device=q.device)
    out = torch.empty(bsz * hkv, units * page, dtype=torch.int64, device=q.device)
    block_p = QUEST_ONE_KERNEL_BLOCK_P if q.is_cuda else 16
    block_w = triton.next_power_of_2(num_pages)
    pages = pages.contiguous()
    _quest_topk_kernel[(bsz * hkv,)](
        q, lo, hi, pages, k.contiguous(), pages if limit is None else limit.contiguous(),
        scores, out, hkv, num_pages, units,
        q.stride(0), q.stride(2), lo.stride(0), lo.stride(1), lo.stride(2),
        BLOCK_P=block_p, **_head_args(q, lo), BLOCK_W=block_w,
        BLOCK=1024 if q.is_cuda else 256, RADIX_BITS=topk.RESIDENT_RADIX_BITS, PAGE=page,
        HAS_LIMIT=limit is not None, num_warps=topk.resident_warps(block_w))
    return out.view(bsz, hkv, units * page)
