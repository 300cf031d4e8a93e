"""One engine step as one message: the `StepPlan` the scheduler makes and the `StepResult`
the model runner gives back (vLLM's SchedulerOutput and ModelRunnerOutput).

Both are plain host data (request ids, token ids, page ids, settings), so the plan is what
tensor parallelism broadcasts to every rank, and the runner needs no `Sequence`: the
scheduler alone updates sequences and pages, from the result. Imports only `config`."""

from __future__ import annotations

from dataclasses import dataclass, field

from vegas_spec.config import SamplingParams


@dataclass(frozen=True)
class Prefill:
    """Positions start..end-1 of a prompt of `total` tokens (a sequence's prefill ids: after
    a preemption its prompt and output so far), `tokens` their ids, written to the
    sequence's `pages` (positions before `start` are cached there already). A piece that
    ends its prompt gives the prompt's first token, drawn with `params`; the sequence then
    takes a row and decodes if it `joins` (False: that token is its last)."""

    request_id: str
    start: int
    tokens: tuple[int, ...]
    total: int
    pages: tuple[int, ...]
    params: SamplingParams
    joins: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def ends(self) -> bool:
        """The piece completes its prompt."""
        return self.end == self.total


@dataclass(frozen=True)
class StepPlan:
    """One step, in the order the runner takes it: the rows that `leave` (finished in the
    step before, or preempted for this one's pages), the static buffers sized for `reserve`
    rows (only while no row is in use), the prompt pieces to `prefill` (their sequences in
    admission order; a completed prompt that joins takes a row after the rows in use), the
    rows whose page lists grew (`pages`: each one's whole list), then, if `decode`, one
    iteration over every row: a draft-verify-accept round, or one plain step where `draft`
    is False (plain decoding, or the adaptive controller's choice)."""

    leave: tuple[str, ...] = ()
    reserve: int = 0
    prefill: tuple[Prefill, ...] = ()
    pages: tuple[tuple[str, tuple[int, ...]], ...] = ()
    decode: bool = False
    draft: bool = True


@dataclass(frozen=True)
class StepResult:
    """What a step gave, on the host: `first`, the first token of each prompt it completed
    (request id, token; in the plan's order); if it decoded, per row (`rows`: request ids in
    row order) the tokens it emitted (1..γ+1) and the selection budget its drafts read (None:
    no sparse drafts), drafted: the iteration was a round (False: a plain step);
    prefill_seconds: the wall time of the step's prefill, up to its first tokens' read."""

    first: list[tuple[str, int]] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    budgets: list[int | None] = field(default_factory=list)
    drafted: bool = False
    prefill_seconds: float = 0.0
