"""Repeated prompts reuse their KV: same tokens, cached entry used, budget respected."""

from __future__ import annotations

import torch

from vegas_spec import SamplingParams
from vegas_spec.prefix_cache import PrefixCache, PrefixEntry


def test_repeated_prompt_hits_the_cache_and_gives_the_same_tokens(llm) -> None:
    prompt = list(range(300, 420))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = llm.generate([prompt], params)[0].token_ids
    assert tuple(prompt) in llm.engine.runner.prefiller.prefix.entries
    calls = []
    model = llm.engine.runner.model
    original = model.forward
    model.forward = lambda ids, *a, **k: calls.append(ids.shape) or original(ids, *a, **k)
    try:
        second = llm.generate([prompt], params, speculative={"method": "vegas"})[0].token_ids
    finally:
        model.forward = original
    assert second == first
    assert all(shape[1] <= 7 for shape in calls)  # no prefill chunk ran again, only decoding


def _entry(tokens: int) -> PrefixEntry:
    kv = [(torch.zeros(tokens, 1, 4), torch.zeros(tokens, 1, 4))]  # 32 bytes per token
    return PrefixEntry(kv, torch.zeros(10), torch.zeros(1, 1, 6))  # + 40 + 24 bytes


def test_lru_evicts_to_stay_under_budget() -> None:
    cache = PrefixCache(max_bytes=800)
    cache.put((1,), _entry(10))  # 384 bytes
    cache.put((2,), _entry(10))
    assert cache.get((1,)) is not None  # (1,) is now the most recent
    cache.put((3,), _entry(10))
    assert set(cache.entries) == {(1,), (3,)} and cache.bytes == 768
    cache.put((4,), _entry(100))  # too large: skipped
    assert (4,) not in cache.entries


def test_longest_stored_prefix_wins() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    for key in [(5, 6), (5, 6, 7, 8), (5, 9, 7)]:
        cache.put(key, _entry(len(key)))
    assert cache.longest([5, 6, 7, 8, 1])[0] == 4
    assert cache.longest([5, 6, 7])[0] == 2  # (5, 6, 7, 8) is longer than the prompt
    assert cache.longest([5, 6, 7, 8])[1] is cache.entries[(5, 6, 7, 8)]  # a whole hit
    assert cache.longest([6, 5]) == (0, None)
