"""The model runner: runs one step at a time over the model, the paged KV cache and the
persistent input batch (`input_batch`), all loaded and sized by `runner_setup`.

`execute` takes one `StepPlan` and returns one `StepResult`: the rows that leave go first
(the survivors keep their plans; the next selection after a round is made for them now,
unless the round's graph made it), then the plan's prompt pieces are prefilled (packed into
forwards, each prompt's first selection scored in the forward that computes its last token;
the prompts that complete give their first tokens and join the batch with the first plan of
their own prefill scores), the grown rows' page tables are rewritten, and one decode
iteration runs over every row: one token per row (`vanilla`) or one draft-verify-accept round
(`speculative.round`), which under static shapes is one graph, greedy or sampled. An
iteration reads the device once (`_commit`). The runner keeps only its rows' device state
and request ids; it knows nothing of queues, sequences or who owns which page. It implements
`step.Runner`, all that the engine uses of it; its parts (model, cache, buffers) are for
tests and benchmarks to read, and `use_graphs` lets a benchmark hold graphs of its own."""

from __future__ import annotations

import dataclasses
import time

import torch

from vegas_spec import runner_setup
from vegas_spec.attention.context import SparsePlan
from vegas_spec.config import EngineConfig, SpecConfig
from vegas_spec.dynamic_steps import DynamicSteps
from vegas_spec.graphs import GraphRunner
from vegas_spec.input_batch import Batch, InputBatch, Ready, Round
from vegas_spec.models.loader import ModelSource
from vegas_spec.pages import PageAllocator
from vegas_spec.prefill import completed
from vegas_spec.sampling import next_tokens
from vegas_spec.speculative.planning import selection_input
from vegas_spec.speculative.policies import Policy, make_policy
from vegas_spec.stats import DeviceSpan, PhaseTimer
from vegas_spec.step import Prefill, StepPlan, StepResult


