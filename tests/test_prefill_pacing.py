"""Prefill pacing: the per-step prompt budget follows the measured step times."""

from __future__ import annotations

import pytest

from vegas_spec.config import ConfigError, EngineConfig
from vegas_spec.prefill_graphs import bucket_floor, token_bucket
from vegas_spec.scheduler import PrefillPacer

DECODE = 0.010  # seconds of a decode-only step in these cases


def measured(ratio: float = 1.0, fixed: float = 0.002, marginal: float = 1e-6,
             ceiling: int = 32768, floor: int = 512, steps: int = 60) -> PrefillPacer:
    """A pacer that has seen decode-only steps of DECODE seconds, then `steps` steps that
    prefilled the budget it gave while rows decoded, each costing fixed + marginal x tokens
    on top."""
    pacer = PrefillPacer(ceiling=ceiling, ratio=ratio, floor=floor, smoothing=0.5)
    pacer.observe(0, True, DECODE)
    for _ in range(steps):
        tokens = pacer.budget(decoding=True)
        pacer.observe(tokens, True, DECODE + fixed + marginal * tokens, tokens)
    return pacer


def test_whole_budget_until_measured_and_when_nothing_decodes() -> None:
    pacer = PrefillPacer(ceiling=32768)
    assert pacer.budget(decoding=True) == 32768  # nothing measured yet
    pacer.observe(4096, True, 0.030)
    assert pacer.budget(decoding=True) == 32768  # no decode-only step yet
    pacer.observe(0, True, DECODE)
    pacer.observe(4096, True, 0.030)  # one step is enough: 4096 x 10 ms / 20 ms
    assert pacer.budget(decoding=True) == 2048
    assert pacer.budget(decoding=False) == 32768


@pytest.mark.parametrize("fixed", [0.0, 0.002, 0.006])
def test_budget_settles_where_the_excess_is_the_target(fixed: float) -> None:
    """(ratio x 10 ms - fixed) / 1 µs per token, whatever part of the cost is fixed, from
    one chunk size (no second size is needed to tell the parts apart)."""
    for ratio in (1.0, 0.75):
        want = (ratio * DECODE - fixed) / 1e-6
        assert measured(ratio=ratio, fixed=fixed).budget(decoding=True) == \
            pytest.approx(want, rel=0.01)


def test_an_unreachable_target_gives_the_smallest_chunk() -> None:
    """A forward's fixed cost above ratio x the decode step: the shortest stall, and the
    estimate goes on from the smallest chunks; a reachable target is paced as before."""
    pacer = measured(ratio=0.1)
    assert pacer.budget(decoding=True) == 512
    assert pacer.budget(decoding=False) == 32768
    # the smallest chunk (the floor) would already take too long
    assert measured(ratio=1.0, fixed=0.0, marginal=1e-4).budget(decoding=True) == 512


def test_budget_never_exceeds_the_ceiling() -> None:
    assert measured(marginal=1e-9, ceiling=8192).budget(decoding=True) == 8192
    assert measured(ceiling=100, floor=512).budget(decoding=True) == 100


def test_a_short_tail_does_not_pull_the_budget_down() -> None:
    """A step that prefilled less than half its budget (a prompt's last piece) is dominated
    by the fixed cost; it is not an estimate of what a full step can take."""
    pacer = measured()
    before = pacer.budget(decoding=True)
    pacer.observe(300, True, DECODE + 0.002 + 300e-6, before)
    assert pacer.budget(decoding=True) == before
    pacer.observe(before, True, DECODE + 0.004 + before * 1e-6, before)  # a slow full step
    assert pacer.budget(decoding=True) < before


def test_prefill_only_steps_say_nothing() -> None:
    pacer = measured()
    before = (pacer.decode_s, pacer.tokens)
    pacer.observe(0, False, 5.0)
    pacer.observe(4096, False, 5.0)
    assert (pacer.decode_s, pacer.tokens) == before


def test_the_decode_estimate_moves_towards_new_steps() -> None:
    pacer = PrefillPacer(ceiling=32768, smoothing=0.5)
    pacer.observe(0, True, 0.010)
    pacer.observe(0, True, 0.020)
    assert pacer.decode_s == pytest.approx(0.015)


@pytest.mark.parametrize("tokens", [512, 700, 768, 1000, 5000, 6144, 7000, 32768, 40000])
def test_bucket_floor_is_the_largest_bucket_not_above(tokens: int) -> None:
    b = bucket_floor(tokens)
    assert token_bucket(b) == b and b <= max(tokens, 512)
    assert token_bucket(b + 1) > tokens or b == 512 and tokens < 512


@pytest.mark.parametrize("bad", [0, -1.0, 101, "1", float("nan")])
def test_bad_pacing_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="prefill_pacing"):
        EngineConfig(prefill_pacing=bad)  # type: ignore[arg-type]
