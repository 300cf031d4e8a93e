"""Sampling: seeded reproducibility (also across batch composition and `select`), the
exponential trick follows the distribution, and invalid settings raise ConfigError."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from vegas_spec.config import ConfigError, SamplingParams, SpecConfig
from vegas_spec.sampling import BatchSampling, next_tokens, probs, sample, uniform

CPU = torch.device("cpu")


def batch(params: list[SamplingParams]) -> BatchSampling:
    return BatchSampling.build(params, CPU)


def draws(s: BatchSampling, p: torch.Tensor, steps: int) -> torch.Tensor:
    """`steps` successive sample() calls on p [B, V] -> [B, steps]."""
    return torch.stack([sample(p, s) for _ in range(steps)], dim=1)


def flat(vocab: int, rows: int) -> torch.Tensor:
    return torch.full((rows, vocab), 1.0 / vocab)


def test_same_seed_same_tokens() -> None:
    params = [SamplingParams(temperature=1.0, seed=s) for s in (11, 12, 13)]
    first, again = draws(batch(params), flat(50, 3), 20), draws(batch(params), flat(50, 3), 20)
    assert torch.equal(first, again)
    other = draws(batch([SamplingParams(temperature=1.0, seed=14)]), flat(50, 1), 20)
    assert not torch.equal(first[0], other[0])
    assert not torch.equal(first[0], first[1])  # one generator per sequence


def test_seeded_sequence_ignores_its_neighbours() -> None:
    alone = draws(batch([SamplingParams(temperature=1.0, seed=7)]), flat(50, 1), 20)
    mixed = batch([SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0,
                                                                          seed=7)])
    assert torch.equal(draws(mixed, flat(50, 2), 20)[1], alone[0])


def test_unseeded_sequences_differ() -> None:
    s = batch([SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)])
    out = draws(s, flat(1000, 2), 10)
    assert not torch.equal(out[0], out[1])


def test_rows_keep_each_sequences_parameters_and_generator() -> None:
    params = [SamplingParams(temperature=0.5 + i, top_k=i, top_p=0.9 - 0.1 * i, seed=100 + i)
              for i in range(4)]
    s = batch(params)
    draws(s, flat(50, 4), 3)  # advance every generator
    sub = s.rows([3, 1], torch.tensor([3, 1]))
    assert sub.temperature.tolist() == pytest.approx([3.5, 1.5])
    assert sub.top_k.tolist() == [3, 1]
    assert sub.top_p.tolist() == pytest.approx([0.6, 0.8])
    ref = batch([params[3], params[1]])
    draws(ref, flat(50, 2), 3)
    assert torch.equal(draws(sub, flat(50, 2), 5), draws(ref, flat(50, 2), 5))
    assert sub.generators[0] is s.generators[3]  # the state moves on with the sequence


def test_sample_follows_the_distribution() -> None:
    p = torch.tensor([0.1, 0.0, 0.35, 0.05, 0.3, 0.2])
    s = batch([SamplingParams(temperature=1.0, seed=3)])
    tokens = sample(p.expand(1, 20_000, -1), s)[0]  # 20k draws from one generator
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
    u = uniform((4, 3), batch(params), CPU)
    assert u.shape == (2, 4, 3) and (u >= 0).all() and (u < 1).all()
    assert torch.equal(u, uniform((4, 3), batch(params), CPU))


def test_next_tokens_greedy_rows_are_argmax() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    greedy = batch([SamplingParams()] * 4)
    assert greedy.all_greedy
    assert torch.equal(next_tokens(logits, greedy), logits.argmax(-1))
    mixed = batch([SamplingParams(), SamplingParams(temperature=1.0, seed=1)] * 2)
    assert not mixed.all_greedy
    for _ in range(20):
        out = next_tokens(logits, mixed)
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
    assert SpecConfig(collect=2).collect == "2"  # the number is accepted as the option "2"
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    assert issubclass(ConfigError, ValueError)


def test_cat_appends_rows_with_their_generators() -> None:
    params = [SamplingParams(temperature=0.7, seed=7), SamplingParams(temperature=0.0, seed=8),
              SamplingParams(temperature=1.2, top_k=5, seed=9)]
    whole = batch(params)
    joined = batch(params[:1]).cat(batch(params[1:]))
    assert not joined.all_greedy and joined.filters
    assert joined.top_k.tolist() == [0, 0, 5]
    assert torch.equal(draws(joined, flat(50, 3), 4), draws(whole, flat(50, 3), 4))
