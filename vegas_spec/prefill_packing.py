"""Ragged prefill packing: pieces of several prompts laid end to end in one forward.

The scheduler's pieces (row, start, end) are cut into chunks of at most a token budget
(`chunks`); a chunk is packed on the host into two flat arrays (`pack`: tokens, positions,
slots, the last rows of the prompts that end in it; the pieces' query offsets, starts, page
rows and query tiles, the last rows' page rows) and copied to the device in two transfers
(`PackedPrefill.fill`), whose views the forward reads (`context`, `forward`). The same
packer serves the eager prefill, on buffers of the chunk's exact sizes (`Layout.exact`), and
the prefill graphs, on buffers padded to a bucket (`prefill_graphs`): padding tokens write
only the filler page, padding pieces are empty, padding last rows read the filler page."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from vegas_spec.attention.backend import AttentionBackend
from vegas_spec.attention.context import LastRows, PrefillPlan, ScoreRequest, StepContext
from vegas_spec.compute.base import Ops
from vegas_spec.models.decoder import Decoder

Span = tuple[int, int, int]  # (batch row, start, end): positions start..end-1 of its prompt


@dataclass(frozen=True)
class Chunk:
    """A packed chunk on the host: pieces of `prompts` (batch rows) with their sequences'
    pages; ends: the pieces that finish their prompt."""

    prompts: list[list[int]]
    pieces: list[Span]
    pages: list[list[int]]
    ends: list[int]

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(end - start for _, start, end in self.pieces)

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(start for _, start, _ in self.pieces)

    @property
    def end_rows(self) -> list[int]:
        """The batch rows of the prompts that end in this chunk."""
        return [self.pieces[j][0] for j in self.ends]


def chunks(prompts: list[list[int]], spans: list[Span], pages: list[list[int]], budget: int,
           last_rows: bool = True) -> Iterator[Chunk]:
    """Positions start..end-1 of prompt `row` for each span (row, start, end), whose earlier
    positions are cached: packed end to end into chunks of at most `budget` tokens, a span
    cut across chunks where it does not fit (last_rows False: no piece ends a prompt)."""
    pieces: list[Span] = []
    used = 0
    for row, start, end in spans:
        while start < end:
            take = min(end - start, budget - used)
            pieces.append((row, start, start + take))
            used, start = used + take, start + take
            if used == budget:
                yield _chunk(prompts, pieces, pages, last_rows)
                pieces, used = [], 0
    if pieces:
        yield _chunk(prompts, pieces, pages, last_rows)


def _chunk(prompts: list[list[int]], pieces: list[Span], pages: list[list[int]],
           last_rows: bool) -> Chunk:
    ends = [j for j, (row, _, end) in enumerate(pieces)
            if last_rows and end == len(prompts[row])]
    return Chunk(prompts, pieces, pages, ends)


@dataclass(frozen=True)
class Layout:
    """The sizes of one packed forward: tokens T, pieces N (empty ones past the chunk's),
    last rows E, page-table width P and query tiles (0: the backend tiles from the host
    lengths)."""

    tokens: int
    pieces: int
    ends: int
    pages: int
    tiles: int

    @classmethod
    def exact(cls, chunk: Chunk) -> Layout:
        """The chunk's own sizes (P: the widest of the batch's page lists)."""
        return cls(sum(chunk.lengths), len(chunk.pieces), len(chunk.ends),
                   max(map(len, chunk.pages)), 0)

    @property
    def ints(self) -> int:
        return 3 * self.tokens + 3 * self.ends

    @property
    def small(self) -> int:
        n, p = self.pieces, self.pages
        return n + 1 + n + n * p + 2 * self.tiles + self.ends * p


def pack(chunk: Chunk, layout: Layout, page_size: int, filler: int,
         tiles: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The chunk padded to `layout` on the host -> ints (int64) and small (int32), laid out
    as `PackedPrefill` reads them; filler: the page that padding writes and reads; tiles [2,
    n] the backend's query tiles (padding tiles: the last piece, empty)."""
    t, e, ps = layout.tokens, layout.ends, page_size
    ints = np.zeros(layout.ints, dtype=np.int64)
    ints[2 * t : 3 * t] = filler * ps  # padding rows write the filler page
    offsets = np.cumsum([0, *chunk.lengths])
    table = np.full((layout.pieces, layout.pages), filler, dtype=np.int32)
    for j, (row, a, b) in enumerate(chunk.pieces):
        lo, hi = offsets[j], offsets[j + 1]
        pos = np.arange(a, b)
        pages = np.asarray(chunk.pages[row], dtype=np.int64)
        ints[lo:hi] = chunk.prompts[row][a:b]
        ints[t + lo : t + hi] = pos
        ints[2 * t + lo : 2 * t + hi] = pages[pos // ps] * ps + pos % ps
        table[j, : len(pages)] = pages
    last_table = np.full((e, layout.pages), filler, dtype=np.int32)
    ints[3 * t : 3 * t + e] = t - 1
    ints[3 * t + 2 * e :] = filler * ps
    for k, j in enumerate(chunk.ends):
        ints[3 * t + k] = offsets[j + 1] - 1
        ints[3 * t + e + k] = chunk.pieces[j][2] - 1
        ints[3 * t + 2 * e + k] = ints[2 * t + offsets[j + 1] - 1]
        last_table[k] = table[j]
    cu = np.full(layout.pieces + 1, offsets[-1], dtype=np.int32)
    cu[: len(offsets)] = offsets
    start = np.zeros(layout.pieces, dtype=np.int32)
    start[: len(chunk.pieces)] = chunk.starts
    tile = np.zeros((2, layout.tiles), dtype=np.int32)
    tile[0] = layout.pieces - 1
    if tiles is not None:
        tile[:, : tiles.shape[1]] = tiles
    small = np.concatenate([cu, start, table.ravel(), tile.ravel(), last_table.ravel()])
    return ints, small


class PackedPrefill:
    """A packed forward's inputs on the device, views of two flat tensors. ints (int64):
    tokens, positions, slots [T]; last_index, last_pos, last_slots [E] (the last two [E, 1]).
    small (int32): cu_q [N + 1], start [N], table [N, P], tiles [2, NT], last_table [E, P]."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        t, n, e, p = layout.tokens, layout.pieces, layout.ends, layout.pages
        self.layout = layout
        self.ints = i = torch.zeros(layout.ints, dtype=torch.long, device=device)
        self.small = m = torch.zeros(layout.small, dtype=torch.int32, device=device)
        self.tokens, self.positions, self.slots = i[:t], i[t : 2 * t], i[2 * t : 3 * t]
        self.last_index = i[3 * t : 3 * t + e]
        self.last_pos = i[3 * t + e : 3 * t + 2 * e].view(e, 1)
        self.last_slots = i[3 * t + 2 * e :].view(e, 1)
        o = 0
        self.cu_q, o = m[o : o + n + 1], o + n + 1
        self.start, o = m[o : o + n], o + n
        self.table, o = m[o : o + n * p].view(n, p), o + n * p
        self.tiles, o = m[o : o + 2 * layout.tiles].view(2, layout.tiles), o + 2 * layout.tiles
        self.last_table = m[o:].view(e, p)

    def fill(self, chunk: Chunk, page_size: int, filler: int,
             tiles: np.ndarray | None = None) -> None:
        """Pack the chunk on the host and copy it over in two transfers (nothing waits)."""
        ints, small = pack(chunk, self.layout, page_size, filler, tiles)
        _copy(self.ints, ints)
        _copy(self.small, small)


def _copy(dst: torch.Tensor, host: np.ndarray) -> None:
    src = torch.from_numpy(host)
    if dst.is_cuda:
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)


def context(buf: PackedPrefill, chunk: Chunk, page_size: int, kv_len: int,
            last: LastRows | None, scores: ScoreRequest | None,
            memo: dict | None = None) -> StepContext:
    """The step context of a packed forward (kv_len: host bound on its keys; last: the rows
    whose scores and queries it emits; memo: per-step values of the backend, tile lists)."""
    plan = PrefillPlan(buf.cu_q, buf.start, chunk.lengths, chunk.starts, last, memo or {})
    return StepContext(positions=buf.positions[None], slot_mapping=buf.slots[None],
                       page_table=buf.table, page_size=page_size, kv_len_max=kv_len,
                       scores=scores, prefill=plan)


def last_rows(buf: PackedPrefill, kv_len: int, q_out: torch.Tensor | None) -> LastRows | None:
    """The buffers' last rows (None: none); kv_len: host bound on their positions + 1."""
    if not buf.layout.ends:
        return None
    return LastRows(buf.last_index, buf.last_pos, buf.last_slots, buf.last_table, kv_len, q_out)


def forward(model: Decoder, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            ops: Ops, attn: AttentionBackend, buf: PackedPrefill, ctx: StepContext,
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model over the packed tokens -> hidden states [T, hidden] and the last rows'
    logits [E, V] float32 (None: no last rows)."""
    hidden = model(buf.tokens[None], ctx, kv_caches, ops, attn)[0]
    if not buf.layout.ends:
        return hidden, None
    return hidden, model.logits(hidden[buf.last_index], ops)
