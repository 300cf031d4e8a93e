"""A whole sampled round (`speculative.round.speculate`, what a GPU captures as one graph)
reproduces the target distribution after temperature, top-k and top-p: chi-square over the
emitted tokens of many rows of a bigram "model", a wrong acceptance rule and the unfiltered
distribution failing the same check; greedy rows of a mixed round are plain argmax; on CUDA
the captured round replays the eager round's tokens."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from vegas_spec import sampling as sampling_module
from vegas_spec.config import SamplingParams
from vegas_spec.sampling import BatchSampling, probs
from vegas_spec.speculative import round as round_module
from vegas_spec.speculative.round import speculate

VOCAB, ROWS, GAMMA = 8, 20_000, 3
SETTING = dict(temperature=0.9, top_k=5, top_p=0.9)


def tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft bigram logits [V, V]: row t is the next-token logits after token t."""
    g = torch.Generator().manual_seed(0)
    target = torch.randn(VOCAB, VOCAB, generator=g)
    draft = target + torch.randn(VOCAB, VOCAB, generator=g) * 0.7
    return target.to(device), draft.to(device)


def bigram_step(target: torch.Tensor, draft: torch.Tensor):  # noqa: ANN201
    def step(kind: str, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return (target if kind == "verify" else draft)[tokens]
    return step


def sampling(rows: int, device: torch.device, greedy_every: int = 0) -> BatchSampling:
    params = [SamplingParams(seed=i) if greedy_every and i % greedy_every == 0
              else SamplingParams(seed=i, **SETTING) for i in range(rows)]
    return BatchSampling.build(params, device)


def run_round(device: torch.device, s: BatchSampling) -> tuple[torch.Tensor, torch.Tensor]:
    target, draft = tables(device)
    rows = s.seeds.shape[0]
    last = torch.zeros(rows, dtype=torch.long, device=device)
    lengths = torch.arange(rows, device=device) % 997 + 5
    return speculate(bigram_step(target, draft), last, lengths, GAMMA, "draft", s)


def follows(samples: torch.Tensor, dist: torch.Tensor) -> bool:
    counts = torch.bincount(samples.cpu(), minlength=VOCAB).double()
    support = dist > 0
    if counts[~support].sum() > 0:
        return False
    if int(support.sum()) == 1:  # nothing else to test: every draw is the one token
        return True
    expected = dist[support].double() / dist[support].double().sum() * counts.sum()
    expected[-1] = counts.sum() - expected[:-1].sum()  # sums agree to the last bit
    return bool(chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3)


def target_dist(token: int, filtered: bool = True) -> torch.Tensor:
    target, _ = tables(torch.device("cpu"))
    setting = SETTING if filtered else {"temperature": SETTING["temperature"]}
    return probs(target[token][None], BatchSampling.build([SamplingParams(**setting)],
                                                          torch.device("cpu")))[0]


def test_a_sampled_round_reproduces_the_filtered_target() -> None:
    accepted, emitted = run_round(torch.device("cpu"), sampling(ROWS, torch.device("cpu")))
    first = emitted[:, 0]
    assert follows(first, target_dist(0))
    assert not follows(first, target_dist(0, filtered=False))  # the filters show
    # the second token, after an accepted first draft v, follows p(. | v)
    kept = accepted >= 1
    checked = [v for v in range(VOCAB) if int((kept & (first == v)).sum()) >= 500
               and int((target_dist(v) > 0).sum()) >= 2]
    assert checked
    for v in checked:
        assert follows(emitted[kept & (first == v), 1], target_dist(v))
    assert 0 < kept.double().mean() < 1 and int(accepted.max()) == GAMMA


def test_a_wrong_rule_fails_inside_the_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeping every draft makes the output follow the draft, which the check rejects."""
    def always_accept(draft, q, p, s, start):  # noqa: ANN001, ANN202
        rows = draft.shape[0]
        return torch.full((rows,), draft.shape[1]), torch.cat([draft, draft[:, :1]], 1)

    monkeypatch.setattr(round_module, "accept_sampling", always_accept)
    _, emitted = run_round(torch.device("cpu"), sampling(ROWS, torch.device("cpu")))
    assert not follows(emitted[:, 0], target_dist(0))


@pytest.mark.parametrize("kind", ["fp8", "int8", "int4"])
def test_drafts_from_a_quantised_copy_keep_the_target(kind: str) -> None:
    """A bigram "model" whose logits are a projection (embedding [V, 64] times W^T), drafting
    through the draft-weight copy's product (`quant.QUANTIZERS`) and verifying through W:
    the first token follows the filtered target (rejection reads the copy's distribution);
    drafts are accepted, not all."""
    from vegas_spec.quant import QUANTIZERS

    g = torch.Generator().manual_seed(1)
    emb = torch.randn(VOCAB, 64, generator=g)
    w = torch.randn(VOCAB, 64, generator=g) * 0.4
    target = emb @ w.t()
    draft = QUANTIZERS[kind](w).ref(emb)
    assert not torch.equal(draft, target)

    def step(which: str, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return (target if which == "verify" else draft)[tokens]

    s = sampling(ROWS, torch.device("cpu"))
    last = torch.zeros(ROWS, dtype=torch.long)
    accepted, emitted = speculate(step, last, torch.arange(ROWS) % 997 + 5, GAMMA, "draft", s)
    want = probs(target[0][None], BatchSampling.build([SamplingParams(**SETTING)],
                                                      torch.device("cpu")))[0]
    assert follows(emitted[:, 0], want)
    assert 0 < float(accepted.double().mean()) < GAMMA


def test_greedy_rows_of_a_mixed_round_are_argmax() -> None:
    accepted, emitted = run_round(torch.device("cpu"), sampling(64, torch.device("cpu"), 2))
    target, draft = tables(torch.device("cpu"))
    chain, token = [], torch.tensor(0)
    for _ in range(GAMMA + 1):  # the target's greedy continuation of token 0
        token = target[token].argmax()
        chain.append(int(token))
    greedy_drafts, token = 0, torch.tensor(0)
    for _ in range(GAMMA):  # how far the draft's greedy chain agrees with it
        token = draft[token].argmax()
        if int(token) != chain[greedy_drafts]:
            break
        greedy_drafts += 1
    for row in range(0, 64, 2):
        assert int(accepted[row]) == greedy_drafts
        assert emitted[row, : greedy_drafts + 1].tolist() == chain[: greedy_drafts + 1]


@pytest.mark.parametrize("vocab", [VOCAB, 300])
def test_a_round_of_candidates_emits_the_dense_rounds_tokens(
        vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows greedy or within sampling.CANDIDATES draft, accept and recover from candidates;
    the same round over vocabulary-wide rows (`probs`) emits the same tokens, row for row."""
    g = torch.Generator().manual_seed(vocab)
    target = torch.randn(vocab, vocab, generator=g) * 2
    draft = target + torch.randn(vocab, vocab, generator=g)
    params = [SamplingParams(seed=i) if i % 5 == 0 else
              SamplingParams(seed=i, temperature=0.6, top_k=20, top_p=0.95) for i in range(600)]
    s = BatchSampling.build(params, torch.device("cpu"))
    last = torch.arange(600) % vocab
    lengths = torch.arange(600) % 97 + 5
    step = bigram_step(target, draft)
    sparse = speculate(step, last, lengths, GAMMA, "draft", s)
    monkeypatch.setattr(round_module, "dist", probs)
    dense = speculate(step, last, lengths, GAMMA, "draft", s)
    assert torch.equal(sparse[0], dense[0])
    keep = torch.arange(GAMMA + 1)[None, :] <= sparse[0][:, None]
    assert torch.equal(sparse[1][keep], dense[1][keep])
    assert 0 < float(sparse[0].double().mean()) < GAMMA  # rejections and acceptances


def mixed_round_inputs(rows: int, vocab: int = VOCAB, device: str = "cpu") -> tuple:
    """Bigram tables of `vocab` tokens, and rows greedy (every fifth) or at the reference's
    setting, with their last tokens and lengths, on `device`."""
    g = torch.Generator().manual_seed(vocab + rows)
    target = torch.randn(vocab, vocab, generator=g) * 2
    draft = target + torch.randn(vocab, vocab, generator=g)
    params = [SamplingParams(seed=i) if i % 5 == 0 else
              SamplingParams(seed=i, temperature=0.6, top_k=20, top_p=0.95) for i in range(rows)]
    s = BatchSampling.build(params, torch.device(device))
    return (target.to(device), draft.to(device), s, (torch.arange(rows) % vocab).to(device),
            (torch.arange(rows) % 97 + 5).to(device))


def test_a_round_on_the_models_dtype_emits_its_float32_casts_tokens() -> None:
    """Logits in bfloat16 (a round's steps return the model's dtype) and their exact float32
    cast: the same drafts, acceptances and tokens, dense rows and candidates alike."""
    target, draft, s, last, lengths = mixed_round_inputs(400)
    target, draft = target.bfloat16(), draft.bfloat16()
    low = speculate(bigram_step(target, draft), last, lengths, GAMMA, "draft", s)
    wide = speculate(bigram_step(target.float(), draft.float()), last, lengths, GAMMA,
                     "draft", s)
    assert all(torch.equal(a, b) for a, b in zip(low, wide))
    dense = BatchSampling.build([SamplingParams(seed=i, temperature=0.8) for i in range(400)],
                                torch.device("cpu"))
    low = speculate(bigram_step(target, draft), last, lengths, GAMMA, "draft", dense)
    wide = speculate(bigram_step(target.float(), draft.float()), last, lengths, GAMMA,
                     "draft", dense)
    assert all(torch.equal(a, b) for a, b in zip(low, wide))


def test_the_sampling_kernels_round_emits_the_references_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same round with `kernels.sample` (on the GPU where there is one, else on CPU
    under the Triton interpreter) and with the PyTorch references (on CPU): the same
    accepted counts and tokens, row for row."""
    target, draft, s, last, lengths = mixed_round_inputs(60)
    reference = speculate(bigram_step(target, draft), last, lengths, GAMMA, "draft", s)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setattr(sampling_module, "_kernels", lambda t: True)
    target, draft, s, last, lengths = mixed_round_inputs(60, device=device)
    kernels = [t.cpu() for t in speculate(bigram_step(target, draft), last, lengths, GAMMA,
                                          "draft", s)]
    assert torch.equal(kernels[0], reference[0])
    keep = torch.arange(GAMMA + 1)[None, :] <= reference[0][:, None]
    assert torch.equal(kernels[1][keep], reference[1][keep])
    assert 0 < float(reference[0].double().mean()) < GAMMA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_captured_sampled_round_replays_the_eager_tokens() -> None:
    device = torch.device("cuda")
    s = sampling(4096, device, greedy_every=3)
    eager = run_round(device, s)
    target, draft = tables(device)
    last = torch.zeros(4096, dtype=torch.long, device=device)
    lengths = torch.arange(4096, device=device) % 997 + 5
    step = bigram_step(target, draft)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        speculate(step, last, lengths, GAMMA, "draft", s)  # warm-up (kernel compiles)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = speculate(step, last, lengths, GAMMA, "draft", s)
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(out, eager))
    assert follows(out[1][1::3, 0], target_dist(0))  # sampled rows, first token
