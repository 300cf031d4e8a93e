"""The engine's step loop on a tiny random model: requests that arrive while others decode,
more requests than rows, prompts prefilled in chunks between decode iterations, aborts. Every
greedy output must be the one its request gives alone, on the dynamic path and on the static
buffers (whose rows move when sequences leave), and every page must come back."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    TINY_ENGINE,
    TINY_IDS,
    TINY_LLAMA,
    TINY_METHODS,
    TINY_VOCAB,
    TRITON_DEVICE,
    config_folder,
    random_prompts,
    tiny_spec,
)

from vegas_spec import SamplingParams
from vegas_spec.engine import LLM, LLMEngine, RequestOutput
from vegas_spec.scheduler import PrefillPacer
from vegas_spec.step import Runner, StepPlan

VOCAB, CONFIG, ENGINE = TINY_VOCAB, TINY_LLAMA, TINY_ENGINE
METHODS, IDS = TINY_METHODS, TINY_IDS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return config_folder(tmp_path_factory, "tiny-llama", CONFIG)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(1, (20, 45, 70, 33, 90), VOCAB)


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


MAX_TOKENS = (12, 5, 9, 16, 7)


@pytest.fixture(scope="module")
def alone(tiny: Path, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    """Each request run by itself, per method: the reference of every batch below."""
    llm = LLM(str(tiny), **ENGINE)
    return {name: [llm.generate([p], params(n), speculative=tiny_spec(m))[0].token_ids
                   for p, n in zip(prompts, MAX_TOKENS, strict=True)]
            for name, m in zip(IDS, METHODS, strict=True)}


def run_staggered(engine: LLMEngine, prompts: list[list[int]], arrivals: list[int],
                  ) -> tuple[dict[str, list[int]], dict[str, list[RequestOutput]]]:
    """Request i is added before step arrivals[i]; -> the final ids and every output."""
    step, ids, outs = 0, {}, {}
    while len(ids) < len(prompts) or engine.has_unfinished():
        for i, at in enumerate(arrivals):
            if at == step:
                ids[engine.add_request(prompts[i], params(MAX_TOKENS[i]))] = i
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        step += 1
    return {rid: outs[rid][-1].token_ids for rid in ids}, outs


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_requests_joining_and_leaving_give_their_alone_tokens(
        tiny: Path, prompts: list[list[int]], alone: dict[str, list[list[int]]],
        method: dict[str, Any] | None, static: bool) -> None:
    """Requests arrive while others decode and leave at different steps: rows join with
    their own first plan, survivors keep theirs; no output changes."""
    engine = LLMEngine(str(tiny), speculative=tiny_spec(method), static_shapes=static,
                       max_num_seqs=4, **ENGINE)
    engine.runner.reserve(4)
    free = len(engine.runner.cache.free_pages)
    ids, outs = run_staggered(engine, prompts, [0, 0, 2, 3, 5])
    want = alone[IDS[METHODS.index(method)]]
    assert [ids[rid] for rid in sorted(ids, key=lambda r: int(r.split("-")[1]))] == want
    for steps in outs.values():  # deltas add up to the output, finished once at the end
        assert sum((o.delta_token_ids for o in steps), []) == steps[-1].token_ids
        assert [o.finished for o in steps] == [False] * (len(steps) - 1) + [True]
        # ids and stats read only now are the ones each output's step gave
        deltas = [o.delta_token_ids for o in steps]
        assert [o.token_ids for o in steps] == list(itertools.accumulate(deltas))
        iterations = [o.stats["sequence"]["iterations"] for o in steps]
        assert iterations == list(range(iterations[0], iterations[-1] + 1))
    assert any(len(steps) > 2 for steps in outs.values())  # running outputs were read late
    assert len(engine.runner.cache.free_pages) == free and not engine.seqs
    assert engine.runner.batch is None or engine.runner.batch.ids == engine.scheduler.leaving
    engine.release_rows()  # the last rows leave, as before a call that needs an idle runner
    assert engine.runner.batch is None and not engine.scheduler.leaving


def test_more_prompts_than_rows_queue_and_equal_alone(tiny: Path, prompts: list[list[int]],
                                                      alone: dict[str, list[list[int]]]) -> None:
    llm = LLM(str(tiny), max_num_seqs=2, static_shapes=True, **ENGINE)
    seen: list[int] = []
    step = llm.engine.step

    def counting(collect: bool = True, **kw: Any) -> list[RequestOutput]:
        seen.append(llm.engine.num_running)
        return step(collect, **kw)

    llm.engine.step = counting  # type: ignore[method-assign]
    outs = llm.generate(prompts, [params(n) for n in MAX_TOKENS],
                        speculative=tiny_spec({"method": "vegas"}))
    assert [o.token_ids for o in outs] == alone["vegas"]
    graphs = llm.engine.runner.graphs
    assert max(seen) <= 2 and graphs is not None and graphs.capacity == 2


@pytest.mark.parametrize("static", [False, True])
def test_offline_rows_decode_once_every_admitted_prompt_is_prefilled(
        tiny: Path, prompts: list[list[int]], alone: dict[str, list[list[int]]],
        static: bool) -> None:
    """generate prefills first: in chunks of 32 tokens the five prompts (258 tokens) take
    nine steps, none of which decodes while an admitted prompt is still being prefilled; every
    request gets its tokens alone."""
    llm = LLM(str(tiny), prefill_chunk=32, static_shapes=static, **ENGINE)
    engine = llm.engine
    decoded = engine._decoded
    during: list[tuple[bool, int]] = []

    def spy(result: Any, touched: dict, info: Any) -> None:
        during.append((engine.scheduler.prefilling(), engine.num_running))
        decoded(result, touched, info)

    engine._decoded = spy  # type: ignore[method-assign]
    outs = llm.generate(prompts, [params(n) for n in MAX_TOKENS],
                        speculative=tiny_spec({"method": "vegas"}))
    assert [o.token_ids for o in outs] == alone["vegas"]
    assert during and not any(busy for busy, _ in during)
    assert during[0][1] == len(prompts)  # the first decode runs every row


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(
        tiny: Path, prompts: list[list[int]], alone: dict[str, list[list[int]]]) -> None:
    """prefill_chunk 32: the 90-token prompt takes three steps, and the running request gets
    tokens in each of them."""
    engine = LLMEngine(str(tiny), speculative=tiny_spec({"method": "vegas"}), prefill_chunk=32,
                       **ENGINE)
    first = engine.add_request(prompts[3], params(MAX_TOKENS[3]))
    engine.step()  # 33 tokens: 32, then 1 and the first token, in two steps
    engine.step()
    late = engine.add_request(prompts[4], params(MAX_TOKENS[4]))
    got = []
    for _ in range(3):
        outs = {o.request_id: o for o in engine.step()}
        got.append((len(outs[first].delta_token_ids) if first in outs else 0, late in outs))
    assert got[0][0] > 0 and got[1][0] > 0  # decoding went on while the prompt prefilled
    assert [arrived for _, arrived in got] == [False, False, True]
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step()})
    assert final[late].token_ids == alone["vegas"][4]


def test_paced_prefill_takes_the_pacers_budget_while_others_decode(
        tiny: Path, prompts: list[list[int]], alone: dict[str, list[list[int]]]) -> None:
    """With prefill pacing, a step prefills at most the pacer's budget (here 30 tokens) while
    a row decodes, the whole prompt when nothing decodes, and outputs stay the ones of each
    request alone."""

    class Thirty(PrefillPacer):
        def budget(self, decoding: bool) -> int:
            return 30 if decoding else self.ceiling

    engine = LLMEngine(str(tiny), speculative=tiny_spec({"method": "vegas"}), prefill_pacing=1.0,
                       **ENGINE)
    assert engine.pacer is not None
    first = engine.add_request(prompts[3], params(MAX_TOKENS[3]))
    engine.step()
    assert engine.last_step.prefill_tokens == len(prompts[3])  # nothing decoding: all of it
    engine.pacer = Thirty(ceiling=engine.pacer.ceiling)
    late = engine.add_request(prompts[4], params(MAX_TOKENS[4]))
    final: dict[str, RequestOutput] = {}
    prefilled = []
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step()})
        prefilled.append(engine.last_step.prefill_tokens)
    assert prefilled[:3] == [30, 30, 30] and sum(prefilled) == len(prompts[4])
    assert final[first].token_ids == alone["vegas"][3]
    assert final[late].token_ids == alone["vegas"][4]


def test_a_paced_steps_prefill_part_holds_its_prefills_device_time(
        tiny: Path, prompts: list[list[int]]) -> None:
    """A step that prefills a chunk completing no prompt (nothing read back: on a GPU the
    device runs it behind the host) while a row decodes: its prefill part holds at least
    the prefill's device time (the phase timer's), so adaptive speculation does not weigh it
    as the iteration's; on the GPU where there is one (CPU: the host's times)."""
    engine = LLMEngine(str(tiny), speculative=tiny_spec({"method": "vegas"}), prefill_chunk=16,
                       device=TRITON_DEVICE, static_shapes=True, **ENGINE)
    engine.reserve(2)  # static buffers (as on CUDA) of two rows: the second prompt joins
    engine.add_request(prompts[0], params(40))
    while not engine.last_step.emitted:
        engine.step()
    engine.add_request(prompts[4], params(4))  # 90 tokens: five chunks of 16, then the rest
    timer = engine.runner.timer
    for _ in range(3):
        before = timer.totals["prefill"]
        engine.step()
        step = engine.last_step
        assert step.prefill_tokens == 16 and step.emitted  # a chunk, and an iteration
        assert timer.totals["prefill"] - before <= step.prefill_seconds < step.seconds


def test_a_step_is_one_plan_of_plain_data(tiny: Path, prompts: list[list[int]],
                                          alone: dict[str, list[list[int]]]) -> None:
    """Every step reaches the runner as exactly one `execute` whose plan is host data only
    (it pickles, as tensor parallelism broadcasts it, and holds no Sequence); the rows that
    finish leave with the next plan, the last ones (no row left in use) with `release_rows`,
    outside any step, and the runner's rows are request ids."""
    engine = LLMEngine(str(tiny), speculative=tiny_spec({"method": "vegas"}), **ENGINE)
    assert isinstance(engine.runner, Runner)
    plans: list[StepPlan] = []
    execute = engine.runner.execute

    def recording(plan: StepPlan) -> Any:
        plans.append(plan)
        return execute(plan)

    engine.runner.execute = recording  # type: ignore[method-assign]
    rids = [engine.add_request(p, params(n)) for p, n in zip(prompts[:2], MAX_TOKENS[:2])]
    final: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step()})
        steps += 1
        if engine.runner.batch is not None:  # the rows that finished are still there
            held = [r for r in engine.runner.batch.ids if r not in engine.scheduler.leaving]
            assert held == [s.request_id for s in engine.scheduler.rows]
    assert [final[r].token_ids for r in rids] == alone["vegas"][:2]
    assert len(plans) == steps and plans[-1].decode
    last = engine.scheduler.leaving
    assert sorted([r for p in plans for r in p.leave] + last) == sorted(rids)
    assert rids[0] in last and engine.runner.batch.ids == last  # the longer one finishes last
    engine.release_rows()
    assert len(plans) == steps and not engine.scheduler.leaving
    assert b"Sequence" not in pickle.dumps(plans) and engine.runner.batch is None


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("method", ["vegas", "quest"])
def test_abort_frees_the_row_and_pages_before_the_next_step(
        tiny: Path, prompts: list[list[int]], alone: dict[str, list[list[int]]], method: str,
        static: bool) -> None:
    """One request is aborted while it decodes, one while it waits for a row: both give their
    pages back at once, the decoding one's row leaves before the next iteration (the others
    keep the plans already made for them) and neither gives another output."""
    engine = LLMEngine(str(tiny), speculative=tiny_spec({"method": method}),
                       static_shapes=static, max_num_seqs=3, **ENGINE)
    cache = engine.runner.cache
    free = len(cache.free_pages)
    rids = [engine.add_request(p, params(n)) for p, n in zip(prompts[:3], (40, 5, 9))]
    queued = engine.add_request(prompts[3], params(5))
    engine.step()
    engine.step()
    assert engine.num_waiting == 1 and engine.num_running == 3 and engine.runner.rows == 3
    gone = engine.seqs[rids[0]]
    held = len(gone.pages)
    before = len(cache.free_pages)
    assert engine.abort(rids[0]) and engine.abort(queued)
    assert not engine.abort("no-such-request") and not engine.abort(rids[0])
    assert engine.num_waiting == 0 and engine.num_running == 2
    assert len(cache.free_pages) == before + held and not gone.pages
    batch = engine.runner.batch
    assert batch is not None and rids[0] not in batch.ids
    if static:
        assert engine.runner.graphs is not None and engine.runner.graphs.rows == 2
    decoded = []
    execute = engine.runner.execute

    def recording(plan: StepPlan) -> Any:
        out = execute(plan)
        decoded.append(out.rows)
        return out

    engine.runner.execute = recording  # type: ignore[method-assign]
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step()})
    assert decoded and all(rids[0] not in rows for rows in decoded)
    assert rids[0] not in final and queued not in final
    assert [final[r].token_ids for r in rids[1:]] == alone[method][1:3]
    engine.release_rows()
    assert len(cache.free_pages) == free and engine.runner.batch is None


