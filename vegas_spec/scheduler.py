"""Waiting and running queues: which requests run, and what each step does (`schedule`: one
`StepPlan` for the model runner, whose `StepResult` the engine appends to the sequences).

Requests are admitted first come, first served while a row is free (`row_limit`) and the
pages of their prompt fit in the pool. A sequence's pages grow as it decodes (`grow`, before
each decode iteration: the slots its next iteration writes, the drafts' headroom included,
and `grow_tokens` more, so that it asks only every few iterations); when the pool runs out,
the most recently admitted sequence is preempted: its pages go back and it returns to the
head of the queue, to be prefilled again with its output so far (vLLM's recompute), so every
admitted request keeps making progress and none holds pages it has not yet written. Pages go
back when a sequence finishes or is aborted. Prompts are prefilled in pieces under a per-step
token budget, oldest first, so a long prompt cannot stall the running sequences for more
than one budget's forward; `PrefillPacer` can size that budget from measured step times
while rows decode.

With the prefix cache on, a sequence takes the cached full pages its prompt starts with by
reference (`place`) and prefills only the rest; the pages a prefill completes are named for
the sequences after it (`prefilled`), and the head of the queue waits while a running
sequence computes the next page of its prompt (`_coming`: many requests with one system
prompt compute it once, not once each in the steps before it is cached). The scheduler alone
takes and releases pages, and alone moves a sequence on: its prefilled positions advance
when a step is planned (as vLLM's computed tokens), and it knows which sequences hold the
runner's rows, in row order (`rows`), and which rows leave in the next plan (`leaving`:
those that finished); the pages a prefill completes are named once the step ran
(`stepped`). Knows nothing of tensors. Imports `sequence`, `step`, `pages` and
`prefix_cache` (names)."""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field

from vegas_spec.pages import PageAllocator
from vegas_spec.prefix_cache import Name, shareable
from vegas_spec.sequence import Sequence, Status
from vegas_spec.step import Prefill, StepPlan


@dataclass
class Piece:
    """Positions start..end-1 of seq's prefill_ids, prefilled in this step."""

    seq: Sequence
    start: int
    end: int


def _running(old: float | None, new: float, weight: float) -> float:
    """A running average: `new` at first, then moved `weight` of the way towards it."""
    return new if old is None else old + weight * (new - old)


@dataclass
class PrefillPacer:
    """The prompt tokens of a step while rows decode (stall-free chunked prefill): as many as
    add about `ratio` x one decode iteration's time to the step, so that a step which admits
    prompts takes about (1 + ratio) x a decode-only step, and the inter-token latency of the
    running requests stays within that factor while long prompts arrive.

    Estimated online from whole-step wall times, which end when the step's tokens reach the
    host: the decode iteration from the decoding steps that prefilled nothing (a running
    average), and the tokens a step can take from the steps that prefilled while rows
    decoded: each says tokens x target / excess, its excess being its time over the decode
    estimate, and the budget is a running average of that (of its logarithm: a ratio). If a
    forward costs F + m x tokens, this settles where F + m x tokens = target whatever F is
    (from T the next is T x target / (F + m T), whose fixed point is stable while F <
    target), so a forward's fixed cost (launches, the host's packing) needs no separate fit.
    Steps that prefilled less than half their budget (a prompt's short tail) are left out:
    their fixed cost would pull the budget down. Where the budget falls under `floor`
    (the target is out of reach: a forward's fixed cost exceeds `ratio` decode iterations),
    a step takes the smallest chunk (the shortest stall, and the estimate goes on from it).
    A step takes the whole ceiling before the first estimates, and whenever
    nothing decodes."""

    ceiling: int
    ratio: float = 1.0
    floor: int = 512
    smoothing: float = 0.2  # weight of the newest step in the running estimates
    decode_s: float | None = field(default=None, init=False)
    log_tokens: float | None = field(default=None, init=False)

    @property
    def tokens(self) -> float | None:
        """The estimate of the tokens a step can take (None before one)."""
        return None if self.log_tokens is None else math.exp(self.log_tokens)

    def budget(self, decoding: bool) -> int:
        tokens = self.tokens
        if not decoding or self.decode_s is None or tokens is None:
            return self.ceiling
        return min(self.ceiling, max(int(tokens), self._smallest))

    @property
    def _smallest(self) -> int:
        """The smallest chunk a paced step takes (the floor, within the ceiling)."""
        return min(self.floor, self.ceiling)

    def observe(self, prefill_tokens: int, decoded: bool, seconds: float,
                asked: int | None = None) -> None:
        """One finished step: prompt tokens it prefilled, whether rows decoded, its seconds,
        the budget it was given (None: the ceiling)."""
        if not decoded:
            return
        if prefill_tokens == 0:
            self.decode_s = _running(self.decode_s, seconds, self.smoothing)
            return
        asked = self.ceiling if asked is None else asked
        if self.decode_s is None:
            return
        enough = asked / 2 if asked < self.ceiling else self._smallest
        if prefill_tokens < enough:
            return
        target = self.ratio * self.decode_s
        excess = max(seconds - self.decode_s, 0.05 * target)  # noise under a tiny excess
        self.log_tokens = _running(self.log_tokens, math.log(prefill_tokens * target / excess),
                                   self.smoothing)


