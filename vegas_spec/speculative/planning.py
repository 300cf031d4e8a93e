"""Plans of a batch whose rows come and go: a sparse plan is row-independent (each row's
indices, recent range and budget depend on that row alone), so joining sequences' plans are
appended to the running rows' plans, which stay as they are, and the rows of sequences that
leave between rounds are cut out of it. `selection_input` is what every plan is made from,
on the dynamic path and inside a round's graph alike."""

from __future__ import annotations

from typing import Any

import torch

from vegas_spec.attention.context import SparsePlan
from vegas_spec.speculative.policies import Policy, QuestSelector, SelectionInput


def selection_input(policy: Policy, backend: Any, scores: torch.Tensor | None,
                    row: torch.Tensor, accepted: torch.Tensor, lengths: torch.Tensor,
                    gamma: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    page_table: torch.Tensor, page_size: int) -> SelectionInput:
    """A policy's input after a full pass (row [B]: its query row 0; accepted [B]; lengths
    [B] committed): the scores summed over the tensor-parallel ranks' heads, ranked with the
    attention backend's top-k kernels."""
    scores = backend.tp.sum_scores(scores, policy.per_kv_head)
    return SelectionInput(scores, row, accepted, lengths, gamma, kv_caches, page_table,
                          page_size, topk=backend.topk, topk_sum=backend.topk_sum)


def cat_plans(a: SparsePlan | None, b: SparsePlan | None) -> SparsePlan | None:
    """a's rows followed by b's (None: full drafts, for both)."""
    if a is None or b is None:
        assert a is None and b is None, "one method per batch: plans on both sides or neither"
        return None
    indices = None
    if a.indices is not None and b.indices is not None:
        indices = _cat_padded(a.indices, b.indices, -1, dim=1)  # [layers, B, G, K]
    selector = None
    if isinstance(a.selector, QuestSelector) and isinstance(b.selector, QuestSelector):
        selector = cat_quest(a.selector, b.selector)
    return SparsePlan(indices, torch.cat([a.recent_start, b.recent_start]),
                      max(a.recent_max, b.recent_max), torch.cat([a.budget, b.budget]), selector)


def take_plan(plan: SparsePlan | None, idx: torch.Tensor) -> SparsePlan | None:
    """The rows idx [B'] of a plan, in that order (None: full drafts)."""
    if plan is None:
        return None
    selector = plan.selector
    if selector is not None:
        assert isinstance(selector, QuestSelector), "only quest selects inside its drafts"
        selector = QuestSelector([(lo[idx], hi[idx]) for lo, hi in selector.bounds],
                                 selector.rankable[idx], selector.n_pages[idx], selector.page,
                                 selector.max_pages, selector.pages[idx])
    indices = None if plan.indices is None else plan.indices[:, idx]  # [layers, B', G, K]
    return SparsePlan(indices, plan.recent_start[idx], plan.recent_max, plan.budget[idx],
                      selector)


def cat_quest(a: QuestSelector, b: QuestSelector) -> QuestSelector:
    """Page bounds [B, NP, Hkv, D] padded to the wider NP with empty pages (lo +inf, hi -inf:
    they never rank, and lie past each row's rankable pages anyway)."""
    bounds = [(_cat_padded(la, lb, float("inf"), dim=0, axis=1),
               _cat_padded(ha, hb, float("-inf"), dim=0, axis=1))
              for (la, ha), (lb, hb) in zip(a.bounds, b.bounds, strict=True)]
    most = None if a.max_pages is None or b.max_pages is None else max(a.max_pages, b.max_pages)
    return QuestSelector(bounds, torch.cat([a.rankable, b.rankable]),
                         torch.cat([a.n_pages, b.n_pages]), a.page, most,
                         torch.cat([a.pages, b.pages]))


def _cat_padded(x: torch.Tensor, y: torch.Tensor, fill: float, dim: int,
                axis: int = -1) -> torch.Tensor:
    """x and y joined along `dim` after padding `axis` to the larger of the two with fill."""
    width = max(x.shape[axis], y.shape[axis])
    return torch.cat([_pad(x, width, fill, axis), _pad(y, width, fill, axis)], dim=dim)


def _pad(x: torch.Tensor, width: int, fill: float, axis: int) -> torch.Tensor:
    missing = width - x.shape[axis]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[axis] = missing
    return torch.cat([x, torch.full(shape, fill, dtype=x.dtype, device=x.device)], dim=axis)
