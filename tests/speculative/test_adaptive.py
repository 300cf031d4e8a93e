"""Adaptive speculation: the controller drafts as many tokens as its measurements say pay
best, none (a plain step) where no round beats a plain step, probes the other choices now and
then, skips the iterations that captured graphs; plain steps and shorter rounds between
rounds leave the output plain decoding's."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from conftest import (
    SPEC_VARIANTS,
    TINY_ENGINE,
    TINY_IDS,
    TINY_LLAMA,
    TINY_METHODS,
    TINY_VOCAB,
    config_folder,
    essay_prompt,
    random_prompts,
    tiny_spec,
)

from vegas_spec import SamplingParams, SpecConfig
from vegas_spec.engine import LLM, LLMEngine
from vegas_spec.speculative.adaptive import (
    Acceptance,
    Ema,
    SpeculationController,
    draft_lengths,
)
from vegas_spec.speculative.policies import window_positions
from vegas_spec.step import StepPlan

ROWS = 1000


def emitted_at(alpha: float, gamma: int, rows: int = ROWS) -> list[int]:
    """Tokens emitted by `rows` rows in a round of γ drafts whose every draft is accepted
    with probability alpha (the expected counts, rounded)."""
    reach = [round(rows * alpha ** j) for j in range(gamma + 1)] + [0]
    return [j + 1 for j in range(gamma + 1) for _ in range(reach[j] - reach[j + 1])]


def tau_of(alpha: float, gamma: int) -> float:
    return sum(alpha ** j for j in range(gamma + 1))


def drive(controller: SpeculationController, iterations: int, plain_s: float,
          round_s: float | dict[int, float], alpha: float, bucket: int = 8,
          switch_s: float = 0.0) -> list[int]:
    """Run the controller against fixed costs (round_s: of γ, or by draft length) and a fixed
    acceptance per draft position (a round right after a plain step costing switch_s more)
    -> its choices (draft lengths, 0 a plain step)."""
    choices: list[int] = []
    longest = controller.lengths[-1]
    for _ in range(iterations):
        g = controller.choose(bucket)
        cost = plain_s if not g else \
            round_s[g] if isinstance(round_s, dict) else round_s * (1 + g) / (1 + longest)
        extra = switch_s if g and choices and not choices[-1] else 0.0
        choices.append(g)
        controller.observe(bucket, g, cost + extra, emitted_at(alpha, g) if g else [1] * ROWS)
    return choices


def only_gamma(**kw: float) -> SpeculationController:
    return SpeculationController(lengths=(6,), **kw)


def test_draft_lengths_are_gamma_and_shorter_ones() -> None:
    assert draft_lengths(6) == (2, 4, 6)
    assert draft_lengths(8) == (3, 5, 8)
    assert draft_lengths(2) == (1, 2)
    assert draft_lengths(1) == (1,)


def test_acceptance_per_position_gives_the_tokens_of_every_shorter_round() -> None:
    acc = Acceptance()
    acc.add(6, emitted_at(0.8, 6))
    assert acc.rates(6) == pytest.approx([0.8] * 6, abs=2e-3)
    for g in range(1, 7):
        assert acc.tokens(g) == pytest.approx(tau_of(0.8, g), abs=1e-2)
    acc.add(2, emitted_at(0.5, 2))  # shorter rounds move only the positions they drafted
    assert acc.rates(6)[0] < 0.8 and acc.rates(6)[3:] == pytest.approx([0.8] * 3, abs=2e-3)


def test_one_rows_rejection_moves_the_estimate_as_one_row_of_a_batch_would() -> None:
    """The counts decay per row-round: at batch 1 a single rejection after a long run of
    full acceptance leaves α_1 near 1 (decayed per round it would drop to 0.8 and τ(γ)
    with it), while at batch 64 a round of rejections moves it at once."""
    one = Acceptance()
    for _ in range(50):
        one.add(6, [7])
    one.add(6, [1])
    assert one.rates(1)[0] > 0.95 and one.tokens(6) > 6.5
    batch = Acceptance()
    for _ in range(50):
        batch.add(6, [7] * 64)
    batch.add(6, [1] * 64)
    assert batch.rates(1)[0] < 0.6


def test_it_speculates_where_a_round_pays() -> None:
    choices = drive(only_gamma(probe=16), 400, plain_s=1.0, round_s=3.0, alpha=0.9)
    late = [bool(g) for g in choices[100:]]
    assert 0.9 < sum(late) / len(late) < 1.0  # mostly rounds, a plain probe now and then
    assert not all(late)


def test_it_decodes_plainly_where_a_round_does_not_pay() -> None:
    choices = drive(only_gamma(probe=16), 400, plain_s=1.0, round_s=3.0, alpha=0.55)
    late = [bool(g) for g in choices[100:]]
    assert 0.0 < sum(late) / len(late) < 0.1  # plain steps, a probing round now and then


@pytest.mark.parametrize("alpha,want", [(0.97, 6), (0.8, 4), (0.6, 2), (0.2, 0)])
def test_it_drafts_the_length_that_pays_best(alpha: float, want: int) -> None:
    """Cheap drafts (an 8B model's FP8 drafts: a round of g costs 1.2 + 0.3 g plain steps):
    with high acceptance the longest round, with lower acceptance shorter ones, with none
    plain steps; the choice is the best rate τ(g) / c(g) of the lengths, and the probes of
    the three others lose at most about `cost` of the time each."""
    costs = {0: 1.0, **{g: 1.2 + 0.3 * g for g in (2, 4, 6)}}
    tau = {g: tau_of(alpha, g) for g in costs}
    rates = {g: tau[g] / c for g, c in costs.items()}
    assert max(rates, key=rates.__getitem__) == want
    c = SpeculationController(lengths=(2, 4, 6), probe=16, cost=0.01)
    late = drive(c, 3000, plain_s=1.0, round_s=costs, alpha=alpha)[500:]
    assert c.best(c.buckets[8]) == want
    assert late.count(want) / len(late) > 0.8
    assert set(late) == {0, 2, 4, 6}  # every other choice probed now and then
    achieved = sum(tau[g] for g in late) / sum(costs[g] for g in late)
    assert achieved >= (1 - 3 * 0.012) * rates[want]


def test_a_length_never_run_is_costed_between_the_measured_ones() -> None:
    c = SpeculationController(lengths=(2, 4, 6))
    c.observe(8, 6, 9.0, emitted_at(0.9, 6))
    c.observe(8, 6, 7.0, emitted_at(0.9, 6))  # the first sample (a capture) is skipped
    c.observe(8, 0, 5.0, [1])
    c.observe(8, 0, 1.0, [1])
    assert c.costs(c.buckets[8]) == pytest.approx({0: 1.0, 2: 3.0, 4: 5.0, 6: 7.0})


def test_a_dear_first_round_after_plain_steps_does_not_keep_it_plain() -> None:
    """Sampled rounds at SmolLM2's costs (11% to gain a round) where the round after plain
    steps costs 4 ms more (planned again): after a stretch of plain steps (acceptance was
    low) the controller measures rounds by their second and speculates again; the time
    lost stays near the probes' share."""
    c = only_gamma(probe=32, cost=0.01)
    drive(c, 300, plain_s=1.95, round_s=10.7, alpha=0.3, switch_s=4.0)
    assert not c.pays(c.buckets[8])
    late = drive(c, 3000, plain_s=1.95, round_s=10.7, alpha=0.985, switch_s=4.0)[-1000:]
    assert c.pays(c.buckets[8]) and sum(map(bool, late)) / len(late) > 0.95


@pytest.mark.parametrize("seed", range(3))
def test_near_break_even_it_does_not_go_back_and_forth(seed: int) -> None:
    """Rounds 2.4% better than plain steps (τ 6.4 at 10 ms against 1.6 ms), the round after
    plain steps 4 ms dearer (planned again), every time ±5% noise: without the re-planning
    charged to a switch, noisy estimates would flip the choice to plain steps and back, each
    flip paying 4 ms; with it the controller stays on rounds but for its probes and loses
    little against rounds alone."""
    rng, c = random.Random(seed), only_gamma()
    total, tokens, last = 0.0, 0.0, None
    choices = []
    for _ in range(3000):
        g = c.choose(8)
        seconds = (10.0 + (4.0 if g and last == 0 else 0.0)) if g else 1.6
        seconds *= 1 + 0.05 * (2 * rng.random() - 1)
        c.observe(8, g, seconds, emitted_at(0.97, g) if g else [1] * ROWS)
        total, tokens, last = total + seconds, tokens + (tau_of(0.97, 6) if g else 1.0), g
        choices.append(g)
    assert c.buckets[8].replan.value == pytest.approx(4.0, rel=0.2)
    assert choices[500:].count(0) / 2500 < 0.05
    assert tokens / total > 0.98 * tau_of(0.97, 6) / 10.0


def test_it_follows_a_change_in_acceptance() -> None:
    c = only_gamma(probe=8)
    drive(c, 200, plain_s=1.0, round_s=3.0, alpha=0.95)
    assert c.pays(c.buckets[8])
    late = drive(c, 300, plain_s=1.0, round_s=3.0, alpha=0.3)[-100:]
    assert not c.pays(c.buckets[8]) and sum(map(bool, late)) < 20


@pytest.mark.parametrize("round_s,alpha", [(11.0, 0.7), (11.0, 0.97), (6.0, 0.99),
                                           (40.0, 0.5)])
def test_probes_lose_at_most_their_share_of_the_time(round_s: float, alpha: float) -> None:
    """Against fixed costs, the time lost to probes (each iteration of the choice not taken,
    beyond what the preferred choice takes for the same tokens) stays within `cost` of the
    run's time (with the bound on the interval: `most`)."""
    plain_s, n, tau = 1.6, 5000, tau_of(alpha, 6)
    c = only_gamma(cost=0.01)
    choices = [bool(g) for g in drive(c, n, plain_s=plain_s, round_s=round_s,
                                      alpha=alpha)[200:]]
    speculate = tau * plain_s > round_s
    probes = sum(d != speculate for d in choices)
    assert probes >= len(choices) // c.most - 1  # it keeps measuring the other choice
    if speculate:
        loss = probes * (plain_s - round_s / tau)
    else:
        loss = probes * (round_s - tau * plain_s)
    total = sum(round_s if d else plain_s for d in choices)
    assert loss <= 0.012 * total


def test_the_probe_interval_grows_with_what_a_probe_loses() -> None:
    c = only_gamma(probe=32, most=1024, cost=0.01)
    drive(c, 100, plain_s=1.6, round_s=11.0, alpha=0.99)  # close to even: probes cost little
    near = c.interval(c.buckets[8], 0 if c.pays(c.buckets[8]) else 6)
    drive(c, 100, plain_s=1.6, round_s=11.0, alpha=0.5, bucket=1)  # rounds lose a lot
    b1 = c.buckets[1]
    far = c.interval(b1, 6)
    dear = only_gamma(probe=32, most=1024, cost=0.01)  # its own costs from the start
    drive(dear, 100, plain_s=1.6, round_s=40.0, alpha=0.5, bucket=2)
    farthest = dear.interval(dear.buckets[2], 6)
    # a probing round is two rounds: twice the loss, twice the spacing; its τ reckoned at
    # the upper confidence bound of the rates
    tau = b1.acceptance.tokens(6, optimistic=True)
    assert b1.acceptance.tokens(6) < tau < b1.acceptance.tokens(6) + 0.2
    assert 32 <= near < far == math.ceil(2 * (11.0 - tau * 1.6) / 0.016) < farthest == 1024


def unlucky_start(alpha: float, seed: int, iterations: int = 600) -> list[int]:
    """Batch 1, rounds of γ 6 costing 5.7 plain steps (code at 7.5K on an H100), each draft
    accepted with probability alpha, the first two rounds unlucky (1 and 0 drafts
    accepted) -> the controller's choices."""
    rng, c, bad, choices = random.Random(seed), only_gamma(), [2, 1], []
    for _ in range(iterations):
        g = c.choose(1)
        if not g:
            c.observe(1, 0, 1.0, [1])
        else:
            emitted = bad.pop(0) if bad else 1 + next(
                (j for j in range(g) if rng.random() >= alpha), g)
            c.observe(1, g, 5.7, [emitted])
        choices.append(g)
    return choices


@pytest.mark.parametrize("seed", range(4))
def test_a_couple_of_unlucky_rounds_do_not_stop_speculation_for_long(seed: int) -> None:
    """At batch 1 two unlucky rounds put τ(6) near 1.5: by its point estimate a probing
    round would lose 8 plain steps' time, and the next probe would wait 800 iterations.
    Reckoned at the rates' upper confidence bound (two rows seen) it is probed again after
    the least interval, and where rounds do pay (acceptance 0.98: τ 6.6 against a cost of
    5.7) the controller speculates again."""
    choices = unlucky_start(0.98, seed)
    assert choices[4:6] == [0, 0]  # the unlucky rounds: plain steps now
    first = next(i for i in range(6, len(choices)) if choices[i])
    assert first <= 6 + 32 + 2
    late = choices[-200:]
    assert sum(map(bool, late)) / len(late) > 0.8


@pytest.mark.parametrize("seed", range(3))
def test_where_rounds_do_not_pay_the_probes_thin_out(seed: int) -> None:
    """The upper bound tightens with every probe: at acceptance 0.5 (τ 2 against a cost of
    5.7) rounds are a small share of the iterations once a few probes have measured them."""
    late = unlucky_start(0.5, seed, 1500)[300:]
    assert sum(map(bool, late)) / len(late) < 0.03


def test_buckets_are_measured_apart() -> None:
    c = only_gamma(probe=1000)
    drive(c, 50, plain_s=1.0, round_s=3.0, alpha=0.95, bucket=1)
    drive(c, 50, plain_s=1.0, round_s=9.0, alpha=0.95, bucket=64)
    assert c.pays(c.buckets[1]) and not c.pays(c.buckets[64])
    summary = c.summary()
    assert summary["rounds"] + summary["plain_steps"] == 100
    assert 0 < summary["speculative_share"] < 1
    assert summary["draft_lengths"] == {0: summary["plain_steps"], 6: summary["rounds"]}


def test_a_new_bucket_starts_from_the_acceptance_of_the_last() -> None:
    c = only_gamma()
    drive(c, 20, plain_s=1.0, round_s=3.0, alpha=0.6, bucket=8)
    assert c.bucket(4).acceptance.rates(6) == c.buckets[8].acceptance.rates(6)


def test_the_first_samples_are_skipped() -> None:
    ema = Ema(decay=0.5, skip=1)
    ema.add(100.0)  # a capture
    assert ema.value is None
    ema.add(2.0)
    ema.add(4.0)
    assert ema.value == pytest.approx(3.0)


def test_a_new_bucket_borrows_the_costs_of_the_last_until_it_measures_its_own() -> None:
    """Rows finishing one by one move the batch through smaller buckets: each starts from
    the last one's costs (no measuring of every choice first, as in the first bucket), and
    its own first kept sample replaces a borrowed cost."""
    c = SpeculationController(lengths=(2, 4, 6))
    drive(c, 40, plain_s=1.0, round_s={2: 2.0, 4: 3.0, 6: 4.0}, alpha=0.9, bucket=16)
    before = dict(c.costs(c.buckets[16]))
    assert c.choose(8) == c.buckets[16].preferred
    assert c.costs(c.buckets[8]) == before
    for _ in range(2):  # the first sample skipped (a capture), the second replaces
        c.observe(8, 6, 3.0, emitted_at(0.9, 6))
    assert c.buckets[8].costs[6].value == 3.0 and c.buckets[16].costs[6].value == before[6]


@dataclass
class Alternate(SpeculationController):
    """Every choice in turn, whatever the timings: a round of γ, a plain step, then each
    shorter round."""

    calls: int = 0

    def choose(self, bucket: int) -> int:
        order = (self.lengths[-1], 0, *self.lengths[:-1])
        self.calls += 1
        return order[(self.calls - 1) % len(order)]


METHODS = [v for v in SPEC_VARIANTS if set(v) == {"method"}]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (17, 9)]


