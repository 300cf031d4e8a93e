"""The packed prefill: one chunk, many chunks, several ragged prompts per forward and prefix-cache
hits all give transformers' logits, on the real model and on a tiny random one with both
backends (the Triton kernels under the interpreter on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TRITON_DEVICE  # the prefill graphs are captured where it is a GPU
from models.test_families import (
    assert_close_logits,
    build_hf,
    engine,
    hf_logits,
    random_ids,
    save,
)

from vegas_spec import SamplingParams
from vegas_spec.engine import LLM
from vegas_spec.prefill_graphs import ScoreKind, token_bucket


def _essay_ids(llm: LLM, essays: list[str], n: int) -> list[int]:
    ids = llm.tokenizer(essays[1][:6000])["input_ids"][:n]
    assert len(ids) == n
    return ids


def _count_forwards(llm: LLM, calls: list[tuple[int, ...]]):  # noqa: ANN202
    original = llm.engine.runner.model.forward

    def forward(ids, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append(tuple(ids.shape))
        return original(ids, *args, **kwargs)

    return original, forward


@pytest.mark.slow
def test_one_chunk_and_many_chunks_match_transformers(llm, hf_model, essays) -> None:
    ids = _essay_ids(llm, essays, 256)
    ref = hf_logits(hf_model, ids)
    whole = llm.logits(ids)
    chunked = llm.logits(ids, chunk=37)  # 7 chunks, whose ends fall inside pages (size 16)
    assert_close_logits(whole, ref)
    assert_close_logits(chunked, ref)
    assert torch.equal(whole.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_prefix_cache_hit_prefills_only_the_rest(llm, hf_model, essays) -> None:
    """A prompt that extends a cached one takes its full pages and prefills only the rest,
    reading the shared keys from those pages: same logits as transformers."""
    ids = _essay_ids(llm, essays, 360)
    ids[0] = 17  # a prefix no other test stores
    llm.next_token_logits([ids[:201]])  # caches its 12 full pages, positions 0..191
    calls: list[tuple[int, ...]] = []
    original, llm.engine.runner.model.forward = _count_forwards(llm, calls)
    try:
        got = llm.next_token_logits([ids])[0]
    finally:
        llm.engine.runner.model.forward = original
    assert calls == [(1, 360 - 192)]  # only the positions the cached pages do not hold
    ref = hf_logits(hf_model, ids)[-1:]
    assert_close_logits(got[None], ref)
    calls.clear()
    llm.engine.runner.model.forward = _count_forwards(llm, calls)[1]
    try:
        again = llm.next_token_logits([ids])[0]
    finally:
        llm.engine.runner.model.forward = original
    # a whole hit computes only the page of its last token (22 full pages are cached)
    assert calls == [(1, 360 - 352)]
    assert_close_logits(again[None], ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ragged_prompts_share_forwards(backend: str, tmp_path: Path) -> None:
    """Three prompts of different lengths packed into forwards of 20 tokens (each prompt cut
    across forwards at unaligned positions: the first at 20, the second at 3, the third at
    17, none a multiple of the page size 8): each prompt's next-token logits are its own."""
    model = build_hf("llama-tied")
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    llm = engine(save(model, tmp_path), prefill_chunk=20, page_size=8, backend=backend,
                 device=device, cuda_graphs=False)  # the eager path: its forwards are counted
    prompts = [random_ids(n, seed=n) for n in (37, 6, 24)]
    calls: list[tuple[int, ...]] = []
    original, llm.engine.runner.model.forward = _count_forwards(llm, calls)
    try:
        got = llm.next_token_logits(prompts)
    finally:
        llm.engine.runner.model.forward = original
    assert calls == [(1, 20), (1, 20), (1, 20), (1, 7)]  # 37 + 6 + 24 = 67 tokens
    ref = torch.stack([hf_logits(model, p)[-1] for p in prompts])
    assert_close_logits(got.cpu(), ref)


