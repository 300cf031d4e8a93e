"""The prefill step: the scheduler's pieces packed into forwards of at most `prefill_chunk`
tokens (`prefill_packing`), each prompt's first selection scored in the forward that computes
its last token, on the prefill graphs' buffers under static shapes (a replay on CUDA), else
on buffers of each chunk's exact sizes. The prefix cache's part: a prompt's longest cached
prefix is copied into its pages at admission (`restore`), a prompt found whole there runs no
forward (its logits as stored, its scores computed again from the stored last queries), and a
prompt that completes is stored."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vegas_spec.attention.backend import AttentionBackend
from vegas_spec.attention.context import LastRows, ScoreRequest
from vegas_spec.cache import PagedKVCache, slots_of
from vegas_spec.input_batch import Ready, page_table, upload
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
from vegas_spec.prefix_cache import PrefixCache, PrefixEntry
from vegas_spec.sampling import BatchSampling, next_tokens
from vegas_spec.scheduler import Piece
from vegas_spec.sequence import Sequence
from vegas_spec.speculative.planning import score_request
from vegas_spec.speculative.policies import Policy


def completed(seqs: list[Sequence], logits: torch.Tensor, scores: torch.Tensor | None,
              device: torch.device) -> Ready | None:
    """The sequences of a prefill whose prompts are now complete, each with its first token
    (the token after prefill_ids, drawn from the logits [B, V]) -> None: none is."""
    ready = [i for i, s in enumerate(seqs) if s.prefilled == len(s.prefill_ids)]
    if not ready:
        return None
    done, idx = [seqs[i] for i in ready], upload(ready, device)
    sampling = BatchSampling.build([s.params for s in done], device)
    lengths = upload([len(s.prefill_ids) for s in done], device)
    first = next_tokens(logits[idx], sampling, lengths)
    return Ready(done, first, sampling, None if scores is None else scores[:, idx], lengths)


@dataclass
class _Sink:
    """Where a prefill's chunks put what the caller needs: the next-token logits [B, V] and
    the batch's ScoreRequest of the prompts' last rows; the last rows' queries per batch row
    (for the prefix cache) when q_last is a dict."""

    logits: torch.Tensor
    scores: ScoreRequest | None = None
    q_last: dict[int, torch.Tensor] | None = None

    def put(self, rows: list[int], batch_rows: torch.Tensor, logits: torch.Tensor,
            scores: torch.Tensor | None, q_last: torch.Tensor | None) -> None:
        """What the last rows of prompts `rows` (batch_rows: the same on the device) gave:
        logits [S', V], scores [layers, S', R, G, W' >= W] (None: none asked) and queries
        [layers, S', H, D] (kept as copies: the fixed-shape buffers are rewritten)."""
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


class Prefiller:
    """Runs prefills over the runner's model, KV cache (`cache.cfg`: this rank's sizes) and
    backend, the logits over the whole model's `vocab`, in chunks of `budget` tokens, through
    its prefill graphs (None: eager) and prefix cache (None: off)."""

    def __init__(self, model: Decoder, cache: PagedKVCache, backend: AttentionBackend,
                 vocab: int, budget: int, graphs: PrefillGraphs | None,
                 prefix: PrefixCache | None) -> None:
        self.model, self.cache, self.backend, self.local = model, cache, backend, cache.cfg
        self.vocab, self.budget, self.graphs, self.prefix = vocab, budget, graphs, prefix
        self.device = cache.layers[0][0].device
        self.page_size = cache.page_size
        # id(seq) -> (seq, the prefix-cache entry that covers its whole prompt)
        self.whole: dict[int, tuple[Sequence, PrefixEntry]] = {}

    def start(self, seqs: list[Sequence]) -> None:
        """Sequences just admitted: each prompt's longest cached prefix is copied into its
        pages (seq.prefilled says how far); a prompt found whole waits for the next step."""
        for seq in seqs:
            done, entry = self.restore(seq)
            seq.prefilled = done
            if entry is not None and done == len(seq.prefill_ids):
                self.whole[id(seq)] = (seq, entry)

    def sequences(self, pieces: list[Piece]) -> list[Sequence]:
        """The sequences a step prefills: those of the pieces, then the prompts found whole."""
        seqs = list(dict.fromkeys([p.seq for p in pieces]))
        return seqs + [s for s, _ in self.whole.values() if s not in seqs]

    def step(self, seqs: list[Sequence], pieces: list[Piece], policy: Policy | None,
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pieces of `sequences(pieces)` and their prompts found whole -> the next-token
        logits [B, V] and the policy's scores of the prompts' last rows (`run`)."""
        row = {id(s): i for i, s in enumerate(seqs)}
        spans = [(row[id(p.seq)], p.start, p.end) for p in pieces]
        whole = [(row[id(s)], self.whole.pop(id(s))[1]) for s in seqs if id(s) in self.whole]
        logits, scores = self.run(seqs, spans, whole, policy)
        for p in pieces:
            p.seq.prefilled = p.end
        return logits, scores

    def next_token_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [B, V] of the token after each prompt (pages held by the caller)."""
        whole, spans = [], []
        for i, seq in enumerate(seqs):
            done, entry = self.restore(seq)
            if entry is not None and done == len(seq.prefill_ids):
                whole.append((i, entry))
            else:
                spans.append((i, done, len(seq.prefill_ids)))
        return self.run(seqs, spans, whole, None)[0]

    def run(self, seqs: list[Sequence], spans: list[Span], whole: list[tuple[int, PrefixEntry]],
            policy: Policy | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompt positions `spans` (row, start, end) of seqs, packed, and the prompts
        restored whole from the prefix cache -> the next-token logits [B, V] and, if the
        policy selects from them, the scores [layers, B, 1, G, W] of the last rows of the
        prompts that end here (other rows: undefined)."""
        prompts = [s.prefill_ids for s in seqs]
        table = page_table(seqs, self.device)
        scores = score_request(policy, self.local.num_layers, self.local.num_kv_heads,
                               len(seqs), 1, max(map(len, prompts)), True, self.device)
        sink = _Sink(torch.empty(len(seqs), self.vocab, device=self.device), scores,
                     {} if self.prefix is not None else None)
        for chunk in chunks(prompts, spans, [s.pages for s in seqs], self.budget):
            self._chunk(chunk, sink)
        if whole:
            self._replay(prompts, whole, table, sink)
        for i, _, end in spans:
            if end == len(prompts[i]):
                self._save(seqs[i], table[i], sink, i)
        return sink.logits, None if scores is None else scores.out

    def logits(self, token_ids: list[int], chunk: int) -> torch.Tensor:
        """Logits [n, V] (float32) of every prompt position, in forwards of `chunk` tokens."""
        pages = self.cache.allocate(len(token_ids))
        try:
            parts = chunks([token_ids], [(0, 0, len(token_ids))], [pages], chunk, False)
            hidden = [self._eager(c, None) for c in parts]
            return self.model.logits(torch.cat(hidden), self.backend)
        finally:
            self.cache.release(pages)

    def warm(self, max_pieces: int, policy: Policy | None) -> int:
        """Every prefill graph the method's chunks can meet, made now -> how many."""
        if self.graphs is None:
            return 0
        kind = ScoreKind(policy.score_mode, policy.per_kv_head) \
            if policy is not None and policy.wants_scores else None
        return self.graphs.warm(self.budget, max_pieces, kind)

    def _chunk(self, chunk: Chunk, sink: _Sink) -> None:
        """One packed forward; nothing waits for the device. The prompts that end here give
        their logits, scores and last queries to the sink."""
        if self.graphs is None:
            self._eager(chunk, sink)
            return
        req = sink.scores
        kind = None if req is None else ScoreKind(req.mode, req.per_kv_head)
        logits, scores, q_out = self.graphs.run(chunk, kind)
        if chunk.ends:
            rows = chunk.end_rows
            sink.put(rows, upload(rows, self.device), logits, scores, q_out)

    def _eager(self, chunk: Chunk, sink: _Sink | None) -> torch.Tensor:
        """The chunk on buffers of its exact sizes (keys bounded by its own positions) -> its
        hidden states [T, hidden]."""
        buf = PackedPrefill(Layout.exact(chunk), self.device)
        buf.fill(chunk, self.page_size, 0)  # page 0 past a row's pages, as in page_table
        rows, cfg = chunk.end_rows, self.local
        q_out = None if sink is None or sink.q_last is None or not rows else torch.empty(
            cfg.num_layers, len(rows), cfg.num_heads, cfg.head_dim, device=self.device,
            dtype=self.cache.layers[0][0].dtype)
        scores = sink.request_for(len(rows)) if sink is not None and rows else None
        last = last_rows(buf, max([len(chunk.prompts[r]) for r in rows], default=0), q_out)
        kv_len = max(a + n for a, n in zip(chunk.starts, chunk.lengths))
        ctx = context(buf, chunk, self.page_size, kv_len, last, scores)
        hidden, logits = forward(self.model, self.cache.layers, self.backend, buf, ctx)
        if sink is not None and logits is not None:
            sink.put(rows, upload(rows, self.device), logits,
                     None if scores is None else scores.out, q_out)
        return hidden

    # --- the prefix cache -------------------------------------------------------------------

    def restore(self, seq: Sequence) -> tuple[int, PrefixEntry | None]:
        """Copy the longest cached prefix of the prompt into the sequence's pages -> how many
        positions it covers and its entry ((0, None) without a hit)."""
        if self.prefix is None:
            return 0, None
        length, entry = self.prefix.longest(seq.prefill_ids)
        if entry is None:
            return 0, None
        slots = self._slots(page_table([seq], self.device)[0], length)
        for (k_cache, v_cache), (k, v) in zip(self.cache.layers, entry.kv):
            k_cache[slots], v_cache[slots] = k, v
        return length, entry

    def _save(self, seq: Sequence, table: torch.Tensor, sink: _Sink, row: int) -> None:
        if self.prefix is None or sink.q_last is None or row not in sink.q_last:
            return
        slots = self._slots(table, len(seq.prefill_ids))
        kv = [(k[slots], v[slots]) for k, v in self.cache.layers]
        self.prefix.put(tuple(seq.prefill_ids),
                        PrefixEntry(kv, sink.logits[row].clone(), sink.q_last[row]))

    def _slots(self, table: torch.Tensor, length: int) -> torch.Tensor:
        positions = torch.arange(length, device=self.device)[None]
        return slots_of(table[None], positions, self.page_size)[0]

    def _replay(self, prompts: list[list[int]], whole: list[tuple[int, PrefixEntry]],
                table: torch.Tensor, sink: _Sink) -> None:
        """Prompts restored whole from the prefix cache: their logits as stored, their scores
        recomputed from the stored last queries (the same kernel on the same values as when
        they were prefilled)."""
        rows = [i for i, _ in whole]
        batch_rows = upload(rows, self.device)
        q = torch.stack([e.q_last for _, e in whole], 1)  # [layers, S', H, D]
        scores = sink.request_for(len(rows))
        if scores is not None:
            positions = upload([len(prompts[i]) - 1 for i in rows], self.device)[:, None]
            pages = table[batch_rows]
            last = LastRows(torch.arange(len(rows), device=self.device), positions,
                            slots_of(pages, positions, self.page_size), pages,
                            max(len(prompts[i]) for i in rows))
            for layer, (k_cache, v_cache) in enumerate(self.cache.layers):
                self.backend.last_row_scores(layer, q[layer], k_cache, v_cache, last, scores,
                                             self.page_size)
        sink.put(rows, batch_rows, torch.stack([e.logits for _, e in whole]),
                 None if scores is None else scores.out, q)
