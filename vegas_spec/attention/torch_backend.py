"""Plain-PyTorch attention: the CPU path and the oracle every Triton kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vegas_spec.attention.backend import AttentionBackend
from vegas_spec.attention.context import ScoreRequest, StepContext
from vegas_spec.cache import slots_of


def quest_page_scores_ref(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                          pages: torch.Tensor) -> torch.Tensor:
    """quest's page scores: q [B, 1, H, D], lo/hi [B, NP, Hkv, D] page bounds, pages [B]
    -> [B, Hkv, NP] float32, sum over the kv head's query heads of sum_d max(q_d lo_d,
    q_d hi_d), -inf for pages >= pages[b]."""
    bsz, _, heads, dim = q.shape
    hkv = lo.shape[2]
    qg = q[:, 0].float().view(bsz, hkv, heads // hkv, dim)
    # max(q_d lo_d, q_d hi_d) is q_d hi_d where q_d >= 0 and q_d lo_d elsewhere (lo <= hi),
    # so the sum over d and the group's heads is two batched products, no [.., NP, D] temp
    up, down = qg.clamp(min=0).sum(2), qg.clamp(max=0).sum(2)  # [B, Hkv, D]
    scores = (torch.einsum("bhd,bphd->bhp", up, hi.float())
              + torch.einsum("bhd,bphd->bhp", down, lo.float()))
    visible = torch.arange(lo.shape[1], device=q.device) < pages[:, None, None]
    return scores.masked_fill(~visible, float("-inf"))


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v [B, n, Hkv, D] -> cache rows slot_mapping [B, n]."""
    slots = slot_mapping.reshape(-1).long()
    k_cache.index_copy_(0, slots, k.reshape(-1, *k.shape[2:]).to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.reshape(-1, *v.shape[2:]).to(v_cache.dtype))


