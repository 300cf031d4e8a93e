"""Acceptance: exact greedy cases with +-100 logits; rejection sampling reproduces the target
distribution (chi-square), and a deliberately wrong rule fails the same check; the
temperature / top-k / top-p transform is the same for draft and target."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from vegas_spec.config import SamplingParams
from vegas_spec.sampling import BatchSampling, probs
from vegas_spec.speculative.acceptance import accept_greedy, accept_sampling

CPU = torch.device("cpu")
VOCAB = 6
DRAWS = 20_000

# Target p_i and draft q_i that differ substantially: token 4 only through the residual
# (q = 0), token 5 never (p = 0) although the draft proposes it often.
P_BASE = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10, 0.00], dtype=torch.float64)
Q_BASE = torch.tensor([0.30, 0.10, 0.10, 0.20, 0.00, 0.30], dtype=torch.float64)


def batch(params: list[SamplingParams]) -> BatchSampling:
    return BatchSampling.build(params, CPU)


def seeded(n: int, **kw: float) -> BatchSampling:
    return batch([SamplingParams(seed=i, **kw) for i in range(n)])


def follows(samples: torch.Tensor, dist: torch.Tensor) -> bool:
    """True when samples [N] are plausibly drawn from dist [V]: no draw outside the support
    and a chi-square p-value above 1e-3."""
    counts = torch.bincount(samples, minlength=len(dist)).double()
    support = dist > 0
    if counts[~support].sum() > 0:
        return False
    expected = dist[support] / dist[support].sum() * counts.sum()
    return bool(chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3)


# --- greedy --------------------------------------------------------------------------------


def one_hot_logits(tokens: list[list[int]]) -> torch.Tensor:
    """[B, n] token ids -> [B, n, V] logits: +100 at the token, -100 elsewhere."""
    t = torch.tensor(tokens)
    return torch.full((*t.shape, VOCAB), -100.0).scatter(-1, t[..., None], 100.0)


def test_greedy_exact_cases() -> None:
    target = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 0, 0, 1]]
    draft = [[1, 2, 3], [1, 5, 3], [0, 2, 3], [5, 0, 0]]
    accepted, tokens = accept_greedy(torch.tensor(draft), one_hot_logits(target))
    # all accepted -> bonus; mismatch at 1 (a later match does not count); none; all + bonus
    assert accepted.tolist() == [3, 1, 0, 3]
    emitted = [tokens[b, : a + 1].tolist() for b, a in enumerate(accepted.tolist())]
    assert emitted == [[1, 2, 3, 4], [1, 2], [1], [5, 0, 0, 1]]


def test_greedy_single_draft() -> None:
    accepted, tokens = accept_greedy(torch.tensor([[2], [3]]), one_hot_logits([[2, 4], [1, 4]]))
    assert accepted.tolist() == [1, 0]
    assert tokens[0, :2].tolist() == [2, 4] and tokens[1, 0].item() == 1


# --- rejection sampling ----------------------------------------------------------------------


def target_and_draft(gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position i uses the base distributions with the vocabulary rotated by i:
    p [γ+1, V], q [γ, V]."""
    p = torch.stack([P_BASE.roll(i) for i in range(gamma + 1)])
    q = torch.stack([Q_BASE.roll(i) for i in range(gamma)])
    return p, q


