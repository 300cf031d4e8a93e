"""Acceptance of drafted tokens: greedy (longest matching prefix) and lossless rejection
sampling. Vocabulary as in vLLM's rejection sampler: drafts d_1..d_γ, target distributions
p_0..p_γ, the *recovered* token replaces the first rejected draft, the *bonus* token follows
when all γ are accepted. Everything stays on device (cumprod instead of a host loop)."""

from __future__ import annotations

import torch

from vegas_spec.sampling import (
    ACCEPT,
    TARGET,
    BatchSampling,
    Dist,
    cat,
    prob_at,
    residual,
    sample,
    uniform,
)


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B, γ]; target_logits [B, γ+1, V].

    Returns accepted [B] (0..γ) and tokens [B, γ+1]: tokens[:, :a] are the accepted drafts,
    tokens[:, a] the target's correction (or bonus) token; later entries are meaningless."""
    target = target_logits.argmax(-1)  # [B, γ+1]
    match = (draft == target[:, :-1]).long()
    accepted = match.cumprod(-1).sum(-1)
    return accepted, target


def accept_sampling(draft: torch.Tensor, q: Dist, p: Dist, s: BatchSampling,
                    start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B, γ]; q [B, γ, V] draft distributions; p [B, γ+1, V] target distributions
    (both after the same temperature/top-k/top-p transform; both dense rows or both
    candidates, `sampling.dist`); start [B] the position of the round's first verify row, so
    that d_i is the token at start + i (its draws are keyed so).

    d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
    the recovered token comes from normalize(max(0, p_i - q_i)); the bonus from p_γ."""
    gamma = draft.shape[1]
    positions = start[:, None] + torch.arange(1, gamma + 2, device=draft.device)  # [B, γ+1]
    head = p[:, :gamma]
    p_d, q_d = prob_at(head, draft), prob_at(q, draft)
    u = uniform(s, positions[:, :gamma], ACCEPT)
    ok = (u * q_d < p_d).long()  # u < p/q without dividing by a zero q
    accepted = ok.cumprod(-1).sum(-1)
    recovered = sample(cat([residual(head, q), p[:, gamma:]], 1), s, positions, TARGET)
    tokens = torch.cat([draft, draft[:, :1]], dim=1)
    pick = torch.arange(gamma + 1, device=draft.device)[None, :] == accepted[:, None]
    return accepted, torch.where(pick, recovered, tokens)