@pytest.fixture(scope="module")
def prompts(llm, essays) -> list[list[int]]:
    return [essay_prompt(llm.tokenizer, essays, n, off) for n, off in ((1000, 3), (1100, 9))]


@pytest.fixture(scope="module")
def plain(llm, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, PARAMS, speculative=SpecConfig(method="vanilla"))
    return [o.token_ids for o in outs]


@pytest.fixture
def alternate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LLMEngine, "_controller",
                        staticmethod(lambda spec: Alternate(draft_lengths(spec.gamma))))


@pytest.mark.parametrize("variant", METHODS, ids=lambda v: v["method"])
def test_plain_steps_between_rounds_give_plain_tokens(llm, prompts, plain, variant,
                                                      alternate: None) -> None:
    """Every policy on the real model, rounds of γ, plain steps and shorter rounds in turn
    (the plan of a round kept across the plain step after it), rows leaving at different
    times."""
    spec = SpecConfig(gamma=4, ratio=0.03, min_tokens=64, **variant)
    outs = llm.generate(prompts, PARAMS, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    stats = outs[0].stats
    assert stats["plain_steps"] > 0 and 0 < stats["speculative_share"] < 1
    lengths = stats["draft_length_histogram"]  # rounds of 1, 3 and 4 drafts (γ 4)
    assert lengths[0] > 0 and lengths[2] > 0 and lengths[3] > 0 and lengths[1] == 0


@pytest.mark.parametrize("method", TINY_METHODS[1:], ids=TINY_IDS[1:])
def test_plain_steps_on_the_static_shapes(tmp_path_factory: pytest.TempPathFactory,
                                          method: dict, alternate: None) -> None:
    """The same on the fixed-shape buffers: plain steps and the round graphs of each draft
    length in turn."""
    folder = config_folder(tmp_path_factory, "tiny-adaptive", TINY_LLAMA)
    prompts = random_prompts(1, (40, 23, 61), TINY_VOCAB)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 7, 13)]
    llm = LLM(str(folder), static_shapes=True, **TINY_ENGINE)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    spec = dataclasses.replace(tiny_spec(method), adaptive=True)
    outs = llm.generate(prompts, params, speculative=spec)
    assert [o.token_ids for o in outs] == want
    assert outs[0].stats["plain_steps"] > 0
    assert all(n > 0 for n in outs[0].stats["draft_length_histogram"])  # 1, 2 and 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", TINY_METHODS[1:], ids=TINY_IDS[1:])