def test_offline_buffers_are_sized_for_the_largest_batch_the_prompts_form(
        tiny: Path, prompts: list[list[int]]) -> None:
    """A long prompt first takes most of the pool, so the first admission is two rows; once it
    finishes, the four short ones run together. The buffers are made once, before the first
    step, for the four (not the first admission's two), and every output is its alone one."""
    spec = tiny_spec({"method": "vegas"})
    probe = LLM(str(tiny), static_shapes=True, **ENGINE)
    page_bytes = probe.engine.runner.cache.bytes_per_page
    long_prompt = [3 + i % (VOCAB - 3) for i in range(400)]
    work = [(long_prompt, 4)] + [(p, 12) for p in prompts[:4]]
    want = [probe.generate([p], params(n), speculative=spec)[0].token_ids for p, n in work]
    need = [probe.engine.runner.cache.pages_for(len(p) + n + spec.gamma + 1) for p, n in work]
    del probe
    pool = need[0] + need[1]  # the long one and one short one; later all four short ones
    assert sum(need[1:]) <= pool < need[0] + need[1] + need[2]
    llm = LLM(str(tiny), static_shapes=True, max_num_seqs=8, load_format="dummy",
              kv_cache_bytes=(pool + 1) * page_bytes)  # + the padding rows' scratch page
    runners, running = [], []
    step = llm.engine.step

    def counting(collect: bool = True, **kw: Any) -> list[RequestOutput]:
        running.append(llm.engine.num_running)
        out = step(collect, **kw)
        runners.append(llm.engine.runner.graphs)
        return out

    llm.engine.step = counting  # type: ignore[method-assign]
    outs = llm.generate([p for p, _ in work], [params(n) for _, n in work], speculative=spec)
    assert [o.token_ids for o in outs] == want
    assert len({id(r) for r in runners}) == 1 and runners[0].capacity == 4
    assert max(running) == 4


