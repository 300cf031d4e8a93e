"""One draft-verify-accept round: the one implementation that the dynamic eager path and
the fixed-shape path (run eagerly on CPU, captured as one CUDA graph per batch bucket on a
GPU) both run, over a step function that hides how a forward gets its inputs.

Greedy rounds draft by argmax and accept the longest matching prefix; sampled rounds draft
with each row's own temperature / top-k / top-p (greedy rows of a mixed batch become one-hot
distributions, for which rejection sampling is greedy acceptance) and accept by rejection
sampling. Every draw is counter-based (`sampling`), so a round reads no generator state and
needs no host synchronisation: the whole round, sampling included, can be one graph."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from vegas_spec.sampling import DRAFT, BatchSampling, Dist, dist, sample, stack
from vegas_spec.speculative.acceptance import accept_greedy, accept_sampling

# step(kind, tokens [B, n], positions [B, n]) -> logits [B, n, V], in the model's dtype or
# float32: read by an argmax, a top-k and the sampling transform (which computes in float32),
# none of which the exact float32 cast changes.
StepFn = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]
Phase = Callable[[str], AbstractContextManager]


def _no_phase(name: str) -> AbstractContextManager:
    return nullcontext()


def draft_tokens(step: StepFn, last: torch.Tensor, lengths: torch.Tensor, gamma: int,
                 kind: str, sampling: BatchSampling | None,
                 ) -> tuple[torch.Tensor, Dist | None]:
    """γ one-token steps of `kind` from last [B] at lengths [B] -> drafts [B, γ] and, when
    sampling, their distributions q [B, γ, V] or candidates (`sampling.dist`; None: greedy
    drafts)."""
    token, drafts, qs = last, [], []
    for j in range(gamma):
        logits = step(kind, token[:, None], (lengths + j)[:, None])[:, -1]
        if sampling is None:
            token = logits.argmax(-1)
        else:
            q = dist(logits, sampling)
            token = sample(q, sampling, lengths + j + 1, DRAFT)
            qs.append(q)
        drafts.append(token)
    return torch.stack(drafts, 1), stack(qs, 1) if qs else None


def speculate(step: StepFn, last: torch.Tensor, lengths: torch.Tensor, gamma: int,
              draft_kind: str, sampling: BatchSampling | None,
              phase: Phase = _no_phase) -> tuple[torch.Tensor, torch.Tensor]:
    """One round from last [B] (the newest token, at position lengths [B], not yet cached):
    accepted [B] (0..γ) and emitted [B, γ+1] (emitted[:, :a+1] are the round's tokens).
    sampling None: a greedy round; phase(name): a context timing each part (eager path)."""
    with phase("draft"):
        draft, q = draft_tokens(step, last, lengths, gamma, draft_kind, sampling)
    with phase("verify"):
        tokens = torch.cat([last[:, None], draft], 1)
        positions = lengths[:, None] + torch.arange(gamma + 1, device=lengths.device)
        logits = step("verify", tokens, positions)
    with phase("accept"):
        if sampling is None:
            return accept_greedy(draft, logits)
        assert q is not None
        return accept_sampling(draft, q, dist(logits, sampling), sampling, lengths)
