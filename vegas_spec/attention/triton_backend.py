"""Triton attention: the same semantics as TorchBackend (its oracle), one kernel per file in
`vegas_spec.kernels`, with RoPE fused with the KV store (and, in a one-row draft step, with
the sparse attention itself). Runs on CUDA, or on CPU under Triton's interpreter (slow: tests
only)."""

from __future__ import annotations

import numpy as np
import torch

from vegas_spec import ops
from vegas_spec.attention.backend import AttentionBackend
from vegas_spec.attention.context import StepContext
from vegas_spec.kernels import topk as topk_kernel
from vegas_spec.kernels.paged_attention import paged_attention
from vegas_spec.kernels.prefill_attention import (
    prefill_attention,
    prefill_config,
    prefill_splits,
    prefill_tiles,
    tile_list,
)
from vegas_spec.kernels.quest_scores import quest_page_scores
from vegas_spec.kernels.rope_store import rope_store
from vegas_spec.kernels.sparse_attention import NewKV, sparse_attention
from vegas_spec.kernels.store_kv import store_kv


def topk_by_width(scores: torch.Tensor, rankable: torch.Tensor, k: torch.Tensor,
                  kmax: int | None = None, page: int = 1,
                  limit: torch.Tensor | None = None) -> torch.Tensor:
    """`ops.topk_positions` on the backend's device: the Triton kernel for rows of at most
    `topk.RESIDENT_MAX_WIDTH` scores (held in registers, one read), the reference for wider
    ones, which beat a kernel that re-read the row (docs/kernel-notes.md). The bound is read
    at each call, so a changed `topk.RESIDENT_MAX_WIDTH` moves it."""
    if scores.shape[-1] <= topk_kernel.RESIDENT_MAX_WIDTH:
        return topk_kernel.topk_positions_triton(scores, rankable, k, kmax, page, limit)
    return ops.topk_positions(scores, rankable, k, kmax, page, limit)


def topk_sum_by_width(scores: torch.Tensor, rankable: torch.Tensor, k: torch.Tensor,
                      kmax: int | None = None) -> torch.Tensor:
    """`ops.topk_positions(scores.sum(-3), rankable, k, kmax)` for scores [..., B, R, G, W]:
    vegas's collected rows (R <= 2) summed inside the resident kernel as it loads them, the
    sum written first otherwise (more rows, or rows wider than the kernel takes)."""
    if scores.shape[-3] <= 2 and scores.shape[-1] <= topk_kernel.RESIDENT_MAX_WIDTH:
        return topk_kernel.topk_row_sum_triton(scores, rankable, k, kmax)
    return topk_by_width(scores.sum(-3), rankable, k, kmax)


class TritonBackend(AttentionBackend):
    """A one-row draft step runs RoPE, its KV store and its sparse attention as one kernel,
    and quest's selector rotates its q inside the page-score kernel. In exact mode full
    attention runs one tiling for every step (`paged_attention(exact=True)`) and the prefill
    kernel keeps one program per tile along the keys: its tiles depend on the head dim only,
    and a row walks its keys in blocks at fixed offsets from key 0 (whichever chunk, tile or
    piece it falls in), the blocks past its position adding exact zeros."""

    name = "triton"

    # Drop-in for vegas_spec.ops.topk_positions on the backend's device.
    topk = staticmethod(topk_by_width)
    topk_sum = staticmethod(topk_sum_by_width)

    def quest_page_scores(self, q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                          pages: torch.Tensor, rope: torch.Tensor | None = None,
                          positions: torch.Tensor | None = None) -> torch.Tensor:
        return quest_page_scores(q, lo, hi, pages, rope, positions)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext,
               rope: torch.Tensor, sinks: torch.Tensor | None = None,
               window: int = 0) -> torch.Tensor:
        """The seam's `attend`; a one-row draft step runs RoPE, the KV store and its sparse
        attention as one kernel, and a selector (quest's) rotates the q it scores pages with
        inside its own kernel. A sliding-window layer's draft steps attend to the window
        (`full`), as the seam's."""
        plan = ctx.sparse
        if not (plan is not None and ctx.prefill is None and q.shape[1] == 1 and not window):
            return super().attend(layer, q, k, v, k_cache, v_cache, ctx, rope, sinks, window)
        if plan.selector is not None:
            indices = plan.selector(layer, q, ctx, self, rope)
        else:
            assert plan.indices is not None
            indices = plan.indices[layer]
        return self.sparse(q, k_cache, v_cache, indices, ctx, sinks,
                           new=NewKV(k, v, rope, ctx.slot_mapping))

    def rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext,
                   rope: torch.Tensor) -> torch.Tensor:
        return rope_store(q, k, v, k_cache, v_cache, rope, ctx.positions, ctx.slot_mapping)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The seam's plain store (no RoPE); `attend` goes through the fused `rope_store`."""
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    def full(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             ctx: StepContext, sinks: torch.Tensor | None = None,
             window: int = 0) -> torch.Tensor:
        """Scores, if requested, go straight into ctx.scores.out[layer] ([B, R, G, W]). The
        kernel takes a layer's sinks and sliding window itself."""
        req = ctx.scores
        if req is not None:
            assert req.out.shape[3] == (k_cache.shape[1] if req.per_kv_head else 1)
        return paged_attention(
            q, k_cache, v_cache, ctx.page_table, ctx.positions, ctx.page_size, ctx.kv_len_max,
            q.shape[-1] ** -0.5, None if req is None else req.rows,
            None if req is None else req.out[layer], "weight" if req is None else req.mode,
            exact=self.exact, sinks=sinks, window=window)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ctx: StepContext, sinks: torch.Tensor | None = None,
                window: int = 0) -> torch.Tensor:
        """The tile list is built once per step (ctx.prefill.memo) and read by every layer.
        Key splits where the launch has too few programs to fill the GPU (a small chunk), in
        the default mode only (they make a row's rounding depend on its chunk). The kernel
        takes sinks and a sliding window itself."""
        plan = ctx.prefill
        assert plan is not None
        cfg = prefill_config(q.shape[-1], q.is_cuda)
        key = ("prefill_tiles", cfg.block_m)
        if key not in plan.memo:
            plan.memo[key] = prefill_tiles(list(plan.lengths), list(plan.starts), cfg.block_m,
                                           q.device)
        tiles = plan.memo[key]
        splits = 1 if self.exact else prefill_splits(q.shape[1], tiles.shape[1], q.device)
        return prefill_attention(q, k_cache, v_cache, ctx.page_table, plan.cu_q, plan.start,
                                 tiles, ctx.page_size, q.shape[-1] ** -0.5, config=cfg,
                                 splits=splits, sinks=sinks, window=window)

    def prefill_block_rows(self, head_dim: int, device: torch.device) -> int | None:
        return prefill_config(head_dim, device.type == "cuda").block_m

    def prefill_tile_list(self, lengths: list[int], starts: list[int],
                          block_m: int) -> np.ndarray:
        return tile_list(lengths, starts, block_m)

    def sparse(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               indices: torch.Tensor, ctx: StepContext, sinks: torch.Tensor | None = None,
               new: NewKV | None = None) -> torch.Tensor:
        """The seam's `sparse`; with `new`, q before RoPE and the step's own k and v stored
        by the same kernel (`attend`)."""
        plan = ctx.sparse
        assert plan is not None
        return sparse_attention(q, k_cache, v_cache, ctx.page_table, ctx.positions,
                                ctx.page_size, indices, plan.recent_start, plan.recent_max,
                                q.shape[-1] ** -0.5, new=new, sinks=sinks,
                                listed=plan.listed if plan.selector is None else None)
