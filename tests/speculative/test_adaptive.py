"""Adaptive speculation: the controller speculates where its measurements say a round beats
a plain step, and only there, probes the other choice now and then, skips the iterations
that captured graphs; plain steps between rounds leave the output plain decoding's."""

from __future__ import annotations

import math
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
from vegas_spec.speculative.adaptive import Ema, SpeculationController
from vegas_spec.speculative.policies import window_positions
from vegas_spec.step import StepPlan


def drive(controller: SpeculationController, iterations: int, plain_s: float, round_s: float,
          tau: float, bucket: int = 8, switch_s: float = 0.0) -> list[bool]:
    """Run the controller against fixed costs and tokens per round (a round right after a
    plain step costing switch_s more) -> its choices."""
    choices: list[bool] = []
    for _ in range(iterations):
        draft = controller.choose(bucket)
        extra = switch_s if draft and choices and not choices[-1] else 0.0
        choices.append(draft)
        controller.observe(bucket, draft, (round_s + extra) if draft else plain_s,
                           tau if draft else 1.0)
    return choices


def test_it_speculates_where_a_round_pays() -> None:
    choices = drive(SpeculationController(probe=16), 400, plain_s=1.0, round_s=3.0, tau=5.0)
    late = choices[100:]
    assert 0.9 < sum(late) / len(late) < 1.0  # mostly rounds, a plain probe now and then
    assert not all(late)


def test_it_decodes_plainly_where_a_round_does_not_pay() -> None:
    choices = drive(SpeculationController(probe=16), 400, plain_s=1.0, round_s=3.0, tau=2.5)
    late = choices[100:]
    assert 0.0 < sum(late) / len(late) < 0.1  # plain steps, a probing round now and then


def test_a_dear_first_round_after_plain_steps_does_not_keep_it_plain() -> None:
    """Sampled rounds at SmolLM2's costs (11% to gain a round) where the round after plain
    steps costs 4 ms more (planned again): after a stretch of plain steps (acceptance was
    low) the controller measures rounds by their second and speculates again; the time
    lost stays near the probes' share."""
    c = SpeculationController(probe=32, cost=0.01)
    drive(c, 300, plain_s=1.95, round_s=10.7, tau=2.0, switch_s=4.0)
    assert not c.pays(c.buckets[8])
    late = drive(c, 3000, plain_s=1.95, round_s=10.7, tau=6.1, switch_s=4.0)[-1000:]
    assert c.pays(c.buckets[8]) and sum(late) / len(late) > 0.95


def test_it_follows_a_change_in_acceptance() -> None:
    c = SpeculationController(probe=8)
    drive(c, 200, plain_s=1.0, round_s=3.0, tau=6.0)
    assert c.pays(c.buckets[8])
    late = drive(c, 300, plain_s=1.0, round_s=3.0, tau=1.5)[-100:]
    assert not c.pays(c.buckets[8]) and sum(late) < 20


@pytest.mark.parametrize("round_s,tau", [(11.0, 3.0), (11.0, 6.0), (6.0, 6.5), (40.0, 2.0)])
def test_probes_lose_at_most_their_share_of_the_time(round_s: float, tau: float) -> None:
    """Against fixed costs, the time lost to probes (each iteration of the choice not taken,
    beyond what the preferred choice takes for the same tokens) stays within `cost` of the
    run's time (with the bound on the interval: `most`)."""
    plain_s, n = 1.6, 5000
    c = SpeculationController(cost=0.01)
    choices = drive(c, n, plain_s=plain_s, round_s=round_s, tau=tau)[200:]
    speculate = tau * plain_s > round_s
    probes = sum(d != speculate for d in choices)
    assert probes >= len(choices) // c.most - 1  # it keeps measuring the other choice
    if speculate:
        loss, total = probes * (plain_s - round_s / tau), sum(
            round_s if d else plain_s for d in choices)
    else:
        loss, total = probes * (round_s - tau * plain_s), sum(
            round_s if d else plain_s for d in choices)
    assert loss <= 0.012 * total


