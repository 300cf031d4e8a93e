"""`LLM(model, **engine_kwargs).generate(prompts, SamplingParams(...))`.

The engine owns the model, the paged KV cache and the attention backend. All requests are
prefilled together: their prompts packed end to end into forwards of up to `prefill_chunk`
tokens (a prompt cut across forwards where it does not fit, the cached prefix of each
restored first), each prompt's first selection scored in the forward that computes its last
token, every chunk one graph replay under static shapes (`PrefillGraphs`). Then all requests
decode together: one token per step for `vanilla`, or draft-verify-accept-select iterations
for the speculative methods. Sequences keep their own lengths, budgets and stopping; finished
ones leave the batch.

With static shapes (always under CUDA graphs) the decode-loop forwards run through a
`GraphRunner` on fixed-shape buffers, and nothing inside an iteration reads the device: the
host learns the accepted counts and tokens once per iteration, in `_commit`. A greedy batch
runs each round's drafts, verification and acceptance as one `spec` graph."""

from __future__ import annotations

import itertools
import math
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vegas_spec.attention.backend import make_backend
from vegas_spec.attention.context import (
    LastRows,
    PrefillPlan,
    ScoreRequest,
    SparsePlan,
    StepContext,
)
from vegas_spec.cache import PagedKVCache, available_bytes, check_memory, slots_of
from vegas_spec.config import (
    MAX_GAMMA,
    ConfigError,
    LengthCapWarning,
    PromptError,
    SamplingParams,
    SpecConfig,
    engine_config,
    is_int,
    prompt_list,
    sampling_list,
    spec_config,
)
from vegas_spec.graphs import GraphRunner, StaticShapes, bucket_for
from vegas_spec.models.decoder import build_model
from vegas_spec.models.loader import dummy_weights, load_config, load_weights, resolve
from vegas_spec.prefill_graphs import Chunk, PrefillGraphs, ScoreKind
from vegas_spec.prefix_cache import PrefixCache, PrefixEntry
from vegas_spec.sampling import BatchSampling, next_tokens, probs, sample
from vegas_spec.speculative.acceptance import accept_greedy, accept_sampling
from vegas_spec.speculative.policies import Policy, SelectionInput, make_policy, max_budget
from vegas_spec.stats import PhaseTimer, RunStats, SeqStats
from vegas_spec.tokenizer import encode, load_tokenizer

CPU_KV_BYTES = 2 << 30


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    limit: int  # total length (prompt + output) at which generation stops
    pages: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stopped_by_string: bool = False
    stats: SeqStats = field(default_factory=SeqStats)

    @property
    def committed(self) -> int:
        """KV positions that hold exact values: the prompt and all outputs but the last."""
        return len(self.prompt_ids) + len(self.output) - 1


@dataclass
class _PrefillSink:
    """Where a prefill's chunks put what the caller needs: the next-token logits [B, V] and
    the batch's ScoreRequest of the prompts' last rows; the last rows' queries per batch row
    (for the prefix cache) when q_last is a dict; or, when hidden is a list, every chunk's
    final hidden states [T, hidden] instead (`LLM.logits`)."""

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
class RequestOutput:
    prompt: str | list[int]
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict[str, Any]


@dataclass
class Batch:
    """Device state of the running sequences. lengths [B] committed KV length; last [B] the
    newest token (not yet in the cache); page_table [B, P]."""

    seqs: list[Sequence]
    page_table: torch.Tensor
    lengths: torch.Tensor
    last: torch.Tensor
    sampling: BatchSampling
    plan: SparsePlan | None = None

    def keep(self, keep: list[int], idx: torch.Tensor) -> Batch:
        """The rows `keep` (idx: the same on the device)."""
        s = self.sampling  # rows picked here: BatchSampling.select would read idx back
        sampling = replace(s, temperature=s.temperature[idx], top_k=s.top_k[idx],
                           top_p=s.top_p[idx], generators=[s.generators[i] for i in keep])
        return Batch([self.seqs[i] for i in keep], self.page_table[idx], self.lengths[idx],
                     self.last[idx], sampling)


