"""The per-step context: everything the attention layer needs to know about one forward pass.

The model has one forward; prefill, plain decode, draft and verify differ only in this object
(nano-vllm's idea). The engine builds it, the attention backend reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class DynamicSelector(Protocol):
    """Chooses draft KV positions inside the attention layer from the current query (quest)."""

    def __call__(self, layer: int, q: torch.Tensor, ctx: StepContext,
                 backend: Any = None, rope: torch.Tensor | None = None) -> torch.Tensor:
        """q: [B, n, H, D] -> positions [B, G, K] (int64, -1 = unused). `backend`, the
        attention backend calling it (None: the plain-PyTorch references), may run the
        scoring and the top-k as its own kernels. With `rope` (the RoPE table), q is before
        RoPE, to be rotated at ctx.positions."""
        ...

    def take(self, idx: torch.Tensor) -> DynamicSelector:
        """Its state for the rows idx [B'] of the batch, in that order (rows that leave)."""
        ...

    def cat(self, other: DynamicSelector) -> DynamicSelector:
        """Its rows followed by other's (rows that join a running batch)."""
        ...


@dataclass
class ScoreRequest:
    """Ask the full-attention pass to also emit selection scores.

    rows: [R] query-row indices (0..n-1) whose scores are wanted.
    out:  [num_layers, B, R, G, W] float32, G = num_kv_heads if per_kv_head else 1;
          written for keys 0..kv_len-1 of each sequence, summed over the query heads.
    """

    rows: torch.Tensor
    out: torch.Tensor
    mode: str = "weight"  # "weight": softmax probability, "logit": raw q.k
    per_kv_head: bool = False


@dataclass
class SparsePlan:
    """Which KV positions a draft step reads: selected(layer) ∪ [recent_start, seq_len).

    indices: [num_layers, B, G, K] positions (int64, -1 = unused), all < recent_start;
             G = 1 (shared by all heads) or num_kv_heads.
    recent_start: [B] first position of the always-read recent range.
    recent_max: host bound on seq_len - recent_start (fixes the gather width).
    budget: [B] selected-token budget k of each sequence (statistics).
    selector: computes indices per layer from the query instead (quest).
    listed: [B] the most positions each row lists (its indices past that are -1, and a
            draft kernel stops there rather than at the static width K; None: K).
    """

    indices: torch.Tensor | None
    recent_start: torch.Tensor
    recent_max: int
    budget: torch.Tensor
    selector: DynamicSelector | None = None
    listed: torch.Tensor | None = None


@dataclass
class LastRows:
    """The prompts whose last token is in a packed prefill step: their first selection comes
    from that token's attention, scored in the same step.

    index [S'] packed row of each last token; positions, slots [S', 1] its position and cache
    slot; page_table [S', P] its sequence's pages; kv_len_max: host bound on positions + 1.
    q_out: [layers, S', H, D] or None: receives each layer's rotated query of those rows
    (the prefix cache keeps it, to score a repeated prompt again without a forward).
    """

    index: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    page_table: torch.Tensor
    kv_len_max: int
    q_out: torch.Tensor | None = None


@dataclass
class PrefillPlan:
    """A packed prefill step: its T tokens ([1, T] inputs) are pieces of S prompts laid end to
    end. Piece s holds positions starts[s] .. starts[s] + lengths[s] - 1 of the sequence whose
    pages are row s of the step's page table; the keys before starts[s] are already cached
    (an earlier chunk, a prefix-cache hit), the piece's own are stored by this step.

    cu_q [S + 1] int32: piece s is tokens cu_q[s] .. cu_q[s + 1] - 1 of the packed axis.
    start [S] int32: starts on the device.
    lengths, starts: the same on the host (tiling, the reference).
    last: the prompts that end in this step (their scores go to the step's ScoreRequest).
    memo: per-step values a backend derives once and reuses in every layer (tile lists).
    """

    cu_q: torch.Tensor
    start: torch.Tensor
    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    last: LastRows | None = None
    memo: dict = field(default_factory=dict)


@dataclass
class StepContext:
    """positions:    [B, n] position of each input token.
    slot_mapping: [B, n] cache slot receiving each token's K/V.
    page_table:   [B, P] pages of each sequence (page_size slots each).
    kv_len_max:   host bound on the KV length once this step's tokens are written (the key
                  axis of the reference gather).
    prefill:      set for a packed prefill step (B = 1, n = T; page_table then has one row
                  per piece; `scores` then covers prefill.last's rows).
    draft:        a draft step: the projections read the model's draft copy of their
                  weights where it has one (`quant`).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    page_table: torch.Tensor
    page_size: int
    kv_len_max: int
    scores: ScoreRequest | None = None
    sparse: SparsePlan | None = None
    prefill: PrefillPlan | None = None
    draft: bool = False
