"""quest's page scores for one draft step, fused: the query's sign split, the product with
the page bounds and the sum over the kv head's query heads in one pass over the bounds.

Oracle: `vegas_spec.ops.quest_page_scores_ref`.

Quest scores a page by sum_d max(q_d lo_d, q_d hi_d), summed over the query heads of a kv
head. Since lo <= hi, max(q_d lo_d, q_d hi_d) is q_d hi_d where q_d >= 0 and q_d lo_d
elsewhere, so the score is up . hi + down . lo with up = sum over the group of max(q, 0)
and down = sum of min(q, 0): two dot products per page, the bounds read once.

Layout of the work: one program per (sequence, kv head, block of BLOCK_P pages). Bytes per
draft step and layer: the bounds, 2 · B · NP · Hkv · D · itemsize (an eighth of the keys'
bytes for 16-token pages), and 4 · B · Hkv · NP of scores; the query is negligible.

With a RoPE table and positions, q is the step's query before RoPE and each program rotates
its group's heads as it loads them (`rope_store.rotate_tile`, the bits `rope_store` gives),
so a quest draft step needs no `rope_store` kernel of its own: its sparse attention stores
the step's k and v (`sparse_attention(new=...)`), as every other method's does."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vegas_spec.kernels import for_device, interpreting
from vegas_spec.kernels.rope_store import rotate_tile


@dataclass(frozen=True)
class QuestTuning:
    """The page-score kernel's launch on one device class: (pages per program, warps) by head
    dim, `tiles_other` at a head dim not listed."""

    tiles: Mapping[int, tuple[int, int]]
    tiles_other: tuple[int, int]


# sm_90's tiles: docs/kernel-notes.md.
_SM90 = QuestTuning(tiles={64: (128, 2), 128: (64, 8)}, tiles_other=(64, 4))
# By device class (`kernels.device_class`). The interpreter: small page blocks.
TUNING: dict[str, QuestTuning] = {
    "sm90": _SM90,
    "default": _SM90,
    "interpreter": QuestTuning(tiles={}, tiles_other=(16, 4)),
}


def tuning(device: torch.device) -> QuestTuning:
    """The entry of `TUNING` that launches on `device` read."""
    return for_device(TUNING, device)


@triton.jit
def _quest_kernel(q_ptr, lo_ptr, hi_ptr, pages_ptr, out_ptr, rope_ptr, pos_ptr, Hkv, NP,
                  stride_qb, stride_qh, stride_lb, stride_lp, stride_lh, stride_ob, stride_oh,
                  stride_rope, stride_pos,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr,
                  MUL_RN: tl.constexpr):
    b = tl.program_id(0) // Hkv
    kvh = tl.program_id(0) % Hkv
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = q_ptr + b * stride_qb + (kvh * GROUP + g)[:, None] * stride_qh
    q_mask = (g < GROUP)[:, None] & d_ok[None, :]
    if ROPE:  # q before RoPE: rotated at the step's position as it is loaded
        half = HEAD_DIM // 2
        first = d < half
        partner = tl.where(first, d + half, d - half)
        pos = tl.load(pos_ptr + b * stride_pos).to(tl.int64)
        cos = rope_ptr + pos * stride_rope + (d % half)[None, :] + 0 * g[:, None]
        q = rotate_tile(q_rows + d[None, :], q_rows + partner[None, :], cos, first[None, :],
                        q_mask, half, MUL_RN).to(tl.float32)
    else:
        q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    up = tl.sum(tl.maximum(q, 0.0), axis=0)  # [D]
    down = tl.sum(tl.minimum(q, 0.0), axis=0)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = p < tl.load(pages_ptr + b)
    off = b.to(tl.int64) * stride_lb + p[:, None] * stride_lp + kvh * stride_lh + d[None, :]
    mask = ok[:, None] & d_ok[None, :]
    hi = tl.load(hi_ptr + off, mask=mask, other=0.0).to(tl.float32)
    lo = tl.load(lo_ptr + off, mask=mask, other=0.0).to(tl.float32)
    score = tl.sum(hi * up[None, :] + lo * down[None, :], axis=1)
    tl.store(out_ptr + b * stride_ob + kvh * stride_oh + p, tl.where(ok, score, float("-inf")),
             mask=p < NP)


def quest_page_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                      pages: torch.Tensor, rope: torch.Tensor | None = None,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, 1, H, D] (one draft row, RoPE applied); lo, hi [B, NP, Hkv, D] the elementwise
    min and max key of every page; pages [B]: pages of rankable positions. Returns page
    scores [B, Hkv, NP] float32, -inf for pages >= pages[b]. With rope (the table [max_pos, D]
    float32, cos | sin) and positions [B, 1], q is before RoPE and rotated here."""
    assert q.dim() == 4 and q.shape[1] == 1 and q.stride(-1) == 1
    assert lo.shape == hi.shape and lo.dim() == 4 and lo.stride() == hi.stride()
    assert lo.stride(-1) == 1 and lo.shape[0] == q.shape[0] and lo.shape[3] == q.shape[3]
    assert q.shape[2] % lo.shape[2] == 0 and pages.shape == (q.shape[0],)
    assert q.device == lo.device == hi.device == pages.device
    bsz, _, heads, dim = q.shape
    num_pages, hkv = lo.shape[1], lo.shape[2]
    group = heads // hkv
    if rope is not None:
        assert positions is not None and positions.shape == (bsz, 1) and dim % 2 == 0
        assert not positions.is_floating_point() and positions.device == q.device
        assert rope.dtype == torch.float32 and rope.shape[1] == dim and rope.stride(-1) == 1
    out = torch.empty(bsz, hkv, num_pages, dtype=torch.float32, device=q.device)
    tiles = tuning(q.device)
    block_p, warps = tiles.tiles.get(dim, tiles.tiles_other)
    table, pos = (q, pages) if rope is None else (rope, positions)
    _quest_kernel[(bsz * hkv, triton.cdiv(num_pages, block_p))](
        q, lo, hi, pages, out, table, pos, hkv, num_pages,
        q.stride(0), q.stride(2), lo.stride(0), lo.stride(1), lo.stride(2),
        out.stride(0), out.stride(1), table.stride(0), pos.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_P=block_p,
        BLOCK_D=max(triton.next_power_of_2(dim), 16), HEAD_DIM=dim, ROPE=rope is not None,
        MUL_RN=not interpreting(), num_warps=warps)
    return out
