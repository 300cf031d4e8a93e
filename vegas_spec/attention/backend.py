"""The attention-backend seam and its backends, chosen by name from a registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch

from vegas_spec.attention.context import LastRows, ScoreRequest, StepContext
from vegas_spec.ops import apply_rope


class AttentionBackend(ABC):
    """One object per engine; every layer of every step calls `attend` (the dense compute
    around it is the ops seam's, `vegas_spec.compute`). `attend` runs `rope_store` first,
    whose default is the plain-PyTorch reference of `vegas_spec.ops` (RoPE, then
    `store_kv`); a backend may override it to fuse both into one kernel. The selection's
    scoring pieces are the backend's too: the scores a full pass emits (`ScoreRequest`),
    quest's per-draft-step page scores (`quest_page_scores`) and the top-k (`topk`,
    `topk_sum`), which a selector runs through the backend that calls it.

    Shapes: q [B, n, H, D] and k/v [B, n, Hkv, D] before RoPE, caches [num_slots, Hkv, D],
    rope [max_pos, D] float32 (cos | sin). `attend` returns [B, n, H, D]: it applies RoPE and
    writes k/v into their slots first, then attends: packed causal prefill attention when
    `ctx.prefill` is set, full causal attention when `ctx.sparse` is None, else sparse draft
    attention over the plan.

    Exact mode (`exact=True`): full and prefill attention compute each row the same way
    whatever the number of rows in the step (batch size x query rows), with one tiling and
    one key split for every shape; RoPE's products are correctly rounded on every path.
    Drafts never reach the output, so the sparse attention keeps its fastest tiling.

    Under tensor parallelism a backend attends to its rank's heads only: it holds no
    collective (the ops seam sums what the ranks' heads give).
    """

    name = "abstract"

    def __init__(self, exact: bool = False) -> None:
        self.exact = exact

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext,
               rope: torch.Tensor, sinks: torch.Tensor | None = None,
               window: int = 0) -> torch.Tensor:
        """sinks [H] (None: none): a learned logit per query head that joins every softmax's
        denominator, scores' included; window > 0: a sliding-window layer, whose query at
        position p sees keys p - window + 1..p, and whose draft steps attend to that window
        as it is (no selection: the window is the draft's)."""
        q = self.rope_store(q, k, v, k_cache, v_cache, ctx, rope)
        if ctx.prefill is not None:
            assert ctx.sparse is None, "a packed prefill attends to everything"
            out = self.prefill(q[0], k_cache, v_cache, ctx, sinks, window)
            last = ctx.prefill.last
            if last is not None:
                q_last = q[0, last.index]
                if last.q_out is not None:
                    last.q_out[layer] = q_last
                if ctx.scores is not None:
                    self.last_row_scores(layer, q_last, k_cache, v_cache, last, ctx.scores,
                                         ctx.page_size, sinks, window)
            return out[None]
        if ctx.sparse is None or window:
            return self.full(layer, q, k_cache, v_cache, ctx, sinks, window)
        plan = ctx.sparse
        if plan.selector is not None:
            indices = plan.selector(layer, q, ctx, self)
        else:
            assert plan.indices is not None
            indices = plan.indices[layer]
        return self.sparse(q, k_cache, v_cache, indices, ctx, sinks)

    def last_row_scores(self, layer: int, q_last: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, last: LastRows, scores: ScoreRequest,
                        page_size: int, sinks: torch.Tensor | None = None,
                        window: int = 0) -> None:
        """Selection scores of prompts' last rows (q_last [S', H, D], rotated) into
        scores.out[layer] ([S', R, G, W]): a one-row full-attention step over their pages,
        whose attention output is dropped."""
        ctx = StepContext(positions=last.positions, slot_mapping=last.slots,
                          page_table=last.page_table, page_size=page_size,
                          kv_len_max=last.kv_len_max, scores=scores)
        self.full(layer, q_last[:, None], k_cache, v_cache, ctx, sinks, window)

    def prefill_block_rows(self, head_dim: int, device: torch.device) -> int | None:
        """Query rows per tile of this backend's prefill kernel, whose tile list
        (`prefill_tile_list`) is then all its prefill reads from the host side; None: the
        prefill reads the pieces' host lengths itself (it cannot be captured in a graph)."""
        return None

    def prefill_tile_list(self, lengths: list[int], starts: list[int],
                          block_m: int) -> np.ndarray:
        raise NotImplementedError(f"the {self.name} backend's prefill does not tile")

    def rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext,
                   rope: torch.Tensor) -> torch.Tensor:
        """RoPE on q and k at ctx.positions; k, v into slots ctx.slot_mapping -> rotated q."""
        k = apply_rope(k, rope, ctx.positions)
        self.store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        return apply_rope(q, rope, ctx.positions)

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v [B, n, Hkv, D] as they are (no RoPE) -> cache rows slot_mapping [B, n]."""

    @abstractmethod
    def full(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             ctx: StepContext, sinks: torch.Tensor | None = None,
             window: int = 0) -> torch.Tensor: ...

    @abstractmethod
    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ctx: StepContext, sinks: torch.Tensor | None = None,
                window: int = 0) -> torch.Tensor:
        """q [T, H, D] of the packed pieces of ctx.prefill -> [T, H, D]."""

    @abstractmethod
    def sparse(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               indices: torch.Tensor, ctx: StepContext,
               sinks: torch.Tensor | None = None) -> torch.Tensor: ...

    @abstractmethod
    def quest_page_scores(self, q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                          pages: torch.Tensor, rope: torch.Tensor | None = None,
                          positions: torch.Tensor | None = None) -> torch.Tensor:
        """quest's scores of every page for a draft row: q [B, 1, H, D], lo/hi [B, NP, Hkv,
        D] the pages' min and max keys, pages [B] ranked pages -> [B, Hkv, NP] float32
        (-inf past pages[b]). With rope (the RoPE table) and positions [B, 1], q is before
        RoPE."""

    # The backend's own top-k (the contract of ops.topk_positions), or None.
    topk: Callable[..., torch.Tensor] | None = None
    # Its top-k of scores [..., B, R, G, W] summed over R (ops.topk_positions(scores.sum(-3),
    # rankable, k, kmax)), or None.
    topk_sum: Callable[..., torch.Tensor] | None = None


def _torch(exact: bool) -> AttentionBackend:
    from vegas_spec.attention.torch_backend import TorchBackend

    return TorchBackend(exact)


def _triton(exact: bool) -> AttentionBackend:
    from vegas_spec.attention.triton_backend import TritonBackend  # imports Triton

    return TritonBackend(exact)


# The registry, listed explicitly: each backend is imported only when it is asked for.
BACKENDS: dict[str, Callable[[bool], AttentionBackend]] = {"torch": _torch, "triton": _triton}


def make_backend(name: str, exact: bool = False) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name](exact)
