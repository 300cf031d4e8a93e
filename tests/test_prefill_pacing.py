"""Prefill pacing: the per-step prompt budget follows the measured step times."""

from __future__ import annotations

import pytest

from vegas_spec.config import ConfigError, EngineConfig
from vegas_spec.prefill_graphs import bucket_floor, token_bucket
from vegas_spec.scheduler import PrefillPacer


def test_whole_budget_until_measured_and_when_nothing_decodes() -> None:
    pacer = PrefillPacer(ceiling=32768)
    assert pacer.budget(decoding=True) == 32768  # nothing measured yet
    pacer.observe(0, True, 0.010)
    assert pacer.budget(decoding=True) == 32768  # no prefill rate yet
    pacer.observe(4096, True, 0.030)
    assert pacer.budget(decoding=False) == 32768


def test_budget_is_ratio_times_a_decode_step_of_prefill() -> None:
    pacer = PrefillPacer(ceiling=32768, ratio=1.0, smoothing=1.0)
    pacer.observe(0, True, 0.012)  # a decode-only step: 12 ms
    pacer.observe(6000, True, 0.024)  # 6000 prompt tokens took the other 12 ms
    assert pacer.budget(decoding=True) == 6000
    pacer.ratio = 0.5
    assert pacer.budget(decoding=True) == 3000
    pacer.observe(0, False, 5.0)  # a prefill-only step says nothing about either rate
    assert (pacer.decode_s, pacer.token_s) == (0.012, 0.002 / 1000)


def test_budget_stays_within_floor_and_ceiling() -> None:
    pacer = PrefillPacer(ceiling=8192, ratio=1.0, floor=512, smoothing=1.0)
    pacer.observe(0, True, 0.001)
    pacer.observe(1000, True, 1.001)  # very slow prefill: 1 ms per token
    assert pacer.budget(decoding=True) == 512
    pacer.observe(1000, True, 0.001)  # prefill that cost nothing measurable
    assert pacer.budget(decoding=True) == 8192
    tiny = PrefillPacer(ceiling=100, floor=512, smoothing=1.0)
    tiny.observe(0, True, 0.001)
    tiny.observe(10, True, 1.0)
    assert tiny.budget(decoding=True) == 100  # never above the configured budget


def test_the_running_average_moves_towards_new_steps() -> None:
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
