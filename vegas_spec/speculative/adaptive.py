"""Adaptive speculation: per iteration, whether a round pays for itself or a plain step is
faster, from the engine's own running measurements.

A round emits τ tokens a row in the time c_round of its batch bucket; a plain step emits one
in c_plain. Speculating pays while τ · c_plain > c_round. The controller keeps, per bucket,
exponential moving averages of both costs (the wall time of an engine step's iteration: the
device's time and all the host's work of the step, which an iteration pays whatever its
tokens, so a plain step is dearer than its forward; in a step that also prefilled, less the
prefill's part, its device time where the device ran it behind the host) and of τ, speculates
while the estimate says it pays and now and then runs the other choice once (a probe) so
that both estimates follow the context as it grows. A probe loses time: a probing round
costs c_round where plain steps would give its τ tokens in τ · c_plain, a probing plain step
c_plain where rounds give a token in c_round / τ; probes are spaced so that this loss is at
most `cost` of the time between them (and at least `probe`, at most `most` iterations
apart).

The first round after plain steps is dearer than the next ones (its rows are planned
again on the host, their recent range having moved on), so its time is not a round's: a
probing round is two rounds, the second measured. Were that first round measured, a
probe would find rounds dearer than they are whenever plain steps ran before it, and the
controller could stay on plain steps where rounds pay. Nothing here touches the device;
the choice changes only how many tokens are drafted, never which tokens are emitted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Ema:
    """An exponential moving average that skips its first `skip` samples (an iteration that
    captured a CUDA graph or compiled a kernel is no measure of the next ones)."""

    decay: float = 0.8
    skip: int = 1
    value: float | None = None
    seen: int = 0

    def add(self, sample: float) -> None:
        self.seen += 1
        if self.seen <= self.skip:
            return
        self.value = sample if self.value is None else \
            self.decay * self.value + (1 - self.decay) * sample


@dataclass
class Bucket:
    plain: Ema = field(default_factory=Ema)
    round: Ema = field(default_factory=Ema)
    tokens: Ema = field(default_factory=lambda: Ema(skip=0))  # τ: tokens a row per round
    streak: int = 0  # iterations since the other choice last ran
    settle: bool = False  # the last iteration was a round after plain steps: one more


@dataclass
class SpeculationController:
    """choose(bucket) -> draft or not; observe(bucket, drafted, seconds, tokens) after the
    iteration. probe, most: the fewest and the most iterations between two runs of the
    choice not taken; cost: the share of the time that probes may lose."""

    probe: int = 32
    most: int = 4096
    cost: float = 0.01
    buckets: dict[int, Bucket] = field(default_factory=dict)
    plain_steps: int = 0
    rounds: int = 0
    drafted: bool | None = None  # the last iteration's choice

    def choose(self, bucket: int) -> bool:
        b = self.buckets.setdefault(bucket, Bucket())
        if b.round.value is None or b.settle:  # measure a round first, then a plain step
            return True
        if b.plain.value is None:
            return False
        speculate = self.pays(b)
        if b.streak >= self.interval(b, speculate):
            return not speculate
        return speculate

    def pays(self, b: Bucket) -> bool:
        assert b.round.value is not None and b.plain.value is not None
        return _tau(b) * b.plain.value > b.round.value

    def interval(self, b: Bucket, speculate: bool) -> int:
        """Iterations between two probes of the choice not taken: enough that a probe's loss
        is at most `cost` of the time of the preferred iterations between them."""
        assert b.round.value is not None and b.plain.value is not None
        plain, round_, tau = b.plain.value, b.round.value, _tau(b)
        if speculate:  # a plain step's token against a round's share of one
            loss, each = plain - round_ / tau, round_
        else:  # two rounds' τ tokens each against as many plain steps
            loss, each = 2 * (round_ - tau * plain), plain
        wanted = math.ceil(loss / (self.cost * each)) if loss > 0 else 0
        return min(max(self.probe, wanted), self.most)

    def observe(self, bucket: int, drafted: bool, seconds: float,
                tokens_per_row: float | None = None) -> None:
        b = self.buckets.setdefault(bucket, Bucket())
        preferred = None if b.round.value is None or b.plain.value is None else self.pays(b)
        b.settle = drafted and self.drafted is False  # planned again: not a round's time
        if not b.settle:
            (b.round if drafted else b.plain).add(seconds)
        self.drafted = drafted
        if drafted:
            self.rounds += 1
            if tokens_per_row is not None:
                b.tokens.add(tokens_per_row)
        else:
            self.plain_steps += 1
        b.streak = 0 if preferred is not None and drafted != preferred else b.streak + 1

    def summary(self) -> dict[str, float | int]:
        total = self.rounds + self.plain_steps
        return {"rounds": self.rounds, "plain_steps": self.plain_steps,
                "speculative_share": self.rounds / total if total else 0.0}


def _tau(b: Bucket) -> float:
    """A bucket's tokens a row per round (1 before any round)."""
    return b.tokens.value if b.tokens.value is not None else 1.0