def test_every_draft_length_replays_as_its_own_graph(tmp_path_factory: pytest.TempPathFactory,
                                                     method: dict, alternate: None) -> None:
    """On a GPU, the captured round graph of each draft length (and the plain step) in turn:
    greedy output is plain decoding's, and seeded sampled output is that of the same
    buffers run eagerly with the same choices."""
    folder = config_folder(tmp_path_factory, "tiny-adaptive-gpu", TINY_LLAMA)
    prompts = random_prompts(1, (40, 23, 61), TINY_VOCAB)
    greedy = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 7, 13)]
    sampled = [SamplingParams(max_tokens=n, ignore_eos=True, seed=i, temperature=0.8,
                              top_p=0.95) for i, n in enumerate((20, 7, 13))]
    cuda = dict(TINY_ENGINE, device="cuda")
    graphs = LLM(str(folder), **cuda)
    eager = LLM(str(folder), cuda_graphs=False, static_shapes=True, **cuda)
    spec = dataclasses.replace(tiny_spec(method), adaptive=True)
    want = [o.token_ids for o in graphs.generate(prompts, greedy)]
    outs = graphs.generate(prompts, greedy, speculative=spec)
    assert [o.token_ids for o in outs] == want
    assert all(n > 0 for n in outs[0].stats["draft_length_histogram"])
    outs = []
    for llm in (graphs, eager):  # the same choices in both: each from a fresh controller
        llm.engine.set_spec(spec)
        llm.engine.controller = Alternate(draft_lengths(spec.gamma))
        outs.append([o.token_ids for o in llm.generate(prompts, sampled, speculative=spec)])
    assert outs[0] == outs[1]
    kinds = {k for k, _, _ in graphs.engine.runner.graphs.graphs}
    assert {"spec", "spec@1", "spec@2", "plain", "filtered", "filtered@1"} <= kinds


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("method", ["vegas", "stream", "lastq"])
def test_a_round_after_plain_steps_plans_from_the_newest_token(
        tmp_path_factory: pytest.TempPathFactory, method: str, static: bool) -> None:
    """Plain steps leave the last plan's recent range behind the newest tokens; the next
    round plans again from the newest committed token (its drafts see every new token):
    its recent range ends there and starts its window's positions before it."""
    from vegas_spec.engine import LLMEngine as Engine

    folder = config_folder(tmp_path_factory, "tiny-refresh", TINY_LLAMA)
    engine = Engine(str(folder), speculative=tiny_spec({"method": method}),
                    static_shapes=static, **TINY_ENGINE)
    for p in random_prompts(2, (60, 45), TINY_VOCAB):
        engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step(prefill_first=True)
    runner = engine.runner
    for _ in range(3):
        runner.execute(StepPlan(decode=True, draft=0))
    assert runner._stale
    runner._refresh_plan(runner.batch)
    assert not runner._stale
    recent, k = (runner.graphs.buf.recent_start[: runner.rows],
                  runner.graphs.buf.budget[: runner.rows]) if static \
        else (runner.batch.plan.recent_start, runner.batch.plan.budget)
    near = window_positions(k, runner.policy.window)
    assert torch.equal(recent, runner.batch.lengths - 1 - near)
    out = runner.execute(StepPlan(decode=True))  # a round from the fresh plan
    assert out.drafted and all(1 <= len(t) <= 4 for t in out.tokens)


