"""The decode loop's steps on the input batch's own tensors (the dynamic path): the eager
counterpart of the `GraphRunner`'s fixed-shape buffers. Shapes follow the rows, and the key
axis of a step reaches one past the longest row's committed length, a bound read on the host
(`Batch.longest`); a round drafts from the plan the batch carries."""

from __future__ import annotations

import torch

from vegas_spec.attention.backend import AttentionBackend
from vegas_spec.attention.context import ScoreRequest, SparsePlan, StepContext
from vegas_spec.cache import PagedKVCache, step_slots
from vegas_spec.compute.base import Ops
from vegas_spec.input_batch import Batch
from vegas_spec.models.decoder import Decoder
from vegas_spec.speculative.planning import score_request
from vegas_spec.speculative.policies import Policy
from vegas_spec.speculative.round import Phase, speculate


class DynamicSteps:
    """Plain steps and rounds of a batch through the model, its KV cache and its compute
    seams (ops and attention backend)."""

    def __init__(self, model: Decoder, cache: PagedKVCache, ops: Ops,
                 attn: AttentionBackend) -> None:
        self.model, self.cache, self.ops, self.attn = model, cache, ops, attn
        self.kv_caches, self.page_size = cache.layers, cache.page_size

    def plain(self, batch: Batch) -> torch.Tensor:
        """One token a row with full attention -> the logits [B, V] of the next."""
        positions = batch.lengths[:, None]
        ctx = self._ctx(batch.page_table, positions, batch.longest + 1)
        return self._forward(batch.last[:, None], ctx, last_only=True)[:, -1]

    def round(self, batch: Batch, policy: Policy, gamma: int, phase: Phase,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """γ drafts (sparse ones over the batch's plan), the verify step and acceptance ->
        accepted [B] and emitted [B, γ+1], as `speculate` returns them, and the verify
        step's scores [layers, B, R, G, W] (None: the policy selects without them)."""
        bound, s, cfg = batch.longest, batch.sampling, self.cache.cfg
        req = score_request(policy, cfg.num_layers, cfg.num_kv_heads, len(batch.ids),
                            gamma + 1, bound + gamma + 1, False, batch.lengths.device)

        def step(kind: str, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            verify = kind == "verify"  # drafts read up to bound + γ - 1, verify bound + γ
            draft = kind == "draft"
            ctx = self._ctx(batch.page_table, positions, bound + gamma + verify,
                            req if verify else None, batch.plan if draft else None, draft)
            return self._forward(tokens, ctx, last_only=not verify)

        draft_kind = "plain" if policy.full_drafts else "draft"
        accepted, emitted = speculate(step, batch.last, batch.lengths, gamma, draft_kind,
                                      None if s.all_greedy else s, phase)
        return accepted, emitted, None if req is None else req.out

    def _ctx(self, page_table: torch.Tensor, positions: torch.Tensor, kv_len_max: int,
             scores: ScoreRequest | None = None, sparse: SparsePlan | None = None,
             draft: bool = False) -> StepContext:
        return StepContext(positions=positions,
                           slot_mapping=step_slots(page_table, positions, self.page_size),
                           page_table=page_table, page_size=self.page_size,
                           kv_len_max=kv_len_max, scores=scores, sparse=sparse, draft=draft)

    def _forward(self, tokens: torch.Tensor, ctx: StepContext,
                 last_only: bool = False) -> torch.Tensor:
        """tokens [B, n] -> logits [B, n, V] float32 ([B, 1, V] with last_only)."""
        hidden = self.model(tokens, ctx, self.kv_caches, self.ops, self.attn)
        return self.model.logits(hidden[:, -1:] if last_only else hidden, self.ops)
