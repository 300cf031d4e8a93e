"""Adaptive speculation: per iteration, how many tokens to draft (none: a plain step), from
the engine's own running measurements.

A round of g drafts emits τ(g) tokens a row in the time c(g) of its batch bucket; a plain
step (g = 0) emits one in c(0). The controller chooses the g of the highest rate
τ(g) / c(g) among 0 and its draft lengths (`draft_lengths`: γ and shorter ones, each a round
graph of its own). It keeps, per bucket, exponential moving averages of each choice's cost
(the wall time of an engine step's iteration: the device's time and all the host's work of
the step, which an iteration pays whatever its tokens, so a plain step is dearer than its
forward; in a step that also prefilled, less the prefill's part) and the acceptance rate of
each draft position, from the tokens every row emitted. Drafts do not depend on how many
follow them, so the rates measured in rounds of γ give τ(g) of every shorter g:
τ(g) = 1 + Σ_{i ≤ g} Π_{j ≤ i} α_j. A cost not yet measured is interpolated between the
measured ones (a round of g costs about its drafts and a verify of g + 1 rows).

A new bucket (rows left or joined) starts from the estimates of the bucket last used: its
costs until each is measured there, and its acceptance. So a batch whose rows finish one by
one does not pay a measurement of every choice in every bucket it passes through.

Now and then it runs a choice not taken (a probe) so that every estimate follows the context
as it grows. A probe loses time: it costs c(g) where the best choice gives its τ(g) tokens
in τ(g) · c(best) / τ(best); probes of each choice are spaced so that this loss is at most
`cost` of the time between them (and at least `probe`, at most `most` iterations apart).

The first round after plain steps is dearer than the next ones (its rows are planned again
on the host, their recent range having moved on), so its time is not a round's: a round
probed after plain steps is two rounds, the second measured. Were that first round
measured, a probe would find rounds dearer than they are whenever plain steps ran before
it, and the controller could stay on plain steps where rounds pay. What that first round
costs beyond a round (`replan`) is charged to each probe that crosses between plain steps and
rounds, and to a switch of the best choice. Nothing here touches the
device; the choice changes only how many tokens are drafted, never which tokens are
emitted."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


def draft_lengths(gamma: int) -> tuple[int, ...]:
    """The draft lengths adaptive speculation chooses among for a method's γ: γ, 2γ/3 and
    γ/3, rounded (6 -> 2, 4, 6; 1 -> 1), each a round graph of its own."""
    return tuple(sorted({max(1, round(gamma * k / 3)) for k in (1, 2, 3)}))


@dataclass
class Ema:
    """An exponential moving average that skips its first `skip` samples (an iteration that
    captured a CUDA graph or compiled a kernel is no measure of the next ones). A value
    taken from elsewhere (`borrowed`: another bucket's) stands until the first sample kept,
    which replaces it."""

    decay: float = 0.8
    skip: int = 1
    value: float | None = None
    seen: int = 0
    borrowed: bool = False

    def add(self, sample: float) -> None:
        self.seen += 1
        if self.seen <= self.skip:
            return
        if self.value is None or self.borrowed:
            self.value, self.borrowed = sample, False
        else:
            self.value = self.decay * self.value + (1 - self.decay) * sample

    def lent(self) -> Ema:
        """A new average of the same settings that holds this one's value until its own
        first sample kept."""
        return Ema(self.decay, self.skip, self.value, 0, self.value is not None)


@dataclass
class Acceptance:
    """Per draft position j (1-based), decayed counts of the rows that reached it (every
    draft before it accepted) and of those that accepted it: α_j = passed / reached. The
    counts decay by `decay` per `rows` rows of a round, so that the memory holds as many
    row-rounds whatever the batch (one row's round alone says little: a single rejection
    would swing the estimate)."""

    decay: float = 0.8
    rows: int = 16
    reached: list[float] = field(default_factory=list)
    passed: list[float] = field(default_factory=list)

    def add(self, drafted: int, emitted: Sequence[int]) -> None:
        """A round of `drafted` drafts whose rows emitted `emitted` tokens each (1..g+1)."""
        grow = drafted - len(self.reached)
        if grow > 0:
            self.reached += [0.0] * grow
            self.passed += [0.0] * grow
        counts = Counter(emitted)
        at_least = len(emitted)  # rows that emitted at least j tokens, j = 1..
        decay = self.decay ** (len(emitted) / self.rows)
        for j in range(1, drafted + 1):
            passed = at_least - counts[j]  # emitted more than j: draft j accepted
            self.reached[j - 1] = decay * self.reached[j - 1] + at_least
            self.passed[j - 1] = decay * self.passed[j - 1] + passed
            at_least = passed

    def rates(self, n: int, optimistic: bool = False) -> list[float]:
        """α_1..α_n (a position never reached takes the rate before it; 1 at first);
        optimistic: each rate's upper confidence bound from its (decayed) count of rows,
        α + sqrt(α(1 - α) / n) + 1 / n, at most 1."""
        out, last = [], 1.0
        for j in range(n):
            if j < len(self.reached) and self.reached[j] > 0:
                count = self.reached[j]
                last = self.passed[j] / count
                if optimistic:
                    last = min(1.0, last + math.sqrt(last * (1 - last) / count)
                               + 1 / count)
            out.append(last)
        return out

    def taus(self, n: int, optimistic: bool = False) -> list[float]:
        """τ(0)..τ(n) in one pass: τ(g), the tokens a row emits in a round of g drafts, is
        1 + Σ_{i ≤ g} Π_{j ≤ i} α_j (optimistic: of the rates' upper bounds)."""
        out, run = [1.0], 1.0
        for a in self.rates(n, optimistic):
            run *= a
            out.append(out[-1] + run)
        return out

    def tokens(self, drafted: int, optimistic: bool = False) -> float:
        """τ(g) of one draft length (`taus`)."""
        return self.taus(drafted, optimistic)[drafted]

    def copy(self) -> Acceptance:
        return Acceptance(self.decay, self.rows, list(self.reached), list(self.passed))


class Estimates(NamedTuple):
    """A bucket's figures by choice (draft length, 0 a plain step), made once per choice of
    the controller: cost, τ, and τ at the rates' upper confidence bounds."""

    cost: dict[int, float]
    tau: list[float]
    upper: list[float]


@dataclass
class Bucket:
    costs: dict[int, Ema]  # by draft length, 0 a plain step
    acceptance: Acceptance
    streak: dict[int, int]  # by draft length: iterations since it last ran
    settle: bool = False  # the last iteration was a round after plain steps: one more
    # what a round after plain steps costs beyond a round (its rows planned again)
    replan: Ema = field(default_factory=lambda: Ema(skip=0))
    preferred: int | None = None  # the last best choice (a probe does not change it)


@dataclass
class SpeculationController:
    """choose(bucket) -> draft length (0: a plain step); observe(bucket, drafted, seconds,
    emitted) after the iteration. lengths: the draft lengths it may choose; probe, most:
    the fewest and the most iterations between two runs of a choice not taken; cost: the
    share of the time that probes may lose."""

    lengths: tuple[int, ...] = (6,)
    probe: int = 32
    most: int = 4096
    cost: float = 0.01
    buckets: dict[int, Bucket] = field(default_factory=dict)
    chosen: Counter[int] = field(default_factory=Counter)  # iterations by draft length
    last: int | None = None  # the last iteration's draft length
    last_bucket: int | None = None

    @property
    def choices(self) -> tuple[int, ...]:
        return (0, *self.lengths)

    def bucket(self, key: int) -> Bucket:
        """A bucket's estimates; a new one starts from those of the bucket last used (the
        same rows, fewer or more of them): its acceptance, and its costs until each is
        measured in the new bucket."""
        b = self.buckets.get(key)
        if b is None:
            prev = self.buckets.get(self.last_bucket) if self.last_bucket is not None else None
            if prev is None:
                b = Bucket({g: Ema() for g in self.choices}, Acceptance(),
                           dict.fromkeys(self.choices, 0))
            else:
                b = Bucket({g: e.lent() for g, e in prev.costs.items()},
                           prev.acceptance.copy(), dict.fromkeys(self.choices, 0),
                           replan=prev.replan.lent(), preferred=prev.preferred)
            self.buckets[key] = b
        return b

    def choose(self, bucket: int) -> int:
        b = self.bucket(bucket)
        longest = self.lengths[-1]
        if b.settle and self.last:  # a round after plain steps: measure the next one
            return self.last
        if b.costs[longest].value is None:  # measure the longest round first, then a plain step
            return longest
        if b.costs[0].value is None:
            return 0
        for g in self.lengths:  # a probe whose time was skipped (a capture): once more
            if b.costs[g].value is None and b.costs[g].seen:
                return g
        est = self.estimates(b)
        best = b.preferred = self.best(b, est)
        due = [(b.streak[g] / self.interval(b, g, best, est), g) for g in self.choices
               if g != best]
        ready = [d for d in due if d[0] >= 1.0]
        return max(ready)[1] if ready else best

    def estimates(self, b: Bucket) -> Estimates:
        longest = self.lengths[-1]
        return Estimates(self.costs(b), b.acceptance.taus(longest),
                         b.acceptance.taus(longest, optimistic=True))

    def costs(self, b: Bucket) -> dict[int, float]:
        """Each choice's cost: measured, or interpolated between the measured ones (the
        longest round and the plain step are measured first)."""
        known = {g: e.value for g, e in b.costs.items() if e.value is not None}
        points = sorted(known)
        out = {}
        for g in self.choices:
            if g in known:
                out[g] = known[g]
                continue
            lo = max(p for p in points if p < g)
            hi = min(p for p in points if p > g)
            out[g] = known[lo] + (known[hi] - known[lo]) * (g - lo) / (hi - lo)
        return out

    def best(self, b: Bucket, est: Estimates | None = None) -> int:
        """The choice of the highest rate τ(g) / c(g) (ties: the shorter). Going from rounds
        to plain steps, or back, costs a round's re-planning once: a choice on the other
        side of the one preferred so far (probes aside) pays it spread over `probe`
        iterations, so that near break-even the controller does not go back and forth."""
        c, tau, _ = self.estimates(b) if est is None else est
        switch = (b.replan.value or 0.0) / self.probe
        now = b.preferred

        def rate(g: int) -> tuple[float, int]:
            other = now is not None and bool(g) != bool(now)
            return tau[g] / (c[g] + (switch if other else 0.0)), -g

        return max(self.choices, key=rate)

    def pays(self, b: Bucket) -> bool:
        """Whether some round beats a plain step in this bucket."""
        return self.best(b) != 0

    def interval(self, b: Bucket, g: int, best: int | None = None,
                 est: Estimates | None = None) -> int:
        """Iterations between two probes of choice g: enough that a probe's loss is at
        most `cost` of the time of the preferred iterations between them, the loss of a
        round reckoned from its τ's upper confidence bound (few rows seen, as at batch 1
        after a couple of unlucky rounds: probed again soon, not after hundreds of plain
        steps)."""
        est = self.estimates(b) if est is None else est
        best = self.best(b, est) if best is None else best
        c, tau, upper = est
        loss = c[g] - upper[g] * c[best] / tau[best]
        if g and not best:  # a round probed after plain steps is two rounds
            loss *= 2
        if bool(g) != bool(best):  # the round after a plain step is planned again
            loss += b.replan.value or 0.0
        wanted = math.ceil(loss / (self.cost * c[best])) if loss > 0 else 0
        return min(max(self.probe, wanted), self.most)

    def observe(self, bucket: int, drafted: int, seconds: float,
                emitted: Sequence[int] = ()) -> None:
        """After an iteration of `drafted` drafts (0: a plain step) that took `seconds` and
        in which each row emitted `emitted` tokens."""
        b = self.bucket(bucket)
        b.settle = bool(drafted) and self.last == 0  # planned again: not a round's time
        if not b.settle:
            b.costs[drafted].add(seconds)
        elif b.costs[drafted].value is not None:
            b.replan.add(max(0.0, seconds - b.costs[drafted].value))
        if drafted and emitted:
            b.acceptance.add(drafted, emitted)
        for g in b.streak:
            b.streak[g] = 0 if g == drafted else b.streak[g] + 1
        self.chosen[drafted] += 1
        self.last, self.last_bucket = drafted, bucket

    def summary(self) -> dict[str, object]:
        total = sum(self.chosen.values())
        rounds = total - self.chosen[0]
        return {"rounds": rounds, "plain_steps": self.chosen[0],
                "speculative_share": rounds / total if total else 0.0,
                "draft_lengths": {g: self.chosen[g] for g in self.choices}}
