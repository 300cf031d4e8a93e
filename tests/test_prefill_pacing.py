"""Prefill pacing: the per-step prompt budget follows the measured step times."""

from __future__ import annotations

import pytest

from vegas_spec.config import ConfigError, EngineConfig
from vegas_spec.prefill_graphs import bucket_floor, token_bucket
from vegas_spec.scheduler import PrefillPacer

DECODE = 0.010  # seconds of a decode-only step in these cases


def measured(ratio: float = 1.0, fixed: float = 0.002, marginal: float = 1e-6,
             ceiling: int = 32768, floor: int = 512) -> PrefillPacer:
    """A pacer that has seen decode-only steps of DECODE seconds and prefills costing
    fixed + marginal x tokens on top, at several token counts."""
    pacer = PrefillPacer(ceiling=ceiling, ratio=ratio, floor=floor, smoothing=0.5)
    pacer.observe(0, True, DECODE)
    for tokens in (4096, 1024, 7500, 2048):
        pacer.observe(tokens, True, DECODE + fixed + marginal * tokens)
    return pacer


def test_whole_budget_until_measured_and_when_nothing_decodes() -> None:
    pacer = PrefillPacer(ceiling=32768)
    assert pacer.budget(decoding=True) == 32768  # nothing measured yet
    pacer.observe(0, True, DECODE)
    pacer.observe(4096, True, 0.030)
    assert pacer.budget(decoding=True) == 32768  # one token count: no line yet
    pacer.observe(1024, True, 0.020)
    assert pacer.budget(decoding=True) < 32768
    assert pacer.budget(decoding=False) == 32768


def test_budget_adds_ratio_decode_steps_over_the_fixed_cost() -> None:
    """(ratio x 10 ms - 2 ms fixed) / 1 µs per token."""
    assert measured(ratio=1.0).budget(decoding=True) == pytest.approx(8000, abs=2)
    assert measured(ratio=0.5).budget(decoding=True) == pytest.approx(3000, abs=2)


def test_an_unreachable_target_gives_the_whole_budget() -> None:
    """A forward's fixed cost above ratio x the decode step: every prefill step stalls anyway,
    so the fewest (largest) forwards keep the throughput."""
    assert measured(ratio=0.1).budget(decoding=True) == 32768
    # the smallest chunk (the floor) would already take too long
    assert measured(ratio=1.0, fixed=0.0, marginal=1e-4).budget(decoding=True) == 32768


def test_an_unreachable_target_can_give_the_smallest_chunk() -> None:
    """out_of_reach "floor": the shortest stall instead of the fewest forwards; a reachable
    target is paced as before."""
    pacer = measured(ratio=0.1)
    pacer.out_of_reach = "floor"
    assert pacer.budget(decoding=True) == 512
    assert pacer.budget(decoding=False) == 32768
    reachable = measured(ratio=1.0)
    reachable.out_of_reach = "floor"
    assert reachable.budget(decoding=True) == pytest.approx(8000, abs=2)
    with pytest.raises(ValueError, match="out_of_reach"):
        PrefillPacer(ceiling=4096, out_of_reach="half")


def test_budget_never_exceeds_the_ceiling() -> None:
    assert measured(marginal=1e-9, ceiling=8192).budget(decoding=True) == 8192
    assert measured(ceiling=100, floor=512).budget(decoding=True) == 100


def test_prefill_only_steps_say_nothing() -> None:
    pacer = measured()
    before = (pacer.decode_s, pacer.cost.line())
    pacer.observe(0, False, 5.0)
    pacer.observe(4096, False, 5.0)
    assert (pacer.decode_s, pacer.cost.line()) == before


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
