"""The prefix cache shares pages: a prompt that starts with cached full pages takes them by
reference and prefills only the rest, with the tokens it gets without the cache, for every
method; the pages of a prefix held by many sequences are counted once, a hit writes nothing
into them, and cached pages go back to use when the pool needs them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    TINY_ENGINE,
    TINY_IDS,
    TINY_LLAMA,
    TINY_METHODS,
    TINY_VOCAB,
    config_folder,
    random_prompts,
    tiny_spec,
)

from vegas_spec import SamplingParams
from vegas_spec.engine import LLM, LLMEngine
from vegas_spec.pages import PageAllocator
from vegas_spec.prefix_cache import PrefixCache, page_names, shareable

PAGE = 16  # the engine's default page size
PREFIX = 100  # tokens of the shared prefix: six full pages and four tokens into the seventh


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return config_folder(tmp_path_factory, "tiny-llama", TINY_LLAMA)


@pytest.fixture(scope="module")
def prefix() -> list[int]:
    return random_prompts(3, (PREFIX,), TINY_VOCAB)[0]


@pytest.fixture(scope="module")
def prompts(prefix: list[int]) -> list[list[int]]:
    """The prefix alone, then three prompts extending it (the first ends on a page's end)."""
    tails = random_prompts(4, (12, 5, 30), TINY_VOCAB)
    return [prefix] + [prefix + t for t in tails]


def params(n: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def alone(tiny: Path, prompts: list[list[int]], method: dict | None,
          n: int = 10) -> list[list[int]]:
    """Each prompt by itself, without a prefix cache: the reference."""
    llm = LLM(str(tiny), **TINY_ENGINE)
    return [llm.generate([p], params(n), speculative=tiny_spec(method))[0].token_ids
            for p in prompts]


def forward_tokens(llm: LLM | LLMEngine) -> list[int]:
    """Spy on the model: the tokens of every forward are appended to the returned list."""
    engine = llm.engine if isinstance(llm, LLM) else llm
    model, seen = engine.runner.model, []
    original = model.forward
    model.forward = lambda ids, *a, **k: seen.append(ids.numel()) or original(ids, *a, **k)
    return seen


# --- pages and names, on the host ---------------------------------------------------------


def test_names_chain_the_whole_prefix() -> None:
    a, b = list(range(40)), list(range(40))
    b[20] = 99  # second page differs
    na, nb = page_names(a, 8, 5), page_names(b, 8, 5)
    assert na[:2] == nb[:2] and all(x != y for x, y in zip(na[2:], nb[2:]))
    c = list(range(8, 16)) + list(range(8))  # a page's tokens alone do not make its name
    assert page_names(c, 8, 2)[1] != na[0]
    assert [shareable(n, 8) for n in (1, 8, 9, 16, 17)] == [0, 0, 1, 1, 2]


def test_shared_pages_are_counted_by_reference_and_parked_when_unheld() -> None:
    pool = PageAllocator(8, 4, 1, PrefixCache(4, max_parked=8))
    ids = list(range(13))
    a = pool.take(4)
    pool.name(ids, a, 13)  # three full pages named, the fourth (one token) not
    assert pool.cached_prefix(ids) == a[:3] and pool.cached_prefix(ids[:12]) == a[:2]
    hit = pool.cached_prefix(ids)
    pool.share(hit)
    assert [pool.refs[p] for p in a] == [2, 2, 2, 1] and pool.used == 4
    pool.release(a)  # the named pages stay held by the sharer; the fourth is free
    assert pool.num_free == 5 and pool.used == 3
    pool.release(hit)  # no one holds them: parked, still free to take, still cached
    assert pool.num_free == 8 and sorted(pool.free_pages) == list(range(8))
    assert pool.cached_prefix(ids) == hit and pool.unheld(hit) == 3


def test_free_pages_go_first_then_the_least_recently_parked() -> None:
    prefix = PrefixCache(4, max_parked=8)
    pool = PageAllocator(6, 4, 1, prefix)
    x, y = list(range(100, 108)), list(range(200, 208))
    px, py = pool.take(2), pool.take(2)
    pool.name(x, px, 8)
    pool.name(y, py, 8)
    pool.release(px)
    pool.release(py)
    assert pool.take(2) and prefix.stats.evicted == 0  # the two never-named pages
    taken = pool.take(2)  # x was parked first: its pages go, from its end
    assert sorted(taken) == sorted(px) and prefix.stats.evicted == 2
    assert pool.cached_prefix(x + [1]) == [] and pool.cached_prefix(y + [1]) == py


def test_at_most_max_parked_pages_stay_cached() -> None:
    pool = PageAllocator(8, 4, 1, PrefixCache(4, max_parked=2))
    ids = list(range(17))
    pages = pool.take(5)
    pool.name(ids, pages, 17)
    pool.release(pages)
    assert pool.num_free == 8 and pool.cached_prefix(ids) == pages[:2]


# --- the engine ---------------------------------------------------------------------------


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("method", TINY_METHODS, ids=TINY_IDS)
def test_hits_give_the_tokens_of_no_cache(tiny: Path, prompts: list[list[int]],
                                          method: dict | None, static: bool) -> None:
    """The prefix is cached first; then prompts that extend it (hits ending mid-page: its
    six full pages of 100 tokens), the prefix again (its last page computed again) and a
    miss decode together: each gets its alone tokens, and prefills only past its hit."""
    want = alone(tiny, prompts, method)
    llm = LLM(str(tiny), prefix_cache_bytes=1 << 20, static_shapes=static, **TINY_ENGINE)
    pool = llm.engine.scheduler.pool
    assert llm.generate([prompts[0]], params(), speculative=tiny_spec(method))[0].token_ids \
        == want[0]
    seen = forward_tokens(llm)
    batch = prompts[1:] + [prompts[0]]
    outs = llm.generate(batch, params(), speculative=tiny_spec(method))
    assert [o.token_ids for o in outs] == want[1:] + want[:1]
    full = shareable(PREFIX, PAGE) * PAGE  # 96
    assert pool.prefix.stats.hit == full * len(batch)
    if not static:  # one prefill forward of every prompt's tokens past the cached 96
        assert seen[0] == sum(len(p) - full for p in batch)


def test_a_hit_takes_the_pages_and_writes_nothing_into_them(
        tiny: Path, prompts: list[list[int]]) -> None:
    """A second sequence with the prefix, arriving while the first decodes: it holds the
    first one's pages (two references each), whose K/V no step of it changes; both get
    their alone tokens."""
    want = alone(tiny, prompts[1:3], None, 24)
    engine = LLMEngine(str(tiny), prefix_cache_bytes=1 << 20, **TINY_ENGINE)
    pool, layers = engine.scheduler.pool, engine.runner.cache.layers
    first = engine.add_request(prompts[1], params(24))
    outs = {o.request_id: o for o in engine.step()}
    a = engine.seqs[first]
    shared = a.pages[: shareable(PREFIX, PAGE)]
    slots = torch.tensor([p * PAGE + i for p in shared for i in range(PAGE)])
    before = [(k[slots].clone(), v[slots].clone()) for k, v in layers]
    seen = forward_tokens(engine)
    second = engine.add_request(prompts[2], params(24))
    outs.update({o.request_id: o for o in engine.step()})
    b = engine.seqs[second]
    assert b.pages[: len(shared)] == shared and b.cached == len(shared) * PAGE
    assert all(pool.refs[p] == 2 for p in shared)
    assert not set(a.pages[len(shared):]) & set(b.pages[len(shared):])
    assert seen[0] == len(prompts[2]) - b.cached  # only its own positions were computed
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert [outs[first].token_ids, outs[second].token_ids] == want
    for (k0, v0), (k, v) in zip(before, layers):
        assert torch.equal(k[slots], k0) and torch.equal(v[slots], v0)
    assert all(pool.refs[p] == 0 for p in shared) and pool.used == 0


@pytest.mark.parametrize("method", [None, {"method": "vegas"}, {"method": "quest"}],
                         ids=["vanilla", "vegas", "quest"])
def test_a_hit_then_preemption_gives_the_alone_tokens(
        tiny: Path, prompts: list[list[int]], method: dict | None) -> None:
    """Three requests sharing the prefix outgrow a small pool as they decode: the newest
    are preempted (dropping their references), come back with the cached prefix and
    resume; every page is back at the end, the cached ones parked."""
    n = 60
    want = alone(tiny, prompts[1:], method, n)
    page_bytes = LLM(str(tiny), **TINY_ENGINE).engine.runner.cache.bytes_per_page
    engine = LLMEngine(str(tiny), speculative=tiny_spec(method), max_num_seqs=3,
                       load_format="dummy", kv_cache_bytes=16 * page_bytes,
                       prefix_cache_bytes=1 << 20)
    engine.scheduler.grow_tokens = 4
    pool, final = engine.scheduler.pool, {}
    rids = [engine.add_request(p, params(n)) for p in prompts[1:]]
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
        held = {p for s in engine.scheduler.running for p in s.pages}
        assert len(held) + pool.num_free == pool.num_pages  # a shared page counted once
        assert sum(pool.refs) == sum(len(s.pages) for s in engine.scheduler.running)
    assert [final[r].token_ids for r in rids] == want
    assert engine.num_preemptions > 0 and pool.prefix.stats.hit > 0
    assert pool.used == 0 and pool.num_free == pool.num_pages


def test_cached_pages_are_evicted_when_the_pool_needs_them(tiny: Path) -> None:
    """A pool of 20 pages: a cached prompt's pages are taken by requests that need the
    whole pool (least recently parked first, a prefix from its end), and the prompt then
    runs again from what is left of it, with the same tokens."""
    a, b, c = random_prompts(9, (120, 150, 150), TINY_VOCAB)
    want = alone(tiny, [a, b, c], None)
    page_bytes = LLM(str(tiny), **TINY_ENGINE).engine.runner.cache.bytes_per_page
    llm = LLM(str(tiny), load_format="dummy", kv_cache_bytes=20 * page_bytes,
              prefix_cache_bytes=1 << 20)
    pool = llm.engine.scheduler.pool
    assert llm.generate([a], params())[0].token_ids == want[0]
    assert len(pool.cached_prefix(a)) == shareable(len(a), PAGE) == 7
    assert [o.token_ids for o in llm.generate([b, c], params())] == want[1:]
    # evicted from the prefix's end: what is left of it is still a prefix
    assert pool.prefix.stats.evicted > 0 and len(pool.cached_prefix(a)) < 7
    assert llm.generate([a], params())[0].token_ids == want[0]
    assert pool.used == 0


def test_many_requests_hold_the_prefix_once(tiny: Path) -> None:
    """64 requests sharing a 200-token prefix in a pool that holds the prefix's pages once
    and each request's own pages (not 64 copies of the prefix): after the first computes the
    prefix, all the others run at once beside it, and their tokens are their alone ones."""
    prefix = random_prompts(5, (200,), TINY_VOCAB)[0]
    tails = random_prompts(6, (8,) * 64, TINY_VOCAB)
    batch, n = [prefix + t for t in tails], 4
    llm = LLM(str(tiny), **TINY_ENGINE)
    want = [o.token_ids for o in llm.generate(batch[:8], params(n))]
    probe = LLMEngine(str(tiny), **TINY_ENGINE)
    seq = probe.sequence(batch[0], params(n))
    pages = probe.scheduler.footprint(seq)  # what one request holds, prefix included
    shared = shareable(len(batch[0]), PAGE)
    need = shared + 64 * (pages - shared)
    bytes_per_page = probe.runner.cache.bytes_per_page
    engine = LLMEngine(str(tiny), load_format="dummy", prefix_cache_bytes=1 << 20,
                       kv_cache_bytes=(need + need // 50 + 2) * bytes_per_page)
    assert 64 * pages > engine.scheduler.pool.num_pages  # no room for 64 prefixes
    rids = [engine.add_request(p, params(n)) for p in batch]
    final, most = {}, 0
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
        most = max(most, engine.num_running)
        if engine.num_running == 64:
            held = {p for s in engine.scheduler.running for p in s.pages}
            assert len(held) == need
    assert most == 64 and engine.num_preemptions == 0
    assert [final[r].token_ids for r in rids[:8]] == want
    assert engine.scheduler.pool.prefix.stats.hit == 63 * shared * PAGE


def test_prefix_cache_off_shares_nothing(tiny: Path, prompts: list[list[int]]) -> None:
    llm = LLM(str(tiny), **TINY_ENGINE)
    llm.generate(prompts[:2], params())
    pool = llm.engine.scheduler.pool
    assert pool.prefix is None and pool.cached_prefix(prompts[1]) == []
    assert pool.num_free == pool.num_pages


def test_next_token_logits_reuse_the_prefix(tiny: Path, prompts: list[list[int]]) -> None:
    """`next_token_logits` takes a cached prefix too, and leaves its pages cached."""
    llm = LLM(str(tiny), prefix_cache_bytes=1 << 20, **TINY_ENGINE)
    plain = LLM(str(tiny), **TINY_ENGINE).next_token_logits(prompts[1:])
    llm.next_token_logits([prompts[0]])
    seen: list[Any] = forward_tokens(llm)
    got = llm.next_token_logits(prompts[1:])
    torch.testing.assert_close(got, plain)
    assert seen == [sum(len(p) - 96 for p in prompts[1:])]
    assert llm.engine.scheduler.pool.used == 0
