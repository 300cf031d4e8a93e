"""Plans of a batch whose rows come and go: a sparse plan is row-independent (each row's
indices, recent range and budget depend on that row alone), so joining sequences' plans are
appended to the running rows' plans, which stay as they are, and the rows of sequences that
leave between rounds are cut out of it. `selection_input` is what every plan is made from,
on the dynamic path and inside a round's graph alike; `score_request` what a full pass writes
the scores that a policy selects from into."""

from __future__ import annotations

from typing import Any

import torch

from vegas_spec.attention.context import ScoreRequest, SparsePlan
from vegas_spec.ops import cat_padded
from vegas_spec.speculative.policies import Policy, SelectionInput


def selection_input(policy: Policy, ops: Any, attn: Any, scores: torch.Tensor | None,
                    row: torch.Tensor, accepted: torch.Tensor, lengths: torch.Tensor,
                    gamma: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    page_table: torch.Tensor, page_size: int) -> SelectionInput:
    """A policy's input after a full pass (row [B]: its query row 0; accepted [B]; lengths
    [B] committed): the scores summed over the tensor-parallel ranks' heads (the ops'
    collective, `sum_scores`), ranked with the attention backend's top-k kernels."""
    scores = ops.sum_scores(scores, policy.per_kv_head)
    return SelectionInput(scores, row, accepted, lengths, gamma, kv_caches, page_table,
                          page_size, topk=attn.topk, topk_sum=attn.topk_sum)


def score_request(policy: Policy | None, layers: int, kv_heads: int, bsz: int, n: int,
                  width: int, prefill: bool, device: torch.device) -> ScoreRequest | None:
    """The scores a full pass of bsz rows of n queries (the last row of a prompt: prefill)
    emits for the policy: out [layers, bsz, R, G, width] (None: it selects without them)."""
    if policy is None or not policy.wants_scores:
        return None
    rows = policy.score_rows(n, prefill)
    groups = kv_heads if policy.per_kv_head else 1
    out = torch.empty(layers, bsz, len(rows), groups, width, device=device)
    return ScoreRequest(torch.tensor(rows, device=device), out, policy.score_mode,
                        policy.per_kv_head)


def cat_plans(a: SparsePlan | None, b: SparsePlan | None) -> SparsePlan | None:
    """a's rows followed by b's (None: full drafts, for both)."""
    if a is None or b is None:
        assert a is None and b is None, "one method per batch: plans on both sides or neither"
        return None
    indices = None
    if a.indices is not None and b.indices is not None:
        indices = cat_padded(a.indices, b.indices, -1, dim=1)  # [layers, B, G, K]
    selector = None
    if a.selector is not None and b.selector is not None:
        selector = a.selector.cat(b.selector)
    listed = None
    if a.listed is not None and b.listed is not None:
        listed = torch.cat([a.listed, b.listed])
    return SparsePlan(indices, torch.cat([a.recent_start, b.recent_start]),
                      max(a.recent_max, b.recent_max), torch.cat([a.budget, b.budget]), selector,
                      listed)


def take_plan(plan: SparsePlan | None, idx: torch.Tensor) -> SparsePlan | None:
    """The rows idx [B'] of a plan, in that order (None: full drafts)."""
    if plan is None:
        return None
    selector = None if plan.selector is None else plan.selector.take(idx)
    indices = None if plan.indices is None else plan.indices[:, idx]  # [layers, B', G, K]
    return SparsePlan(indices, plan.recent_start[idx], plan.recent_max, plan.budget[idx],
                      selector, None if plan.listed is None else plan.listed[idx])