def test_triton_prefill_gives_torch_tokens(tmp_path: Path) -> None:
    """Greedy vegas output through the Triton prefill and decode kernels equals the torch
    backend's plain output on a batch of ragged prompts."""
    model = build_hf("qwen3")
    folder = save(model, tmp_path)
    prompts = [random_ids(n, seed=n) for n in (30, 13)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = engine(folder, prefill_chunk=24).generate(prompts, params)
    spec = engine(folder, prefill_chunk=24, backend="triton", device=TRITON_DEVICE).generate(
        prompts, params, speculative={"method": "vegas", "gamma": 3, "min_tokens": 8})
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fixed_shape_prefill_gives_the_same_logits(backend: str, tmp_path: Path) -> None:
    """The prefill graphs' padded buffers (run eagerly on CPU): tokens padded to a bucket,
    pieces padded with empty ones, several chunks through one buffer set, then a second
    batch of another size; each prompt's next-token logits are its own."""
    model = build_hf("qwen3")
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    llm = engine(save(model, tmp_path), prefill_chunk=30, page_size=8, backend=backend,
                 static_shapes=True, device=device)
    graphs = llm.engine.runner.prefiller.graphs
    assert graphs is not None
    if not graphs.capture:
        graphs.pad_to = 16  # pad on CPU too, as the captured graphs do
    for lengths in [(37, 6, 30), (20,)]:
        prompts = [random_ids(n, seed=n + 1) for n in lengths]
        got = llm.next_token_logits(prompts)
        ref = torch.stack([hf_logits(model, p)[-1] for p in prompts])
        assert_close_logits(got.cpu(), ref)
    # chunks of 30, 30 (3 pieces), 13 tokens; then 20: buckets 32, 32, 16, 24 (all padded)
    chunks = [(30, 1), (30, 4), (13, 1), (20, 1)]
    assert {key[:2] for key in graphs.entries} == {(token_bucket(n, graphs.pad_to), s)
                                                   for n, s in chunks}
    assert all((e.graph is not None) == graphs.capture for e in graphs.entries.values())


def test_fixed_shape_prefill_scores_and_tokens(tmp_path: Path) -> None:
    """Greedy vegas through the fixed-shape prefill (first selection scored inside it) and
    the fixed-shape decode loop equals plain decoding."""
    model = build_hf("llama-tied")
    folder = save(model, tmp_path)
    prompts = [random_ids(n, seed=n) for n in (30, 18)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    plain = engine(folder).generate(prompts, params)
    static = engine(folder, static_shapes=True, prefill_chunk=24, max_model_len=48,
                    backend="triton", device=TRITON_DEVICE)
    for method in ("vegas", "lastq"):
        outs = static.generate(prompts, params,
                               speculative={"method": method, "gamma": 3, "min_tokens": 8})
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], method


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "fixed-shape"])
def test_mixed_prefix_hits_give_plain_tokens(static: bool, tmp_path: Path) -> None:
    """One batch holding a whole prefix-cache hit, a prompt that extends a cached one and a
    miss, decoded with vegas (each first selection scored over the shared pages' keys): the
    tokens of plain decoding without a cache."""
    model = build_hf("qwen2")
    folder = save(model, tmp_path)
    a, b, c = (random_ids(n, seed=n + 7) for n in (50, 41, 33))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [a, b + random_ids(12, seed=3), c]
    plain = engine(folder).generate(prompts, params)
    cached = engine(folder, prefix_cache_bytes=1 << 24, static_shapes=static, prefill_chunk=32)
    cached.generate([a, b], params)
    calls: list[tuple[int, ...]] = []
    original, cached.engine.runner.model.forward = _count_forwards(cached, calls)
    try:
        outs = cached.generate(prompts, params, speculative={"method": "vegas", "gamma": 3,
                                                             "min_tokens": 8})
    finally:
        cached.engine.runner.model.forward = original
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    if not static:  # past the cached full pages: 2 tokens of a (48 cached), 21 of b's
        # extension (32 cached) and 33 of c, in chunks of 32
        assert [c for c in calls if c[1] > 4][:2] == [(1, 32), (1, 24)]


def test_warm_up_makes_every_prefill_shape_first(tmp_path: Path) -> None:
    """`warm_up` makes the forward of every (token bucket, piece bucket) a chunk of the
    method can fall in; a batch of ragged prompts then runs on those alone (none is made
    later) and decodes plain decoding's tokens. Every token bucket of one piece count shares
    its output tensors."""
    folder = save(build_hf("qwen3"), tmp_path)
    prompts = [random_ids(n, seed=n + 1) for n in (97, 6, 64)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = engine(folder).generate(prompts, params)
    llm = engine(folder, prefill_chunk=60, page_size=8, static_shapes=True,
                 speculative={"method": "vegas", "gamma": 3, "min_tokens": 8})
    graphs = llm.engine.runner.prefiller.graphs
    assert graphs is not None
    graphs.pad_to = 16  # pad on CPU too, as the captured graphs do
    # tokens 16, 24, 32, 48, 64 (the bucket of the 60-token budget); pieces 1, 2, 4
    assert graphs.buckets(60, 3) == [(t, s) for t in (16, 24, 32, 48, 64) for s in (1, 2, 4)]
    assert llm.engine.warm_up(3) == 15
    assert llm.engine.warm_up(3) == 0  # made once
    made = set(graphs.entries)
    assert {kind for _, _, kind in made} == {ScoreKind("weight", False)}
    outs = llm.generate(prompts, params)
    assert set(graphs.entries) == made
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    kind = ScoreKind("weight", False)
    shared = {id(graphs.entries[t, 4, kind].out.logits) for t in (16, 24, 32, 48, 64)}
    assert len(shared) == 1


def test_token_buckets_up_to_the_budget() -> None:
    """The buckets `warm` makes at the default 512-token step: every rung of the ladder up to
    the one that holds the budget."""
    from vegas_spec.prefill_graphs import PrefillGraphs

    graphs = PrefillGraphs.__new__(PrefillGraphs)
    graphs.pad_to = 512
    rungs = sorted({t for t, _ in graphs.buckets(32768, 1)})
    assert rungs == [512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576,
                     32768]
    assert sorted({t for t, _ in graphs.buckets(5000, 1)})[-1] == 6144
    assert {s for _, s in graphs.buckets(1024, 5)} == {1, 2, 4, 8}
    graphs.pad_to = None
    assert graphs.buckets(1024, 5) == []