GROW_TOKENS = 64  # slots a sequence takes beyond what its next iteration writes
WATERMARK = 0.01  # of the pool, kept free at admission for the running sequences to grow


class Scheduler:
    def __init__(self, pool: PageAllocator, max_num_seqs: int, prefill_budget: int,
                 grow_tokens: int = GROW_TOKENS) -> None:
        self.pool, self.max_num_seqs, self.prefill_budget = pool, max_num_seqs, prefill_budget
        self.grow_tokens = grow_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        # pages the queue's head may not take while sequences run
        self.watermark = math.ceil(WATERMARK * pool.num_free)
        # the names of the full prompt pages of the running sequences still prefilling
        self._names: dict[Sequence, list[Name]] = {}
        self._head: tuple[Sequence, int, list[Name]] | None = None  # `_head_names`' last
        self.rows: list[Sequence] = []  # the sequences that hold the runner's rows, in order
        self.leaving: list[str] = []  # request ids of rows that finished: they leave next
        self._planned: list[Piece] = []  # the pieces of the step planned last, until it ran

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _tokens(self, seq: Sequence, ahead: int | None = None) -> int:
        """The KV slots seq's next iteration writes (after the prefill of prefill_ids, or the
        decode of its newest token) and `ahead` more (default grow_tokens: what it takes when
        it gets pages), within what it may ever write."""
        ahead = self.grow_tokens if ahead is None else ahead
        return min(seq.kv_tokens, seq.num_tokens + seq.headroom + ahead)

    def footprint(self, seq: Sequence) -> int:
        """Pages seq takes at admission."""
        return self.pool.pages_for(self._tokens(seq))

    def admit(self, row_limit: int) -> list[Sequence]:
        """Move waiting sequences to running, oldest first, while fewer than row_limit (and
        max_num_seqs) run and their first pages fit (beside the watermark, while others
        run; cached prefix pages cost only the parked ones they take); each takes them now.
        The head waits while a running sequence computes the next page of its prompt."""
        admitted = []
        limit = min(row_limit, self.max_num_seqs)
        while self.waiting and len(self.running) < limit:
            seq = self.waiting[0]
            spare = self.watermark if self.running else 0
            names = self._head_names(seq)
            hit = self.pool.cached_prefix(seq.prefill_ids, names)
            need = self.footprint(seq) - len(hit) + self.pool.unheld(hit)
            if need + spare > self.pool.num_free or self._coming(seq, names, len(hit)):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.place(seq, self._tokens(seq), names)
            if names and seq.prefilled < len(seq.prefill_ids):
                self._names[seq] = names
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def place(self, seq: Sequence, tokens: int, names: list[Name] | None = None) -> None:
        """seq takes the pages of `tokens` slots (the caller has checked that they fit): its
        prompt's longest cached prefix by reference (prefilled already), the rest new.
        names: its prompt's page names, if made already."""
        hit = self.pool.cached_prefix(seq.prefill_ids, names)
        self.pool.share(hit)
        seq.cached = seq.prefilled = len(hit) * self.pool.page_size
        seq.pages = hit + self.pool.allocate(tokens - seq.cached)
        if self.pool.prefix is not None:
            self.pool.prefix.stats.queried += len(seq.prefill_ids)
            self.pool.prefix.stats.hit += seq.cached

    def _head_names(self, seq: Sequence) -> list[Name]:
        """The page names of the head's prompt, made once while it waits at the head."""
        if self._head is None or self._head[0] is not seq \
                or self._head[1] != len(seq.prefill_ids):
            self._head = (seq, len(seq.prefill_ids), self.pool.names(seq.prefill_ids))
        return self._head[2]

    def _coming(self, seq: Sequence, names: list[Name], cached: int) -> bool:
        """Whether a running sequence is computing the page of seq's prompt after its
        `cached` cached pages now: seq then waits for it rather than computing it again."""
        size = self.pool.page_size
        if not self._names or cached >= shareable(len(seq.prefill_ids), size):
            return False
        return any(len(theirs) > cached and theirs[cached] == names[cached]
                   and other.prefilled < (cached + 1) * size
                   for other, theirs in self._names.items())

    def schedule(self, row_limit: int, budget: int | None = None,
                 prefill_first: bool = False) -> StepPlan:
        """The next step: admission (while fewer than row_limit run), the prompt pieces of
        one budget (prefilled from now on), and, unless prefill_first holds the rows back
        while a prompt is still incomplete, one decode iteration over the rows (those in
        use and the prompts completed now that go on decoding), each with the pages it
        writes (the newest sequences preempted where the pool runs out)."""
        self.admit(row_limit)
        reserve = len(self.running)
        self._planned = pieces = self.prefill_pieces(budget)
        for p in pieces:
            p.seq.prefilled = p.end
        prefill = [self._piece(p) for p in pieces]
        rows = self.rows + [p.seq for p, w in zip(pieces, prefill) if w.joins]
        decode = bool(rows) and not (prefill_first and self.prefilling())
        grown, preempted = self.grow(rows) if decode else ([], [])
        leave, self.leaving = self.leaving, []
        if preempted:  # a preempted prompt's piece still runs (it was planned), then it waits
            prefill = [w if not w.joins or p.seq.status is Status.RUNNING
                       else dataclasses.replace(w, joins=False)
                       for p, w in zip(pieces, prefill)]
            leave += [s.request_id for s in self.rows if s.status is not Status.RUNNING]
        self.rows = [s for s in rows if s.status is Status.RUNNING]
        return StepPlan(tuple(leave), reserve, tuple(prefill),
                        tuple((s.request_id, tuple(s.pages)) for s in grown),
                        decode and bool(self.rows))

    @staticmethod
    def _piece(p: Piece) -> Prefill:
        """The plan's copy of a piece: its ids and the sequence's pages; one that completes
        its prompt joins unless its first token is the last that the length allows."""
        seq = p.seq
        total = len(seq.prefill_ids)
        joins = p.end == total and seq.limit - seq.num_tokens > 1
        return Prefill(seq.request_id, p.start, tuple(seq.prefill_ids[p.start : p.end]), total,
                       tuple(seq.pages), seq.params, joins)

    def stepped(self) -> None:
        """After the planned step ran and its tokens are appended: the pages its prefill
        completed become shareable (a preempted sequence's are gone already), and the rows
        whose sequences finished leave with the next plan."""
        pieces, self._planned = self._planned, []
        self.prefilled([p for p in pieces if p.seq.status is Status.RUNNING])
        if any(s.finished for s in self.rows):
            self.leaving += [s.request_id for s in self.rows if s.finished]
            self.rows = [s for s in self.rows if not s.finished]

    def prefilled(self, pieces: list[Piece]) -> None:
        """After a prefill ran `pieces`: the pages it completed become shareable."""
        for p in pieces:
            self.pool.name(p.seq.prefill_ids, p.seq.pages, p.end, self._names.get(p.seq))
            if p.end == len(p.seq.prefill_ids):
                self._names.pop(p.seq, None)

    def grow(self, rows: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Before a decode iteration over `rows` (running sequences, oldest first): each gets
        the pages its iteration writes, preempting the most recently admitted sequences
        (itself last) while the pool is short -> (the rows that got pages, the preempted)."""
        grown: list[Sequence] = []
        preempted: list[Sequence] = []
        for seq in rows:
            if seq.status is not Status.RUNNING or seq.finished:
                continue
            need = self.pool.pages_for(self._tokens(seq, ahead=0))
            if len(seq.pages) >= need:
                continue
            while need - len(seq.pages) > self.pool.num_free:
                victim = self._victim(seq)
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                more = self.pool.pages_for(self._tokens(seq)) - len(seq.pages)
                seq.pages += self.pool.take(min(more, self.pool.num_free))
                grown.append(seq)
        return [s for s in grown if s.status is Status.RUNNING], preempted

    def _victim(self, seq: Sequence) -> Sequence:
        """The most recently admitted unfinished running sequence other than seq (seq if
        none is left)."""
        for other in reversed(self.running):
            if other is not seq and not other.finished:
                return other
        return seq

    def preempt(self, seq: Sequence) -> None:
        """A running sequence gives its pages back and waits at the head of the queue."""
        self.running.remove(seq)
        self.pool.release(seq.pages)
        self._names.pop(seq, None)
        seq.requeue()
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def max_resident(self, seqs: list[Sequence]) -> int:
        """The most of `seqs` that could run at once: at most max_num_seqs, and no more
        than the free pages admit, the smallest sequences counted first."""
        left, count = self.pool.num_free, 0
        for need in sorted(self.footprint(s) for s in seqs):
            if need > left or count == self.max_num_seqs:
                break
            left -= need
            count += 1
        return count

    def prefilling(self) -> bool:
        """Whether a running sequence still has prompt positions to prefill."""
        return any(seq.prefilled < len(seq.prefill_ids) for seq in self.running)

    def prefill_pieces(self, budget: int | None = None) -> list[Piece]:
        """The prompt positions to prefill in this step: at most `budget` (default
        prefill_budget) tokens, running sequences in admission order, a prompt cut where the
        budget ends."""
        pieces, left = [], self.prefill_budget if budget is None else budget
        for seq in self.running:
            todo = len(seq.prefill_ids) - seq.prefilled
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
            if seq in self.rows:
                self.rows.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.pages)
        self._names.pop(seq, None)
        seq.pages = []
        seq.status = Status.FINISHED
