"""Packed prefill forwards on fixed-shape buffers, captured as CUDA graphs per bucket.

An eager prefill forward launches about ten kernels per layer from Python; on a small model
the host then takes longer to issue a chunk than the GPU takes to run it, and a one-prompt
prefill leaves the GPU idle most of the time. Here a chunk is packed on the host by
`prefill_packing` (tokens, positions, slots, the pieces' page rows and query tiles, the rows
that end a prompt) into two flat buffers, copied to the device in two transfers, and the
whole forward (every layer, the logits of the prompts' last rows, their selection scores and
queries) is one graph replay.

A graph is fixed by (token bucket, piece bucket, score kind): tokens are padded to the next
bucket of the 1, 1.5, 2, 3, 4, 6, ... x 512 ladder (padding rows write only the scratch page
and are in no query tile, so they cost only their share of the matrix products), pieces to
the next power of two (padding pieces are empty, their tiles do nothing, their last rows read
the scratch page). The key axis of the last rows' scores is the static page-table width, as
in the decode graphs. A graph is captured at the first chunk of its shape, or for every shape
at once by `warm` (a server, before its first request: a capture takes far longer than a
step, and every running sequence would wait for it). On CPU, or with a backend that needs
the host lengths of the pieces (the torch backend), the same buffers run eagerly at the
chunk's exact sizes (`pad_to` None; a test sets it to run the padding on CPU), so both paths
share every line of the buffer logic, and the eager prefill's packing too."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vegas_spec.attention.backend import AttentionBackend
from vegas_spec.attention.context import ScoreRequest
from vegas_spec.compute.base import Ops
from vegas_spec.graphs import capture
from vegas_spec.models.decoder import Decoder
from vegas_spec.prefill_packing import Chunk, Layout, PackedPrefill, context, forward, last_rows


def token_bucket(tokens: int, smallest: int = 512) -> int:
    """The smallest bucket of smallest x (1, 1.5, 2, 3, 4, 6, ...) holding `tokens`
    (smallest: a power of two)."""
    bucket = smallest
    while bucket < tokens:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket // 3 * 4
    return bucket


def bucket_floor(tokens: int, smallest: int = 512) -> int:
    """The largest bucket of `token_bucket`'s ladder that is at most `tokens` (`smallest`
    when none is): a per-step token budget that fills its forward without padding."""
    bucket = smallest
    while (up := token_bucket(bucket + 1, smallest)) <= tokens:
        bucket = up
    return bucket


def piece_bucket(pieces: int) -> int:
    return 1 << max(pieces - 1, 0).bit_length()


@dataclass(frozen=True)
class ScoreKind:
    """What the first selection needs from the prompts' last rows: scores [layers, S, 1, G,
    W] in `mode`, G = num_kv_heads if per_kv_head else 1."""

    mode: str
    per_kv_head: bool


class PrefillOutputs:
    """What a forward of S pieces gives: the last rows' queries q_out [layers, S, H, D],
    logits [S, V] and scores (a ScoreRequest of out [layers, S, 1, G, W], or None). The
    buckets of one piece count and score kind share one set: a run's outputs are copied out
    before the next forward starts, and the largest of them (the scores, S x W floats per
    layer) would otherwise be held once per token bucket."""

    def __init__(self, pieces: int, pages: int, model: Decoder, device: torch.device,
                 dtype: torch.dtype, score: ScoreKind | None, page_size: int) -> None:
        cfg, s = model.cfg, pieces
        self.q_out = torch.zeros(cfg.num_layers, s, cfg.num_heads, cfg.head_dim, device=device,
                                 dtype=dtype)
        self.logits = torch.zeros(s, cfg.vocab_size, device=device)
        self.scores = None
        if score is not None:
            groups = cfg.num_kv_heads if score.per_kv_head else 1
            out = torch.zeros(cfg.num_layers, s, 1, groups, pages * page_size, device=device)
            self.scores = ScoreRequest(torch.zeros(1, dtype=torch.long, device=device), out,
                                       score.mode, score.per_kv_head)


@dataclass
class _Entry:
    buf: PackedPrefill
    out: PrefillOutputs
    graph: torch.cuda.CUDAGraph | None = None


class PrefillGraphs:
    """The prefill forwards of one engine: `run(chunk, score)` -> the last rows' logits
    [E, V], scores [layers, E, 1, G, W] (or None) and queries [layers, E, H, D], views that
    the next run of the same bucket overwrites."""

    def __init__(self, model: Decoder, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 ops: Ops, attn: AttentionBackend, page_size: int, pages: int,
                 scratch_page: int, capture: bool) -> None:
        self.model, self.kv_caches, self.ops, self.attn = model, kv_caches, ops, attn
        self.page_size, self.pages, self.scratch_page = page_size, pages, scratch_page
        k_cache = kv_caches[0][0]
        self.device, self.dtype = k_cache.device, k_cache.dtype
        self.block_m = attn.prefill_block_rows(model.cfg.head_dim, self.device)
        # Graphs need a backend whose prefill reads only device buffers (the tile list).
        self.capture = capture and self.block_m is not None
        # The smallest token bucket: graphs pad to coarse buckets (few captures). None: eager
        # runs on buffers of the chunk's exact sizes, made per chunk, whose matrix products
        # then have the shapes of the dynamic path's and round as they do.
        self.pad_to: int | None = 512 if self.capture else None
        self.entries: dict[tuple[int, int, ScoreKind | None], _Entry] = {}
        self.outputs: dict[tuple[int, ScoreKind | None], PrefillOutputs] = {}
        self.pool: tuple[int, int] | None = None

    def buckets(self, max_tokens: int, max_pieces: int) -> list[tuple[int, int]]:
        """Every (token bucket, piece bucket) a chunk of at most max_tokens tokens in at most
        max_pieces pieces can fall in (none without padding: eager runs have no buckets)."""
        if self.pad_to is None:
            return []
        tokens, top = [self.pad_to], token_bucket(max_tokens, self.pad_to)
        while tokens[-1] < top:
            tokens.append(token_bucket(tokens[-1] + 1, self.pad_to))
        pieces, cap = [1], piece_bucket(max(1, max_pieces))
        while pieces[-1] < cap:
            pieces.append(pieces[-1] * 2)
        return [(t, s) for t in tokens for s in pieces if s <= t]

    def warm(self, max_tokens: int, max_pieces: int, score: ScoreKind | None) -> int:
        """Make (and capture) every bucket's forward now, so that no chunk a server meets
        waits for a capture -> how many were made."""
        before = len(self.entries)
        for tokens, pieces in self.buckets(max_tokens, max_pieces):
            self._kept((tokens, pieces, score))
        return len(self.entries) - before

    def run(self, chunk: Chunk, score: ScoreKind | None,
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        total = sum(chunk.lengths)
        if self.pad_to is None:
            key = (total, len(chunk.pieces), score)
        else:
            key = (token_bucket(total, self.pad_to), piece_bucket(len(chunk.pieces)), score)
        entry = self._kept(key)
        self._fill(entry.buf, chunk)
        if entry.graph is not None:
            entry.graph.replay()
        else:
            self._body(entry, chunk)
        out, e = entry.out, len(chunk.ends)
        scores = None if out.scores is None else out.scores.out[:, :e]
        return out.logits[:e], scores, out.q_out[:, :e]

    # --- buffers ----------------------------------------------------------------------------

    def _kept(self, key: tuple[int, int, ScoreKind | None]) -> _Entry:
        """The forward of bucket `key`, made at its first use (and kept where chunks are
        padded to buckets; eager runs at exact sizes make one per chunk)."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self._entry(*key)
            if self.pad_to is not None:
                self.entries[key] = entry
        return entry

    def _entry(self, tokens: int, pieces: int, score: ScoreKind | None) -> _Entry:
        """Buffers of `pieces` pieces and as many last rows, and one empty piece past them
        (the padding tiles')."""
        tiles = 0 if self.block_m is None else -(-tokens // self.block_m) + pieces
        layout = Layout(tokens, pieces + 1, pieces, self.pages, max(tiles, 1))
        entry = _Entry(PackedPrefill(layout, self.device), self._outputs(pieces, score))
        self._fill(entry.buf, Chunk([], [], [], []))  # all padding: touches only the scratch page
        if self.capture:
            entry.graph = self._capture(entry)
        return entry

    def _outputs(self, pieces: int, score: ScoreKind | None) -> PrefillOutputs:
        """The output tensors of forwards of `pieces` pieces: shared by every token bucket
        (kept only where buckets are kept: eager runs make their own)."""
        out = self.outputs.get((pieces, score))
        if out is None:
            out = PrefillOutputs(pieces, self.pages, self.model, self.device, self.dtype, score,
                                 self.page_size)
            if self.pad_to is not None:
                self.outputs[pieces, score] = out
        return out

    def _fill(self, buf: PackedPrefill, chunk: Chunk) -> None:
        """The chunk packed into the buffers, padded to their shapes, with the backend's tile
        list where its prefill reads one."""
        tiles = None if self.block_m is None else self.attn.prefill_tile_list(
            list(chunk.lengths), list(chunk.starts), self.block_m)
        buf.fill(chunk, self.page_size, self.scratch_page, tiles)

    # --- the forward ------------------------------------------------------------------------

    def _body(self, entry: _Entry, chunk: Chunk) -> None:
        """The forward a graph captures: the model over the packed tokens, then the logits of
        the last rows (their scores and queries are written inside the forward)."""
        buf, out, kv_len = entry.buf, entry.out, self.pages * self.page_size
        memo = {} if self.block_m is None else {("prefill_tiles", self.block_m): buf.tiles}
        ctx = context(buf, chunk, self.page_size, kv_len, last_rows(buf, kv_len, out.q_out),
                      out.scores, memo)
        _, logits = forward(self.model, self.kv_caches, self.ops, self.attn, buf, ctx)
        assert logits is not None
        out.logits.copy_(logits)

    def _capture(self, entry: _Entry) -> torch.cuda.CUDAGraph:
        """On the all-padding buffers; every capture shares one memory pool."""
        graph, _ = capture(lambda: self._body(entry, Chunk([], [], [], [])), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        return graph
