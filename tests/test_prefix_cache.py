"""Repeated prompts reuse their KV: same tokens, cached entry used, budget respected."""

from __future__ import annotations

import torch

from vegas_spec import SamplingParams
from vegas_spec.prefix_cache import PrefixCache


def test_repeated_prompt_hits_the_cache_and_gives_the_same_tokens(llm) -> None:
    prompt = list(range(300, 420))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = llm.generate([prompt], params)[0].token_ids
    assert tuple(prompt[:-1]) in llm.prefix_cache.entries
    calls = []
    original = llm.model.forward
    llm.model.forward = lambda ids, *a, **k: calls.append(ids.shape) or original(ids, *a, **k)
    try:
        second = llm.generate([prompt], params, speculative={"method": "vegas"})[0].token_ids
    finally:
        llm.model.forward = original
    assert second == first
    assert all(shape[1] <= 7 for shape in calls)  # no prefill chunk ran again


def test_lru_evicts_to_stay_under_budget() -> None:
    kv = [(torch.zeros(10, 1, 4), torch.zeros(10, 1, 4))]  # 320 bytes
    cache = PrefixCache(max_bytes=700)
    cache.put((1,), kv)
    cache.put((2,), kv)
    assert cache.get((1,)) is not None  # (1,) is now the most recent
    cache.put((3,), kv)
    assert set(cache.entries) == {(1,), (3,)} and cache.bytes == 640
    cache.put((4,), [(torch.zeros(100, 1, 4), torch.zeros(100, 1, 4))])  # too large: skipped
    assert (4,) not in cache.entries
