"""One engine step as one message: the `StepPlan` the scheduler makes and the `StepResult`
the model runner gives back (vLLM's SchedulerOutput and ModelRunnerOutput), and `Runner`,
the interface of the runner that executes it.

Both messages are plain host data (request ids, token ids, page ids, settings), so the plan
is what tensor parallelism broadcasts to every rank, and the runner needs no `Sequence`: the
scheduler alone updates sequences and pages, from the result. Imports only `config` (the
rest for annotations)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from vegas_spec.config import SamplingParams

if TYPE_CHECKING:
    import torch

    from vegas_spec.config import ModelConfig, SpecConfig
    from vegas_spec.pages import PageAllocator
    from vegas_spec.stats import PhaseTimer


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
    iteration over every row: a draft-verify-accept round of `draft` drafts (None: the
    method's γ; the adaptive controller may choose fewer), or one plain step where `draft` is
    0 (plain decoding, or the adaptive controller's choice)."""

    leave: tuple[str, ...] = ()
    reserve: int = 0
    prefill: tuple[Prefill, ...] = ()
    pages: tuple[tuple[str, tuple[int, ...]], ...] = ()
    decode: bool = False
    draft: int | None = None


@dataclass(frozen=True)
class StepResult:
    """What a step gave, on the host: `first`, the first token of each prompt it completed
    (request id, token; in the plan's order); if it decoded, per row (`rows`: request ids in
    row order) the tokens it emitted (1..γ+1) and the selection budget its drafts read (None:
    no sparse drafts), drafted: the round's draft length (0: a plain step);
    prefill_seconds: the part of the step's wall time its prefill took: up to its first
    tokens' read, or where the prefill read nothing back and the device ran it behind the
    host, its device time."""

    first: list[tuple[str, int]] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    budgets: list[int | None] = field(default_factory=list)
    drafted: int = 0
    prefill_seconds: float = 0.0


@runtime_checkable
class Runner(Protocol):
    """The model runner as the engine sees it: `model_runner.ModelRunner`, or under tensor
    parallelism `executor.ParallelRunner`, which broadcasts each call that touches the device
    to the workers. Facts fixed when it is built; one `execute` per step; between steps, an
    abort's `drop`, `clear` after a failure, and the set-up calls, made only while no row is
    in use (`set_spec`, `reserve`, `warm_rounds`, `warm_prefill`); the logits helpers. Nothing
    else of a runner is the engine's to read or set."""

    @property
    def model_config(self) -> ModelConfig:
        """The whole model's config (not a rank's share)."""

    @property
    def max_model_len(self) -> int:
        """The longest sequence, prompt and output, in tokens."""

    @property
    def device(self) -> torch.device:
        """Where the model runs (and the logits helpers return)."""

    @property
    def pages(self) -> PageAllocator:
        """The KV pool's pages on the host (under tensor parallelism cut to the smallest
        rank's pool), which the scheduler alone takes and releases."""

    @property
    def scratch_page(self) -> int:
        """The page that padding rows write, held for good (-1: none, no static shapes)."""

    @property
    def draft_weight_bytes(self) -> int:
        """Bytes of the draft steps' FP8 or INT4 weight copies (0: none)."""

    @property
    def draft_weight_kind(self) -> str:
        """What the draft steps' projections read: fp8, int8, int4 or model."""

    @property
    def capacity(self) -> int | None:
        """Rows the static buffers hold now (None: no static buffers); while rows are in use
        they are not sized again, so no more sequences may run."""

    @property
    def timer(self) -> PhaseTimer:
        """The device time of the steps' phases since `restart_timer`."""

    def restart_timer(self) -> PhaseTimer:
        """A fresh phase timer from now on -> it."""

    def execute(self, plan: StepPlan) -> StepResult:
        """One step: the plan's leaving rows, buffers, prefill, pages and decode iteration."""

    def drop(self, *request_ids: str) -> None:
        """Rows that leave between steps (aborted, or finished when no row is left)."""

    def clear(self) -> None:
        """Forget every row (after a failure)."""

    def set_spec(self, spec: SpecConfig) -> None:
        """Another decoding method, while no row is in use."""

    def reserve(self, rows: int) -> None:
        """Static buffers (and graphs) for `rows` rows, while no row is in use."""

    def warm_rounds(self, kinds: tuple[str, ...] | None = None) -> None:
        """The decode graphs of `kinds` (None: every one) captured now."""

    def warm_prefill(self, max_pieces: int) -> int:
        """Every prefill bucket captured now -> the forwards made."""

    def logits(self, token_ids: list[int], pages: list[int], chunk: int) -> torch.Tensor:
        """Logits [n, V] of every position of a prompt on `pages` (held by the caller)."""

    def next_token_logits(self, pieces: list[Prefill]) -> torch.Tensor:
        """Logits [B, V] of the token after each prompt of `pieces`."""
