"""Waiting and running queues: which requests run, and which prompt positions are prefilled
in the next step.

Requests are admitted first come, first served while a row is free (`row_limit`) and their
KV pages fit in the pool: a sequence takes every page it may write (prompt, output and the
drafts' headroom) at admission and gives them back when it finishes or is aborted, so a
running sequence never waits for memory. Prompts are prefilled in pieces under a per-step
token budget, oldest first, so a long prompt cannot stall the running sequences for more
than one budget's forward; `PrefillPacer` can size that budget from measured step times
while rows decode. Knows nothing of tensors. Imports `sequence`."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from vegas_spec.sequence import Sequence, Status


class PagePool(Protocol):
    free_pages: list[int]

    def pages_for(self, tokens: int) -> int: ...

    def allocate(self, tokens: int) -> list[int]: ...

    def release(self, pages: list[int]) -> None: ...


@dataclass
class Piece:
    """Positions start..end-1 of seq's prompt, prefilled in this step."""

    seq: Sequence
    start: int
    end: int


@dataclass
class _CostFit:
    """Exponentially weighted least squares of a prefill's cost over its tokens:
    seconds ~ fixed + marginal x tokens (a forward has a cost of its own, launches and the
    host's packing, besides its tokens')."""

    decay: float
    seen: int = 0
    s0: float = 0.0
    s1: float = 0.0
    s2: float = 0.0
    t0: float = 0.0
    t1: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        d = 1.0 - self.decay
        self.seen += 1
        self.s0, self.s1, self.s2 = d * self.s0 + 1, d * self.s1 + tokens, d * self.s2 + tokens ** 2
        self.t0, self.t1 = d * self.t0 + seconds, d * self.t1 + tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """(fixed, marginal) seconds, or None until two different token counts were seen."""
        spread = self.s0 * self.s2 - self.s1 ** 2
        if self.seen < 2 or spread <= 1e-6 * self.s0 * self.s2:
            return None
        marginal = (self.s0 * self.t1 - self.s1 * self.t0) / spread
        if marginal <= 0:
            return None
        return max((self.t0 - marginal * self.s1) / self.s0, 0.0), marginal


@dataclass
class PrefillPacer:
    """The prompt tokens of a step while rows decode (stall-free chunked prefill): as many as
    add about `ratio` x one decode iteration's time to the step, so that a step which admits
    prompts takes about (1 + ratio) x a decode-only step, and the inter-token latency of the
    running requests stays within that factor while long prompts arrive.

    Estimated online from whole-step wall times, which end when the step's tokens reach the
    host: the decode iteration from the decoding steps that prefilled nothing (a running
    average), the prefill's cost from the excess of those that did (a line, fixed +
    marginal per token: a forward costs something whatever its size). Where even the
    smallest chunk would exceed the target (the fixed cost of a forward is more than `ratio`
    decode iterations), pacing cannot reach it: with `out_of_reach` "whole" a step then takes
    the whole `ceiling` (fewer, larger forwards keep the most throughput), with "floor" the
    smallest chunk (the shortest stall). A step takes the whole ceiling before the first
    estimates, and whenever nothing decodes."""

    ceiling: int
    ratio: float = 1.0
    floor: int = 512
    smoothing: float = 0.2  # weight of the newest step in the running estimates
    out_of_reach: str = "whole"  # or "floor"
    decode_s: float | None = field(default=None, init=False)
    cost: _CostFit = field(init=False)

    def __post_init__(self) -> None:
        if self.out_of_reach not in ("whole", "floor"):
            raise ValueError(f"out_of_reach must be 'whole' or 'floor', got {self.out_of_reach!r}")
        self.cost = _CostFit(self.smoothing)

    def budget(self, decoding: bool) -> int:
        line = self.cost.line()
        if not decoding or self.decode_s is None or line is None:
            return self.ceiling
        fixed, marginal = line
        tokens = int((self.ratio * self.decode_s - fixed) / marginal)
        floor = min(self.floor, self.ceiling)
        if tokens < floor:
            return self.ceiling if self.out_of_reach == "whole" else floor
        return min(self.ceiling, tokens)

    def observe(self, prefill_tokens: int, decoded: bool, seconds: float) -> None:
        """One finished step: prompt tokens it prefilled, whether rows decoded, its seconds."""
        if not decoded:
            return
        if prefill_tokens == 0:
            old, w = self.decode_s, self.smoothing
            self.decode_s = seconds if old is None else old + w * (seconds - old)
        elif self.decode_s is not None:
            self.cost.add(prefill_tokens, max(seconds - self.decode_s, 0.0))


class Scheduler:
    def __init__(self, pool: PagePool, max_num_seqs: int, prefill_budget: int) -> None:
        self.pool, self.max_num_seqs, self.prefill_budget = pool, max_num_seqs, prefill_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, row_limit: int) -> list[Sequence]:
        """Move waiting sequences to running, oldest first, while fewer than row_limit (and
        max_num_seqs) run and their pages fit; each takes its pages now."""
        admitted = []
        limit = min(row_limit, self.max_num_seqs)
        while self.waiting and len(self.running) < limit:
            seq = self.waiting[0]
            if self.pool.pages_for(seq.kv_tokens) > len(self.pool.free_pages):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.pages = self.pool.allocate(seq.kv_tokens)
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def max_resident(self, seqs: list[Sequence]) -> int:
        """The most of `seqs` that could ever run at once: at most max_num_seqs, and no more
        than the free pages hold, the smallest sequences counted first."""
        left, count = len(self.pool.free_pages), 0
        for need in sorted(self.pool.pages_for(s.kv_tokens) for s in seqs):
            if need > left or count == self.max_num_seqs:
                break
            left -= need
            count += 1
        return count

    def prefill_pieces(self, budget: int | None = None) -> list[Piece]:
        """The prompt positions to prefill in this step: at most `budget` (default
        prefill_budget) tokens, running sequences in admission order, a prompt cut where the
        budget ends."""
        pieces, left = [], self.prefill_budget if budget is None else budget
        for seq in self.running:
            todo = len(seq.prompt_ids) - seq.prefilled
            if todo <= 0 or left <= 0:
                continue
            take = min(todo, left)
            pieces.append(Piece(seq, seq.prefilled, seq.prefilled + take))
            left -= take
        return pieces

    def finish(self, seq: Sequence) -> None:
        """A running or waiting sequence is done (finished or aborted): its pages go back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.pages)
        seq.pages = []
        seq.status = Status.FINISHED
