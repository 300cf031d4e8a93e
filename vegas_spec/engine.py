"""`LLM(model, **engine_kwargs).generate(prompts, SamplingParams(...))`.

The engine owns the model, the paged KV cache and the attention backend. A request is
prefilled alone (in chunks), then all requests decode together: one token per step for
`vanilla`, or draft-verify-accept-select iterations for the speculative methods. Sequences
keep their own lengths, budgets and stopping; finished ones leave the batch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vegas_spec.attention.backend import make_backend
from vegas_spec.attention.context import ScoreRequest, SparsePlan, StepContext
from vegas_spec.attention.torch_backend import slots_of
from vegas_spec.cache import PagedKVCache
from vegas_spec.config import ConfigError, EngineConfig, SamplingParams, SpecConfig
from vegas_spec.models.decoder import build_model
from vegas_spec.models.loader import dummy_weights, load_config, load_weights, resolve
from vegas_spec.prefix_cache import PrefixCache
from vegas_spec.sampling import BatchSampling, next_tokens, probs, sample
from vegas_spec.spec.acceptance import accept_greedy, accept_sampling
from vegas_spec.spec.policies import Policy, SelectionInput, make_policy
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

    def keep(self, keep: list[int]) -> Batch:
        idx = torch.tensor(keep, device=self.lengths.device, dtype=torch.long)
        return Batch([self.seqs[i] for i in keep], self.page_table[idx], self.lengths[idx],
                     self.last[idx], self.sampling.select(idx))


class LLM:
    def __init__(self, model: str | None = None, *, speculative: SpecConfig | dict | None = None,
                 **engine_kwargs: Any) -> None:
        self.config = EngineConfig(**engine_kwargs)
        self.spec = _spec(speculative)
        self.device = torch.device(self.config.device)
        self.source = resolve(model)
        self.model_config = cfg = load_config(self.source)
        if self.config.load_format == "dummy":
            weights = dummy_weights(cfg, self.config.torch_dtype, self.device)
        else:
            weights = load_weights(self.source, cfg)
        self.model = build_model(cfg, weights, self.config.torch_dtype, self.device)
        del weights
        self.backend = make_backend(self.config.resolved_backend)
        self.cache = PagedKVCache.from_budget(cfg, self._kv_budget(), self.config.page_size,
                                              self.config.torch_dtype, self.device)
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
        return self.model_config.max_position_embeddings

    def _kv_budget(self) -> int:
        if self.config.kv_cache_bytes is not None:
            return int(self.config.kv_cache_bytes)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * self.config.kv_cache_fraction)
        return CPU_KV_BYTES

    # --- requests -----------------------------------------------------------------------

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, *,
                 chat: bool = False, speculative: SpecConfig | dict | None = None,
                 ) -> list[RequestOutput]:
        spec = _spec(speculative) if speculative is not None else self.spec
        prompts = _as_list(prompts)
        params_list = _params_list(params, len(prompts))
        seqs = [self._sequence(p, sp, chat, spec) for p, sp in zip(prompts, params_list)]
        extra = spec.gamma + 1 if spec.speculative else 0  # drafts past the last kept token
        self.cache.check_fits([s.limit + extra for s in seqs])
        for s in seqs:
            s.pages = self.cache.allocate(s.limit + extra)
        try:
            stats = self._run(seqs, spec)
        finally:
            for s in seqs:
                self.cache.release(s.pages)
        summary = stats.summary()
        return [RequestOutput(p, s.prompt_ids, self._text(s), s.output, s.finish_reason or "length",
                              {**summary, "sequence": s.stats.summary()})
                for p, s in zip(prompts, seqs)]

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [n, V] (float32) of every prompt position, through the paged prefill path."""
        seq = self._sequence(token_ids, SamplingParams(max_tokens=1), False, _spec(None))
        pages = self.cache.allocate(len(token_ids))
        try:
            table = torch.tensor([pages], dtype=torch.int32, device=self.device)
            ids = torch.tensor(seq.prompt_ids, device=self.device)
            out = []
            for start in range(0, len(ids), self.config.prefill_chunk):
                end = min(start + self.config.prefill_chunk, len(ids))
                positions = torch.arange(start, end, device=self.device)[None]
                out.append(self._forward(ids[None, start:end], self._ctx(table, positions, end)))
            return torch.cat(out, dim=1)[0]
        finally:
            self.cache.release(pages)

    def _sequence(self, prompt: str | list[int], params: SamplingParams, chat: bool,
                  spec: SpecConfig) -> Sequence:
        ids = encode(self.tokenizer, prompt, chat) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ConfigError("empty prompt")
        if any(not 0 <= t < self.model_config.vocab_size for t in ids):
            raise ConfigError(f"prompt token ids must lie in [0, {self.model_config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ConfigError(f"prompt has {len(ids)} tokens but the model's context is "
                              f"{self.max_model_len}: nothing is left to generate")
        limit = min(len(ids) + params.max_tokens, self.max_model_len)
        window = self.model_config.sliding_window
        extra = spec.gamma + 1 if spec.speculative else 0
        if window is not None and limit + extra > window:
            raise ConfigError(f"sequences longer than the sliding window ({window} tokens) are "
                              "not supported")
        return Sequence(ids, params, limit, stats=SeqStats(gamma=spec.gamma
                                                           if spec.speculative else 0))

    # --- the loop -----------------------------------------------------------------------

    @torch.inference_mode()
    def _run(self, seqs: list[Sequence], spec: SpecConfig) -> RunStats:
        policy = make_policy(spec) if spec.speculative else None
        timer = PhaseTimer(self.device)
        stats = RunStats(spec.method, spec.gamma if spec.speculative else 0, timer,
                         prompt_tokens=sum(len(s.prompt_ids) for s in seqs),
                         seqs=[s.stats for s in seqs])
        t0 = time.perf_counter()
        batch, scores = self._prefill_all(seqs, policy, timer)
        stats.wall_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        row = batch.lengths - 1  # the prefill's last query row
        next_batch: Batch | None = self._select(batch, policy, spec.gamma, timer, scores, row,
                                                torch.zeros_like(row))
        while next_batch is not None:
            next_batch = self._iteration(next_batch, spec, policy, timer)
        timer.flush()
        stats.wall_decode = time.perf_counter() - t0
        stats.generated_tokens = sum(len(s.output) for s in seqs)
        return stats

    def _iteration(self, batch: Batch, spec: SpecConfig, policy: Policy | None,
                   timer: PhaseTimer) -> Batch | None:
        scores = None
        if policy is None:
            with timer.phase("decode"):
                emitted = self._plain_step(batch)[:, None]
            accepted = torch.zeros_like(batch.lengths)
        else:
            accepted, emitted, scores = self._speculate(batch, spec, policy, timer)
        row = batch.lengths  # verify row 0 sat at the old length
        batch.lengths = batch.lengths + accepted + 1
        batch.last = emitted.gather(1, accepted[:, None])[:, 0]
        plan = batch.plan
        budgets = None if plan is None else plan.budget.tolist()
        for i, (seq, a, toks) in enumerate(zip(batch.seqs, accepted.tolist(), emitted.tolist())):
            if policy is not None:
                seq.stats.record(a + 1, None if budgets is None else budgets[i])
            self._append(seq, toks[: a + 1])
        timer.flush()
        return self._select(batch, policy, spec.gamma, timer, scores, row, accepted)

    def _select(self, batch: Batch, policy: Policy | None, gamma: int, timer: PhaseTimer,
                scores: torch.Tensor | None, row: torch.Tensor,
                accepted: torch.Tensor) -> Batch | None:
        """Drop finished sequences, then choose the next draft round's KV positions."""
        alive = [i for i, s in enumerate(batch.seqs) if s.finish_reason is None]
        if not alive:
            return None
        if len(alive) < len(batch.seqs):
            idx = torch.tensor(alive, device=self.device)
            row, accepted = row[idx], accepted[idx]
            scores = None if scores is None else scores[:, idx]
            batch = batch.keep(alive)
        if policy is not None:
            with timer.phase("select"):
                batch.plan = policy.plan(SelectionInput(
                    scores, row, accepted, batch.lengths, gamma, self.cache.layers,
                    batch.page_table, self.config.page_size))
        return batch

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

    def _host_len(self, batch: Batch) -> int:
        return max(s.committed for s in batch.seqs)

    def _plain_step(self, batch: Batch) -> torch.Tensor:
        positions = batch.lengths[:, None]
        ctx = self._ctx(batch.page_table, positions, self._host_len(batch) + 1)
        logits = self._forward(batch.last[:, None], ctx, last_only=True)[:, -1]
        return next_tokens(logits, batch.sampling)

    def _speculate(self, batch: Batch, spec: SpecConfig, policy: Policy, timer: PhaseTimer,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        gamma = spec.gamma
        with timer.phase("draft"):
            drafts, q = self._draft(batch, gamma)
        with timer.phase("verify"):
            tokens = torch.cat([batch.last[:, None], drafts], dim=1)
            positions = batch.lengths[:, None] + torch.arange(gamma + 1, device=self.device)
            kv_len = self._host_len(batch) + gamma + 1
            req = self._score_request(policy, len(batch.seqs), gamma + 1, kv_len, False)
            logits = self._forward(tokens, self._ctx(batch.page_table, positions, kv_len, req))
        with timer.phase("accept"):
            if batch.sampling.all_greedy:
                accepted, emitted = accept_greedy(drafts, logits)
            else:
                assert q is not None
                accepted, emitted = accept_sampling(drafts, q, probs(logits, batch.sampling),
                                                    batch.sampling)
        return accepted, emitted, None if req is None else req.out

    def _draft(self, batch: Batch, gamma: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """gamma sparse steps -> drafts [B, γ] and their distributions q [B, γ, V] (sampling)."""
        token, drafts, qs = batch.last, [], []
        kv_len = self._host_len(batch) + gamma
        for j in range(gamma):
            positions = batch.lengths[:, None] + j
            # plan None: the `full` oracle drafts with full attention
            ctx = self._ctx(batch.page_table, positions, kv_len, sparse=batch.plan)
            logits = self._forward(token[:, None], ctx)[:, -1]
            if batch.sampling.all_greedy:
                token = logits.argmax(-1)
            else:
                q = probs(logits, batch.sampling)
                token = sample(q, batch.sampling)
                qs.append(q)
            drafts.append(token)
        return torch.stack(drafts, 1), torch.stack(qs, 1) if qs else None

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
        """Prefill every sequence alone, sample its first token; scores [layers, B, 1, G, W]
        of each prompt's last query row when the policy selects from them."""
        page_table = self._page_table(seqs)
        sampling = BatchSampling.build([s.params for s in seqs], self.device)
        with timer.phase("prefill"):
            outs = [self._prefill(s, page_table[i : i + 1], policy) for i, s in enumerate(seqs)]
            first = next_tokens(torch.cat([lg for lg, _ in outs]), sampling)
        lengths = torch.tensor([len(s.prompt_ids) for s in seqs], device=self.device)
        for seq, tok in zip(seqs, first.tolist()):
            self._append(seq, [tok])
        scores = [sc for _, sc in outs if sc is not None]
        merged = _merge_scores(scores) if scores else None
        return Batch(seqs, page_table, lengths, first, sampling), merged

    def _prefill(self, seq: Sequence, page_table: torch.Tensor, policy: Policy | None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Chunks over all prompt tokens but the last (or their cached KV), then the last
        token alone: logits [1, V] and, if the policy wants them, its scores."""
        ids = torch.tensor(seq.prompt_ids, device=self.device)
        head = len(seq.prompt_ids) - 1
        if head > 0 and not self._restore_prefix(seq, page_table):
            for start in range(0, head, self.config.prefill_chunk):
                end = min(start + self.config.prefill_chunk, head)
                positions = torch.arange(start, end, device=self.device)[None]
                self.model(ids[None, start:end], self._ctx(page_table, positions, end),
                           self.cache.layers, self.backend)
            self._save_prefix(seq, page_table)
        req = self._score_request(policy, 1, 1, head + 1, True)
        ctx = self._ctx(page_table, torch.tensor([[head]], device=self.device), head + 1, req)
        logits = self._forward(ids[None, head:], ctx)
        return logits[:, -1], None if req is None else req.out

    def _prefix_slots(self, seq: Sequence, page_table: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(len(seq.prompt_ids) - 1, device=self.device)[None]
        return slots_of(page_table, positions, self.config.page_size)[0]

    def _restore_prefix(self, seq: Sequence, page_table: torch.Tensor) -> bool:
        kv = self.prefix_cache.get(tuple(seq.prompt_ids[:-1])) if self.prefix_cache else None
        if kv is None:
            return False
        slots = self._prefix_slots(seq, page_table)
        for (k_cache, v_cache), (k, v) in zip(self.cache.layers, kv):
            k_cache[slots], v_cache[slots] = k, v
        return True

    def _save_prefix(self, seq: Sequence, page_table: torch.Tensor) -> None:
        if self.prefix_cache is not None:
            slots = self._prefix_slots(seq, page_table)
            self.prefix_cache.put(tuple(seq.prompt_ids[:-1]),
                                  [(k[slots], v[slots]) for k, v in self.cache.layers])

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


def _spec(spec: SpecConfig | dict | None) -> SpecConfig:
    if spec is None:
        return SpecConfig(method="vanilla")
    return spec if isinstance(spec, SpecConfig) else SpecConfig(**spec)


def _as_list(prompts: Any) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise ConfigError("prompts must be a string, a list of strings or of token-id lists")
    return prompts


def _params_list(params: SamplingParams | list[SamplingParams] | None,
                 n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ConfigError(f"{len(params)} sampling params for {n} prompts")
    return list(params)


def _merge_scores(scores: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence prefill scores [layers, 1, R, G, W_i] -> [layers, B, R, G, max W]."""
    width = max(s.shape[-1] for s in scores)
    return torch.cat([torch.nn.functional.pad(s, (0, width - s.shape[-1])) for s in scores], 1)