@dataclass
class Recorder(SpeculationController):
    """Rounds and plain steps in turn, each observation kept."""

    seen: list[tuple[int, int, float, list[int]]] = field(default_factory=list)

    def choose(self, bucket: int) -> int:
        return 3 if len(self.seen) % 2 == 0 else 0

    def observe(self, bucket: int, drafted: int, seconds: float,
                emitted: Sequence[int] = ()) -> None:
        self.seen.append((bucket, drafted, seconds, list(emitted)))


def test_an_iteration_costs_its_host_work_but_not_a_prefill(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller weighs an iteration by the whole engine step that decoded it (the
    host's work per iteration, here a slow one, is paid by a plain step as by a round), but
    not by a prefill in the same step."""
    import time

    from vegas_spec.engine import LLMEngine as Engine
    from vegas_spec.model_runner import ModelRunner

    recorder = Recorder()
    monkeypatch.setattr(Engine, "_controller", staticmethod(lambda spec: recorder))
    folder = config_folder(tmp_path_factory, "tiny-costs", TINY_LLAMA)
    engine = Engine(str(folder), speculative=tiny_spec({"method": "stream"}), **TINY_ENGINE)
    slow_host, slow_prefill = 0.05, 0.3
    select = ModelRunner._select
    monkeypatch.setattr(ModelRunner, "_select",
                        lambda self: (time.sleep(slow_host), select(self))[1])
    prefill = ModelRunner._prefill
    monkeypatch.setattr(ModelRunner, "_prefill",
                        lambda self, pieces: (time.sleep(slow_prefill if pieces else 0),
                                              prefill(self, pieces))[1])
    a, b = random_prompts(3, (40, 50), TINY_VOCAB)
    engine.add_request(a, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()  # prefills a, whose row then decodes its first iteration
    for _ in range(4):
        engine.step()
    engine.add_request(b, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()  # prefills b while a decodes
    assert len(recorder.seen) == 6
    assert [d for _, d, _, _ in recorder.seen] == [3, 0] * 3
    assert [bucket for bucket, _, _, _ in recorder.seen] == [1] * 5 + [2]  # b joined
    assert all(slow_host <= s < slow_prefill for _, _, s, _ in recorder.seen)
    # each row's tokens: one from a plain step, 1..γ+1 from a round
    assert all(t == [1] * (1 + (i == 5)) for i, (_, d, _, t) in enumerate(recorder.seen)
               if not d)
    assert all(t and all(1 <= n <= 4 for n in t) for _, d, _, t in recorder.seen if d)
