"""The attention-backend seam and its backends, chosen by name from a registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from vegas_spec.attention.context import LastRows, ScoreRequest, StepContext
from vegas_spec.ops import (
    add_rms_norm,
    apply_rope,
    exact_linear,
    exact_silu_mul,
    moe_experts,
    rms_norm,
    route,
    silu_mul,
)
from vegas_spec.parallel import SINGLE, TPGroup
from vegas_spec.quant import DRAFT_TYPES, DraftWeight


class AttentionBackend(ABC):
    """One object per engine; every layer of every step calls `attend` and the per-token steps
    around attention (`rope_store` inside `attend`, `norm`, `add_norm`, `silu_mul`), whose
    defaults are the plain-PyTorch references of `vegas_spec.ops`; a backend overrides them
    to fuse each into one kernel.

    Shapes: q [B, n, H, D] and k/v [B, n, Hkv, D] before RoPE, caches [num_slots, Hkv, D],
    rope [max_pos, D] float32 (cos | sin). `attend` returns [B, n, H, D]: it applies RoPE and
    writes k/v into their slots first, then attends: packed causal prefill attention when
    `ctx.prefill` is set, full causal attention when `ctx.sparse` is None, else sparse draft
    attention over the plan. `linear` is every projection and the LM head.

    Exact mode (`exact=True`): every step but the draft's sparse attention computes each row
    the same way whatever the number of rows in the step (batch size x query rows): the
    products through a row-invariant `linear`, full and prefill attention with one tiling and
    one key split for every shape. The per-token steps are row-wise: RMSNorm reduces one row
    (its rsqrt and RoPE's products are correctly rounded on every path) and SiLU * up is
    elementwise, here through `exact_silu_mul`, whose exp takes one path for every element.
    Drafts never reach the output, so the sparse attention keeps its fastest tiling.

    A mixture of experts' MLP is `moe` (the router's top-k, then `experts`: the reference
    `ops.moe_experts` here, the fused kernel in the Triton backend).

    Tensor parallelism (`tp`, see `vegas_spec.parallel`) is the seam's too: the decoder
    calls `row_linear` for o_proj and down and `moe` for the experts (the partial products
    all_reduced, `sum_ranks`), `embed` for the vocabulary-parallel embeddings and
    `head_linear` for the LM head (the logit slices all_gathered); at world size 1 they are
    `linear` and a plain lookup.
    """

    name = "abstract"

    def __init__(self, exact: bool = False, tp: TPGroup = SINGLE) -> None:
        self.exact = exact
        self.tp = tp

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
        ctx = StepContext(positions=last.positions, seq_lens=last.positions[:, -1] + 1,
                          slot_mapping=last.slots, page_table=last.page_table,
                          page_size=page_size, kv_len_max=last.kv_len_max, scores=scores)
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

    def linear(self, x: torch.Tensor, weight: torch.Tensor | DraftWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype. An FP8 draft
        or INT4 draft copy (drafts only, in any mode) runs its reference: correct, not fast."""
        if isinstance(weight, DRAFT_TYPES):
            return weight.ref(x, bias)
        if self.exact:
            return exact_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def row_linear(self, x: torch.Tensor, weight: torch.Tensor | DraftWeight,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """Row-parallel `linear`: x [..., K/N] @ weight [N_out, K/N]^T summed over the ranks
        (in exact mode in rank order, the same for every shape), + bias [N_out] once after
        the sum."""
        if self.tp.world_size == 1:
            return self.linear(x, weight, bias)
        out = self.sum_ranks(self.linear(x, weight))
        return out if bias is None else out + bias

    def sum_ranks(self, part: torch.Tensor) -> torch.Tensor:
        """A row-parallel block's partial output [...] summed over the ranks (in exact mode in
        rank order, the same for every shape)."""
        if self.tp.world_size == 1:
            return part
        return self.tp.sum_in_order(part) if self.exact else self.tp.all_reduce(part)

    def moe(self, x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, top_k: int, renormalize: bool,
            gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
            limit: float = 0.0) -> torch.Tensor:
        """A mixture of experts: x [..., H] (normed) -> [..., H]. router_logits [..., E] pick
        each token's top_k experts (`ops.route`), `experts` runs them on this rank's slice of
        every expert (gate_up [E, 2I/N, H], down [E, H, I/N]; gpt-oss's biases gate_up_bias
        [E, 2I/N] and down_bias [E, H], the latter in rank 0's part only, so that the sum
        adds it once; its clamped SwiGLU where limit > 0), and the partial outputs are summed
        over the ranks."""
        weights, ids = route(router_logits.reshape(-1, router_logits.shape[-1]), top_k,
                             renormalize)
        if self.tp.rank != 0:
            down_bias = None
        out = self.experts(x.reshape(-1, x.shape[-1]), gate_up, down, weights, ids,
                           gate_up_bias, down_bias, limit)
        return self.sum_ranks(out).view(x.shape)

    def experts(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                weights: torch.Tensor, ids: torch.Tensor,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                limit: float = 0.0) -> torch.Tensor:
        """x [T, H] through the experts ids [T, k] weighted by weights [T, k] -> [T, H]
        (`ops.moe_experts`, in exact mode its row-invariant products)."""
        return moe_experts(x, gate_up, down, weights, ids, self.exact, gate_up_bias, down_bias,
                           limit)

    def head_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel LM head: x [..., hidden] @ weight [V/N, hidden]^T, the ranks'
        slices gathered -> [..., V]."""
        return self.tp.gather_last(self.linear(x, weight))

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """ids [...] -> rows of the (vocabulary-parallel) embedding table [..., hidden]."""
        return self.tp.embed(ids, weight)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., N] -> RMSNorm(x) * weight."""
        return rms_norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [..., N] -> (norm(h), h) with h = x + residual."""
        return add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [..., 2I] -> silu(gate) * up [..., I]."""
        return exact_silu_mul(gate_up) if self.exact else silu_mul(gate_up)

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
