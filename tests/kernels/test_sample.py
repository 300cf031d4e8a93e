"""The sampling kernels against their references in `sampling`: the same integer hash, so
the same keys, uniforms and tokens per row (only log's and exp's last bits may differ, which
moves no argmax of these rows); a one-hot row (a greedy row of a sampled batch) gives its
token; the candidates' probabilities after temperature, top-k and top-p as the reference
computes them, for greedy, filtered and mixed rows of sequences of several rows."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, generator

from vegas_spec.config import SamplingParams
from vegas_spec.kernels.sample import candidate_probs, draws, sample_tokens
from vegas_spec.sampling import (
    ACCEPT,
    DRAFT,
    TARGET,
    BatchSampling,
    candidate_probs_ref,
    draw_keys,
    exponential_argmax_ref,
    mix32,
    to_uniform,
)

SEEDS = torch.tensor([0, 1, -5, 2**40 + 3, -(2**62), 2**63 - 1])


@pytest.mark.parametrize("slot", [TARGET, ACCEPT, DRAFT])
def test_draws_are_the_references(slot: int) -> None:
    """Keys and uniforms of every (seed, position) of [S, m] positions, negative and wide
    seeds and positions past 2^32 among them."""
    positions = torch.arange(len(SEEDS) * 4).view(-1, 4) * 997 + (1 << 33)
    keys = draw_keys(SEEDS, positions, slot)
    got = draws(SEEDS.to(DEVICE), positions.to(DEVICE), slot).cpu()
    assert torch.equal(got, keys)
    uniforms = draws(SEEDS.to(DEVICE), positions.to(DEVICE), slot, uniform=True).cpu()
    assert torch.equal(uniforms, to_uniform(mix32(keys)))
    one = draws(SEEDS.to(DEVICE), torch.arange(len(SEEDS)).to(DEVICE), slot).cpu()
    assert torch.equal(one, draw_keys(SEEDS, torch.arange(len(SEEDS)), slot))


@pytest.mark.parametrize("vocab", [7, 2048, 5000, 49152])
def test_draws_the_references_tokens(vocab: int) -> None:
    rows = 24
    p = torch.softmax(torch.randn(rows, vocab, generator=generator(vocab)) * 3, -1)
    p[3] = torch.nn.functional.one_hot(torch.tensor(vocab - 1), vocab).float()
    seeds, positions = torch.arange(rows) * 977 - 5, torch.arange(rows) * 13
    got = sample_tokens(p.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE), DRAFT).cpu()
    assert torch.equal(got, exponential_argmax_ref(p, draw_keys(seeds, positions, DRAFT)))
    assert got[3] == vocab - 1


def test_rows_of_sequences_read_their_sequences_seed() -> None:
    """[S, m] positions: row r draws with seed r // m, as the reference keys it."""
    seqs, m, vocab = 3, 5, 300
    p = torch.softmax(torch.randn(seqs * m, vocab, generator=generator(2)) * 2, -1)
    seeds, positions = torch.tensor([11, -7, 2**50]), torch.arange(seqs * m).view(seqs, m)
    got = sample_tokens(p.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE), TARGET).cpu()
    keys = draw_keys(seeds, positions, TARGET).reshape(-1)
    assert torch.equal(got, exponential_argmax_ref(p, keys))


def test_rows_of_a_strided_view() -> None:
    """A row stride past the vocabulary (a slice of a wider buffer) reads the right rows."""
    wide = torch.softmax(torch.randn(6, 300, generator=generator(1)), -1)
    seeds, positions = torch.arange(6), torch.arange(6)
    got = sample_tokens(wide[:, :200].to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE),
                        DRAFT).cpu()
    keys = draw_keys(seeds, positions, DRAFT)
    assert torch.equal(got, exponential_argmax_ref(wide[:, :200].contiguous(), keys))


@pytest.mark.parametrize("width", [5, 64])
def test_candidates_draw_their_dense_rows_tokens(width: int) -> None:
    """Weights of listed token ids (a candidate row, ids in any order, one id repeated with
    weight 0) draw the token their vocabulary-wide row draws, on the kernel and the
    reference alike; equal ratios go to the lowest id."""
    rows, vocab = 40, 3000
    g = generator(width)
    index = torch.stack([torch.randperm(vocab, generator=g)[:width] for _ in range(rows)])
    values = torch.softmax(torch.randn(rows, width, generator=g) * 2, -1)
    values[:, -1] = 0.0
    index[:, -1] = index[:, 0]  # a repeated id of weight 0 changes nothing
    dense = torch.zeros(rows, vocab).scatter_add_(-1, index, values)
    seeds, positions = torch.arange(rows) * 31 + 7, torch.arange(rows)
    keys = draw_keys(seeds, positions, DRAFT)
    want = exponential_argmax_ref(dense, keys)
    assert torch.equal(exponential_argmax_ref(values, keys, index), want)
    got = sample_tokens(values.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE), DRAFT,
                        index.to(DEVICE)).cpu()
    assert torch.equal(got, want)
    # a tie of ratios (the same id listed twice with the same weight): the lowest id wins
    tie_v = torch.tensor([[0.5, 0.5, 0.0]])
    tie_i = torch.tensor([[4, 4, 2]])
    seed, position = torch.tensor([3]), torch.tensor([0])
    assert exponential_argmax_ref(tie_v, draw_keys(seed, position, DRAFT), tie_i).item() == 4
    got = sample_tokens(tie_v.to(DEVICE), seed.to(DEVICE), position.to(DEVICE), DRAFT,
                        tie_i.to(DEVICE))
    assert got.item() == 4


@pytest.mark.parametrize("m", [1, 7])
def test_candidate_probs_are_the_references(m: int) -> None:
    """Greedy rows, top-k alone, top-p alone, both, a top-k wider than the candidates and a
    near-zero temperature, each sequence over m rows: the same ids, the same probabilities
    to float32 rounding, one-hot greedy rows at their argmax."""
    settings = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, top_k=20),
                SamplingParams(temperature=1.0, top_p=0.9, top_k=64),
                SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
                SamplingParams(temperature=1e-6, top_k=5),
                SamplingParams(temperature=1.3, top_k=1)]
    s = BatchSampling.build(settings, torch.device("cpu"))
    width, vocab = 64, 5000
    logits = torch.randn(len(settings) * m, vocab, generator=generator(m)) * 4
    values, index = torch.topk(logits, width, dim=-1)
    top = logits.argmax(-1)
    want_v, want_i = candidate_probs_ref(values, index, top, s.temperature, s.top_k, s.top_p)
    got_v, got_i = candidate_probs(*(t.to(DEVICE) for t in (
        values, index, top, s.temperature, s.top_k, s.top_p)))
    assert torch.equal(got_i.cpu(), want_i)
    torch.testing.assert_close(got_v.cpu(), want_v, rtol=1e-5, atol=1e-7)
    greedy = got_v.cpu().view(len(settings), m, width)[0]
    assert torch.equal(greedy[:, 0], torch.ones(m)) and greedy[:, 1:].abs().sum() == 0
    kept = (want_v.view(len(settings), m, width) > 0).sum(-1)
    assert (kept[1] == 20).all() and (kept[4] <= 5).all() and (kept[5] == 1).all()
    assert (kept[3] <= 20).all() and (kept[2] < 64).all()