def _page_bytes(tiny: Path) -> int:
    return LLM(str(tiny), **ENGINE).engine.runner.cache.bytes_per_page


@pytest.mark.parametrize(("static", "prefix_cache"), [(False, 0), (True, 0), (False, 1 << 22)],
                         ids=["dynamic", "static", "prefix-cache"])
@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_preempted_requests_resume_and_give_their_alone_tokens(
        tiny: Path, prompts: list[list[int]], method: dict[str, Any] | None,
        static: bool, prefix_cache: int) -> None:
    """Pages grow as the rows decode: three requests that need 22 pages by their end share a
    pool of 14, so the newest are preempted (their pages back, to be prefilled again with
    their output so far, from the prefix cache where it has them) and resume; every request
    still gets its alone tokens and every page comes back."""
    spec, n = tiny_spec(method), 60
    solo = LLM(str(tiny), **ENGINE)
    want = [solo.generate([p], params(n), speculative=spec)[0].token_ids for p in prompts[:3]]
    page = solo.engine.runner.cache.bytes_per_page
    engine = LLMEngine(str(tiny), speculative=spec, static_shapes=static, max_num_seqs=3,
                       load_format="dummy", kv_cache_bytes=15 * page,
                       prefix_cache_bytes=prefix_cache)
    engine.scheduler.grow_tokens = 4  # pages asked for every page_size tokens or so
    cache = engine.runner.cache
    free = len(cache.free_pages)
    final: dict[str, RequestOutput] = {}
    rids = [engine.add_request(p, params(n)) for p in prompts[:3]]
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
        held = sum(len(s.pages) for s in engine.scheduler.running)
        assert held + len(cache.free_pages) == free  # the waiting hold none
        assert not any(s.pages for s in engine.scheduler.waiting)
    assert [final[r].token_ids for r in rids] == want
    assert engine.num_preemptions > 0
    engine.release_rows()
    assert len(cache.free_pages) == free and not engine.seqs and engine.runner.batch is None


def test_a_short_request_runs_beside_long_ones_that_have_not_used_their_pages(
        tiny: Path, prompts: list[list[int]]) -> None:
    """Five requests that may each grow to the whole context (33 pages) hold only the pages
    they have written, so in a pool of 100 pages all five run, and a short request that
    arrives behind them is admitted at the next step, not after one of them finishes."""
    engine = LLMEngine(str(tiny), max_num_seqs=8, load_format="dummy",
                       kv_cache_bytes=100 * _page_bytes(tiny))
    long = [engine.add_request(p, SamplingParams(max_tokens=10**9, ignore_eos=True))
            for p in prompts]
    engine.step()
    assert engine.num_running == 5 and engine.num_waiting == 0
    short = engine.add_request(prompts[0][:3], params(8))
    engine.step()
    assert engine.num_running == 6 and engine.num_waiting == 0
    while short in engine.seqs:
        engine.step()
    for rid in long:
        assert engine.abort(rid)
    assert len(engine.runner.cache.free_pages) == engine.runner.cache.num_pages