def test_the_probe_interval_grows_with_what_a_probe_loses() -> None:
    c = SpeculationController(probe=32, most=1024, cost=0.01)
    drive(c, 100, plain_s=1.6, round_s=11.0, tau=6.35)  # close to even: probes cost little
    near = c.interval(c.buckets[8], c.pays(c.buckets[8]))
    drive(c, 100, plain_s=1.6, round_s=11.0, tau=2.0, bucket=1)  # rounds lose 7.8 a probe
    far = c.interval(c.buckets[1], c.pays(c.buckets[1]))
    drive(c, 100, plain_s=1.6, round_s=40.0, tau=2.0, bucket=2)
    farthest = c.interval(c.buckets[2], c.pays(c.buckets[2]))
    # a probing round is two rounds: twice the loss, twice the spacing
    assert 32 <= near < far == math.ceil(2 * (11.0 - 3.2) / 0.016) < farthest == 1024


def test_buckets_are_measured_apart() -> None:
    c = SpeculationController(probe=1000)
    drive(c, 50, plain_s=1.0, round_s=3.0, tau=6.0, bucket=1)
    drive(c, 50, plain_s=1.0, round_s=9.0, tau=6.0, bucket=64)
    assert c.pays(c.buckets[1]) and not c.pays(c.buckets[64])
    summary = c.summary()
    assert summary["rounds"] + summary["plain_steps"] == 100
    assert 0 < summary["speculative_share"] < 1


def test_the_first_samples_are_skipped() -> None:
    ema = Ema(decay=0.5, skip=1)
    ema.add(100.0)  # a capture
    assert ema.value is None
    ema.add(2.0)
    ema.add(4.0)
    assert ema.value == pytest.approx(3.0)


@dataclass
class Alternate(SpeculationController):
    """A round and a plain step in turn, whatever the timings."""

    calls: int = 0

    def choose(self, bucket: int) -> bool:
        self.calls += 1
        return self.calls % 2 == 1


METHODS = [v for v in SPEC_VARIANTS if set(v) == {"method"}]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (17, 9)]


@pytest.fixture(scope="module")
def prompts(llm, essays) -> list[list[int]]:
    return [essay_prompt(llm.tokenizer, essays, n, off) for n, off in ((2000, 3), (2200, 9))]


@pytest.fixture(scope="module")
def plain(llm, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, PARAMS, speculative=SpecConfig(method="vanilla"))
    return [o.token_ids for o in outs]


@pytest.fixture
def alternate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LLMEngine, "_controller", staticmethod(lambda spec: Alternate()))


@pytest.mark.parametrize("variant", METHODS, ids=lambda v: v["method"])
def test_plain_steps_between_rounds_give_plain_tokens(llm, prompts, plain, variant,
                                                      alternate: None) -> None:
    """Every policy on the real model, rounds and plain steps in turn (the plan of a round
    kept across the plain step after it), rows leaving at different times."""
    spec = SpecConfig(gamma=4, ratio=0.03, min_tokens=64, **variant)
    outs = llm.generate(prompts, PARAMS, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    stats = outs[0].stats
    assert stats["plain_steps"] > 0 and 0 < stats["speculative_share"] < 1


@pytest.mark.parametrize("method", TINY_METHODS[1:], ids=TINY_IDS[1:])
def test_plain_steps_on_the_static_shapes(tmp_path_factory: pytest.TempPathFactory,
                                          method: dict, alternate: None) -> None:
    """The same on the fixed-shape buffers (a plain step between round graphs)."""
    folder = config_folder(tmp_path_factory, "tiny-adaptive", TINY_LLAMA)
    prompts = random_prompts(1, (40, 23, 61), TINY_VOCAB)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 7, 13)]
    llm = LLM(str(folder), static_shapes=True, **TINY_ENGINE)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    outs = llm.generate(prompts, params, speculative=tiny_spec(method))
    assert [o.token_ids for o in outs] == want
    assert outs[0].stats["plain_steps"] > 0


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
        runner.execute(StepPlan(decode=True, draft=False))
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

    seen: list[tuple[int, bool, float, float | None]] = field(default_factory=list)

    def choose(self, bucket: int) -> bool:
        return len(self.seen) % 2 == 0

    def observe(self, bucket: int, drafted: bool, seconds: float,
                tokens_per_row: float | None = None) -> None:
        self.seen.append((bucket, drafted, seconds, tokens_per_row))


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
    assert [d for _, d, _, _ in recorder.seen] == [True, False] * 3
    assert [bucket for bucket, _, _, _ in recorder.seen] == [1] * 5 + [2]  # b joined
    assert all(slow_host <= s < slow_prefill for _, _, s, _ in recorder.seen)
    assert all(t == 1.0 for _, d, _, t in recorder.seen if not d)
    assert all(t is not None and t >= 1.0 for _, d, _, t in recorder.seen if d)