class ModelRunner:
    """One engine's steps (a `step.Runner`): `execute` a `StepPlan`; `drop` rows that leave
    between steps."""

    def __init__(self, config: EngineConfig, source: ModelSource, spec: SpecConfig) -> None:
        self.config, self.source, self.device = config, source, torch.device(config.device)
        self.parts = parts = runner_setup.load(config, source)
        self.model_config, self.max_model_len = parts.model_config, parts.max_model_len
        self.model, self.cache = parts.model, parts.cache
        self.ops, self.attn = parts.ops, parts.attn
        self.scratch_page, self.draft_weight_bytes = parts.scratch_page, parts.draft_weight_bytes
        self.draft_weight_kind = parts.draft_weight_kind
        self.prefiller = runner_setup.prefiller(parts, config)
        self.steps = DynamicSteps(self.model, self.cache, self.ops, self.attn)
        self.timer = PhaseTimer(self.device)
        self.input = InputBatch(self.device)
        self._round: Round | None = None  # the last round's, until its next plan is made
        self._stale = False  # plain steps ran since the last plan: refresh it before a round
        self.set_spec(spec)

    @property
    def batch(self) -> Batch | None:
        return self.input.batch

    @property
    def graphs(self) -> GraphRunner | None:
        """The decode loop's buffers and graphs (static shapes), which hold the rows' plans."""
        return self.input.graphs

    def use_graphs(self, graphs: GraphRunner | None) -> None:
        """For benchmarks that time graphs of their own, while no row is in use: `graphs` as
        the decode loop's buffers (None: none; the next `reserve` makes the method's)."""
        self.input.graphs = graphs

    @property
    def rows(self) -> int:
        return self.input.rows

    @property
    def pages(self) -> PageAllocator:
        """The KV pool's pages on the host (the scheduler's to take and release)."""
        return self.cache.pages

    @property
    def capacity(self) -> int | None:
        """Rows the static buffers hold now (None: no static buffers)."""
        return None if self.graphs is None else self.graphs.capacity

    def restart_timer(self) -> PhaseTimer:
        """A fresh phase timer for the steps from now on -> it."""
        self.timer = PhaseTimer(self.device)
        return self.timer

    # --- method and sizes ---------------------------------------------------------------

    def set_spec(self, spec: SpecConfig) -> None:
        """The decoding method; changed only while no sequence holds a row."""
        assert self.batch is None, "the method changes only between batches"
        self.spec = spec
        self.policy: Policy | None = make_policy(spec) if spec.speculative else None

    @torch.inference_mode(False)
    def reserve(self, rows: int) -> None:
        """Static shapes: buffers (and graphs) for `rows` rows of this method, rebuilt only
        while no row is in use (ordinary tensors, whichever mode the caller is in)."""
        if self.config.static and self.batch is None and rows > 0:
            runner_setup.reserve(self.input, self.parts, self.config, self.spec, self.policy,
                                 rows)

    def warm_rounds(self, kinds: tuple[str, ...] | None = None) -> None:
        """After `reserve` and before any row joins: the decode graphs of `kinds` (None:
        every one a request can need, greedy and sampled rounds and the adaptive plain step)
        captured now, for every batch bucket, so that no decode loop meets a capture."""
        if self.graphs is not None and self.batch is None:
            with torch.inference_mode():
                self.graphs.warm(kinds)

    @torch.inference_mode()
    def warm_prefill(self, max_pieces: int) -> int:
        """Every prefill bucket this method's chunks can meet (up to max_pieces pieces)
        captured now rather than at its first chunk -> how many forwards were made."""
        return self.prefiller.warm(max_pieces, self.policy)

    def clear(self) -> None:
        """Forget every row (after a failure: the caller releases the sequences' pages)."""
        self._round, self._stale = None, False
        self.input.clear()

    # --- the step -----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """One step of the plan (see `StepPlan` for its order) -> its result."""
        self._leave(plan.leave)
        self.reserve(plan.reserve)
        self._select()
        t0 = time.perf_counter()
        span = DeviceSpan(self.device) if plan.prefill else None
        first = self._prefill(list(plan.prefill)) if plan.prefill else []
        prefill_seconds = time.perf_counter() - t0
        if span is not None:
            span.stop()
        if plan.pages:
            self.input.grow(plan.pages)
        if not plan.decode:
            return StepResult(first, prefill_seconds=prefill_seconds)
        out = self.decode(plan.draft)
        if span is not None:  # a chunk that completes no prompt reads nothing back: the
            # device runs it behind the host, inside the decode's wait, where it counts
            prefill_seconds = max(prefill_seconds, span.seconds())
        return dataclasses.replace(out, first=first, prefill_seconds=prefill_seconds)

    @torch.inference_mode()
    def drop(self, *request_ids: str) -> None:
        """Rows that leave between steps (aborted, or the last ones finished): they go now,
        before the next step, and the survivors keep the plans already made for them."""
        self._leave(request_ids)

    def _leave(self, ids: tuple[str, ...]) -> None:
        """The rows of `ids` go (ids without a row are ignored); the survivors move down in
        order, keeping their plans (after a round, its outputs move with them)."""
        batch, rnd = self.batch, self._round
        if batch is None or not ids:
            return
        gone = set(ids)
        alive = [i for i, rid in enumerate(batch.ids) if rid not in gone]
        if len(alive) == len(batch.ids):
            return
        # after a round the dynamic plan is made again (`_select`); a plain step's is kept
        idx = self.input.keep(alive, plans=rnd is None)
        self._round = None if rnd is None or idx is None else rnd.take(idx)

    def _select(self) -> None:
        """After a round, once the rows that leave are gone: the next draft round's KV
        positions, unless the round's graph already chose them (`planned`); plain decoding
        has no round and makes no plan."""
        rnd, self._round = self._round, None
        if rnd is None or rnd.planned or self.batch is None:
            return
        self.batch.plan = self._plan(self.batch, rnd.scores, rnd.row, rnd.accepted, 0)

    def _prefill(self, pieces: list[Prefill]) -> list[tuple[str, int]]:
        """Run the pieces (packed, in forwards of prefill_chunk tokens) -> the first token of
        each prompt they complete (the prefill's one host read); those that join take rows."""
        with self.timer.phase("prefill"):
            logits, scores = self.prefiller.step(pieces, self.policy)
        ready = completed(pieces, logits, scores, self.device)
        if ready is None:
            return []
        first = [(p.request_id, tok) for p, tok in zip(ready.pieces, ready.first.tolist())]
        self._join(ready)
        return first

    def _join(self, ready: Ready) -> None:
        """Rows for the completed prompts that go on decoding, after the rows in use, each
        with the first plan of its own prefill scores."""
        joining = ready.joining(self.device)
        if joining is not None:
            new, scores = joining
            new.plan = self._first_plan(new, scores, self.input.place(new))  # last prompt row
            self.input.append(new)

    @torch.inference_mode()
    def next_token_logits(self, pieces: list[Prefill]) -> torch.Tensor:
        """Logits [B, V] (float32) of the token after each prompt, each piece its prompt's
        rest (pages held by the caller, cached prefixes among them), through the prefill
        that decoding runs (batched, chunked)."""
        return self.prefiller.next_token_logits(pieces)

    @torch.inference_mode()
    def logits(self, token_ids: list[int], pages: list[int], chunk: int) -> torch.Tensor:
        """Logits [n, V] (float32) of every prompt position, in forwards of `chunk` tokens,
        on `pages` (held by the caller)."""
        return self.prefiller.logits(token_ids, pages, chunk)

    def _refresh_plan(self, batch: Batch) -> None:
        """Before a round that follows plain steps: the last plan's recent range no longer
        reaches the newest tokens, so the rows are planned again from their newest committed
        token, as after a prefill, without scores (a policy that needs them keeps the sink
        and the most recent positions for this round; its verify pass plans the next)."""
        self._stale = False
        batch.plan = self._first_plan(batch, None, 0)  # static shapes: None, in the buffers

    def _first_plan(self, batch: Batch, scores: torch.Tensor | None, start: int,
                    ) -> SparsePlan | None:
        """The plan of rows whose newest committed token is their only query row."""
        row = batch.lengths - 1
        return self._plan(batch, scores, row, torch.zeros_like(row), start)

    def _plan(self, batch: Batch, scores: torch.Tensor | None, row: torch.Tensor,
              accepted: torch.Tensor, start: int) -> SparsePlan | None:
        """The policy's selection for the rows of `batch`, which sit from row `start` of the
        static buffers (written there; the dynamic plan is returned)."""
        if self.policy is None:
            return None
        with self.timer.phase("select"):
            inp = selection_input(self.policy, self.ops, self.attn, scores, row, accepted,
                                  batch.lengths, self.spec.gamma, self.cache.layers,
                                  batch.page_table, self.config.page_size)
            if self.graphs is None:
                return self.policy.plan(inp)
            inp.max_len = batch.longest  # host bounds instead of reading the device
            self.graphs.set_plan_rows(self.policy.plan(self.graphs.bound(inp, start)), start)
            return None

    # --- decode -------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, draft: int | None = None) -> StepResult:
        """One iteration over every row (the step's last part): a draft-verify-accept round
        of `draft` drafts (None: the method's γ), or a plain step (plain decoding, or draft
        0: where a round would not pay, the plan kept for the next)."""
        batch = self.batch
        assert batch is not None
        out = self._iteration(batch, draft)
        batch.committed = [n + len(t) for n, t in zip(batch.committed, out.tokens)]
        self.timer.flush()
        return out

    def _iteration(self, batch: Batch, draft: int | None = None) -> StepResult:
        gamma = self.spec.gamma if draft is None else draft
        assert 0 <= gamma <= self.spec.gamma, f"a round drafts at most γ tokens, not {gamma}"
        if self.policy is None or not gamma:  # one token a row: nothing to accept
            with self.timer.phase("decode"):
                tokens = self._plain_step(batch)
            batch.lengths = batch.lengths + 1
            batch.last = tokens
            self._stale = self.policy is not None
            return self._commit(batch, None, tokens, None)
        if self._stale:
            self._refresh_plan(batch)
        accepted, emitted, scores, budget, planned = self._speculate(batch, self.policy,
                                                                     gamma)
        row = batch.lengths  # verify row 0 sat at the old length
        batch.lengths = batch.lengths + accepted + 1
        batch.last = emitted.gather(1, accepted[:, None])[:, 0]
        self._round = Round(scores, row, accepted, planned)
        return self._commit(batch, accepted, emitted, budget, gamma)

    def _commit(self, batch: Batch, accepted: torch.Tensor | None, emitted: torch.Tensor,
                budget: torch.Tensor | None, drafted: int = 0) -> StepResult:
        """The iteration's one host read: accepted [B], emitted [B, n] and the budgets [B]
        the drafts read come back in one transfer (accepted None: plain decoding, emitted
        [B] one token a row)."""
        ids = list(batch.ids)
        if accepted is None:
            return StepResult(rows=ids, tokens=[[t] for t in emitted.tolist()],
                              budgets=[None] * len(ids))
        cols = [accepted[:, None], emitted] + ([] if budget is None else [budget[:, None]])
        rows = torch.cat(cols, 1).tolist()
        tokens = [row[1 : row[0] + 2] for row in rows]
        budgets = [None] * len(rows) if budget is None else [row[-1] for row in rows]
        return StepResult(rows=ids, tokens=tokens, budgets=budgets, drafted=drafted)

    def _plain_step(self, batch: Batch) -> torch.Tensor:
        """One token a row with full attention -> the next tokens [B]."""
        tokens, positions = batch.last[:, None], batch.lengths[:, None]
        if self.graphs is not None:
            logits = self.graphs.run("plain", tokens, positions, batch.longest)[:, -1]
        else:
            logits = self.steps.plain(batch)
        return next_tokens(logits, batch.sampling, batch.lengths + 1)

    def _speculate(self, batch: Batch, policy: Policy, gamma: int,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                              torch.Tensor | None, bool]:
        """One round of γ drafts: accepted [B], emitted [B, γ+1], the verify pass's
        scores, the budgets [B] the drafts read (None: full drafts), and whether the next
        plan is already made (a planning round graph)."""
        graphs, sparse, s = self.graphs, not policy.full_drafts, batch.sampling
        if graphs is not None:  # drafts, verify, acceptance (and the next selection): one graph
            with self.timer.phase("speculate"):
                accepted, emitted, budget = graphs.run_spec(batch.last, batch.lengths, s,
                                                            gamma, batch.longest)
            return (accepted, emitted, graphs.scores(), budget if sparse else None,
                    graphs.shapes.plans)
        budget = batch.plan.budget if sparse and batch.plan is not None else None
        accepted, emitted, scores = self.steps.round(batch, policy, gamma, self.timer.phase)
        return accepted, emitted, scores, budget, False