class LLM:
    def __init__(self, model: str | None = None, *, speculative: SpecConfig | dict | None = None,
                 **engine_kwargs: Any) -> None:
        self.config = engine_config(engine_kwargs)
        self.spec = _spec(speculative)
        self.device = torch.device(self.config.device)
        if self.config.kv_cache_bytes is not None:  # before loading anything
            check_memory(self.config.kv_cache_bytes, self.device)
        self.source = resolve(model)
        self.model_config = cfg = load_config(self.source)
        if (self.config.max_model_len or 0) > cfg.max_position_embeddings:
            raise ConfigError(f"max_model_len {self.config.max_model_len} exceeds the model's "
                              f"{cfg.max_position_embeddings} positions")
        if self.config.load_format == "dummy":
            weights = dummy_weights(cfg, self.config.torch_dtype, self.device)
        else:
            weights = load_weights(self.source, cfg)
        self.model = build_model(cfg, weights, self.config.torch_dtype, self.device)
        del weights
        self.backend = make_backend(self.config.resolved_backend)
        self.cache = PagedKVCache.from_budget(cfg, self._kv_budget(), self.config.page_size,
                                              self.config.torch_dtype, self.device)
        # Static shapes: padding rows of a batch bucket write into this page only.
        self.scratch_page = self.cache.allocate(1)[0] if self.config.static else -1
        self.graphs: GraphRunner | None = None  # the decode loop's buffers (static shapes)
        self.prefill_graphs = PrefillGraphs(
            self.model, self.cache.layers, self.backend, self.config.page_size,
            self.cache.pages_for(self.max_model_len + MAX_GAMMA + 1), self.scratch_page,
            self.config.graphs) if self.config.static else None
        self._tokenizer = None
        self.prefix_cache = PrefixCache(self.config.prefix_cache_bytes) \
            if self.config.prefix_cache_bytes > 0 else None

    @property
    def tokenizer(self):  # noqa: ANN201
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.source)
        return self._tokenizer

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

    # --- requests -----------------------------------------------------------------------

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, *,
                 chat: bool = False, speculative: SpecConfig | dict | None = None,
                 ) -> list[RequestOutput]:
        started = time.perf_counter()
        spec = _spec(speculative) if speculative is not None else self.spec
        prompts, batch = prompt_list(prompts)
        params_list = _params_list(params, len(prompts))
        named = batch and len(prompts) > 1  # errors and warnings give the prompt's index
        seqs = [self._sequence(p, sp, chat, spec, i if named else None)
                for i, (p, sp) in enumerate(zip(prompts, params_list))]
        self._warn_capped(seqs, named)
        extra = spec.gamma + 1 if spec.speculative else 0  # drafts past the last kept token
        self.cache.check_fits([s.limit + extra for s in seqs])
        for s in seqs:
            s.pages = self.cache.allocate(s.limit + extra)
        try:
            stats = self._run(seqs, spec, started)
        finally:
            for s in seqs:
                self.cache.release(s.pages)
        summary = stats.summary()
        return [RequestOutput(p, s.prompt_ids, self._text(s), s.output, s.finish_reason or "length",
                              {**summary, "sequence": s.stats.summary()})
                for p, s in zip(prompts, seqs)]

    @torch.inference_mode()
    def logits(self, token_ids: list[int], *, chunk: int | None = None) -> torch.Tensor:
        """Logits [n, V] (float32) of every prompt position, through the packed prefill path
        in forwards of `chunk` tokens (default: the engine's prefill chunk)."""
        if chunk is not None and (not is_int(chunk) or chunk < 1):
            raise ConfigError(f"chunk must be an integer >= 1, got {chunk!r}")
        seq = self._sequence(token_ids, SamplingParams(max_tokens=1), False, _spec(None))
        pages = self.cache.allocate(len(token_ids))
        try:
            table = torch.tensor([pages], dtype=torch.int32, device=self.device)
            sink = _PrefillSink(hidden=[])
            self._prefill_spans([seq.prompt_ids], [(0, 0, len(token_ids))], table,
                                chunk or self.config.prefill_tokens(self.model_config), sink)
            assert sink.hidden is not None
            return self.model.logits(torch.cat(sink.hidden))
        finally:
            self.cache.release(pages)

    @torch.inference_mode()
    def next_token_logits(self, prompts: str | list[str] | list[int] | list[list[int]], *,
                          chat: bool = False) -> torch.Tensor:
        """Logits [B, V] (float32) of the token after each prompt, through the prefill that
        `generate` runs (batched, chunked, with the prefix cache when it is on)."""
        seqs = [self._sequence(p, SamplingParams(max_tokens=1), chat, _spec(None), i)
                for i, p in enumerate(_as_list(prompts))]
        self.cache.check_fits([s.limit for s in seqs])
        for s in seqs:
            s.pages = self.cache.allocate(s.limit)
        try:
            return self._prefill(seqs, self._page_table(seqs), None)[0]
        finally:
            for s in seqs:
                self.cache.release(s.pages)

    def _sequence(self, prompt: str | list[int], params: SamplingParams, chat: bool,
                  spec: SpecConfig, index: int | None = None) -> Sequence:
        """index: the prompt's place in a batch, named by the errors."""
        ids = encode(self.tokenizer, prompt, chat) if isinstance(prompt, str) else list(prompt)
        vocab, context = self.model_config.vocab_size, self.max_model_len
        if not ids:
            raise PromptError("is empty (no tokens)", index)
        if min(ids) < 0 or max(ids) >= vocab:
            bad = [t for t in ids if not 0 <= t < vocab]
            raise PromptError(f"holds token ids outside [0, {vocab}), e.g. {bad[0]}", index)
        if len(ids) >= context:
            raise PromptError(f"has {len(ids)} tokens but the model's context is {context}: "
                              "nothing is left to generate", index)
        limit = min(len(ids) + params.max_tokens, context)
        window = self.model_config.sliding_window
        extra = spec.gamma + 1 if spec.speculative else 0
        if window is not None and limit + extra > window:
            raise PromptError(f"would grow to {limit + extra} tokens, past the sliding window "
                              f"({window} tokens); longer sequences are not supported", index)
        return Sequence(ids, params, limit, stats=SeqStats(gamma=spec.gamma
                                                           if spec.speculative else 0))

    def _warn_capped(self, seqs: list[Sequence], named: bool) -> None:
        """Say which prompts leave less room in the context than max_tokens asks for: they
        stop there, with finish_reason "length". Warned once every prompt is accepted."""
        for i, s in enumerate(seqs):
            if len(s.prompt_ids) + s.params.max_tokens > s.limit:
                room = s.limit - len(s.prompt_ids)
                warnings.warn(LengthCapWarning(
                    f"leaves room for {room} new tokens in the model's context of "
                    f"{self.max_model_len}: max_tokens {s.params.max_tokens} is capped to {room}",
                    i if named else None), stacklevel=3)

    # --- the loop -----------------------------------------------------------------------

    @torch.inference_mode()
    def _run(self, seqs: list[Sequence], spec: SpecConfig, started: float) -> RunStats:
        """started: when generate() was called (time to first token counts from it)."""
        policy = make_policy(spec) if spec.speculative else None
        timer = PhaseTimer(self.device)
        stats = RunStats(spec.method, spec.gamma if spec.speculative else 0, timer,
                         prompt_tokens=sum(len(s.prompt_ids) for s in seqs),
                         seqs=[s.stats for s in seqs])
        if self.config.static:
            greedy = all(s.params.greedy for s in seqs)
            self.graphs = self._graph_runner(spec, policy, len(seqs), greedy)
        t0 = time.perf_counter()
        batch, scores = self._prefill_all(seqs, policy, timer)
        stats.wall_prefill = time.perf_counter() - t0
        stats.ttft = time.perf_counter() - started  # the first tokens are on the host
        if self.graphs is not None:
            self.graphs.set_batch(batch.page_table)
        t0 = time.perf_counter()
        row = batch.lengths - 1  # the prefill's last query row
        next_batch: Batch | None = self._select(batch, policy, spec.gamma, timer, scores, row,
                                                torch.zeros_like(row))
        while next_batch is not None:
            next_batch = self._iteration(next_batch, spec, policy, timer)
        timer.flush()
        stats.wall_decode = time.perf_counter() - t0
        stats.wall_total = time.perf_counter() - started
        stats.generated_tokens = sum(len(s.output) for s in seqs)
        return stats

    def _iteration(self, batch: Batch, spec: SpecConfig, policy: Policy | None,
                   timer: PhaseTimer) -> Batch | None:
        scores, budget, planned = None, None, False
        if policy is None:
            with timer.phase("decode"):
                emitted = self._plain_step(batch)[:, None]
            accepted = torch.zeros_like(batch.lengths)
        else:
            accepted, emitted, scores, budget, planned = self._speculate(batch, spec, policy,
                                                                         timer)
        row = batch.lengths  # verify row 0 sat at the old length
        batch.lengths = batch.lengths + accepted + 1
        batch.last = emitted.gather(1, accepted[:, None])[:, 0]
        self._commit(batch, policy, accepted, emitted, budget)
        timer.flush()
        return self._select(batch, policy, spec.gamma, timer, scores, row, accepted, planned)

    def _commit(self, batch: Batch, policy: Policy | None, accepted: torch.Tensor,
                emitted: torch.Tensor, budget: torch.Tensor | None) -> None:
        """The iteration's one host read: accepted [B], emitted [B, n] and the budgets [B]
        the drafts read come back in one transfer; then the tokens are appended and
        stopping is checked."""
        n = emitted.shape[1]
        cols = [accepted[:, None], emitted] + ([] if budget is None else [budget[:, None]])
        for seq, row in zip(batch.seqs, torch.cat(cols, 1).tolist()):
            a = row[0]  # vanilla: one token per step (a = 0)
            seq.stats.record(a + 1, None if budget is None else row[1 + n])
            self._append(seq, row[1 : a + 2])

    def _select(self, batch: Batch, policy: Policy | None, gamma: int, timer: PhaseTimer,
                scores: torch.Tensor | None, row: torch.Tensor, accepted: torch.Tensor,
                planned: bool = False) -> Batch | None:
        """Drop finished sequences, then choose the next draft round's KV positions (unless
        the round's graph already did, `planned`, and no sequence left)."""
        alive = [i for i, s in enumerate(batch.seqs) if s.finish_reason is None]
        if not alive:
            return None
        if planned and len(alive) == len(batch.seqs):
            return batch
        if len(alive) < len(batch.seqs):
            idx = self._upload(alive)
            row, accepted = row[idx], accepted[idx]
            scores = None if scores is None else scores[:, idx]
            batch = batch.keep(alive, idx)
            if self.graphs is not None:
                self.graphs.set_batch(batch.page_table)
        if policy is not None:
            with timer.phase("select"):
                batch.plan = policy.plan(self._selection_input(batch, gamma, scores, row,
                                                               accepted))
                if self.graphs is not None:
                    self.graphs.set_plan(batch.plan)
        return batch

    def _selection_input(self, batch: Batch, gamma: int, scores: torch.Tensor | None,
                         row: torch.Tensor, accepted: torch.Tensor) -> SelectionInput:
        inp = SelectionInput(scores, row, accepted, batch.lengths, gamma, self.cache.layers,
                             batch.page_table, self.config.page_size)
        if self.graphs is not None:  # host bounds instead of reading the device
            inp.max_len = self._host_len(batch)
            return self.graphs.bound(inp)
        return inp

    # --- steps --------------------------------------------------------------------------

    def _ctx(self, page_table: torch.Tensor, positions: torch.Tensor, kv_len_max: int,
             scores: ScoreRequest | None = None, sparse: SparsePlan | None = None) -> StepContext:
        return StepContext(positions=positions, seq_lens=positions[:, -1] + 1,
                           slot_mapping=slots_of(page_table, positions, self.config.page_size),
                           page_table=page_table, page_size=self.config.page_size,
                           kv_len_max=kv_len_max, scores=scores, sparse=sparse)

    def _forward(self, tokens: torch.Tensor, ctx: StepContext,
                 last_only: bool = False) -> torch.Tensor:
        """tokens [B, n] -> logits [B, n, V] float32 ([B, 1, V] with last_only)."""
        hidden = self.model(tokens, ctx, self.cache.layers, self.backend)
        return self.model.logits(hidden[:, -1:] if last_only else hidden)

    def _upload(self, values: list[int] | torch.Tensor) -> torch.Tensor:
        """Host ints -> an int64 device tensor without waiting for the device."""
        host = torch.as_tensor(values, dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _host_len(self, batch: Batch) -> int:
        return max(s.committed for s in batch.seqs)

    def _step(self, batch: Batch, kind: str, tokens: torch.Tensor, positions: torch.Tensor,
              kv_len: int) -> torch.Tensor:
        """A one-token step ("plain" or "draft" over batch.plan): tokens, positions [B, 1]
        -> logits [B, V]."""
        if self.graphs is not None:
            return self.graphs.run(kind, tokens, positions)[:, -1]
        sparse = batch.plan if kind == "draft" else None
        ctx = self._ctx(batch.page_table, positions, kv_len, sparse=sparse)
        return self._forward(tokens, ctx, last_only=True)[:, -1]

    def _plain_step(self, batch: Batch) -> torch.Tensor:
        logits = self._step(batch, "plain", batch.last[:, None], batch.lengths[:, None],
                            self._host_len(batch) + 1)
        return next_tokens(logits, batch.sampling)

    def _speculate(self, batch: Batch, spec: SpecConfig, policy: Policy, timer: PhaseTimer,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                              torch.Tensor | None, bool]:
        """One draft-verify-accept round: accepted [B], emitted [B, γ+1], the verify pass's
        scores, the budgets [B] the drafts read, and whether the next plan is already made
        (a planning `spec` graph)."""
        gamma = spec.gamma
        graphs = self.graphs
        if graphs is not None and "spec" in graphs.shapes.kinds:
            # drafts, verify, acceptance (and the next selection): one graph
            with timer.phase("speculate"):
                accepted, emitted, budget = graphs.run_spec(batch.last, batch.lengths)
            return (accepted, emitted, graphs.scores(),
                    None if batch.plan is None else budget, graphs.shapes.plans)
        budget = None if batch.plan is None else batch.plan.budget
        with timer.phase("draft"):
            drafts, q = self._draft(batch, gamma)
        with timer.phase("verify"):
            logits, scores = self._verify(batch, policy, drafts, gamma)
        with timer.phase("accept"):
            if batch.sampling.all_greedy:
                accepted, emitted = accept_greedy(drafts, logits)
            else:
                assert q is not None
                accepted, emitted = accept_sampling(drafts, q, probs(logits, batch.sampling),
                                                    batch.sampling)
        return accepted, emitted, scores, budget, False

    def _verify(self, batch: Batch, policy: Policy, drafts: torch.Tensor, gamma: int,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[x0, d1..dγ] with full attention -> logits [B, γ+1, V] and the policy's scores
        [layers, B, R, G, W] (None if it wants none)."""
        tokens = torch.cat([batch.last[:, None], drafts], dim=1)
        positions = batch.lengths[:, None] + torch.arange(gamma + 1, device=self.device)
        if self.graphs is not None:
            return self.graphs.run("verify", tokens, positions), self.graphs.scores()
        kv_len = self._host_len(batch) + gamma + 1
        req = self._score_request(policy, len(batch.seqs), gamma + 1, kv_len, False)
        logits = self._forward(tokens, self._ctx(batch.page_table, positions, kv_len, req))
        return logits, None if req is None else req.out

    def _draft(self, batch: Batch, gamma: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """gamma sparse steps -> drafts [B, γ] and their distributions q [B, γ, V] (sampling)."""
        token, drafts, qs = batch.last, [], []
        kv_len = self._host_len(batch) + gamma
        kind = "plain" if batch.plan is None else "draft"  # None: the `full` oracle
        for j in range(gamma):
            logits = self._step(batch, kind, token[:, None], batch.lengths[:, None] + j, kv_len)
            if batch.sampling.all_greedy:
                token = logits.argmax(-1)
            else:
                q = probs(logits, batch.sampling)
                token = sample(q, batch.sampling)
                qs.append(q)
            drafts.append(token)
        return torch.stack(drafts, 1), torch.stack(qs, 1) if qs else None

    # --- static shapes ------------------------------------------------------------------

    def _graph_runner(self, spec: SpecConfig, policy: Policy | None, bsz: int,
                      greedy: bool = False) -> GraphRunner:
        """The runner of this method's shapes, rebuilt when they or the batch outgrow it;
        greedy: whole rounds as `spec` graphs instead of separate draft and verify steps."""
        shapes = self._static_shapes(spec, policy, greedy)
        runner = self.graphs
        if runner is not None and runner.shapes == shapes and runner.capacity >= bsz:
            return runner
        self.graphs = None  # free the old buffers and graphs before capturing new ones
        return GraphRunner(self.model, self.cache.layers, self.backend, shapes, bucket_for(bsz),
                           self.config.page_size, self.scratch_page, self.config.graphs, policy)

    def _static_shapes(self, spec: SpecConfig, policy: Policy | None,
                       greedy: bool) -> StaticShapes:
        if policy is None:
            return StaticShapes(("plain",), 0, self.cache.pages_for(self.max_model_len))
        gamma, hkv = spec.gamma, self.model_config.num_kv_heads
        kmax = max_budget(spec, self.max_model_len)
        width = policy.index_width(kmax)
        dynamic = policy.selects_in_step
        draft = "plain" if policy.full_drafts else "draft" if width or dynamic else None
        pages = self.cache.pages_for(self.max_model_len + gamma + 1)
        spec_round = greedy and draft is not None
        kinds = ("spec",) if spec_round else ("verify",) + ((draft,) if draft else ())
        return StaticShapes(
            kinds=kinds, verify_rows=gamma + 1, draft_kind=draft or "draft",
            plans=spec_round and not policy.full_drafts,
            pages=pages, kmax=kmax,
            index_width=width, index_groups=hkv if policy.per_kv_head else 1,
            recent_max=2 * gamma + 1,
            score_rows=tuple(policy.score_rows(gamma + 1, False)) if policy.wants_scores else (),
            score_groups=hkv if policy.per_kv_head else 1, score_mode=policy.score_mode,
            per_kv_head=policy.per_kv_head,
            quest_pages=math.ceil(pages * self.config.page_size / spec.page) if dynamic else 0,
            quest_page=spec.page)

    def _score_request(self, policy: Policy | None, bsz: int, n: int, width: int,
                       prefill: bool) -> ScoreRequest | None:
        if policy is None or not policy.wants_scores:
            return None
        rows = policy.score_rows(n, prefill)
        groups = self.model_config.num_kv_heads if policy.per_kv_head else 1
        out = torch.empty(self.model_config.num_layers, bsz, len(rows), groups, width,
                          device=self.device)
        return ScoreRequest(torch.tensor(rows, device=self.device), out, policy.score_mode,
                            policy.per_kv_head)

    # --- prefill ------------------------------------------------------------------------

    def _prefill_all(self, seqs: list[Sequence], policy: Policy | None, timer: PhaseTimer,
                     ) -> tuple[Batch, torch.Tensor | None]:
        """Prefill every sequence, sample its first token; scores [layers, B, 1, G, W] of each
        prompt's last query row when the policy selects from them."""
        page_table = self._page_table(seqs)
        sampling = BatchSampling.build([s.params for s in seqs], self.device)
        with timer.phase("prefill"):
            logits, scores = self._prefill(seqs, page_table, policy)
            first = next_tokens(logits, sampling)
        lengths = torch.tensor([len(s.prompt_ids) for s in seqs], device=self.device)
        for seq, tok in zip(seqs, first.tolist()):
            self._append(seq, [tok])
        return Batch(seqs, page_table, lengths, first, sampling), scores

    def _prefill(self, seqs: list[Sequence], page_table: torch.Tensor, policy: Policy | None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every prompt position, packed (`_prefill_spans`) after restoring each prompt's
        longest cached prefix, -> the next-token logits [B, V] and, if the policy selects
        from them, the scores [layers, B, 1, G, W] of each prompt's last row (scored in the
        forward that computes it). A prompt found whole in the prefix cache runs no forward:
        its logits are restored and its scores recomputed from the kept queries."""
        prompts = [s.prompt_ids for s in seqs]
        width = max(len(p) for p in prompts)
        sink = _PrefillSink(
            logits=torch.empty(len(seqs), self.model_config.vocab_size, device=self.device),
            scores=self._score_request(policy, len(seqs), 1, width, True),
            q_last={} if self.prefix_cache is not None else None,
            pages=[s.pages for s in seqs])
        hits = [self._restore_prefix(s, page_table[i]) for i, s in enumerate(seqs)]
        spans = [(i, done, len(p)) for i, (p, (done, _)) in enumerate(zip(prompts, hits))
                 if done < len(p)]
        self._prefill_spans(prompts, spans, page_table,
                            self.config.prefill_tokens(self.model_config), sink)
        whole = [(i, entry) for i, (done, entry) in enumerate(hits)
                 if entry is not None and done == len(prompts[i])]
        if whole:
            self._replay_last_rows(prompts, whole, page_table, sink)
        for i, _, _ in spans:
            self._save_prefix(seqs[i], page_table[i], sink, i)
        return sink.logits, None if sink.scores is None else sink.scores.out

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
                     self.model.logits(hidden[plan.last.index]),
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
        cfg = self.model_config
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
        length, entry = self.prefix_cache.longest(seq.prompt_ids)
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
        slots = self._prefix_slots(page_table, len(seq.prompt_ids))
        kv = [(k[slots], v[slots]) for k, v in self.cache.layers]
        self.prefix_cache.put(tuple(seq.prompt_ids),
                              PrefixEntry(kv, sink.logits[row].clone(), sink.q_last[row]))

    def _page_table(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.pages) for s in seqs)
        rows = [s.pages + [0] * (width - len(s.pages)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    # --- stopping -----------------------------------------------------------------------

    def _append(self, seq: Sequence, tokens: list[int]) -> None:
        """Append emitted tokens one by one, stopping at max_tokens, EOS or a stop string."""
        eos = set(self.model_config.eos_token_ids)
        for tok in tokens:
            seq.output.append(tok)
            if tok in eos and not seq.params.ignore_eos:
                seq.finish_reason = "stop"
            elif len(seq.prompt_ids) + len(seq.output) >= seq.limit:
                seq.finish_reason = "length"
            if seq.params.stop and self._hit_stop(seq):
                seq.finish_reason = "stop"
            if seq.finish_reason:
                break

    def _hit_stop(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)
        hits = [text.find(s) for s in seq.params.stop if s in text]
        seq.text = text[: min(hits)] if hits else text
        seq.stopped_by_string = bool(hits)
        return bool(hits)

    def _text(self, seq: Sequence) -> str:
        if seq.stopped_by_string:
            return seq.text
        names = ("tokenizer.json", "tokenizer_config.json")
        if not self.source.is_gguf and not any((self.source.path / f).exists() for f in names):
            return ""  # token-id prompts on a checkpoint without a tokenizer
        return self.tokenizer.decode(seq.output, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)


# Request checks live in vegas_spec.config (shared by every front end).

def _spec(spec: SpecConfig | dict | None) -> SpecConfig:
    return spec_config(spec)


def _as_list(prompts: Any) -> list:
    return prompt_list(prompts)[0]


def _params_list(params: SamplingParams | list[SamplingParams] | None,
                 n: int) -> list[SamplingParams]:
    return sampling_list(params, n)
