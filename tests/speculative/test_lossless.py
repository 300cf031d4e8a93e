"""End to end on the real SmolLM2 model with Paul Graham essays as context: the greedy output
of every method and every vegas variant is token-identical to plain decoding, for a batch of
prompts of different lengths (1,000 to 1,350 tokens)."""

from __future__ import annotations

import pytest
from conftest import SHARED_BATCH, SPEC_VARIANTS, essay_prompt, kv_bytes

from vegas_spec import SamplingParams, SpecConfig

MAX_TOKENS = 16  # after the prefill's token, at least three rounds of gamma 6 per row


@pytest.fixture(scope="module")
def prompts(llm, essays) -> list[list[int]]:
    return [essay_prompt(llm.tokenizer, essays, n, offset)
            for n, offset in ((1000, 0), (1150, 7), (1350, 19))]


@pytest.fixture(scope="module")
def plain(llm, prompts):
    return llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


@pytest.mark.parametrize("variant", SPEC_VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
def test_greedy_speculative_equals_plain(llm, prompts, plain, variant) -> None:
    # min_tokens 32 keeps the budget at ~3% of these contexts, so drafts really are sparse.
    spec = SpecConfig(gamma=6, ratio=0.02, min_tokens=32, **variant)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                        speculative=spec)
    assert len({len(p) for p in prompts}) == len(prompts) >= 3
    for out, ref in zip(outs, plain):
        assert out.token_ids == ref.token_ids
        assert len(out.token_ids) == MAX_TOKENS
    stats = outs[0].stats
    assert 1.0 <= stats["tokens_per_iteration"] <= 7.0
    assert sum(stats["tokens_per_iteration_histogram"]) == stats["iterations"]
    if variant["method"] == "full":
        assert stats["acceptance_rate_per_position"] == [1.0] * 6
    else:
        assert stats["budget_mean"] < 0.1 * len(prompts[-1])


# vegas and lastq keeping local context (SpecConfig window, pool), each setting on the dynamic
# path, and vegas's once on the static shapes' too (fixed-shape buffers, host bounds; lastq's
# plan is the same code, tests/test_graphs.py runs it captured).
LOCAL = [({"method": "vegas", "window": 64, "pool": 7}, False),
         ({"method": "vegas", "window": 32, "pool": 3}, True),
         ({"method": "lastq", "window": 64, "pool": 7}, False),
         ({"method": "lastq", "window": 32, "pool": 3}, False)]


@pytest.fixture(scope="module")
def static_llm():
    """The embedded model on the static shapes' fixed buffers (eager on CPU)."""
    from vegas_spec.engine import LLM

    return LLM(kv_cache_bytes=kv_bytes(SHARED_BATCH), static_shapes=True, max_model_len=1536)


@pytest.mark.parametrize("variant,static", LOCAL,
                         ids=[f"{v['method']}-w{v['window']}-p{v['pool']}-"
                              f"{'static' if s else 'dynamic'}" for v, s in LOCAL])
def test_local_context_selection_equals_plain(request, prompts, plain, variant,
                                              static: bool) -> None:
    """A budget of 8% (80-108 tokens here) above the window, so that the pooled top-k
    chooses too."""
    engine = request.getfixturevalue("static_llm" if static else "llm")
    spec = SpecConfig(gamma=6, ratio=0.08, min_tokens=64, **variant)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                           speculative=spec)
    assert (engine.engine.runner.graphs is not None) == static
    for out, ref in zip(outs, plain):
        assert out.token_ids == ref.token_ids
    stats = outs[0].stats
    assert variant["window"] < stats["budget_mean"] < 0.1 * len(prompts[-1])
    assert 1.0 <= stats["tokens_per_iteration"] <= 7.0


def test_rejected_drafts_do_not_leak(llm, prompts, plain) -> None:
    """γ larger than the accepted run length forces rejections every iteration; a stale
    draft K/V read by a later step would change the tokens."""
    spec = SpecConfig(method="stream", gamma=12, ratio=0.01, min_tokens=16, sink=1)
    outs = llm.generate(prompts[:1], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                        speculative=spec)
    assert outs[0].token_ids == plain[0].token_ids
    assert outs[0].stats["tokens_per_iteration"] < 13 - 1