def _softmax_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    valid: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor,
                                                                torch.Tensor]:
    """q [B, n, Hkv, g, D]; keys/values [B, Hkv, L, D]; valid [B, Hkv or 1, n, L].

    Returns out [B, n, Hkv, g, D] (q's dtype), raw logits s = q.k and softmax p,
    both [B, Hkv, g, n, L] float32."""
    s = torch.einsum("bnhgd,bhld->bhgnl", q.float(), keys.float())
    mask = valid.unsqueeze(2)
    p = torch.softmax((s * scale).masked_fill(~mask, float("-inf")), dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # a row with no valid key (never in practice)
    out = torch.einsum("bhgnl,bhld->bnhgd", p, values.float())
    return out.to(q.dtype), s.masked_fill(~mask, 0.0), p


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                        kv_len: int, scale: float, score_rows: torch.Tensor | None = None,
                        score_mode: str = "weight", per_kv_head: bool = False,
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full causal attention of n queries per sequence over its pages.

    q [B, n, H, D]; positions [B, n]; kv_len >= every sequence length.
    Query i of sequence b sees keys 0..positions[b, i].
    Scores (if score_rows [R] is given): [B, R, G, kv_len] float32 summed over the query heads
    (G = Hkv if per_kv_head else 1), softmax weights or raw logits q.k, 0 where not visible."""
    bsz, n, heads, dim = q.shape
    hkv = k_cache.shape[1]
    key_pos = torch.arange(kv_len, device=q.device).expand(bsz, kv_len)
    slots = slots_of(page_table, key_pos, page_size)
    keys = k_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[slots].transpose(1, 2)
    valid = (key_pos[:, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B, 1, n, L]
    out, s, p = _softmax_attend(q.view(bsz, n, hkv, heads // hkv, dim), keys, values, valid,
                                scale)
    scores = None
    if score_rows is not None:
        picked = (p if score_mode == "weight" else s)[:, :, :, score_rows.long()]
        scores = picked.sum(2).transpose(1, 2)  # [B, R, Hkv, L]
        scores = scores if per_kv_head else scores.sum(2, keepdim=True)
    return out.reshape(bsz, n, heads, dim), scores


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          page_table: torch.Tensor, lengths: tuple[int, ...],
                          starts: tuple[int, ...], page_size: int, scale: float) -> torch.Tensor:
    """Causal attention of packed prompt pieces (the prefill kernel's oracle).

    q [T, H, D]: piece s is the next lengths[s] rows, positions starts[s] .. starts[s] +
    lengths[s] - 1 of the sequence with pages page_table[s]; query i of piece s sees keys
    0 .. starts[s] + i, all in the cache. Returns [T, H, D] (rows past the pieces: 0)."""
    out, offset = torch.zeros_like(q), 0
    for s, (n, start) in enumerate(zip(lengths, starts)):
        pos = (start + torch.arange(n, device=q.device))[None]  # [1, n]
        piece, _ = paged_attention_ref(q[None, offset : offset + n], k_cache, v_cache,
                                       page_table[s : s + 1], pos, page_size, start + n, scale)
        out[offset : offset + n] = piece[0]
        offset += n
    return out


def prefill_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, lengths: tuple[int, ...],
                           starts: tuple[int, ...], page_size: int,
                           scale: float) -> torch.Tensor:
    """The same through torch's fused scaled_dot_product_attention, one call per piece: the
    CPU path's prefill, which never forms the n x n score matrix in the reference's float32
    einsum form."""
    result, offset = torch.zeros_like(q), 0
    hkv = k_cache.shape[1]
    for s, (n, start) in enumerate(zip(lengths, starts)):
        key_pos = torch.arange(start + n, device=q.device)[None]
        slots = slots_of(page_table[s : s + 1], key_pos, page_size)[0]
        keys = k_cache[slots].transpose(0, 1)[None]  # [1, Hkv, L, D]
        values = v_cache[slots].transpose(0, 1)[None]
        query = q[offset : offset + n].transpose(0, 1)[None]  # [1, H, n, D]
        mask = None
        if start > 0:  # the cached context is visible to every query of the piece
            mask = key_pos[0][None, :] <= (start + torch.arange(n, device=q.device))[:, None]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                             is_causal=start == 0, scale=scale,
                                             enable_gqa=q.shape[1] != hkv)
        result[offset : offset + n] = out[0].transpose(0, 1)
        offset += n
    return result


def sparse_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                         indices: torch.Tensor, recent_start: torch.Tensor, recent_max: int,
                         scale: float) -> torch.Tensor:
    """Attention over selected positions plus a contiguous recent range.

    q [B, n, H, D]; indices [B, G, K] positions (-1 = unused; G = 1 shares them across the
    kv heads); recent_start [B]; query i sees recent positions recent_start..positions[b, i]
    (at most recent_max of them) and every listed index (all lie before recent_start)."""
    bsz, n, heads, dim = q.shape
    hkv, groups = k_cache.shape[1], indices.shape[1]
    recent = recent_start[:, None, None] + torch.arange(recent_max, device=q.device)
    pos = torch.cat([indices.long(), recent.expand(bsz, groups, recent_max)], dim=-1)
    top = page_table.shape[1] * page_size - 1  # recent slots past the end are masked below
    slots = slots_of(page_table, pos.clamp(0, top), page_size)  # [B, G, K+R]
    head = torch.arange(hkv, device=q.device)
    if groups == 1:
        keys = k_cache[slots[:, 0]].transpose(1, 2)  # [B, Hkv, K+R, D]
        values = v_cache[slots[:, 0]].transpose(1, 2)
    else:
        keys = k_cache[slots, head[None, :, None]]  # [B, Hkv, K+R, D]
        values = v_cache[slots, head[None, :, None]]
    valid = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= positions[:, None, :, None])
    out, _, _ = _softmax_attend(q.view(bsz, n, hkv, heads // hkv, dim), keys, values, valid,
                                scale)
    return out.reshape(bsz, n, heads, dim)


def write_scores(req: ScoreRequest, layer: int, scores: torch.Tensor) -> None:
    width = scores.shape[-1]
    req.out[layer, :, :, :, :width] = scores
    req.out[layer, :, :, :, width:] = 0.0


class TorchBackend(AttentionBackend):
    name = "torch"

    def quest_page_scores(self, q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                          pages: torch.Tensor) -> torch.Tensor:
        return quest_page_scores_ref(q, lo, hi, pages)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)

    def full(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             ctx: StepContext) -> torch.Tensor:
        req = ctx.scores
        out, scores = paged_attention_ref(
            q, k_cache, v_cache, ctx.page_table, ctx.positions, ctx.page_size, ctx.kv_len_max,
            q.shape[-1] ** -0.5, None if req is None else req.rows,
            "weight" if req is None else req.mode, req is not None and req.per_kv_head)
        if req is not None and scores is not None:
            write_scores(req, layer, scores)
        return out

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        plan = ctx.prefill
        assert plan is not None
        return prefill_attention_sdpa(q, k_cache, v_cache, ctx.page_table, plan.lengths,
                                      plan.starts, ctx.page_size, q.shape[-1] ** -0.5)

    def sparse(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               indices: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        plan = ctx.sparse
        assert plan is not None
        return sparse_attention_ref(q, k_cache, v_cache, ctx.page_table, ctx.positions,
                                    ctx.page_size, indices, plan.recent_start, plan.recent_max,
                                    q.shape[-1] ** -0.5)