def run_rule(rule, gamma: int, seed: int = 0, n: int = DRAWS,  # noqa: ANN001
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n identical rows: drafts d_i ~ q_i, then rule(draft, q, p, sampling).
    Returns draft [n, γ], accepted [n], tokens [n, γ+1]."""
    p, q = target_and_draft(gamma)
    gen = torch.Generator().manual_seed(10_000 + seed)
    draft = torch.stack([torch.multinomial(q[i].float(), n, replacement=True, generator=gen)
                         for i in range(gamma)], dim=1)
    s = batch([SamplingParams(temperature=1.0, seed=seed * n + i) for i in range(n)])
    big_q, big_p = q.float().expand(n, -1, -1), p.float().expand(n, -1, -1)
    start = torch.randint(0, 1000, (n,), generator=gen)  # the rows' positions differ
    return (draft, *rule(draft, big_q, big_p, s, start))


def always_accept(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, s: BatchSampling,
                  start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrong: keeps every draft, so the output follows q."""
    bonus = torch.multinomial(p[:, -1], 1, generator=torch.Generator().manual_seed(1))
    return torch.full((draft.shape[0],), draft.shape[1]), torch.cat([draft, bonus], dim=1)


def resample_from_target(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                         s: BatchSampling, start: torch.Tensor,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrong: the right acceptance test, but a rejected draft is replaced by a sample of p_i
    instead of the residual normalize(max(0, p_i - q_i))."""
    gamma, gen = draft.shape[1], torch.Generator().manual_seed(2)
    p_d = p[:, :gamma].gather(-1, draft[..., None])[..., 0]
    q_d = q.gather(-1, draft[..., None])[..., 0]
    ok = torch.rand(p_d.shape, generator=gen) * q_d < p_d
    accepted = ok.long().cumprod(-1).sum(-1)
    fresh = torch.multinomial(p.flatten(0, 1), 1, generator=gen).view(p.shape[:2])
    tokens = torch.cat([draft, fresh[:, -1:]], dim=1)
    pick = torch.arange(gamma + 1)[None, :] == accepted[:, None]
    return accepted, torch.where(pick, fresh, tokens)


@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_rejection_sampling_reproduces_the_target(gamma: int) -> None:
    p, q = target_and_draft(gamma)
    draft, accepted, tokens = run_rule(accept_sampling, gamma)
    assert accepted.min() >= 0 and accepted.max() <= gamma
    assert follows(tokens[:, 0], p[0])
    first_kept = accepted >= 1
    assert follows(tokens[first_kept, 1], p[1])
    # the first draft survives with probability sum_v min(p_0, q_0)
    rate, beta = first_kept.double().mean().item(), torch.minimum(p[0], q[0]).sum().item()
    assert abs(rate - beta) < 4 * np.sqrt(beta * (1 - beta) / DRAWS)
    # accepted drafts are the drafts themselves
    for i in range(gamma):
        rows = accepted > i
        assert torch.equal(tokens[rows, i], draft[rows, i])


@pytest.mark.parametrize("rule", [always_accept, resample_from_target])
def test_a_wrong_rule_fails_the_same_check(rule) -> None:  # noqa: ANN001
    p, _ = target_and_draft(2)
    _, _, tokens = run_rule(rule, 2)
    assert not follows(tokens[:, 0], p[0])


def test_rejection_sampling_is_reproducible() -> None:
    first = run_rule(accept_sampling, 2, seed=3, n=2000)
    again = run_rule(accept_sampling, 2, seed=3, n=2000)
    other = run_rule(accept_sampling, 2, seed=4, n=2000)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[2], other[2])


def test_greedy_rows_of_a_mixed_batch_stay_argmax() -> None:
    """Temperature-0 rows give the same result as greedy acceptance, whatever the sampled
    rows next to them do."""
    gamma, vocab = 3, 11
    s = batch([SamplingParams(temperature=t, seed=i)
               for i, t in enumerate([0.0, 0.8, 0.0, 1.0, 0.0, 1.3])])
    greedy = torch.tensor([True, False, True, False, True, False])
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(30):
        target = torch.randn(6, gamma + 1, vocab, generator=gen) * 3
        drafted = target[:, :gamma] + torch.randn(6, gamma, vocab, generator=gen) * 2
        q = probs(drafted, s)
        draft = torch.where(greedy[:, None], drafted.argmax(-1),
                            torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(6, gamma))
        accepted, tokens = accept_sampling(draft, q, probs(target, s), s,
                                           torch.randint(0, 99, (6,), generator=gen))
        want_acc, want_tok = accept_greedy(draft, target)
        assert torch.equal(accepted[greedy], want_acc[greedy])
        for b in torch.nonzero(greedy)[:, 0].tolist():
            a = int(accepted[b])
            assert torch.equal(tokens[b, : a + 1], want_tok[b, : a + 1])
            seen.add(a)
    assert 0 in seen and len(seen) >= 3  # rejections and acceptances both exercised


# --- the shared transform --------------------------------------------------------------------


def test_temperature_sharpens() -> None:
    logits = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(1))
    temps = [0.5, 1.0, 2.0]
    out = probs(logits, batch([SamplingParams(temperature=t) for t in temps]))
    for b, t in enumerate(temps):
        assert torch.allclose(out[b], torch.softmax(logits[b] / t, -1), atol=1e-6)
    same = probs(logits[:1].expand(3, -1, -1),
                 batch([SamplingParams(temperature=t) for t in temps]))
    top = same.max(-1).values  # [3, 2]
    assert (top[0] > top[1]).all() and (top[1] > top[2]).all()


def test_top_k_zeroes_all_but_the_k_largest() -> None:
    logits = torch.randn(2, 4, 30, generator=torch.Generator().manual_seed(2))
    out = probs(logits, batch([SamplingParams(temperature=0.7, top_k=2)] * 2))
    two = logits.topk(2, dim=-1)
    assert ((out > 0).sum(-1) == 2).all()
    kept = out.gather(-1, two.indices)
    assert torch.allclose(kept, torch.softmax(two.values / 0.7, -1), atol=1e-6)


@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9, 0.95])
def test_top_p_keeps_the_minimal_nucleus(top_p: float, top_k: int) -> None:
    logits = torch.randn(3, 5, 20, generator=torch.Generator().manual_seed(3)) * 2
    out = probs(logits, batch([SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p)] * 3))
    for b in range(3):
        for i in range(5):
            want = _nucleus(logits[b, i].double().numpy() / 0.9, top_k, top_p)
            assert np.allclose(out[b, i].double().numpy(), want, atol=1e-6)


def _nucleus(x: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Top-k, renormalise, then the fewest most likely tokens whose mass reaches top_p."""
    order = list(np.argsort(-x))[: top_k or len(x)]
    weights = np.exp(x[order] - x[order].max())
    weights /= weights.sum()
    keep, mass = [], 0.0
    for token, w in zip(order, weights):
        keep.append(token)
        mass += w
        if mass >= top_p:
            break
    out = np.zeros_like(x)
    out[keep] = np.exp(x[keep] - x[keep].max())
    return out / out.sum()


def test_top_p_stops_at_the_first_token_reaching_it() -> None:
    """Probabilities 1/2, 1/4, 1/8, 1/8 are exact in binary: with top_p = 3/4 the nucleus is
    the first two tokens, the third (mass before it exactly 3/4) is not needed."""
    logits = torch.tensor([[0.0, -1.0, -2.0, -2.0]]) * math.log(2)
    out = probs(logits, batch([SamplingParams(temperature=1.0, top_p=0.75)]))
    assert torch.allclose(out, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))


def test_greedy_rows_are_one_hot_even_for_near_ties() -> None:
    logits = torch.tensor([[1.0, 1.0 - 1e-6, -3.0], [0.5, 0.5 + 1e-6, 0.2]])
    out = probs(logits, batch([SamplingParams(), SamplingParams(temperature=1.0)]))
    assert out[0].tolist() == [1.0, 0.0, 0.0]
    assert torch.allclose(out[1], torch.softmax(logits[1], -1))


def test_top_p_one_filters_nothing() -> None:
    """top_p = 1 disables the filter, also on a large vocabulary whose float32 cumulative
    sum reaches 1 before the last token."""
    logits = torch.randn(2, 50_000, generator=torch.Generator().manual_seed(4)) * 3
    out = probs(logits, batch([SamplingParams(temperature=1.0, top_p=1.0)] * 2))
    assert (out > 0).all()
    assert torch.allclose(out, torch.softmax(logits, -1), atol=1e-7)


def test_draft_and_target_share_the_transform() -> None:
    """Draft logits [B, γ, V] and target logits [B, γ+1, V] go through the same per-row
    transform: equal logits give equal distributions, whatever the shape or batch."""
    gamma, vocab = 3, 40
    params = [SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_p=0.8),
              SamplingParams(temperature=1.0, top_k=3)]
    s = batch(params)
    target = torch.randn(4, gamma + 1, vocab, generator=torch.Generator().manual_seed(5)) * 2
    q, p = probs(target[:, :gamma].clone(), s), probs(target, s)
    assert torch.equal(q, p[:, :gamma])
    for b, param in enumerate(params):
        alone = probs(target[b: b + 1, -1], batch([param]))
        assert torch.allclose(alone[0], p[b, -1], atol=1e-7)
    assert torch.equal(p[1], torch.nn.functional.one_hot(target[1].argmax(-1), vocab).float())
    assert ((p[3] > 0).sum(-1) == 3).all()
