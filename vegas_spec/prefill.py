"""The prefill step: the scheduler's pieces packed into forwards of at most `prefill_chunk`
tokens (`prefill_packing`), each prompt's first selection scored in the forward that computes
its last token, on the prefill graphs' buffers under static shapes (a replay on CUDA), else
on buffers of each chunk's exact sizes. A prompt whose first pages the scheduler took from the
prefix cache starts after them (`Prefill.start`): its pieces read the shared keys from
their pages, as a chunked prompt reads its earlier chunks' keys. A piece carries only the ids
of its own positions (`Window` shows it to the packer as its whole prompt)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vegas_spec.attention.backend import AttentionBackend
from vegas_spec.attention.context import ScoreRequest
from vegas_spec.cache import PagedKVCache
from vegas_spec.compute.base import Ops
from vegas_spec.input_batch import Ready, upload
from vegas_spec.models.decoder import Decoder
from vegas_spec.prefill_graphs import PrefillGraphs, ScoreKind
from vegas_spec.prefill_packing import (
    Chunk,
    Layout,
    PackedPrefill,
    Span,
    chunks,
    context,
    forward,
    last_rows,
)
from vegas_spec.sampling import BatchSampling, next_tokens
from vegas_spec.speculative.planning import score_request
from vegas_spec.speculative.policies import Policy
from vegas_spec.step import Prefill


class Window:
    """A piece's prompt as the packer reads it: its length, and the ids of the piece's own
    positions (the only ones it slices)."""

    __slots__ = ("piece",)

    def __init__(self, piece: Prefill) -> None:
        self.piece = piece

    def __len__(self) -> int:
        return self.piece.total

    def __getitem__(self, span: slice) -> tuple[int, ...]:
        start = self.piece.start
        assert span.start >= start and span.stop <= self.piece.end, "outside the piece"
        return self.piece.tokens[span.start - start : span.stop - start]


def completed(pieces: list[Prefill], logits: torch.Tensor, scores: torch.Tensor | None,
              device: torch.device) -> Ready | None:
    """The pieces of a prefill that complete their prompts, each with its first token (the
    token after the prompt, drawn from the logits [B, V]) -> None: none does."""
    ready = [i for i, p in enumerate(pieces) if p.ends]
    if not ready:
        return None
    done, idx = [pieces[i] for i in ready], upload(ready, device)
    sampling = BatchSampling.build([p.params for p in done], device)
    lengths = upload([p.total for p in done], device)
    first = next_tokens(logits[idx], sampling, lengths)
    return Ready(done, first, sampling, None if scores is None else scores[:, idx], lengths)


@dataclass
class _Sink:
    """Where a prefill's chunks put what the caller needs: the next-token logits [B, V] and
    the batch's ScoreRequest of the prompts' last rows."""

    logits: torch.Tensor
    scores: ScoreRequest | None = None

    def put(self, batch_rows: torch.Tensor, logits: torch.Tensor,
            scores: torch.Tensor | None) -> None:
        """What the last rows of prompts batch_rows (on the device) gave: logits [S', V] and
        scores [layers, S', R, G, W' >= W] (None: none asked)."""
        self.logits[batch_rows] = logits
        if self.scores is not None and scores is not None:
            self.scores.out[:, batch_rows] = scores[..., : self.scores.out.shape[-1]]

    def request_for(self, rows: int) -> ScoreRequest | None:
        """A ScoreRequest like the batch's, for `rows` of its rows (None: no scores)."""
        req = self.scores
        if req is None:
            return None
        out = torch.empty(req.out.shape[0], rows, *req.out.shape[2:], device=req.out.device)
        return ScoreRequest(req.rows, out, req.mode, req.per_kv_head)


class Prefiller:
    """Runs prefills over the runner's model, KV cache (`cache.cfg`: this rank's sizes) and
    compute seams (ops and attention backend), the logits over the whole model's `vocab`, in
    chunks of `budget` tokens, through its prefill graphs (None: eager)."""

    def __init__(self, model: Decoder, cache: PagedKVCache, ops: Ops, attn: AttentionBackend,
                 vocab: int, budget: int, graphs: PrefillGraphs | None) -> None:
        self.model, self.cache, self.local = model, cache, cache.cfg
        self.ops, self.attn = ops, attn
        self.vocab, self.budget, self.graphs = vocab, budget, graphs
        self.device = cache.layers[0][0].device
        self.page_size = cache.page_size

    def step(self, pieces: list[Prefill], policy: Policy | None,
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pieces (one per prompt: batch row i is pieces[i]'s) -> the next-token logits
        [B, V] and the policy's scores of the prompts' last rows (`run`)."""
        spans = [(i, p.start, p.end) for i, p in enumerate(pieces)]
        return self.run([Window(p) for p in pieces], [list(p.pages) for p in pieces], spans,
                        policy)

    def next_token_logits(self, pieces: list[Prefill]) -> torch.Tensor:
        """Logits [B, V] of the token after each prompt, each piece its prompt's rest (pages
        held by the caller, the positions before it computed)."""
        return self.step(pieces, None)[0]

    def run(self, prompts: list, pages: list[list[int]], spans: list[Span],
            policy: Policy | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompt positions `spans` (row, start, end) of prompts (each on its `pages`), packed
        -> the next-token logits [B, V] and, if the policy selects from them, the scores
        [layers, B, 1, G, W] of the last rows of the prompts that end here (other rows:
        undefined)."""
        scores = score_request(policy, self.local.num_layers, self.local.num_kv_heads,
                               len(prompts), 1, max(map(len, prompts)), True, self.device)
        sink = _Sink(torch.empty(len(prompts), self.vocab, device=self.device), scores)
        for chunk in chunks(prompts, spans, pages, self.budget):
            self._chunk(chunk, sink)
        return sink.logits, None if scores is None else scores.out

    def logits(self, token_ids: list[int], pages: list[int], chunk: int) -> torch.Tensor:
        """Logits [n, V] (float32) of every prompt position, in forwards of `chunk` tokens,
        on `pages` (held by the caller)."""
        parts = chunks([token_ids], [(0, 0, len(token_ids))], [pages], chunk, False)
        hidden = [self._eager(c, None) for c in parts]
        return self.model.logits(torch.cat(hidden), self.ops)

    def warm(self, max_pieces: int, policy: Policy | None) -> int:
        """Every prefill graph the method's chunks can meet, made now -> how many."""
        if self.graphs is None:
            return 0
        kind = ScoreKind(policy.score_mode, policy.per_kv_head) \
            if policy is not None and policy.wants_scores else None
        return self.graphs.warm(self.budget, max_pieces, kind)

    def _chunk(self, chunk: Chunk, sink: _Sink) -> None:
        """One packed forward; nothing waits for the device. The prompts that end here give
        their logits and scores to the sink."""
        if self.graphs is None:
            self._eager(chunk, sink)
            return
        req = sink.scores
        kind = None if req is None else ScoreKind(req.mode, req.per_kv_head)
        logits, scores, _ = self.graphs.run(chunk, kind)
        if chunk.ends:
            sink.put(upload(chunk.end_rows, self.device), logits, scores)

    def _eager(self, chunk: Chunk, sink: _Sink | None) -> torch.Tensor:
        """The chunk on buffers of its exact sizes (keys bounded by its own positions) -> its
        hidden states [T, hidden]."""
        buf = PackedPrefill(Layout.exact(chunk), self.device)
        buf.fill(chunk, self.page_size, 0)  # page 0 past a row's pages, as in page_table
        rows = chunk.end_rows
        scores = sink.request_for(len(rows)) if sink is not None and rows else None
        last = last_rows(buf, max([len(chunk.prompts[r]) for r in rows], default=0), None)
        kv_len = max(a + n for a, n in zip(chunk.starts, chunk.lengths))
        ctx = context(buf, chunk, self.page_size, kv_len, last, scores)
        hidden, logits = forward(self.model, self.cache.layers, self.ops, self.attn, buf, ctx)
        if sink is not None and logits is not None:
            sink.put(upload(rows, self.device), logits, None if scores is None else scores.out)
        return hidden
