"""The incremental detokenizer and stop checker on SmolLM2's tokenizer: the deltas join to the
decode of the whole output, each token costs a decode of a few tokens (never the whole output
again), stop strings that span tokens end the text before them, and a stream never hands out
the start of a stop string."""

from __future__ import annotations

import random
from typing import Any

import pytest

from vegas_spec.config import SamplingParams
from vegas_spec.models.loader import resolve
from vegas_spec.sequence import Detokenizer, Sequence, StopChecker
from vegas_spec.stats import SeqStats, summarize
from vegas_spec.tokenizer import load_tokenizer, text_decoder

TEXT = ("Café naïve — 日本語のテキスト 😀🚀 and ünïcödé; the quick brown fox jumps over the "
        "lazy dog.\n\n  Indented   spaces,\ttabs, and ``quotes'' — done. ") * 8
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return load_tokenizer(resolve(None))


class Counting:
    """A tokenizer whose decode counts the ids it is given."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def full(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("group", [1, 3, 7])
def test_deltas_join_to_the_whole_decode(tokenizer: Any, group: int) -> None:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"] + [EOS]
    counting = Counting(tokenizer)
    detok = Detokenizer(counting)
    deltas = [detok.push(ids[i : i + group]) for i in range(0, len(ids), group)]
    deltas.append(detok.push([], final=True))
    assert "".join(deltas) == detok.text == full(tokenizer, ids)
    assert any(d == "" for d in deltas[:-1]) or group > 1  # multi-byte characters wait
    assert counting.decoded < 6 * len(ids) + 6 * group  # windows, not the whole output


def test_ids_pushed_together_give_the_text_of_one_by_one(tokenizer: Any) -> None:
    """After every group (1..γ+1 ids, as a decode iteration appends them) the text is the one
    per-id pushes reach, multi-byte characters that a group leaves open included; the
    backend's decode is the tokenizer's."""
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"] + [EOS]
    fast = text_decoder(tokenizer)
    assert fast(ids) == full(tokenizer, ids)
    together, alone = Detokenizer(tokenizer, fast), Detokenizer(tokenizer)
    rng, i, waited = random.Random(1), 0, 0
    while i < len(ids):
        group = ids[i : i + rng.randint(1, 7)]
        i += len(group)
        final = i >= len(ids)
        for j, tok in enumerate(group, 1):
            alone.push([tok], final=final and j == len(group))
        together.push(group, final=final)
        assert together.text == alone.text
        waited += full(tokenizer, ids[:i]) != together.text
    assert waited > 0 and together.text == full(tokenizer, ids)


def sequence(tokenizer: Any, stop: tuple[str, ...], max_tokens: int = 500) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, stop=stop)
    return Sequence("r", [1], [1], params, 1 + max_tokens, eos=frozenset({EOS}),
                    detok=Detokenizer(tokenizer))


def test_a_stop_string_across_tokens_ends_the_text_before_it(tokenizer: Any) -> None:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    seq = sequence(tokenizer, ("brown fox", "never there"))
    streamed = []
    rng = random.Random(0)
    i = 0
    while not seq.finished:
        n = rng.randint(1, 4)  # 1..γ+1 tokens a step
        seq.append(ids[i : i + n])
        i += n
        streamed.append(seq.delta()[0])
    assert seq.finish_reason == "stop"
    assert seq.text == TEXT[: TEXT.index("brown fox")]
    assert "".join(streamed) == seq.text
    # the output ends at the token that completed the stop string
    assert "brown fox" in full(tokenizer, seq.output)
    assert "brown fox" not in full(tokenizer, seq.output[:-1])


def test_streams_hold_back_what_may_start_a_stop(tokenizer: Any) -> None:
    ids = tokenizer("one two three four", add_special_tokens=False)["input_ids"]
    seq = sequence(tokenizer, ("four five",))
    seq.append(ids)
    text, tokens = seq.delta()
    assert not seq.finished and tokens == ids
    assert text == "one two three"[: len("one two three four") - len("four five") + 1]
    seq.finish("length")
    assert seq.delta() == (seq.text[len(text) :], [])
    assert text + seq.text[len(text) :] == "one two three four"


def test_eos_and_length_finish(tokenizer: Any) -> None:
    seq = sequence(tokenizer, (), max_tokens=3)
    assert seq.append([28, EOS, 29]) == 2 and seq.finish_reason == "stop"
    seq = sequence(tokenizer, (), max_tokens=3)
    assert seq.append([28, 29, 30, 31]) == 3 and seq.finish_reason == "length"
    assert seq.text == full(tokenizer, [28, 29, 30])


def test_stop_checker_looks_only_near_the_new_text() -> None:
    check = StopChecker(["abc", "zz"])
    assert check.find("xxabc", 1) == 2
    assert check.find("abcxxxx", 2) is None  # already seen: not where this delta reaches
    assert check.find("xxxzz", 1) == 3 and check.holdback() == 2
    assert StopChecker([]).find("anything", 3) is None


def test_running_statistics_summarize_as_the_whole_lists() -> None:
    rng = random.Random(2)
    stats = SeqStats(gamma=6)
    for _ in range(50):
        stats.record(rng.randint(1, 7), rng.choice([None, rng.randint(8, 400)]))
        assert stats.summary() == summarize(stats.tokens_per_iteration, 6, stats.budget)
    assert SeqStats().summary() == {"iterations": 0}
    assert summarize([1, 3, 7, 3], 6, [10, 30]) == {
        "iterations": 4, "tokens_per_iteration": 3.5,
        "tokens_per_iteration_histogram": [1, 0, 2, 0, 0, 0, 1],
        "acceptance_rate_per_position": [0.75, 0.75, 0.25, 0.25, 0.25, 0.25],
        "budget_mean": 20.0}
