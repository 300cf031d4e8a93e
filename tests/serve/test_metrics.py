"""The server's Prometheus metrics count what each engine step did: rounds by the draft
length adaptive speculation chose, plain steps, draft and accepted tokens."""

from __future__ import annotations

from types import SimpleNamespace

from vegas_spec.engine import StepInfo
from vegas_spec.serve.metrics import Metrics


def fake_engine(info: StepInfo) -> SimpleNamespace:
    return SimpleNamespace(last_step=info, num_waiting=0, num_running=2,
                           scheduler=SimpleNamespace(pool=SimpleNamespace(num_free=10)))


def value(metrics: Metrics, name: str) -> float:
    got = metrics.registry.get_sample_value(name)
    assert got is not None, name
    return got


def test_rounds_count_the_drafts_of_the_length_chosen() -> None:
    m = Metrics()
    steps = [StepInfo(gamma=6, drafted=6, emitted=[7, 2]),  # a round of γ
             StepInfo(gamma=6, drafted=2, emitted=[3, 1]),  # a shorter round
             StepInfo(gamma=6, drafted=0, emitted=[1, 1])]  # a plain step
    for info in steps:
        m.step(fake_engine(info), [])
    assert value(m, "vegas_speculative_rounds_total") == 2
    assert value(m, "vegas_plain_steps_total") == 1
    assert value(m, "vegas_draft_tokens_total") == 6 * 2 + 2 * 2
    assert value(m, "vegas_accepted_tokens_total") == 6 + 1 + 2 + 0
    assert value(m, "vegas_draft_length_count") == 3
    assert value(m, "vegas_draft_length_sum") == 8
    assert m.registry.get_sample_value("vegas_draft_length_bucket", {"le": "0.0"}) == 1
    assert m.registry.get_sample_value("vegas_draft_length_bucket", {"le": "2.0"}) == 2


def test_plain_decoding_counts_no_rounds() -> None:
    m = Metrics()
    m.step(fake_engine(StepInfo(gamma=0, drafted=0, emitted=[1, 1, 1])), [])
    assert value(m, "vegas_speculative_rounds_total") == 0
    assert value(m, "vegas_plain_steps_total") == 0
    assert value(m, "vegas_draft_length_count") == 0
    assert value(m, "vegas_generation_tokens_total") == 3
