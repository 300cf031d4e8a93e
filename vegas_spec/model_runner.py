"""The model runner: owns the model, the paged KV cache, the attention backend, the prefix
cache, the persistent input batch and the CUDA graphs, and runs one step at a time.

The input batch (`Batch`) holds one row per decoding sequence, from the step its prompt is
prefilled to the step it finishes: rows that join are appended with the first plan of their
own prefill scores, rows that leave are condensed away, and the survivors keep their plans
(under static shapes the rows of the `GraphRunner`'s buffers move with them). A prefill runs
the pieces the scheduler chose, packed into forwards of `prefill_chunk` tokens, each prompt's
first selection scored in the forward that computes its last token. A decode iteration is one
token per row (`vanilla`) or one draft-verify-accept round (`speculative.round`), which
under static shapes is one graph, greedy or sampled; each iteration reads the device once
(`_commit`), returning a typed `StepOutput`. Knows nothing of queues."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from vegas_spec import parallel
from vegas_spec.attention.backend import make_backend
from vegas_spec.attention.context import (
    LastRows,
    PrefillPlan,
    ScoreRequest,
    SparsePlan,
    StepContext,
)
from vegas_spec.cache import PagedKVCache, available_bytes, slots_of
from vegas_spec.config import MAX_GAMMA, ConfigError, EngineConfig, SpecConfig
from vegas_spec.graphs import GraphRunner, StaticShapes, bucket_for
from vegas_spec.models.decoder import Decoder, build_model
from vegas_spec.models.loader import ModelSource, dummy_weights, load_config, load_weights
from vegas_spec.models.shared import ModelKey, file_stamps, shared_model
from vegas_spec.prefill_graphs import Chunk, PrefillGraphs, ScoreKind
from vegas_spec.prefix_cache import PrefixCache, PrefixEntry
from vegas_spec.quant import fp8_supported
from vegas_spec.sampling import BatchSampling, next_tokens
from vegas_spec.scheduler import Piece
from vegas_spec.sequence import Sequence
from vegas_spec.speculative.planning import cat_plans, selection_input, take_plan
from vegas_spec.speculative.policies import Policy, make_policy, max_budget
from vegas_spec.speculative.round import speculate
from vegas_spec.stats import PhaseTimer

CPU_KV_BYTES = 2 << 30


@dataclass
class _PrefillSink:
    """Where a prefill's chunks put what the caller needs: the next-token logits [B, V] and
    the batch's ScoreRequest of the prompts' last rows; the last rows' queries per batch row
    (for the prefix cache) when q_last is a dict; or, when hidden is a list, every chunk's
    final hidden states [T, hidden] instead (`logits`)."""

    logits: torch.Tensor | None = None
    scores: ScoreRequest | None = None
    q_last: dict[int, torch.Tensor] | None = None
    hidden: list[torch.Tensor] | None = None
    pages: list[list[int]] | None = None  # host pages of each batch row (prefill graphs)

    def put(self, rows: list[int], batch_rows: torch.Tensor, logits: torch.Tensor,
            scores: torch.Tensor | None, q_last: torch.Tensor | None) -> None:
        """What the last rows of prompts `rows` (batch_rows: the same on the device) gave:
        logits [S', V], scores [layers, S', R, G, W' >= W] (None: none asked) and queries
        [layers, S', H, D] (kept as copies: the fixed-shape buffers are rewritten)."""
        assert self.logits is not None
        self.logits[batch_rows] = logits
        if self.scores is not None and scores is not None:
            self.scores.out[:, batch_rows] = scores[..., : self.scores.out.shape[-1]]
        if self.q_last is not None and q_last is not None:
            for j, row in enumerate(rows):
                self.q_last[row] = q_last[:, j].clone()

    def request_for(self, rows: int) -> ScoreRequest | None:
        """A ScoreRequest like the batch's, for `rows` of its rows (None: no scores)."""
        req = self.scores
        if req is None:
            return None
        out = torch.empty(req.out.shape[0], rows, *req.out.shape[2:], device=req.out.device)
        return ScoreRequest(req.rows, out, req.mode, req.per_kv_head)


@dataclass
class Batch:
    """Device state of the decoding rows. lengths [B] committed KV length; last [B] the
    newest token (not yet in the cache); page_table [B, P]; plan: the next draft round's
    selection on the dynamic path (under static shapes it lives in the runner's buffers)."""

    seqs: list[Sequence]
    page_table: torch.Tensor
    lengths: torch.Tensor
    last: torch.Tensor
    sampling: BatchSampling
    plan: SparsePlan | None = None

    def keep(self, keep: list[int], idx: torch.Tensor) -> Batch:
        """The rows `keep` (idx: the same on the device); the plan is made again."""
        return Batch([self.seqs[i] for i in keep], self.page_table[idx], self.lengths[idx],
                     self.last[idx], self.sampling.rows(keep, idx))

    def cat(self, other: Batch) -> Batch:
        """These rows followed by other's, page tables padded to the wider one."""
        width = max(self.page_table.shape[1], other.page_table.shape[1])
        tables = [torch.nn.functional.pad(t, (0, width - t.shape[1]))
                  for t in (self.page_table, other.page_table)]
        return Batch(self.seqs + other.seqs, torch.cat(tables), torch.cat([self.lengths,
                     other.lengths]), torch.cat([self.last, other.last]),
                     self.sampling.cat(other.sampling), cat_plans(self.plan, other.plan))


@dataclass
class StepOutput:
    """One decode iteration, on the host: per row its sequence, the tokens it emitted
    (1..γ+1) and the selection budget its drafts read (None: no sparse drafts); drafted:
    the iteration was a round (False: a plain step)."""

    seqs: list[Sequence]
    tokens: list[list[int]]
    budgets: list[int | None]
    drafted: bool = False


@dataclass
class _Round:
    """What the selection after an iteration needs: the verify scores, the position of
    verify row 0 [B], the accepted counts [B], and whether the round's graph already wrote
    the next plan."""

    scores: torch.Tensor | None
    row: torch.Tensor
    accepted: torch.Tensor
    planned: bool = False


# "auto" draft weights are FP8 on GPUs that have FP8 conversions once this is True: on an
# H200 the FP8 kernel still streams its weights no faster than cuBLAS streams bf16 ones, so a
# draft step with FP8 copies is slower (BENCHMARKS.md §1.2).
FP8_DRAFTS_BY_DEFAULT = False


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, spec: SpecConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.source = source
        self.model_config = cfg = load_config(source)
        if (config.max_model_len or 0) > cfg.max_position_embeddings:
            raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's "
                              f"{cfg.max_position_embeddings} positions")
        # Under tensor parallelism this rank's share: its heads, its slices of the weights,
        # its KV heads in the cache; model_config stays the whole model's.
        self.tp = parallel.current()
        self.local_config = local = parallel.shard_config(cfg, self.tp.world_size)
        # One model per checkpoint, dtype and device in a process: another engine's if one
        # holds it (`models.shared`). A draft copy is made before the KV budget, which
        # the memory it takes then leaves out.
        self.draft_weight_kind = drafts = self._drafts()
        key = ModelKey(file_stamps(source), config.load_format, config.torch_dtype,
                       self.device, self.tp.rank, self.tp.world_size, drafts)
        self.model = shared_model(key, lambda: self._load_model(drafts))
        self.draft_weight_bytes = self.model.draft_weight_bytes()
        self.backend = make_backend(config.resolved_backend, config.exact)
        self.backend.tp = self.tp
        self.cache = PagedKVCache.from_budget(local, self._kv_budget(), config.page_size,
                                              config.torch_dtype, self.device)
        # Static shapes: padding rows of a batch bucket write into this page only.
        self.scratch_page = self.cache.allocate(1)[0] if config.static else -1
        self.graphs: GraphRunner | None = None  # the decode loop's buffers (static shapes)
        self.prefill_graphs = PrefillGraphs(
            self.model, self.cache.layers, self.backend, config.page_size,
            self.cache.pages_for(self.max_model_len + MAX_GAMMA + 1), self.scratch_page,
            config.graphs) if config.static else None
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes) \
            if config.prefix_cache_bytes > 0 else None
        self.timer = PhaseTimer(self.device)
        self.batch: Batch | None = None
        self._round: _Round | None = None
        self._stale = False  # plain steps ran since the last plan: refresh it before a round
        # id(seq) -> (seq, the prefix-cache entry that covers its whole prompt)
        self._whole: dict[int, tuple[Sequence, PrefixEntry]] = {}
        self._ready: tuple[list[Sequence], torch.Tensor, BatchSampling,
                           torch.Tensor | None, torch.Tensor] | None = None
        self.set_spec(spec)

    def _load_model(self, drafts: str) -> Decoder:
        """This rank's model read from the source (or drawn: load_format "dummy"), with its
        `drafts` draft copies (fp8 or int4; model: none)."""
        cfg, config = self.model_config, self.config
        if config.load_format == "dummy":
            weights = dummy_weights(cfg, config.torch_dtype, self.device, tp=self.tp)
        else:
            weights = load_weights(self.source, cfg, self.tp)
        model = build_model(self.local_config, weights, config.torch_dtype, self.device)
        if drafts != "model":
            model.make_draft_weights(drafts)
        return model

    def _drafts(self) -> str:
        """What `draft_weights` asks the draft steps to read: fp8, int4 or model; "auto" is
        model until FP8 drafts measure faster than the model's weights
        (`FP8_DRAFTS_BY_DEFAULT`)."""
        mode = self.config.draft_weights
        if mode == "auto":
            mode = "fp8" if FP8_DRAFTS_BY_DEFAULT and fp8_supported(self.device) else "model"
        if mode == "fp8" and self.device.type == "cuda" and not fp8_supported(self.device):
            raise ConfigError("draft_weights fp8 needs a GPU with FP8 conversions (compute "
                              "capability 8.9 or newer)")
        return mode

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len or self.model_config.max_position_embeddings

    def _kv_budget(self) -> int:
        if self.config.kv_cache_bytes is not None:
            return int(self.config.kv_cache_bytes)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * self.config.kv_cache_fraction)
        avail = available_bytes(self.device)
        return CPU_KV_BYTES if avail is None else \
            min(CPU_KV_BYTES, int(avail * self.config.kv_cache_fraction))

    # --- method and rows ----------------------------------------------------------------

    def set_spec(self, spec: SpecConfig) -> None:
        """The decoding method; changed only while no sequence holds a row."""
        assert self.batch is None, "the method changes only between batches"
        self.spec = spec
        self.policy: Policy | None = make_policy(spec) if spec.speculative else None

    @property
    def rows(self) -> int:
        return 0 if self.batch is None else len(self.batch.seqs)

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
            self.graphs = self._graph_runner(self.spec, self.policy, rows)

    def warm_rounds(self, kinds: tuple[str, ...] | None = None) -> None:
        """After `reserve` and before any row joins: the decode graphs of `kinds` (None:
        every one a request can need, greedy and sampled rounds and the adaptive plain step)
        captured now, for every batch bucket, so that no decode loop meets a capture."""
        if self.graphs is not None and self.batch is None:
            with torch.inference_mode():
                self.graphs.warm(kinds)

    def warm_prefill(self, max_pieces: int) -> int:
        """Capture every prefill bucket this method's chunks can meet (up to the prefill
        budget's tokens in up to max_pieces pieces) now rather than at their first chunk ->
        how many forwards were made (0 without prefill graphs)."""
        graphs, policy = self.prefill_graphs, self.policy
        if graphs is None:
            return 0
        kind = ScoreKind(policy.score_mode, policy.per_kv_head) \
            if policy is not None and policy.wants_scores else None
        with torch.inference_mode():
            return graphs.warm(self.config.prefill_tokens(self.model_config), max_pieces, kind)

    def _graph_runner(self, spec: SpecConfig, policy: Policy | None, bsz: int) -> GraphRunner:
        """The runner of this method's shapes, rebuilt when they or the batch outgrow it."""
        shapes = self._static_shapes(spec, policy)
        runner = self.graphs
        # the round graphs make the next selection with the policy they were captured with
        same = (runner.policy.cfg if runner is not None and runner.policy else None) == \
            (policy.cfg if policy else None)
        if runner is not None and runner.shapes == shapes and runner.capacity >= bsz and same:
            return runner
        self.graphs = None  # free the old buffers and graphs before capturing new ones
        return GraphRunner(self.model, self.cache.layers, self.backend, shapes, bucket_for(bsz),
                           self.config.page_size, self.scratch_page, self.config.graphs, policy)

    def _static_shapes(self, spec: SpecConfig, policy: Policy | None) -> StaticShapes:
        """The greedy round (`spec`) is captured with the buffers; the sampled rounds at
        their first use (one engine serves both)."""
        if policy is None:
            return StaticShapes(("plain",), 0, self.cache.pages_for(self.max_model_len))
        gamma, hkv = spec.gamma, self.local_config.num_kv_heads
        kmax = max_budget(spec, self.max_model_len)
        width = policy.index_width(kmax)
        pages = self.cache.pages_for(self.max_model_len + gamma + 1)
        # adaptive speculation runs plain steps where a round would not pay
        return StaticShapes(
            kinds=("spec", "plain") if spec.adaptive else ("spec",), verify_rows=gamma + 1,
            draft_kind="plain" if policy.full_drafts else "draft",
            plans=not policy.full_drafts,
            pages=pages, kmax=kmax, rank_width=self.max_model_len,
            index_width=width, index_groups=hkv if policy.per_kv_head else 1,
            recent_max=policy.recent_max(gamma),
            score_rows=tuple(policy.score_rows(gamma + 1, False)) if policy.wants_scores else (),
            score_groups=hkv if policy.per_kv_head else 1, score_mode=policy.score_mode,
            per_kv_head=policy.per_kv_head)

    def clear(self) -> None:
        """Forget every row (after a failure: the caller releases the sequences' pages)."""
        self.batch, self._round, self._ready = None, None, None
        self._stale = False
        self._whole.clear()
        if self.graphs is not None:
            self.graphs.condense([], self._upload([]))

    # --- prefill ------------------------------------------------------------------------

    def start(self, seqs: list[Sequence]) -> None:
        """Sequences just admitted: each prompt's longest cached prefix is copied into its
        pages (seq.prefilled says how far)."""
        for seq in seqs:
            done, entry = self._restore_prefix(seq, self._page_table([seq])[0])
            seq.prefilled = done
            if entry is not None and done == len(seq.prefill_ids):
                self._whole[id(seq)] = (seq, entry)

    @torch.inference_mode()
    def prefill(self, pieces: list[Piece]) -> tuple[list[Sequence], list[int]]:
        """Run the pieces (packed, in forwards of prefill_chunk tokens) -> the sequences whose
        prompts are now complete (those found whole in the prefix cache too) and their first
        tokens; `join` then gives the ones that go on decoding their rows."""
        seqs = list(dict.fromkeys([p.seq for p in pieces]))
        seqs += [s for s, _ in self._whole.values() if s not in seqs]
        if not seqs:
            return [], []
        row = {id(s): i for i, s in enumerate(seqs)}
        spans = [(row[id(p.seq)], p.start, p.end) for p in pieces]
        whole = [(row[id(s)], self._whole.pop(id(s))[1]) for s in seqs if id(s) in self._whole]
        with self.timer.phase("prefill"):
            logits, scores = self._prefill(seqs, spans, whole, self.policy)
        for p in pieces:
            p.seq.prefilled = p.end
        ready = [i for i, s in enumerate(seqs) if s.prefilled == len(s.prefill_ids)]
        if not ready:
            return [], []
        done = [seqs[i] for i in ready]
        idx = self._upload(ready)
        sampling = BatchSampling.build([s.params for s in done], self.device)
        lengths = self._upload([len(s.prefill_ids) for s in done])
        first = next_tokens(logits[idx], sampling, lengths)  # the token after prefill_ids
        self._ready = (done, first, sampling, None if scores is None else scores[:, idx],
                       lengths)
        return done, first.tolist()

    @torch.inference_mode()
    def join(self, seqs: list[Sequence]) -> None:
        """Rows for the sequences of the last prefill that go on decoding (a subset of them,
        in order), each with the first plan of its own prefill scores."""
        assert self._ready is not None
        done, first, sampling, scores, lengths = self._ready
        self._ready = None
        keep = [i for i, s in enumerate(done) if s in seqs]
        if not keep:
            return
        idx = self._upload(keep)
        new = Batch([done[i] for i in keep], self._page_table([done[i] for i in keep]),
                    lengths[idx], first[idx], sampling.rows(keep, idx))
        start = self.rows
        if self.graphs is not None:
            self.graphs.set_rows(start, new.page_table, new.sampling)
        row = new.lengths - 1  # the prefill's last query row
        new.plan = self._plan(new, None if scores is None else scores[:, idx], row,
                              torch.zeros_like(row), start)
        self.batch = new if self.batch is None else self.batch.cat(new)

    def _prefill(self, seqs: list[Sequence], spans: list[tuple[int, int, int]],
                 whole: list[tuple[int, PrefixEntry]], policy: Policy | None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompt positions `spans` (row, start, end) of seqs, packed (`_prefill_spans`), and
        the prompts restored whole from the prefix cache -> the next-token logits [B, V] and,
        if the policy selects from them, the scores [layers, B, 1, G, W] of the last rows of
        the prompts that end here (other rows: undefined)."""
        prompts = [s.prefill_ids for s in seqs]
        page_table = self._page_table(seqs)
        sink = _PrefillSink(
            logits=torch.empty(len(seqs), self.model_config.vocab_size, device=self.device),
            scores=self._score_request(policy, len(seqs), 1, max(map(len, prompts)), True),
            q_last={} if self.prefix_cache is not None else None,
            pages=[s.pages for s in seqs])
        self._prefill_spans(prompts, spans, page_table,
                            self.config.prefill_tokens(self.model_config), sink)
        if whole:
            self._replay_last_rows(prompts, whole, page_table, sink)
        for i, _, end in spans:
            if end == len(prompts[i]):
                self._save_prefix(seqs[i], page_table[i], sink, i)
        assert sink.logits is not None
        return sink.logits, None if sink.scores is None else sink.scores.out

    @torch.inference_mode()
    def next_token_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [B, V] (float32) of the token after each prompt (pages held by the caller),
        through the prefill that decoding runs (batched, chunked, the prefix cache on)."""
        whole = []
        spans = []
        for i, seq in enumerate(seqs):
            done, entry = self._restore_prefix(seq, self._page_table([seq])[0])
            if entry is not None and done == len(seq.prefill_ids):
                whole.append((i, entry))
            else:
                spans.append((i, done, len(seq.prefill_ids)))
        return self._prefill(seqs, spans, whole, None)[0]

    @torch.inference_mode()
    def logits(self, token_ids: list[int], chunk: int) -> torch.Tensor:
        """Logits [n, V] (float32) of every prompt position, in forwards of `chunk` tokens."""
        pages = self.cache.allocate(len(token_ids))
        try:
            table = torch.tensor([pages], dtype=torch.int32, device=self.device)
            sink = _PrefillSink(hidden=[])
            self._prefill_spans([token_ids], [(0, 0, len(token_ids))], table, chunk, sink)
            assert sink.hidden is not None
            return self.model.logits(torch.cat(sink.hidden), self.backend)
        finally:
            self.cache.release(pages)

    def _prefill_spans(self, prompts: list[list[int]], spans: list[tuple[int, int, int]],
                       page_table: torch.Tensor, budget: int, sink: _PrefillSink) -> None:
        """Positions start..end-1 of prompt `row` for each span (row, start, end), whose
        earlier positions are cached: packed end to end into forwards of at most `budget`
        tokens, a span cut across forwards where it does not fit, one launch per kernel and
        layer for all prompts of a forward."""
        chunk, used = [], 0
        for row, start, end in spans:
            while start < end:
                take = min(end - start, budget - used)
                chunk.append((row, start, start + take))
                used, start = used + take, start + take
                if used == budget:
                    self._prefill_chunk(prompts, chunk, page_table, sink)
                    chunk, used = [], 0
        if chunk:
            self._prefill_chunk(prompts, chunk, page_table, sink)

    def _prefill_chunk(self, prompts: list[list[int]], pieces: list[tuple[int, int, int]],
                       page_table: torch.Tensor, sink: _PrefillSink) -> None:
        """One packed forward over the pieces (row, start, end); nothing waits for the device
        (one host-to-device copy of the step's metadata). The prompts that end here give
        their logits, scores and last queries to the sink."""
        lengths = [end - start for _, start, end in pieces]
        starts = [start for _, start, _ in pieces]
        offsets = list(itertools.accumulate(lengths))
        ends = [j for j, (row, _, end) in enumerate(pieces)
                if end == len(prompts[row]) and sink.hidden is None]
        if self.prefill_graphs is not None and sink.pages is not None:
            self._prefill_static(Chunk(prompts, pieces, sink.pages, ends), sink)
            return
        total, count = offsets[-1], len(pieces)
        host = torch.cat([
            torch.tensor([t for row, a, b in pieces for t in prompts[row][a:b]]),
            torch.cat([torch.arange(a, b) for _, a, b in pieces]),
            torch.repeat_interleave(torch.arange(count), torch.tensor(lengths)),
            torch.tensor([0, *offsets] + starts + [row for row, _, _ in pieces]),
            torch.tensor([offsets[j] - 1 for j in ends] + [pieces[j][0] for j in ends]),
        ])
        dev = self._upload(host)
        tokens, positions, piece = dev[:total], dev[total : 2 * total], dev[2 * total : 3 * total]
        meta = dev[3 * total : 3 * total + 2 * count + 1 + count].to(torch.int32)
        cu_q, start, rows = meta[: count + 1], meta[count + 1 : 2 * count + 1], meta[-count:]
        table = page_table[rows.long()]
        ps = self.config.page_size
        slots = table.long()[piece, positions // ps] * ps + positions % ps
        plan = PrefillPlan(cu_q, start, tuple(lengths), tuple(starts))
        scores = None
        if ends:
            index, batch_rows = dev[-2 * len(ends) :].view(2, -1)
            plan.last, scores = self._last_rows(prompts, [pieces[j][0] for j in ends], index,
                                                batch_rows, page_table, slots, positions, sink)
        ctx = StepContext(positions=positions[None], seq_lens=start + cu_q.diff(),
                          slot_mapping=slots[None], page_table=table, page_size=ps,
                          kv_len_max=max(a + n for a, n in zip(starts, lengths)),
                          scores=scores, prefill=plan)
        hidden = self.model(tokens[None], ctx, self.cache.layers, self.backend)[0]
        if sink.hidden is not None:
            sink.hidden.append(hidden)
        elif ends:
            assert plan.last is not None
            sink.put([pieces[j][0] for j in ends], batch_rows,
                     self.model.logits(hidden[plan.last.index], self.backend),
                     None if scores is None else scores.out, plan.last.q_out)

    def _prefill_static(self, chunk: Chunk, sink: _PrefillSink) -> None:
        """The chunk on the prefill graphs' fixed-shape buffers (a replay on CUDA)."""
        assert self.prefill_graphs is not None
        req = sink.scores
        kind = None if req is None else ScoreKind(req.mode, req.per_kv_head)
        logits, scores, q_out = self.prefill_graphs.run(chunk, kind)
        if chunk.ends:
            rows = [chunk.pieces[j][0] for j in chunk.ends]
            sink.put(rows, self._upload(rows), logits, scores, q_out)

    def _last_rows(self, prompts: list[list[int]], rows: list[int], index: torch.Tensor,
                   batch_rows: torch.Tensor, page_table: torch.Tensor, slots: torch.Tensor,
                   positions: torch.Tensor, sink: _PrefillSink,
                   ) -> tuple[LastRows, ScoreRequest | None]:
        """The LastRows of prompts `rows` (their last tokens at packed rows `index`) and the
        step's own ScoreRequest for them."""
        cfg = self.local_config
        q_out = None if sink.q_last is None else torch.empty(
            cfg.num_layers, len(rows), cfg.num_heads, cfg.head_dim, device=self.device,
            dtype=self.config.torch_dtype)
        last = LastRows(index, positions[index][:, None], slots[index][:, None],
                        page_table[batch_rows], max(len(prompts[r]) for r in rows), q_out)
        return last, sink.request_for(len(rows))

    def _replay_last_rows(self, prompts: list[list[int]], whole: list[tuple[int, PrefixEntry]],
                          page_table: torch.Tensor, sink: _PrefillSink) -> None:
        """Prompts restored whole from the prefix cache: their logits as stored, their scores
        recomputed from the stored last queries (the same kernel on the same values as when
        they were prefilled)."""
        rows = [i for i, _ in whole]
        batch_rows = self._upload(rows)
        q = torch.stack([e.q_last for _, e in whole], 1)  # [layers, S', H, D]
        scores = sink.request_for(len(rows))
        if scores is not None:
            positions = self._upload([len(prompts[i]) - 1 for i in rows])[:, None]
            table = page_table[batch_rows]
            last = LastRows(torch.arange(len(rows), device=self.device), positions,
                            slots_of(table, positions, self.config.page_size), table,
                            max(len(prompts[i]) for i in rows))
            for layer, (k_cache, v_cache) in enumerate(self.cache.layers):
                self.backend.last_row_scores(layer, q[layer], k_cache, v_cache, last, scores,
                                             self.config.page_size)
        sink.put(rows, batch_rows, torch.stack([e.logits for _, e in whole]),
                 None if scores is None else scores.out, q)

    def _prefix_slots(self, page_table: torch.Tensor, length: int) -> torch.Tensor:
        positions = torch.arange(length, device=self.device)[None]
        return slots_of(page_table[None], positions, self.config.page_size)[0]

    def _restore_prefix(self, seq: Sequence, page_table: torch.Tensor,
                        ) -> tuple[int, PrefixEntry | None]:
        """Copy the longest cached prefix of the prompt into the sequence's pages -> how many
        positions it covers and its entry ((0, None) without a hit)."""
        if self.prefix_cache is None:
            return 0, None
        length, entry = self.prefix_cache.longest(seq.prefill_ids)
        if entry is None:
            return 0, None
        slots = self._prefix_slots(page_table, length)
        for (k_cache, v_cache), (k, v) in zip(self.cache.layers, entry.kv):
            k_cache[slots], v_cache[slots] = k, v
        return length, entry

    def _save_prefix(self, seq: Sequence, page_table: torch.Tensor, sink: _PrefillSink,
                     row: int) -> None:
        if self.prefix_cache is None or sink.q_last is None or row not in sink.q_last:
            return
        assert sink.logits is not None
        slots = self._prefix_slots(page_table, len(seq.prefill_ids))
        kv = [(k[slots], v[slots]) for k, v in self.cache.layers]
        self.prefix_cache.put(tuple(seq.prefill_ids),
                              PrefixEntry(kv, sink.logits[row].clone(), sink.q_last[row]))

    def _page_table(self, seqs: list[Sequence]) -> torch.Tensor:
        """[len(seqs), P] int32: each sequence's pages, 0 past them (P: the most pages)."""
        width = max(len(s.pages) for s in seqs)
        rows = [s.pages + [0] * (width - len(s.pages)) for s in seqs]
        return self._upload(rows).to(torch.int32)

    @torch.inference_mode()
    def grow(self, seqs: list[Sequence]) -> None:
        """Rows whose sequences took more pages (`Scheduler.grow`): their page-table rows
        rewritten, the batch's table widened where they outgrow it."""
        batch = self.batch
        assert batch is not None
        where = {id(s): i for i, s in enumerate(batch.seqs)}
        idx = self._upload([where[id(s)] for s in seqs])
        table = self._page_table(seqs)
        width = table.shape[1]
        if width > batch.page_table.shape[1]:
            batch.page_table = torch.nn.functional.pad(
                batch.page_table, (0, width - batch.page_table.shape[1]))
        batch.page_table[idx, :width] = table
        if self.graphs is not None:
            self.graphs.set_pages(idx, table)

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
        self._round = _Round(scores, row, accepted, planned)
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
            idx = self._keep_rows(alive)
            if idx is None:
                return
            if rnd is None:  # a plain step: the rows keep the plans they had
                assert self.batch is not None
                self.batch.plan = take_plan(batch.plan, idx)
                return
            rnd = _Round(None if rnd.scores is None else rnd.scores[:, idx], rnd.row[idx],
                         rnd.accepted[idx], rnd.planned)
        if rnd is None or rnd.planned:  # plain decoding, or a round that planned
            return
        assert self.batch is not None
        self.batch.plan = self._plan(self.batch, rnd.scores, rnd.row, rnd.accepted, 0)

    @torch.inference_mode()
    def drop(self, seq: Sequence) -> None:
        """A sequence that leaves between steps (aborted): its row goes now, before the next
        iteration, and the survivors keep the plans already made for them; a prompt found
        whole in the prefix cache and not yet run is forgotten."""
        self._whole.pop(id(seq), None)
        batch = self.batch
        if batch is None or not any(s is seq for s in batch.seqs):
            return
        idx = self._keep_rows([i for i, s in enumerate(batch.seqs) if s is not seq])
        if idx is not None and self.batch is not None:
            self.batch.plan = take_plan(batch.plan, idx)  # static shapes: moved in the buffers

    def _keep_rows(self, alive: list[int]) -> torch.Tensor | None:
        """Only rows `alive` stay, moved down in order (their buffer rows with them) -> their
        indices on the device (None: no row is left). The dynamic plan is dropped."""
        if not alive:
            self.batch = None
            if self.graphs is not None:
                self.graphs.condense([], self._upload([]))
            return None
        assert self.batch is not None
        idx = self._upload(alive)
        self.batch = self.batch.keep(alive, idx)
        if self.graphs is not None:
            self.graphs.condense(alive, idx)
        return idx

    def _refresh_plan(self, batch: Batch) -> None:
        """Before a round that follows plain steps: the last plan's recent range no longer
        reaches the newest tokens, so the rows are planned again from their newest committed
        token, as after a prefill, without scores (a policy that needs them keeps the sink
        and the most recent positions for this round; its verify pass plans the next)."""
        self._stale = False
        row = batch.lengths - 1
        plan = self._plan(batch, None, row, torch.zeros_like(row), 0)
        if self.graphs is None:
            batch.plan = plan

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
            inp.max_len = self._host_len(batch)  # host bounds instead of reading the device
            self.graphs.set_plan_rows(self.policy.plan(self.graphs.bound(inp, start)), start)
            return None

    # --- steps --------------------------------------------------------------------------

    def _ctx(self, page_table: torch.Tensor, positions: torch.Tensor, kv_len_max: int,
             scores: ScoreRequest | None = None, sparse: SparsePlan | None = None,
             draft: bool = False) -> StepContext:
        return StepContext(positions=positions, seq_lens=positions[:, -1] + 1,
                           slot_mapping=slots_of(page_table, positions, self.config.page_size),
                           page_table=page_table, page_size=self.config.page_size,
                           kv_len_max=kv_len_max, scores=scores, sparse=sparse, draft=draft)

    def _forward(self, tokens: torch.Tensor, ctx: StepContext,
                 last_only: bool = False) -> torch.Tensor:
        """tokens [B, n] -> logits [B, n, V] float32 ([B, 1, V] with last_only)."""
        hidden = self.model(tokens, ctx, self.cache.layers, self.backend)
        return self.model.logits(hidden[:, -1:] if last_only else hidden, self.backend)

    def _upload(self, values: list[int] | torch.Tensor) -> torch.Tensor:
        """Host ints -> an int64 device tensor without waiting for the device."""
        host = torch.as_tensor(values, dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _host_len(self, batch: Batch) -> int:
        return max(s.committed for s in batch.seqs)

    def _plain_step(self, batch: Batch) -> torch.Tensor:
        """One token a row with full attention -> the next tokens [B]."""
        tokens, positions = batch.last[:, None], batch.lengths[:, None]
        if self.graphs is not None:
            logits = self.graphs.run("plain", tokens, positions)[:, -1]
        else:  # keys up to one past the longest committed row
            ctx = self._ctx(batch.page_table, positions, self._host_len(batch) + 1)
            logits = self._forward(tokens, ctx, last_only=True)[:, -1]
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
        gamma, bound = self.spec.gamma, self._host_len(batch)
        req = self._score_request(policy, len(batch.seqs), gamma + 1, bound + gamma + 1, False)

        def step(kind: str, tokens: torch.Tensor, positions: torch.Tensor,
                 raw: bool) -> torch.Tensor:
            verify = kind == "verify"  # drafts read up to bound + γ - 1, verify bound + γ
            draft = kind == "draft"
            ctx = self._ctx(batch.page_table, positions, bound + gamma + verify,
                            req if verify else None, batch.plan if draft else None, draft)
            return self._forward(tokens, ctx, last_only=not verify)

        accepted, emitted = speculate(step, batch.last, batch.lengths, gamma,
                                      "draft" if sparse else "plain",
                                      None if s.all_greedy else s, self.timer.phase)
        return accepted, emitted, None if req is None else req.out, budget, False

    def _score_request(self, policy: Policy | None, bsz: int, n: int, width: int,
                       prefill: bool) -> ScoreRequest | None:
        if policy is None or not policy.wants_scores:
            return None
        rows = policy.score_rows(n, prefill)
        groups = self.local_config.num_kv_heads if policy.per_kv_head else 1
        out = torch.empty(self.model_config.num_layers, bsz, len(rows), groups, width,
                          device=self.device)
        return ScoreRequest(torch.tensor(rows, device=self.device), out, policy.score_mode,
                            policy.per_kv_head)
