"""The model runner: runs one step at a time over the model, the paged KV cache and the
persistent input batch (`input_batch`), all loaded and sized by `runner_setup`.

A prefill runs the pieces the scheduler chose (`prefill`: packed into forwards, each prompt's
first selection scored in the forward that computes its last token); the prompts that
complete join the batch with the first plan of their own prefill scores. A decode iteration
is one token per row (`vanilla`) or one draft-verify-accept round (`speculative.round`),
which under static shapes is one graph, greedy or sampled; each iteration reads the device
once (`_commit`), returning a typed `StepOutput`. Knows nothing of queues."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vegas_spec import runner_setup
from vegas_spec.attention.context import SparsePlan
from vegas_spec.config import EngineConfig, SpecConfig
from vegas_spec.dynamic_steps import DynamicSteps
from vegas_spec.graphs import GraphRunner
from vegas_spec.input_batch import Batch, InputBatch, Ready, Round
from vegas_spec.models.loader import ModelSource
from vegas_spec.prefill import completed
from vegas_spec.sampling import next_tokens
from vegas_spec.scheduler import Piece
from vegas_spec.sequence import Sequence
from vegas_spec.speculative.planning import selection_input
from vegas_spec.speculative.policies import Policy, make_policy
from vegas_spec.stats import PhaseTimer


@dataclass
class StepOutput:
    """One decode iteration, on the host: per row its sequence, the tokens it emitted
    (1..γ+1) and the selection budget its drafts read (None: no sparse drafts); drafted:
    the iteration was a round (False: a plain step)."""

    seqs: list[Sequence]
    tokens: list[list[int]]
    budgets: list[int | None]
    drafted: bool = False


class ModelRunner:
    """One engine's steps: `start`, `prefill` and `join` for prompts, `grow`, `decode`,
    `select` and `drop` for the rows, in the order the engine calls them."""

    def __init__(self, config: EngineConfig, source: ModelSource, spec: SpecConfig) -> None:
        self.config, self.source, self.device = config, source, torch.device(config.device)
        self.parts = parts = runner_setup.load(config, source)
        self.model_config, self.max_model_len = parts.model_config, parts.max_model_len
        self.model, self.backend, self.cache = parts.model, parts.backend, parts.cache
        self.scratch_page, self.draft_weight_bytes = parts.scratch_page, parts.draft_weight_bytes
        self.draft_weight_kind = parts.draft_weight_kind
        self.prefiller = runner_setup.prefiller(parts, config)
        self.steps = DynamicSteps(self.model, self.cache, self.backend)
        self.timer = PhaseTimer(self.device)
        self.input = InputBatch(self.device)
        self._round: Round | None = None
        self._stale = False  # plain steps ran since the last plan: refresh it before a round
        self._ready: Ready | None = None  # the last prefill's completed prompts
        self.set_spec(spec)

    @property
    def batch(self) -> Batch | None:
        return self.input.batch

    @property
    def graphs(self) -> GraphRunner | None:
        """The decode loop's buffers and graphs (static shapes), which hold the rows' plans."""
        return self.input.graphs

    @graphs.setter
    def graphs(self, runner: GraphRunner | None) -> None:
        self.input.graphs = runner

    @property
    def rows(self) -> int:
        return self.input.rows

    # --- method and sizes ---------------------------------------------------------------

    def set_spec(self, spec: SpecConfig) -> None:
        """The decoding method; changed only while no sequence holds a row."""
        assert self.batch is None, "the method changes only between batches"
        self.spec = spec
        self.policy: Policy | None = make_policy(spec) if spec.speculative else None

    def row_limit(self, max_num_seqs: int) -> int:
        """Sequences that may run: under static shapes, while rows are in use, the buffers'
        capacity (they are sized again only when empty)."""
        if self.graphs is not None and self.batch is not None:
            return min(self.graphs.capacity, max_num_seqs)
        return max_num_seqs

    def reserve(self, rows: int) -> None:
        """Static shapes: buffers (and graphs) for `rows` rows of this method, rebuilt only
        while no row is in use."""
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
        self._round, self._ready, self._stale = None, None, False
        self.input.clear()

    # --- prefill ------------------------------------------------------------------------

    def start(self, seqs: list[Sequence]) -> None:
        """Sequences just admitted, their pages (cached prefix pages among them) placed by
        the scheduler: nothing to do on one rank (under tensor parallelism the proxy sends
        them to the workers here)."""

    @torch.inference_mode()
    def prefill(self, pieces: list[Piece]) -> tuple[list[Sequence], list[int]]:
        """Run the pieces (packed, in forwards of prefill_chunk tokens) -> the sequences whose
        prompts are now complete and their first tokens; `join` then gives the ones that go
        on decoding their rows."""
        seqs = list(dict.fromkeys(p.seq for p in pieces))
        if not seqs:
            return [], []
        with self.timer.phase("prefill"):
            logits, scores = self.prefiller.step(seqs, pieces, self.policy)
        self._ready = ready = completed(seqs, logits, scores, self.device)
        return ([], []) if ready is None else (ready.seqs, ready.first.tolist())

    @torch.inference_mode()
    def join(self, seqs: list[Sequence]) -> None:
        """Rows for the sequences of the last prefill that go on decoding (a subset of them,
        in order), each with the first plan of its own prefill scores."""
        assert self._ready is not None
        joining, self._ready = self._ready.joining(seqs, self.device), None
        if joining is None:
            return
        new, scores = joining
        new.plan = self._first_plan(new, scores, self.input.place(new))  # its last prompt row
        self.input.append(new)

    @torch.inference_mode()
    def next_token_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [B, V] (float32) of the token after each prompt (pages held by the caller,
        cached prefixes among them), through the prefill that decoding runs (batched,
        chunked)."""
        return self.prefiller.next_token_logits(seqs)

    @torch.inference_mode()
    def logits(self, token_ids: list[int], pages: list[int], chunk: int) -> torch.Tensor:
        """Logits [n, V] (float32) of every prompt position, in forwards of `chunk` tokens,
        on `pages` (held by the caller)."""
        return self.prefiller.logits(token_ids, pages, chunk)

    # --- rows ---------------------------------------------------------------------------

    @torch.inference_mode()
    def grow(self, seqs: list[Sequence]) -> None:
        """Rows whose sequences took more pages (`Scheduler.grow`): their page-table rows
        rewritten (the batch's, the graphs' buffers)."""
        self.input.grow(seqs)

    @torch.inference_mode()
    def select(self) -> None:
        """After the tokens of an iteration are appended: drop the finished rows (the
        survivors move down, keeping their plans), then choose the next draft round's KV
        positions unless the round's graph already did (`planned`); plain decoding has no
        round and makes no plan."""
        batch, rnd = self.batch, self._round
        assert batch is not None
        self._round = None
        alive = [i for i, s in enumerate(batch.seqs) if not s.finished]
        if len(alive) < len(batch.seqs):
            # after a plain step the rows keep the plans they had
            idx = self.input.keep(alive, plans=rnd is None)
            if idx is None or rnd is None:
                return
            rnd = rnd.take(idx)
        if rnd is None or rnd.planned:  # plain decoding, or a round that planned
            return
        assert self.batch is not None
        self.batch.plan = self._plan(self.batch, rnd.scores, rnd.row, rnd.accepted, 0)

    @torch.inference_mode()
    def drop(self, seq: Sequence) -> None:
        """A sequence that leaves between steps (aborted): its row goes now, before the next
        iteration, and the survivors keep the plans already made for them."""
        self.input.drop(seq)

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
            inp = selection_input(self.policy, self.backend, scores, row, accepted,
                                  batch.lengths, self.spec.gamma, self.cache.layers,
                                  batch.page_table, self.config.page_size)
            if self.graphs is None:
                return self.policy.plan(inp)
            inp.max_len = batch.longest  # host bounds instead of reading the device
            self.graphs.set_plan_rows(self.policy.plan(self.graphs.bound(inp, start)), start)
            return None

    # --- decode -------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, draft: bool = True) -> StepOutput:
        """One iteration over every row: a draft-verify-accept round, or a plain step (plain
        decoding, or draft False: where a round would not pay, the plan kept for the next)."""
        assert self.batch is not None
        out = self._iteration(self.batch, draft)
        self.timer.flush()
        return out

    def _iteration(self, batch: Batch, draft: bool = True) -> StepOutput:
        if self.policy is None or not draft:  # one token a row: nothing to accept
            with self.timer.phase("decode"):
                tokens = self._plain_step(batch)
            batch.lengths = batch.lengths + 1
            batch.last = tokens
            self._stale = self.policy is not None
            return self._commit(batch, None, tokens, None)
        if self._stale:
            self._refresh_plan(batch)
        accepted, emitted, scores, budget, planned = self._speculate(batch, self.policy)
        row = batch.lengths  # verify row 0 sat at the old length
        batch.lengths = batch.lengths + accepted + 1
        batch.last = emitted.gather(1, accepted[:, None])[:, 0]
        self._round = Round(scores, row, accepted, planned)
        out = self._commit(batch, accepted, emitted, budget)
        out.drafted = True
        return out

    def _commit(self, batch: Batch, accepted: torch.Tensor | None, emitted: torch.Tensor,
                budget: torch.Tensor | None) -> StepOutput:
        """The iteration's one host read: accepted [B], emitted [B, n] and the budgets [B]
        the drafts read come back in one transfer (accepted None: plain decoding, emitted
        [B] one token a row)."""
        seqs = list(batch.seqs)
        if accepted is None:
            return StepOutput(seqs, [[t] for t in emitted.tolist()], [None] * len(seqs))
        cols = [accepted[:, None], emitted] + ([] if budget is None else [budget[:, None]])
        rows = torch.cat(cols, 1).tolist()
        tokens = [row[1 : row[0] + 2] for row in rows]
        budgets = [None] * len(rows) if budget is None else [row[-1] for row in rows]
        return StepOutput(seqs, tokens, budgets)

    def _plain_step(self, batch: Batch) -> torch.Tensor:
        """One token a row with full attention -> the next tokens [B]."""
        tokens, positions = batch.last[:, None], batch.lengths[:, None]
        if self.graphs is not None:
            logits = self.graphs.run("plain", tokens, positions)[:, -1]
        else:
            logits = self.steps.plain(batch)
        return next_tokens(logits, batch.sampling, batch.lengths + 1)

    def _speculate(self, batch: Batch, policy: Policy,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                              torch.Tensor | None, bool]:
        """One draft-verify-accept round: accepted [B], emitted [B, γ+1], the verify pass's
        scores, the budgets [B] the drafts read (None: full drafts), and whether the next
        plan is already made (a planning round graph)."""
        graphs, sparse, s = self.graphs, not policy.full_drafts, batch.sampling
        if graphs is not None:  # drafts, verify, acceptance (and the next selection): one graph
            with self.timer.phase("speculate"):
                accepted, emitted, budget = graphs.run_spec(batch.last, batch.lengths, s)
            return (accepted, emitted, graphs.scores(), budget if sparse else None,
                    graphs.shapes.plans)
        budget = batch.plan.budget if sparse and batch.plan is not None else None
        accepted, emitted, scores = self.steps.round(batch, policy, self.spec.gamma,
                                                     self.timer.phase)
        return accepted, emitted, scores, budget, False
