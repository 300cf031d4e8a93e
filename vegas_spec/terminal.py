"""What `vegas generate` and `vegas compare` show while the engine works: one prompt's text as
it is decoded (stdout), and on a terminal a line on stderr, rewritten in place, with the
prefill's progress of long prompts and a batch's tokens done of the total and their rate.

Fed by `LLM.generate(on_step=...)` with a `Progress` after every step; standard library only,
and it writes at most a few times a second, so that it costs the run nothing measurable."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from vegas_spec.engine import Progress

# Prompts of at least this many tokens in all show the prefill's progress (shorter ones
# prefill in about a second on a CPU).
LONG_PREFILL = 1024
EVERY_S = 0.2  # the line is rewritten at most this often
CLEAR = "\r\033[K"  # back to the line's start, erase it


class Display:
    """out: where the text of a single prompt streams (None: not streamed); line: the
    terminal that shows the progress line (None: no line); label: the line's first word
    (the method in `vegas compare`)."""

    def __init__(self, out: TextIO | None, line: TextIO | None, label: str = "") -> None:
        self.out, self.line, self.label = out, line, label
        self.written = 0  # characters of text streamed to out
        self.shown = ""  # the progress line on the terminal ("" : none)
        self.last = 0.0  # when the line was last written
        self.decoding: tuple[float, int] | None = None  # (when, tokens) decoding began
        self.phase = ""  # of the line last shown: prefill or decode

    @property
    def active(self) -> bool:
        """Whether it shows anything (else the run need not call it)."""
        return self.out is not None or self.line is not None

    def __call__(self, progress: Progress) -> None:
        if self.out is not None and any(o.delta_text for o in progress.outputs):
            self.clear()
            for o in progress.outputs:
                self.out.write(o.delta_text)
                self.written += len(o.delta_text)
            self.out.flush()
        if self.line is not None:
            self._update(progress)

    def _update(self, p: Progress) -> None:
        now = time.perf_counter()
        if p.prefilled < p.prompt_tokens:
            phase = "prefill"
            text = f"prefill {p.prefilled:,}/{p.prompt_tokens:,} tokens" \
                if p.prompt_tokens >= LONG_PREFILL else ""
        else:  # a streamed text shows the decode itself
            phase, text = "decode", "" if self.out is not None else self._decode_text(p, now)
        if not text:
            self.clear()
        elif phase != self.phase or now - self.last >= EVERY_S:  # a new phase at once
            self._show(text, now)
        self.phase = phase

    def _decode_text(self, p: Progress, now: float) -> str:
        if self.decoding is None:
            self.decoding = (now, p.generated)
        since, first = self.decoding
        rate = (p.generated - first) / (now - since) if now > since else 0.0
        speed = f", {rate:,.1f} tokens/s" if p.generated > first else ""
        return f"{p.generated:,}/{p.most:,} tokens{speed}"

    def _show(self, text: str, now: float) -> None:
        assert self.line is not None
        self.shown = f"{self.label}: {text}" if self.label else text
        self.line.write(CLEAR + self.shown)
        self.line.flush()
        self.last = now

    def clear(self) -> None:
        """Erase the progress line (before text is written, and at the end)."""
        if self.shown and self.line is not None:
            self.line.write(CLEAR)
            self.line.flush()
        self.shown = ""
