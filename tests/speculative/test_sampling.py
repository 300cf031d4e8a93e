"""Sampling: counter-based draws (the same for a seed, position and slot, whatever the batch;
different for another of the three), the exponential trick follows the distribution, and
invalid settings raise ConfigError (the sampling kernel's tests: tests/kernels/test_sample.py)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from vegas_spec import sampling
from vegas_spec.config import ConfigError, SamplingParams, SpecConfig
from vegas_spec.sampling import (
    ACCEPT,
    DRAFT,
    TARGET,
    BatchSampling,
    draw_keys,
    next_tokens,
    probs,
    sample,
    uniform,
)

CPU = torch.device("cpu")


def batch(params: list[SamplingParams]) -> BatchSampling:
    return BatchSampling.build(params, CPU)


def draws(s: BatchSampling, p: torch.Tensor, steps: int, slot: int = TARGET) -> torch.Tensor:
    """Samples of p [B, V] at positions 0..steps-1 -> [B, steps]."""
    positions = torch.arange(steps).expand(p.shape[0], -1)
    return sample(p[:, None].expand(-1, steps, -1), s, positions, slot)


def flat(vocab: int, rows: int) -> torch.Tensor:
    return torch.full((rows, vocab), 1.0 / vocab)


def test_same_seed_same_tokens() -> None:
    params = [SamplingParams(temperature=1.0, seed=s) for s in (11, 12, 13)]
    first, again = draws(batch(params), flat(50, 3), 20), draws(batch(params), flat(50, 3), 20)
    assert torch.equal(first, again)
    other = draws(batch([SamplingParams(temperature=1.0, seed=14)]), flat(50, 1), 20)
    assert not torch.equal(first[0], other[0])
    assert not torch.equal(first[0], first[1])  # one stream per sequence
    assert len(set(first[0].tolist())) > 5  # positions draw independently


def test_slots_are_independent_streams() -> None:
    s = batch([SamplingParams(temperature=1.0, seed=3)])
    by_slot = [draws(s, flat(1000, 1), 30, slot)[0] for slot in (TARGET, ACCEPT, DRAFT)]
    assert all(not torch.equal(a, b) for i, a in enumerate(by_slot) for b in by_slot[i + 1:])


def test_seeded_sequence_ignores_its_neighbours() -> None:
    alone = draws(batch([SamplingParams(temperature=1.0, seed=7)]), flat(50, 1), 20)
    mixed = batch([SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0,
                                                                          seed=7)])
    assert torch.equal(draws(mixed, flat(50, 2), 20)[1], alone[0])


def test_unseeded_sequences_differ() -> None:
    s = batch([SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)])
    out = draws(s, flat(1000, 2), 10)
    assert not torch.equal(out[0], out[1])


def test_large_and_negative_seeds_are_distinct_streams() -> None:
    """Seeds span [-2^63, 2^64): values with the same low 64 bits are one seed, others not."""
    seeds = [2**64 - 1, -1, 2**63, 5, 5 + 2**32]
    keys = draw_keys(batch([SamplingParams(seed=x) for x in seeds]).seeds,
                     torch.zeros(5, 1, dtype=torch.long), TARGET)[:, 0].tolist()
    assert keys[0] == keys[1] and len(set(keys)) == 4


def test_rows_keep_each_sequences_parameters_and_seed() -> None:
    params = [SamplingParams(temperature=0.5 + i, top_k=i, top_p=0.9 - 0.1 * i, seed=100 + i)
              for i in range(4)]
    s = batch(params)
    sub = s.rows([3, 1], torch.tensor([3, 1]))
    assert sub.temperature.tolist() == pytest.approx([3.5, 1.5])
    assert sub.top_k.tolist() == [3, 1]
    assert sub.top_p.tolist() == pytest.approx([0.6, 0.8])
    assert sub.seeds.tolist() == [103, 101]
    ref = batch([params[3], params[1]])
    assert torch.equal(draws(sub, flat(50, 2), 5), draws(ref, flat(50, 2), 5))


def test_sample_follows_the_distribution() -> None:
    p = torch.tensor([0.1, 0.0, 0.35, 0.05, 0.3, 0.2])
    s = batch([SamplingParams(temperature=1.0, seed=3)])
    tokens = draws(s, p[None], 20_000)[0]  # 20k positions of one sequence
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[1] == 0
    support = p > 0
    expected = p[support].double() / p[support].sum() * counts.sum()
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3
    # and a distribution it does not follow is rejected by the same test
    wrong = torch.tensor([0.15, 0.3, 0.05, 0.3, 0.2], dtype=torch.float64) * counts.sum()
    assert chisquare(counts[support].numpy(), wrong.numpy()).pvalue < 1e-3


def test_uniform_shape_range_and_seed() -> None:
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=1.0, seed=6)]
    positions = torch.arange(12).view(1, 4, 3).expand(2, -1, -1)
    u = uniform(batch(params), positions)
    assert u.shape == (2, 4, 3) and (u > 0).all() and (u < 1).all()
    assert torch.equal(u, uniform(batch(params), positions))
    assert not torch.equal(u[0], u[1])
    big = uniform(batch([SamplingParams(seed=9)]), torch.arange(50_000)[None])[0].double()
    assert abs(big.mean().item() - 0.5) < 0.01 and abs(big.var().item() - 1 / 12) < 0.003


@pytest.mark.parametrize("top_p", [0.5, 0.95, 1.0])
def test_ranking_candidates_gives_the_sorts_distribution(top_p: float) -> None:
    """Rows whose top-k fits sampling.CANDIDATES rank that many tokens (torch.topk) instead of
    sorting the vocabulary: the same distribution (no ties in these logits)."""
    logits = torch.randn(5, 3, 3000, generator=torch.Generator().manual_seed(6)) * 3
    params = [SamplingParams(temperature=0.7, top_k=k, top_p=top_p) for k in (1, 5, 20, 64, 3)]
    s = batch(params)
    assert s.candidates and s.filters
    got = probs(logits, s)
    x = logits / 0.7
    sort = torch.softmax(sampling._top_k_top_p(x, s.top_k, s.top_p), -1)
    assert torch.allclose(got, sort, atol=1e-6)
    assert ((got > 0).sum(-1) <= torch.tensor([1, 5, 20, 64, 3])[:, None]).all()
    # beside a row that sorts (top-k past CANDIDATES), a row keeps its own ranking
    wide = batch(params + [SamplingParams(temperature=0.7, top_k=65)])
    assert not wide.candidates
    beside = probs(torch.cat([logits, logits[:1]]), wide)
    assert torch.equal(beside[:5], got)
    assert ((beside[5] > 0).sum(-1) <= 65).all() and ((beside[5] > 0).sum(-1) > 1).all()


def test_next_tokens_greedy_rows_are_argmax() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    greedy = batch([SamplingParams()] * 4)
    assert greedy.all_greedy
    assert torch.equal(next_tokens(logits, greedy, torch.zeros(4)), logits.argmax(-1))
    mixed = batch([SamplingParams(), SamplingParams(temperature=1.0, seed=1)] * 2)
    assert not mixed.all_greedy
    for position in range(20):
        out = next_tokens(logits, mixed, torch.full((4,), position))
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_probs_shape_and_normalisation() -> None:
    logits = torch.randn(2, 3, 4, 17, generator=torch.Generator().manual_seed(1))
    s = batch([SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1)] * 2)
    out = probs(logits, s)
    assert out.shape == logits.shape
    assert torch.allclose(out.sum(-1), torch.ones(2, 3, 4))


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"stop": ("",)}, "stop"),
])
def test_invalid_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"method": "magic"}, "method"),
    ({"gamma": 0}, "gamma"),
    ({"gamma": 33}, "gamma"),
    ({"gamma": 2.0}, "gamma"),
    ({"ratio": 0.0}, "ratio"),
    ({"ratio": 1.5}, "ratio"),
    ({"min_tokens": 0}, "min_tokens"),
    ({"score": "prob"}, "score"),
    ({"collect": "3"}, "collect"),
    ({"granularity": "head"}, "granularity"),
    ({"sink": -1}, "sink"),
    ({"page": 0}, "page"),
    ({"chunk": 0}, "chunk"),
])
def test_invalid_spec_config(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SpecConfig(**kwargs)


def test_valid_settings_are_kept() -> None:
    assert SpecConfig(collect=2).options.collect == "2"  # the number is accepted as the option "2"
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    assert issubclass(ConfigError, ValueError)


def test_cat_appends_rows_with_their_seeds() -> None:
    params = [SamplingParams(temperature=0.7, seed=7), SamplingParams(temperature=0.0, seed=8),
              SamplingParams(temperature=1.2, top_k=5, seed=9)]
    whole = batch(params)
    joined = batch(params[:1]).cat(batch(params[1:]))
    assert not joined.all_greedy and joined.filters
    assert joined.top_k.tolist() == [0, 0, 5]
    assert torch.equal(draws(joined, flat(50, 3), 4), draws(whole, flat(50, 3), 4))


@pytest.mark.parametrize("top_p", [0.5, 0.95, 1.0])
def test_candidates_are_the_dense_distribution(top_p: float) -> None:
    """`dist` of a batch whose rows are greedy or top-k within CANDIDATES keeps candidates:
    scattered into the vocabulary they are `probs` to the bit (greedy rows one-hot at the
    argmax, also where the top logits tie), and they draw the dense row's tokens."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 3, 3000, generator=g) * 3
    logits[1, 0, [5, 17]] = logits[1, 0].max() + 1.0  # a tie at the top of a greedy row
    params = [SamplingParams(temperature=0.6, top_k=k, top_p=top_p, seed=k)
              for k in (20, 1, 64, 5, 2, 20)]
    params[1] = SamplingParams()
    s = batch(params)
    got = sampling.dist(logits, s)
    assert isinstance(got, sampling.Candidates) and got.shape == (6, 3, sampling.CANDIDATES)
    want = probs(logits, s)
    assert torch.equal(got.dense(3000), want)
    assert int(got.index[1, 0, 0]) == 5 == int(logits[1, 0].argmax())
    positions = torch.arange(18).view(6, 3) + 100
    for slot in (sampling.TARGET, sampling.DRAFT):
        assert torch.equal(sample(got, s, positions, slot), sample(want, s, positions, slot))
    # a batch with a row past CANDIDATES, or with no filter, keeps the dense rows
    assert torch.is_tensor(sampling.dist(logits, batch(params[:5] + [
        SamplingParams(temperature=0.6, top_k=65)])))
    assert torch.is_tensor(sampling.dist(logits, batch([SamplingParams(temperature=0.6)] * 6)))
