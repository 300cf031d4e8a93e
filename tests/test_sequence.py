"""The incremental detokenizer and stop checker on SmolLM2's tokenizer: the deltas join to the
decode of the whole output, each token costs a decode of a few tokens (never the whole output
again), ids added without decoding give, when read, the text their pushes give, stop strings
that span tokens end the text before them, and a stream never hands out the start of a stop
string."""

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
        drafted = rng.choice([2, 4, 6])
        stats.record(rng.randint(1, drafted + 1), rng.choice([None, rng.randint(8, 400)]),
                     drafted)
        assert stats.summary() == summarize(stats.tokens_per_iteration, 6, stats.budget,
                                            stats.drafts)
    assert SeqStats().summary() == {"iterations": 0}
    assert summarize([1, 3, 7, 3], 6, [10, 30]) == {
        "iterations": 4, "tokens_per_iteration": 3.5,
        "tokens_per_iteration_histogram": [1, 0, 2, 0, 0, 0, 1],
        "draft_length_histogram": [0, 0, 0, 0, 0, 4],
        "acceptance_rate_per_position": [0.75, 0.75, 0.25, 0.25, 0.25, 0.25],
        "budget_mean": 20.0}
    # rounds of fewer drafts count only at the positions they drafted
    assert summarize([1, 3, 7, 3], 6, [], [2, 2, 6, 6])["acceptance_rate_per_position"] == [
        0.75, 0.75, 0.5, 0.5, 0.5, 0.5]


@pytest.fixture(scope="module")
def partial_ids(tokenizer: Any) -> list[int]:
    """Ids whose text alone is an incomplete UTF-8 character (byte tokens)."""
    fast = text_decoder(tokenizer)
    return [i for i in range(len(tokenizer)) if "\ufffd" in fast([i])]


def random_ids(tokenizer: Any, partial: list[int], rng: random.Random, n: int) -> list[int]:
    """Runs of TEXT's ids (multi-byte characters split across tokens), byte tokens that
    leave characters incomplete (or invalid), any ids, special ids."""
    text = tokenizer(TEXT[:400], add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    while len(ids) < n:
        r = rng.random()
        if r < 0.3:
            ids += [rng.choice(partial) for _ in range(rng.randint(1, 4))]
        elif r < 0.5:
            ids.append(rng.randrange(len(tokenizer)))
        elif r < 0.55:
            ids.append(rng.choice(tokenizer.all_special_ids))
        else:
            at = rng.randrange(len(text))
            ids += text[at : at + rng.randint(1, 8)]
    return ids


@pytest.mark.parametrize("reads", [0.0, 0.3, 1.0])
def test_added_ids_read_later_give_the_pushed_text(tokenizer: Any, partial_ids: list[int],
                                                   reads: float) -> None:
    """Ids added without decoding (1..γ+1 at a time) and read at random points, or only at
    the end, give exactly the text of pushing them as they came, with fewer decodes."""
    fast = text_decoder(tokenizer)
    for seed in range(40):
        rng = random.Random(seed)
        ids = random_ids(tokenizer, partial_ids, rng, 150)
        counting = Counting(tokenizer)
        pushed, added = Detokenizer(tokenizer, fast), Detokenizer(counting)
        i = 0
        while i < len(ids):
            group = ids[i : i + rng.randint(1, 7)]
            i += len(group)
            final = i >= len(ids)
            pushed.push(group, final=final)
            added.add(group, final=final)
            if rng.random() < reads:
                assert added.text == pushed.text, seed
        decoded = counting.decoded
        assert added.text == pushed.text == full(tokenizer, ids), seed
        if reads == 0.0:
            assert decoded == 0 and counting.decoded <= 2 * len(ids)  # one window, once


def test_a_sequence_without_stops_decodes_only_when_read(tokenizer: Any) -> None:
    """Appends decode nothing; the text, once read, is the one of pushing every step's
    kept ids."""
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"][:200]
    counting = Counting(tokenizer)
    seq = Sequence("r", [1], [1], SamplingParams(max_tokens=150), 151, eos=frozenset({EOS}),
                   detok=Detokenizer(counting))
    pushed = Detokenizer(tokenizer)
    rng, i = random.Random(3), 0
    while not seq.finished:
        group = ids[i : i + rng.randint(1, 7)]
        kept = seq.append(group)
        pushed.push(group[:kept], final=seq.finished)
        i += kept
    assert counting.decoded == 0 and seq.finish_reason == "length"
    assert seq.output == ids[:150]
    assert seq.text == pushed.text == full(tokenizer, ids[:150])
    assert counting.decoded > 0
    assert seq.delta() == (seq.text, ids[:150])


def test_with_stops_each_token_is_decoded_and_the_output_ends_at_the_stop(
        tokenizer: Any) -> None:
    """All ids at once: the output still ends at the token that completes the stop."""
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    counting = Counting(tokenizer)
    seq = Sequence("r", [1], [1], SamplingParams(max_tokens=500, stop=("brown fox",)), 501,
                   eos=frozenset({EOS}), detok=Detokenizer(counting))
    kept = seq.append(ids[:120])
    assert counting.decoded > 0 and seq.finish_reason == "stop"
    assert seq.output == ids[:kept] and kept < 120
    assert "brown fox" in full(tokenizer, ids[:kept])
    assert "brown fox" not in full(tokenizer, ids[: kept - 1])
    assert seq.text == TEXT[: TEXT.index("brown fox")]


def test_a_summary_up_to_an_iteration_is_the_one_taken_then() -> None:
    rng = random.Random(4)
    stats, taken = SeqStats(gamma=6), []
    for _ in range(40):
        drafted = rng.choice([3, 6])
        stats.record(rng.randint(1, drafted + 1), rng.choice([None, rng.randint(8, 400)]),
                     drafted)
        taken.append((stats.iterations, len(stats.budget), stats.summary()))
    assert all(stats.summary_upto(n, b) == s for n, b, s in taken)
    assert taken[0][2] != taken[-1][2]
