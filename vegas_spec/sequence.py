"""One request's state: its ids, sampling settings, output so far and KV pages, with an
incremental detokenizer and stop checker, so that each step's new tokens become a text delta
without decoding the whole output again (and, without stop strings, are decoded only when the
text is read).

A sequence goes WAITING (queued) -> RUNNING (pages held: prefilling while `prefilled` is
short of `prefill_ids`, then decoding) -> FINISHED (pages released). A running sequence that
the pool cannot grow is preempted back to WAITING (`requeue`): its pages go back, and when it
runs again its prompt and the output so far are prefilled together (recomputed), after which
it decodes on from where it stopped. Imports `config`, `stats`."""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vegas_spec.config import SamplingParams
from vegas_spec.stats import SeqStats


class Tokenizer(Protocol):
    def decode(self, ids: list[int], **kwargs: Any) -> str: ...


# ids -> their text, special tokens skipped, spaces left as they are
Decode = Callable[[list[int]], str]
_NO_IDS: frozenset[int] = frozenset()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Detokenizer:
    """Incremental decoding (vLLM's offsets): each push decodes only a window that starts
    at the previous delta's first token, and returns the text it adds. A window whose text
    ends in U+FFFD (an incomplete UTF-8 character of byte-level BPE) waits for more tokens.
    The deltas join to the decode of the whole output. Ids may also be added without
    decoding them (`add`): they are decoded together, as one push, when `text` is next read,
    which gives the text their pushes would. decode: the tokenizer's decode with its
    settings bound (`tokenizer.text_decoder`), else its `decode` is called."""

    def __init__(self, tokenizer: Tokenizer, decode: Decode | None = None) -> None:
        self.tokenizer = tokenizer
        self._decode = decode or functools.partial(
            tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        self.ids: list[int] = []
        self.prefix = 0  # the window's first token
        self.read = 0  # tokens whose text is in self.text
        self._text = ""
        self._before: str | None = None  # text of ids[prefix:read]
        self._pushed = 0  # ids already decoded: those after them were added, not pushed
        self._final = False  # the added ids end the output

    @property
    def text(self) -> str:
        """The text so far (the ids added since the last read decoded first)."""
        if self._pushed < len(self.ids) or self._final:
            self._flush()
        return self._text

    def add(self, ids: list[int], final: bool = False) -> None:
        """Append ids without decoding them yet; final: they end the output (see push)."""
        self.ids.extend(ids)
        self._final = self._final or final

    def push(self, ids: list[int], final: bool = False) -> str:
        """Append ids -> the text they (and the ids added before them) complete ("" while a
        character is incomplete); final: flush whatever is pending, complete or not. Several
        ids at once give the text that pushing them one by one would: up to the last of them
        that completes a character."""
        start = len(self._text)
        self.add(ids, final)
        self._flush()
        return self._text[start:]

    def _flush(self) -> None:
        """Decode the ids added since the last push, as one group."""
        pushed, final = self._pushed, self._final
        self._pushed, self._final = len(self.ids), False
        if not self._advance(len(self.ids), final):
            # the last id leaves a character incomplete: the text of those before it
            for end in range(len(self.ids) - 1, pushed, -1):
                if self._advance(end, False):
                    break

    def _advance(self, end: int, final: bool) -> bool:
        """Take the text of ids up to `end` if it grows (and, unless final, ends in a whole
        character) -> whether it did."""
        if self._before is None:  # the same window until the text advances
            self._before = self._decode(self.ids[self.prefix : self.read])
        before, after = self._before, self._decode(self.ids[self.prefix : end])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return False
        self._text += after[len(before) :]
        self.prefix, self.read, self._before = self.read, end, None
        return True


class StopChecker:
    """Finds the first stop string in a growing text, looking only at what each delta adds
    (and the len(longest stop) - 1 characters before it, where a stop may have begun)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.reach = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, added: int) -> int | None:
        """The first index of a stop string in text that its last `added` characters touch."""
        if not self.stops or not added:
            return None
        lo = max(0, len(text) - added - self.reach + 1)
        hits = [i for i in (text.find(s, lo) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def holdback(self) -> int:
        """Characters a stream keeps back: they may be the start of a stop string."""
        return max(self.reach - 1, 0)


@dataclass(eq=False)  # compared and hashed by identity
class Sequence:
    request_id: str
    prompt: str | list[int]
    prompt_ids: list[int]
    params: SamplingParams
    limit: int  # total length (prompt + output) at which generation stops
    headroom: int = 0  # KV slots past `limit` that drafts write (γ + 1 for speculation)
    eos: frozenset[int] = frozenset()
    detok: Detokenizer | None = None
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)
    prefilled: int = 0  # positions of prefill_ids whose K/V are in the cache
    cached: int = 0  # of those, the first ones, on pages taken from the prefix cache
    # the ids a prefill runs over: the prompt, or after a preemption the prompt and output
    prefill_ids: list[int] = field(default_factory=list)
    preemptions: int = 0
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_at: int | None = None  # where a stop string begins in the text
    stats: SeqStats = field(default_factory=SeqStats)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    streamed: int = 0  # characters of text already handed out as deltas
    tokens_streamed: int = 0
    _stop: StopChecker | None = None

    def __post_init__(self) -> None:
        self._stop = StopChecker(self.params.stop or [])
        if not self.prefill_ids:
            self.prefill_ids = self.prompt_ids

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""
        return len(self.prompt_ids) + len(self.output)

    @property
    def committed(self) -> int:
        """KV positions that hold exact values: the prompt and all outputs but the last."""
        return len(self.prompt_ids) + len(self.output) - 1

    @property
    def kv_tokens(self) -> int:
        """KV slots the sequence may write by the time it finishes (its pages grow to
        these as it decodes)."""
        return self.limit + self.headroom

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        if self.detok is None:
            return ""
        return self.detok.text if self.stop_at is None else self.detok.text[: self.stop_at]

    def append(self, tokens: list[int]) -> int:
        """Append emitted tokens, stopping at max_tokens, EOS or a stop string; -> how many
        were kept. Without stop strings nothing needs the text yet: the kept tokens are
        detokenized, together with any before them, when the text is next read."""
        if self.first_token_time is None and tokens:
            self.first_token_time = time.perf_counter()
        if self.detok is not None and self._stop is not None and self._stop.stops:
            return self._append_each(tokens)  # a stop string ends the output at its token
        kept = self._kept(tokens)
        if kept < len(tokens):
            tokens = tokens[:kept]
        self.output.extend(tokens)
        if self.detok is not None and kept:
            self.detok.add(tokens, final=self.finished)
        return kept

    def _kept(self, tokens: list[int]) -> int:
        """How many of tokens to keep before EOS or the length limit ends the sequence (its
        finish_reason then set)."""
        eos = _NO_IDS if self.params.ignore_eos else self.eos
        room = self.limit - len(self.prompt_ids) - len(self.output)
        if len(tokens) < room and eos.isdisjoint(tokens):  # the common case: all of them
            return len(tokens)
        for n, tok in enumerate(tokens, 1):
            if tok in eos:
                self.finish_reason = "stop"
                return n
            if n >= room:
                self.finish_reason = "length"
                return n
        return len(tokens)

    def _append_each(self, tokens: list[int]) -> int:
        for n, tok in enumerate(tokens, 1):
            self._kept([tok])
            self.output.append(tok)
            self._detokenize(tok)
            if self.finish_reason:
                return n
        return len(tokens)

    def _detokenize(self, tok: int) -> None:
        assert self.detok is not None and self._stop is not None
        added = len(self.detok.push([tok], final=self.finish_reason is not None))
        at = self._stop.find(self.detok.text, added)
        if at is not None:
            self.stop_at, self.finish_reason = at, "stop"

    def requeue(self) -> None:
        """Preempted (its pages already released): waiting again, to prefill its prompt and
        the output so far before it decodes on."""
        self.status, self.prefilled, self.cached, self.pages = Status.WAITING, 0, 0, []
        self.prefill_ids = self.prompt_ids + self.output
        self.preemptions += 1

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
        if self.detok is not None:
            self.detok.add([], final=True)

    def delta(self) -> tuple[str, list[int]]:
        """The text and token ids not yet handed out; while running, the characters that may
        begin a stop string are kept back."""
        text = self.text
        end = len(text)
        if not self.finished and self._stop is not None:
            end = max(self.streamed, end - self._stop.holdback())
        out, self.streamed = text[self.streamed : end], end
        ids, self.tokens_streamed = self.output[self.tokens_streamed :], len(self.output)
        return out, ids
