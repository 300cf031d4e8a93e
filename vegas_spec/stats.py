"""Run and per-sequence statistics, and a phase timer that does not synchronise the device
inside an iteration (CUDA events are read once the iteration's tokens reach the host)."""

from __future__ import annotations

import itertools
import operator
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

# A speculative iteration's phases; "speculate" is a whole greedy round run as one CUDA graph
# (drafts, verify and acceptance), in place of draft + verify + accept.
SPEC_PHASES = ("draft", "verify", "speculate", "select", "accept")


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self._pending: list[tuple[str, Any, Any]] = []

    @contextmanager
    def phase(self, name: str):  # noqa: ANN201
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.totals[name] += time.perf_counter() - t0

    def flush(self) -> None:
        """Collect CUDA event timings; call after a host sync (the events are done)."""
        for name, start, end in self._pending:
            end.synchronize()
            self.totals[name] += start.elapsed_time(end) / 1000.0
        self._pending.clear()


class DeviceSpan:
    """The device's time from construction to `stop` (CUDA events; 0.0 elsewhere, where the
    host's own clock measures the work), read once the device has passed `stop`: after a
    later host read, so that reading it waits for nothing."""

    def __init__(self, device: torch.device) -> None:
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
            self.events[0].record()

    def stop(self) -> None:
        if self.events is not None:
            self.events[1].record()

    def seconds(self) -> float:
        if self.events is None:
            return 0.0
        start, end = self.events
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


@dataclass
class SeqStats:
    """A sequence's iterations: tokens emitted, draft length and budget read by each, with
    running counts so that a summary after every step costs O(γ²), not O(iterations)."""

    gamma: int = 0
    iterations: int = 0
    tokens_per_iteration: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # each round's draft length
    budget: list[int] = field(default_factory=list)
    # rounds by (draft length, tokens emitted)
    counts: Counter[tuple[int, int]] = field(default_factory=Counter)
    budget_total: int = 0
    plain_steps: int = 0  # iterations of a speculative method run as plain steps (adaptive)

    def record(self, emitted: int, budget: int | None, drafted: int | None = None) -> None:
        """One iteration of `drafted` drafts (None: the method's γ); a plain step of a
        speculative method (drafted 0) is counted apart, so that tokens per iteration and
        acceptance describe the rounds."""
        drafted = self.gamma if drafted is None else drafted
        if not drafted and self.gamma:
            self.plain_steps += 1
            return
        self.iterations += 1
        self.tokens_per_iteration.append(emitted)
        self.drafts.append(drafted)
        self.counts[(drafted, emitted)] += 1
        if budget is not None:
            self.budget.append(budget)
            self.budget_total += budget

    def summary(self) -> dict[str, Any]:
        """The rounds' figures (plain steps are in the run's summary)."""
        return summarize_counts(self.counts, self.gamma, self.budget_total, len(self.budget))

    def summary_upto(self, iterations: int, budgets: int) -> dict[str, Any]:
        """The summary as it stood after the first `iterations` records, `budgets` of them
        with a budget (the lists only grow): O(iterations)."""
        return summarize(self.tokens_per_iteration[:iterations], self.gamma,
                         self.budget[:budgets], self.drafts[:iterations])


def with_plain_steps(out: dict[str, Any], gamma: int, plain: int) -> dict[str, Any]:
    """A speculative summary with the plain steps the adaptive choice took and the share of
    iterations that speculated."""
    if gamma:
        total = out["iterations"] + plain
        out["plain_steps"] = plain
        out["speculative_share"] = out["iterations"] / total if total else 0.0
    return out


def summarize(tpi: list[int], gamma: int, budget: list[int],
              drafts: list[int] | None = None) -> dict[str, Any]:
    """tokens per iteration (mean, histogram), draft lengths, acceptance rate per draft
    position, budget, from each round's tokens emitted and draft length (drafts None: γ
    every round); plain decoding (gamma 0) only counts its iterations, one per decoded
    token."""
    lengths = [gamma] * len(tpi) if drafts is None else drafts
    return summarize_counts(Counter(zip(lengths, tpi)), gamma, sum(budget), len(budget))


def summarize_counts(counts: Counter[tuple[int, int]], gamma: int, budget_total: int,
                     budgets: int) -> dict[str, Any]:
    """`summarize` from the number of rounds of each (draft length, tokens emitted) and the
    sum and number of the budgets."""
    n = sum(counts.values())
    if gamma == 0 or not n:
        return {"iterations": n}
    emitted: Counter[int] = Counter()
    lengths: Counter[int] = Counter()
    for (g, e), c in counts.items():
        emitted[e] += c
        lengths[g] += c
    hist = [emitted[i] for i in range(1, gamma + 2)]
    drafted = [lengths[g] for g in range(1, gamma + 1)]
    # draft position j (1-based) is accepted when the round emitted more than j tokens
    # (every round emits at least one), of the rounds that drafted it (draft length >= j)
    above = list(itertools.accumulate(hist[:gamma], operator.sub, initial=n))[1:]
    reached = list(itertools.accumulate(drafted[::-1]))[::-1]
    out: dict[str, Any] = {
        "iterations": n,
        "tokens_per_iteration": sum(t * c for t, c in emitted.items()) / n,
        "tokens_per_iteration_histogram": hist,
        "draft_length_histogram": drafted,
        "acceptance_rate_per_position": [a / r if r else 0.0 for a, r in zip(above, reached)],
    }
    if budgets:
        out["budget_mean"] = budget_total / budgets
    return out


@dataclass
class RunStats:
    method: str
    gamma: int
    timer: PhaseTimer
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_prefill: float = 0.0
    wall_decode: float = 0.0
    # from the requests' arrival (generate(), once the tokenizer is loaded) to the first
    # token of every prompt on the host
    ttft: float = 0.0
    wall_total: float = 0.0  # from the arrival to the last token
    load: float = 0.0  # loading (the tokenizer, on the first call) before the arrival
    seqs: list[SeqStats] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        tpi = [t for s in self.seqs for t in s.tokens_per_iteration]
        drafts = [g for s in self.seqs for g in s.drafts]
        budget = [b for s in self.seqs for b in s.budget]
        phases = {k: round(v, 6) for k, v in self.timer.totals.items()}
        spec_total = sum(phases.get(k, 0.0) for k in SPEC_PHASES)
        # The first token of each sequence comes from the prefill; the decode loop emits the
        # rest. Fewer than two of those give no meaningful rate.
        decoded = self.generated_tokens - len(self.seqs)
        out: dict[str, Any] = {
            "method": self.method, "gamma": self.gamma,
            "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
            "load_s": round(self.load, 6),
            "ttft_s": round(self.ttft, 6), "prefill_s": round(self.wall_prefill, 6),
            "decode_s": round(self.wall_decode, 6), "total_s": round(self.wall_total, 6),
            "decode_tokens_per_s": decoded / self.wall_decode
            if decoded > 1 and self.wall_decode > 0 else None,
            "phase_s": phases,
        }
        if spec_total > 0:
            out["phase_fraction"] = {k: phases[k] / spec_total for k in SPEC_PHASES
                                     if k in phases}
        out.update(with_plain_steps(summarize(tpi, self.gamma, budget, drafts), self.gamma,
                                    sum(s.plain_steps for s in self.seqs)))
        return out
