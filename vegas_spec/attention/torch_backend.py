"""Plain-PyTorch attention: the CPU path and the oracle every Triton kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vegas_spec.attention.backend import AttentionBackend
from vegas_spec.attention.context import ScoreRequest, StepContext
from vegas_spec.cache import gather_head_slots, gather_slots, slots_of
from vegas_spec.ops import quest_page_scores_ref


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v [B, n, Hkv, D] -> cache rows slot_mapping [B, n]."""
    slots = slot_mapping.reshape(-1).long()
    k_cache.index_copy_(0, slots, k.reshape(-1, *k.shape[2:]).to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.reshape(-1, *v.shape[2:]).to(v_cache.dtype))


def _sink_softmax(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last axis of logits [B, Hkv, g, n, L] (scaled, masked), with sinks
    [Hkv * g] (a learned logit per query head, gpt-oss's) joining the denominator only: the
    sink is column 0 of the softmax, then dropped, so a key's place in the reduction is the
    same for every row and key-axis length (exact mode's premise)."""
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    _, hkv, g, _, _ = logits.shape
    sink = sinks.float().view(1, hkv, g, 1, 1).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([sink, logits], dim=-1), dim=-1)[..., 1:]


def _softmax_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    valid: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, n, Hkv, g, D]; keys/values [B, Hkv, L, D]; valid [B, Hkv or 1, n, L]; sinks
    [Hkv * g] or None (`_sink_softmax`).

    Returns out [B, n, Hkv, g, D] (q's dtype), raw logits s = q.k and softmax p,
    both [B, Hkv, g, n, L] float32."""
    s = torch.einsum("bnhgd,bhld->bhgnl", q.float(), keys.float())
    mask = valid.unsqueeze(2)
    p = _sink_softmax((s * scale).masked_fill(~mask, float("-inf")), sinks)
    p = torch.nan_to_num(p, nan=0.0)  # a row with no valid key (never in practice)
    out = torch.einsum("bhgnl,bhld->bnhgd", p, values.float())
    return out.to(q.dtype), s.masked_fill(~mask, 0.0), p


# Keys per block of the exact reference's products (a fixed partition of the key axis).
EXACT_KEYS = 64
# Query rows per call of the exact prefill reference (bounds its temporaries only).
EXACT_PREFILL_ROWS = 64


def _product_sum(a: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """(a * b).sum(-1) with a and b broadcast to `shape`, the product written into a
    contiguous buffer, so that the sum always runs over a contiguous last axis: torch then
    reduces each output on its own, in an order set by the axis length only."""
    prod = torch.empty(shape, dtype=torch.float32, device=a.device)
    torch.mul(a, b, out=prod)
    return prod.sum(-1)


def _exact_softmax_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          valid: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_softmax_attend` with each query row's bits independent of the other rows of the call
    and of how far the key axis reaches past the row's last visible key (exact mode).

    A matmul's order of summation depends on its shape (the rows, the key-axis length), so
    none is used: q.k is an elementwise product summed over D (`_product_sum`: the order is
    set by D); the softmax is torch's over the key axis, whose max and sum run in vector
    lanes by key index, so keys the row cannot see (exp = 0) add exact zeros; p.v sums blocks
    of EXACT_KEYS keys at fixed offsets from key 0 (the axis padded to whole blocks) and adds
    the blocks in order: a block past the row's last visible key adds an exact zero."""
    bsz, n, hkv, g, dim = q.shape
    length = keys.shape[2]
    pad = -length % EXACT_KEYS
    keys, values = F.pad(keys, (0, 0, 0, pad)), F.pad(values, (0, 0, 0, pad))
    valid = F.pad(valid, (0, pad), value=False)
    qf = q.float().permute(0, 2, 3, 1, 4)[:, :, :, :, None, :]  # [B, Hkv, g, n, 1, D]
    s = torch.cat([_product_sum(qf, k.float()[:, :, None, None], (bsz, hkv, g, n, EXACT_KEYS,
                                                                   dim))
                   for k in keys.split(EXACT_KEYS, dim=2)], dim=-1)  # [B, Hkv, g, n, L']
    mask = valid.unsqueeze(2)
    p = _sink_softmax((s * scale).masked_fill(~mask, float("-inf")), sinks)
    p = torch.nan_to_num(p, nan=0.0)
    acc = torch.zeros(bsz, hkv, g, n, dim, dtype=torch.float32, device=q.device)
    for j, v in enumerate(values.split(EXACT_KEYS, dim=2)):
        pj = p[..., j * EXACT_KEYS:(j + 1) * EXACT_KEYS][:, :, :, :, None, :]
        vt = v.float().transpose(2, 3)[:, :, None, None]  # [B, Hkv, 1, 1, D, keys]
        acc = acc + _product_sum(pj, vt, (bsz, hkv, g, n, dim, EXACT_KEYS))
    out = acc.permute(0, 3, 1, 2, 4).to(q.dtype)  # [B, n, Hkv, g, D]
    return out, s[..., :length].masked_fill(~mask[..., :length], 0.0), p[..., :length]


def _visible_keys(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                  positions: torch.Tensor, page_size: int, kv_len: int,
                  window: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys 0..kv_len-1 of each sequence from its pages: keys, values [B, Hkv, L, D] and
    valid [B, 1, n, L] (query i of sequence b sees keys 0..positions[b, i]; with a sliding
    window w > 0 only the last w of them, positions[b, i] - w + 1..positions[b, i])."""
    bsz = page_table.shape[0]
    key_pos = torch.arange(kv_len, device=positions.device).expand(bsz, kv_len)
    slots = slots_of(page_table, key_pos, page_size)
    keys = gather_slots(k_cache, slots).transpose(1, 2)
    values = gather_slots(v_cache, slots).transpose(1, 2)
    valid = key_pos[:, None, :] <= positions[:, :, None]
    if window:
        valid &= key_pos[:, None, :] > positions[:, :, None] - window
    return keys, values, valid.unsqueeze(1)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                        kv_len: int, scale: float, score_rows: torch.Tensor | None = None,
                        score_mode: str = "weight", per_kv_head: bool = False,
                        exact: bool = False, sinks: torch.Tensor | None = None,
                        window: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full causal attention of n queries per sequence over its pages.

    q [B, n, H, D]; positions [B, n]; kv_len >= every sequence length.
    Query i of sequence b sees keys 0..positions[b, i] (with window w > 0 the last w of
    them); sinks [H] (None: none) join each head's softmax denominator.
    Scores (if score_rows [R] is given): [B, R, G, kv_len] float32 summed over the query heads
    (G = Hkv if per_kv_head else 1), softmax weights or raw logits q.k, 0 where not visible.
    exact: each row's output bits independent of n, B and kv_len (`_exact_softmax_attend`)."""
    bsz, n, heads, dim = q.shape
    hkv = k_cache.shape[1]
    keys, values, valid = _visible_keys(k_cache, v_cache, page_table, positions, page_size,
                                        kv_len, window)
    attend = _exact_softmax_attend if exact else _softmax_attend
    out, s, p = attend(q.view(bsz, n, hkv, heads // hkv, dim), keys, values, valid, scale,
                       sinks)
    scores = None
    if score_rows is not None:
        picked = (p if score_mode == "weight" else s)[:, :, :, score_rows.long()]
        scores = picked.sum(2).transpose(1, 2)  # [B, R, Hkv, L]
        scores = scores if per_kv_head else scores.sum(2, keepdim=True)
    return out.reshape(bsz, n, heads, dim), scores


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          page_table: torch.Tensor, lengths: tuple[int, ...],
                          starts: tuple[int, ...], page_size: int, scale: float,
                          sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention of packed prompt pieces (the prefill kernel's oracle).

    q [T, H, D]: piece s is the next lengths[s] rows, positions starts[s] .. starts[s] +
    lengths[s] - 1 of the sequence with pages page_table[s]; query i of piece s sees keys
    0 .. starts[s] + i (with window w > 0 the last w of them), all in the cache; sinks [H]
    as `paged_attention_ref`'s. Returns [T, H, D] (rows past the pieces: 0)."""
    out, offset = torch.zeros_like(q), 0
    for s, (n, start) in enumerate(zip(lengths, starts)):
        pos = (start + torch.arange(n, device=q.device))[None]  # [1, n]
        piece, _ = paged_attention_ref(q[None, offset : offset + n], k_cache, v_cache,
                                       page_table[s : s + 1], pos, page_size, start + n, scale,
                                       sinks=sinks, window=window)
        out[offset : offset + n] = piece[0]
        offset += n
    return out


def prefill_attention_exact(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            page_table: torch.Tensor, lengths: tuple[int, ...],
                            starts: tuple[int, ...], page_size: int, scale: float,
                            sinks: torch.Tensor | None = None, window: int = 0,
                            exact: bool = True) -> torch.Tensor:
    """`prefill_attention_ref` in exact mode: a row's bits do not depend on how its prompt is
    cut into chunks or packed with others (each row is reduced over keys 0.. its position by
    `_exact_softmax_attend`, whatever rows share the call). Slow: the CPU path of exact mode.
    With exact=False the same calls of at most EXACT_PREFILL_ROWS rows through the default
    reference: the CPU path of attention with sinks or a sliding window, which torch's fused
    attention does not take."""
    out, offset = torch.zeros_like(q), 0
    for s, (n, start) in enumerate(zip(lengths, starts)):
        for first in range(0, n, EXACT_PREFILL_ROWS):
            rows = min(EXACT_PREFILL_ROWS, n - first)
            pos = (start + first + torch.arange(rows, device=q.device))[None]
            at = offset + first
            piece, _ = paged_attention_ref(q[None, at:at + rows], k_cache, v_cache,
                                           page_table[s:s + 1], pos, page_size,
                                           start + first + rows, scale, exact=exact,
                                           sinks=sinks, window=window)
            out[at:at + rows] = piece[0]
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
        keys = gather_slots(k_cache, slots).transpose(0, 1)[None]  # [1, Hkv, L, D]
        values = gather_slots(v_cache, slots).transpose(0, 1)[None]
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


def paged_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                         kv_len: int, scale: float) -> torch.Tensor:
    """`paged_attention_ref` without scores through torch's fused
    scaled_dot_product_attention: the CPU path's plain steps and unscored verify steps, which
    never form the float32 logits and weights the reference keeps for its scores (on a GPU
    the torch backend keeps the reference's form). A row that sees no key gives 0, as in the
    reference."""
    keys, values, valid = _visible_keys(k_cache, v_cache, page_table, positions, page_size,
                                        kv_len)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=valid,
                                         scale=scale, enable_gqa=q.shape[2] != k_cache.shape[1])
    return torch.nan_to_num(out.transpose(1, 2), nan=0.0)


def sparse_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                         indices: torch.Tensor, recent_start: torch.Tensor, recent_max: int,
                         scale: float, sinks: torch.Tensor | None = None,
                         listed: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over selected positions plus a contiguous recent range.

    q [B, n, H, D]; indices [B, G, K] positions (-1 = unused; G = 1 shares them across the
    kv heads); recent_start [B]; query i sees recent positions recent_start..positions[b, i]
    (at most recent_max of them) and every listed index (all lie before recent_start);
    sinks [H] (None: none) join each head's softmax denominator; listed [B] (None: K): only
    a row's first listed[b] indices count."""
    bsz, n, heads, dim = q.shape
    if listed is not None:
        column = torch.arange(indices.shape[-1], device=q.device)
        indices = torch.where(column < listed[:, None, None], indices, -1)
    hkv, groups = k_cache.shape[1], indices.shape[1]
    recent = recent_start[:, None, None] + torch.arange(recent_max, device=q.device)
    pos = torch.cat([indices.long(), recent.expand(bsz, groups, recent_max)], dim=-1)
    top = page_table.shape[1] * page_size - 1  # recent slots past the end are masked below
    slots = slots_of(page_table, pos.clamp(0, top), page_size)  # [B, G, K+R]
    if groups == 1:
        keys = gather_slots(k_cache, slots[:, 0]).transpose(1, 2)  # [B, Hkv, K+R, D]
        values = gather_slots(v_cache, slots[:, 0]).transpose(1, 2)
    else:  # each kv head at its own positions
        keys = gather_head_slots(k_cache, slots)  # [B, Hkv, K+R, D]
        values = gather_head_slots(v_cache, slots)
    valid = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= positions[:, None, :, None])
    out, _, _ = _softmax_attend(q.view(bsz, n, hkv, heads // hkv, dim), keys, values, valid,
                                scale, sinks)
    return out.reshape(bsz, n, heads, dim)


def write_scores(req: ScoreRequest, layer: int, scores: torch.Tensor) -> None:
    width = scores.shape[-1]
    req.out[layer, :, :, :, :width] = scores
    req.out[layer, :, :, :, width:] = 0.0


class TorchBackend(AttentionBackend):
    """In exact mode full and prefill attention run `_exact_softmax_attend` (slow)."""

    name = "torch"

    def quest_page_scores(self, q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                          pages: torch.Tensor, rope: torch.Tensor | None = None,
                          positions: torch.Tensor | None = None) -> torch.Tensor:
        return quest_page_scores_ref(q, lo, hi, pages, rope, positions)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)

    def full(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             ctx: StepContext, sinks: torch.Tensor | None = None,
             window: int = 0) -> torch.Tensor:
        req = ctx.scores
        plain = sinks is None and not window  # what torch's fused attention takes
        if req is None and plain and not self.exact and q.device.type == "cpu":
            return paged_attention_sdpa(q, k_cache, v_cache, ctx.page_table, ctx.positions,
                                        ctx.page_size, ctx.kv_len_max, q.shape[-1] ** -0.5)
        out, scores = paged_attention_ref(
            q, k_cache, v_cache, ctx.page_table, ctx.positions, ctx.page_size, ctx.kv_len_max,
            q.shape[-1] ** -0.5, None if req is None else req.rows,
            "weight" if req is None else req.mode, req is not None and req.per_kv_head,
            exact=self.exact, sinks=sinks, window=window)
        if req is not None and scores is not None:
            write_scores(req, layer, scores)
        return out

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ctx: StepContext, sinks: torch.Tensor | None = None,
                window: int = 0) -> torch.Tensor:
        plan = ctx.prefill
        assert plan is not None
        args = (q, k_cache, v_cache, ctx.page_table, plan.lengths, plan.starts, ctx.page_size,
                q.shape[-1] ** -0.5)
        if self.exact or sinks is not None or window:
            return prefill_attention_exact(*args, sinks=sinks, window=window, exact=self.exact)
        return prefill_attention_sdpa(*args)

    def sparse(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               indices: torch.Tensor, ctx: StepContext,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        plan = ctx.sparse
        assert plan is not None
        return sparse_attention_ref(q, k_cache, v_cache, ctx.page_table, ctx.positions,
                                    ctx.page_size, indices, plan.recent_start, plan.recent_max,
                                    q.shape[-1] ** -0.5, sinks,
                                    plan.listed if plan.selector is None else None)
