"""Fixed-shape decode-loop forwards, captured as CUDA graphs per batch-size bucket.

Three kinds of step run in the decode loop: `plain` (one token, full attention: vanilla
decoding and the `full` oracle's drafts), `draft` (one token, sparse attention over the plan)
and `verify` (γ+1 tokens, full attention and selection scores). A whole round is one more
kind (`speculative.round.speculate` over these steps): γ draft steps, each feeding its token
to the next, the verify step, acceptance and the policy's selection for the next round
(written into the plan buffers), so an iteration launches one graph instead of γ+1 graphs
with copies, sampling and an eager selection between them. `spec` is the greedy round;
`sampled` and `filtered` (some row uses top-k or top-p) draft and accept with each row's own
sampling settings, greedy rows of the batch included, their draws counter-based so that a
replay needs no generator state. Adaptive speculation may draft fewer than γ tokens: each
draft length of `shapes.lengths` has round graphs of its own (`kind@g`, `with_length`), whose
verify step runs g+1 rows. Each reads only persistent
buffers sized for the largest bucket: a batch of B rows runs as bucket(B) rows, the extra rows
reading and writing a reserved scratch page, their outputs ignored. Before a step the
engine's tensors are copied into the buffers (device to device, no host read); the step then
replays its graph (CUDA) or runs eagerly on the same buffers (CPU), so both paths share every
line of the buffer logic. quest selects inside every draft step: its page bounds and counts
live in the state its policy makes (`Policy.step_state`, a `QuestState` of fixed shape: all
pages of the static key width), which each plan fills and the captured draft step's selector
(`Policy.step_selector`) reads, the pages of its key width only; the buffers only keep it
with its rows.

A graph's key axis is its key width (`Span`): the page table's full width, or one of the
narrower widths a batch runs while its longest row fits (`use_span`), so `kv_len_max` is
fixed per graph; the kernels stop at each row's position, and the reference masks the rest.
The kinds of `shapes.kinds` are captured for every bucket up to the capacity and every key
width when the runner is built (largest first, one shared memory pool), each after a
warm-up run, on dummy buffers that only touch the scratch page; any other kind (the sampled
rounds, the adaptive plain step) at its first use, for every bucket and width at once, on
the live buffers, the plans put back after the warm-up runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vegas_spec.attention.backend import AttentionBackend
from vegas_spec.attention.context import ScoreRequest, SparsePlan, StepContext
from vegas_spec.cache import step_slots
from vegas_spec.compute.base import Ops
from vegas_spec.models.decoder import Decoder
from vegas_spec.sampling import BatchSampling
from vegas_spec.speculative.planning import selection_input
from vegas_spec.speculative.policies import Policy, SelectionInput
from vegas_spec.speculative.round import speculate


def capture(body: Callable[[], Any], pool: tuple[int, int] | None,
            ) -> tuple[torch.cuda.CUDAGraph, Any]:
    """A CUDA graph of body() -> (the graph, body's outputs, rewritten by every replay). A
    warm-up run on a side stream first, so that Triton compiles and the allocator settles
    outside the capture; pool: the memory pool to share (None: the graph's own)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    return graph, out


# Whole rounds: greedy; sampled; with top-k or top-p, by a sort of the vocabulary; with a
# top-k of at most sampling.CANDIDATES tokens (top-p within it), by torch.topk.
ROUNDS = ("spec", "sampled", "filtered", "topk")


def round_kind(sampling: BatchSampling | None) -> str:
    """The round graph a batch of these sampling settings runs."""
    if sampling is None:
        return "spec"
    return round_kind_of(sampling.greedy, sampling.filtered, sampling.bounded)


def round_kind_of(greedy: list[bool], filtered: list[bool], bounded: list[bool]) -> str:
    """`round_kind` from the rows' host flags (`sampling.host_flags`)."""
    if all(greedy):
        return "spec"
    if not any(filtered):
        return "sampled"
    return "topk" if all(bounded) else "filtered"


def with_length(kind: str, gamma: int, longest: int) -> str:
    """The graph kind of a round of `gamma` drafts: the round kind itself for the longest
    (γ), `kind@gamma` for a shorter one."""
    return kind if gamma == longest else f"{kind}@{gamma}"


def bucket_for(rows: int) -> int:
    """The batch-size bucket of `rows` sequences: the next power of two (1, 2, 4, ... 128, ...)."""
    return 1 << max(rows - 1, 0).bit_length()


def buckets_upto(capacity: int) -> list[int]:
    return [1 << i for i in range(capacity.bit_length()) if 1 << i <= capacity]


@dataclass(frozen=True)
class Span:
    """One key width of the decode graphs: a batch whose longest committed length plus one
    round (γ+1 positions; 1 for plain decoding) stays within `length` runs the graphs of
    this width, which read `pages` page-table columns (their attention splits and merges
    sized for them), lists of at most `index_width` positions under budgets of at most
    `kmax`, and rank the verify scores of positions below `length`."""

    length: int
    pages: int
    kmax: int = 0
    index_width: int = 0


@dataclass(frozen=True)
class StaticShapes:
    """Everything that fixes the shapes of the decode-loop forwards of one method.

    kinds:        the steps to capture: some of plain, draft, verify and spec (spec@g: a
                  round of g drafts, `with_length`).
    verify_rows:  γ+1 (0 for plain decoding).
    lengths:      the draft lengths of the round graphs, ascending, γ the last (() : γ).
    score_rows_of: for each of `lengths`, the verify rows whose scores its round asks for.
    pages:        page-table width P; kv_len_max = P * page_size.
    kmax:         host bound on every selection budget.
    rank_width:   host bound on the positions a selection ranks (0: the whole key width);
                  max_model_len, which every committed length stays below, where the key
                  width is rounded up past it for the drafts and verify rows of a round.
    index_width:  K of the plan's indices [layers, B, G, K] (0: none).
    index_groups: G of those indices (1 or num_kv_heads).
    recent_max:   2γ+1, the widest recent range a draft step reads.
    score_rows:   verify rows (of γ+1) whose selection scores the policy wants (() = none).
    score_groups: G of the scores [layers, B, R, G, W].
    draft_kind:   the step a `spec` round drafts with ("draft", or "plain" for full drafts).
    plans:        a `spec` round ends with the selection of the next round's plan.
    spans:        narrower key widths than the whole (`pages`, `kmax`, `index_width`,
                  `rank_width`), ascending, each with graphs of its own: a long
                  generation's early rounds need not split, merge and rank keys sized for
                  max_model_len (() : the whole width alone).
    """

    kinds: tuple[str, ...]
    verify_rows: int
    pages: int
    lengths: tuple[int, ...] = ()
    score_rows_of: tuple[tuple[int, ...], ...] = ()
    kmax: int = 0
    rank_width: int = 0
    index_width: int = 0
    index_groups: int = 1
    recent_max: int = 0
    score_rows: tuple[int, ...] = ()
    score_groups: int = 1
    score_mode: str = "weight"
    per_kv_head: bool = False
    draft_kind: str = "draft"
    plans: bool = False
    spans: tuple[Span, ...] = ()

    @property
    def widths(self) -> tuple[Span, ...]:
        """Every key width the graphs are captured at, ascending, the whole one last (its
        length: max_model_len, `rank_width`)."""
        whole = Span(self.rank_width, self.pages, self.kmax, self.index_width)
        return (*self.spans, whole)

    def span_for(self, longest: int | None) -> int:
        """The index in `widths` of the narrowest width whose graphs hold a batch whose
        longest committed length is `longest` (None: the whole width)."""
        if longest is not None:
            need = longest + max(self.verify_rows, 1)
            for i, span in enumerate(self.spans):
                if need <= span.length:
                    return i
        return len(self.spans)

    @property
    def draft_lengths(self) -> tuple[int, ...]:
        """The draft lengths a round may take (γ alone unless `lengths` says more)."""
        return self.lengths or ((self.verify_rows - 1,) if self.verify_rows else ())

    def scored(self, gamma: int) -> tuple[int, ...]:
        """The verify rows whose scores a round of `gamma` drafts asks for."""
        if not self.score_rows or gamma == self.verify_rows - 1:
            return self.score_rows
        return self.score_rows_of[self.lengths.index(gamma)]


SAMPLING = ("temperature", "top_k", "top_p", "seeds")  # per-row settings, as BatchSampling


class StaticBuffers:
    """The inputs of every decode-loop forward, `capacity` rows each; a bucket reads the first
    rows. tokens, positions: {n: [C, n] int64} for n = 1 and g+1 for each draft length g;
    page_table [C, P] int32;
    indices [layers, C, G, K] int64; recent_start, budget, listed [C] int64 (listed: the most
    positions a row lists, `SparsePlan.listed`); score_rows {n: [R_n] int64}, the rows a
    verify step of n rows scores; scores [layers, C, R, G, W] float32 (W = P * page_size;
    a verify step of n rows writes the first R_n); state: the policy's in-step
    selection state (`Policy.step_state`: quest's page bounds; None for the others);
    last, lengths [C] int64: a round's newest tokens and committed lengths; temperature,
    top_k, top_p, seeds [C]: each row's sampling settings (a sampled round's)."""

    def __init__(self, shapes: StaticShapes, capacity: int, kv_cache: torch.Tensor, layers: int,
                 page_size: int, scratch_page: int, policy: Policy | None = None) -> None:
        device = kv_cache.device
        i64 = dict(dtype=torch.long, device=device)
        widths = {1} | {g + 1 for g in shapes.draft_lengths}
        self.scratch_page = scratch_page
        self.tokens = {n: torch.zeros(capacity, n, **i64) for n in widths}
        self.positions = {n: torch.zeros(capacity, n, **i64) for n in widths}
        self.page_table = torch.zeros(capacity, shapes.pages, dtype=torch.int32, device=device)
        self.indices = torch.zeros(layers, capacity, shapes.index_groups, shapes.index_width,
                                   **i64)
        self.recent_start = torch.zeros(capacity, **i64)
        self.budget = torch.zeros(capacity, **i64)
        self.listed = torch.zeros(capacity, **i64)
        self.score_rows = {g + 1: torch.tensor(shapes.scored(g), **i64)
                           for g in shapes.draft_lengths}
        self.scores = torch.zeros(layers, capacity, len(shapes.score_rows), shapes.score_groups,
                                  shapes.pages * page_size if shapes.score_rows else 0,
                                  dtype=torch.float32, device=device)
        self.state = None if policy is None else \
            policy.step_state(layers, capacity, shapes.pages * page_size, kv_cache)
        self.last = torch.zeros(capacity, **i64)
        self.lengths = torch.zeros(capacity, **i64)
        self.temperature = torch.zeros(capacity, device=device)
        self.top_k = torch.zeros(capacity, **i64)
        self.top_p = torch.ones(capacity, device=device)
        self.seeds = torch.zeros(capacity, **i64)
        self.reset()

    def reset(self, start: int = 0, end: int | None = None) -> None:
        """Rows start..end-1 dummy rows: token 0 at position 0 on the scratch page, nothing
        listed."""
        rows = slice(start, end)
        for n in self.tokens:
            self.tokens[n][rows].zero_()
            self.positions[n][rows].zero_()
        self.page_table[rows].fill_(self.scratch_page)
        self.indices[:, rows].fill_(-1)
        self.recent_start[rows].zero_()
        self.budget[rows].zero_()
        self.listed[rows].zero_()
        self.last[rows].zero_()
        self.lengths[rows].zero_()
        self.temperature[rows].zero_()  # greedy: a dummy row's draws are one-hot
        self.top_k[rows].zero_()
        self.top_p[rows].fill_(1.0)
        self.seeds[rows].zero_()
        if self.state is not None:
            self.state.reset(rows)

    def move_rows(self, src: torch.Tensor, rows: int) -> None:
        """Row src[j] -> row j for j < rows (src [rows] int64 on the device): a sequence's
        page table, plan and in-step selection state move with it; scores and the step inputs are
        rewritten by every step, so they stay."""
        self.page_table[:rows] = self.page_table[src]
        self.indices[:, :rows] = self.indices[:, src]
        self.recent_start[:rows] = self.recent_start[src]
        self.budget[:rows] = self.budget[src]
        self.listed[:rows] = self.listed[src]
        for name in SAMPLING:
            values = getattr(self, name)
            values[:rows] = values[src]
        if self.state is not None:
            self.state.move_rows(src, rows)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    out: tuple[torch.Tensor, ...]  # rewritten by every replay


class GraphRunner:
    """Owns the fixed-shape buffers and the CUDA graphs of one method's decode loop.

    A sequence owns one buffer row from joining to leaving: set_rows when sequences join
    (after the rows in use), set_plan_rows for their first plan, condense when some leave
    (the survivors move down with their page tables and plans, so the bucket follows the
    live rows); then
    run(kind, tokens, positions) per step, or run_spec(last, lengths) per round
    (which makes the next selection itself when shapes.plans, with `policy`). With capture
    False every step runs eagerly on the buffers (the CPU path)."""

    def __init__(self, model: Decoder, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 ops: Ops, attn: AttentionBackend, shapes: StaticShapes, capacity: int,
                 page_size: int, scratch_page: int, capture: bool,
                 policy: Policy | None = None) -> None:
        assert policy is not None or not shapes.plans, "a planning round needs the policy"
        self.model, self.kv_caches, self.ops, self.attn = model, kv_caches, ops, attn
        self.policy = policy
        self.shapes, self.capacity, self.page_size = shapes, capacity, page_size
        self.kv_len = shapes.pages * page_size
        self.buf = StaticBuffers(shapes, capacity, kv_caches[0][0], len(kv_caches), page_size,
                                 scratch_page, policy)
        self.rows, self.bucket = capacity, capacity
        self.widths = shapes.widths
        self.span = len(shapes.spans)  # the index in widths of the steps' key width
        self.scored = len(shapes.score_rows)  # score rows of the last verify step
        # The runner's own memory pool (made by its first capture): a pool shared with an
        # earlier runner could outlive that runner's graphs while its blocks are still held,
        # which the caching allocator refuses when the next capture joins it.
        self.pool: tuple[int, int] | None = None
        self.graphs: dict[tuple[str, int, int], _Graph] = {}
        self.capturing = capture  # kinds outside shapes.kinds are captured at first use
        if capture:
            self._capture_all()

    # --- per batch / per selection ----------------------------------------------------------

    def set_rows(self, start: int, page_table: torch.Tensor,
                 sampling: BatchSampling | None = None) -> None:
        """Sequences joining at rows start.. (page_table [n, P'], P' <= P; sampling: their
        settings, None for greedy): the batch is now start + n rows; the rows' plans are
        written by set_plan_rows."""
        rows, width = page_table.shape
        assert start + rows <= self.capacity and width <= self.shapes.pages
        b, end = self.buf, start + rows
        b.reset(start, end)
        b.page_table[start:end, :width].copy_(page_table)
        if sampling is not None:
            for name in SAMPLING:
                getattr(b, name)[start:end].copy_(getattr(sampling, name))
        self._resize(end)

    def set_pages(self, rows: torch.Tensor, page_table: torch.Tensor) -> None:
        """Rows `rows` [n] (of the batch) took more pages: page_table [n, P'] (P' <= P)."""
        assert page_table.shape[1] <= self.shapes.pages
        self.buf.page_table[rows, : page_table.shape[1]] = page_table

    def condense(self, keep: list[int], src: torch.Tensor) -> None:
        """Only rows `keep` (src: the same on the device) stay, moved to rows 0.. in order,
        each with its plan; the rows past them become dummy rows."""
        rows = len(keep)
        if keep != list(range(rows)):
            self.buf.move_rows(src, rows)
        self.buf.reset(rows, self.rows)
        self._resize(rows)

    def _resize(self, rows: int) -> None:
        self.rows, self.bucket = rows, bucket_for(rows)

    @property
    def width(self) -> Span:
        """The key width the next steps run at (`use_span`)."""
        return self.widths[self.span]

    def use_span(self, longest: int | None) -> None:
        """The steps from now on run the graphs of the narrowest key width that holds a batch
        whose longest committed length is `longest` (host-known; None: the whole width)."""
        self.span = self.shapes.span_for(longest)

    def set_plan_rows(self, plan: SparsePlan | None, start: int) -> None:
        """The first plan of the sequences that joined at rows start.. (from their prefill)."""
        if plan is not None:
            self._write_plan(plan, plan.recent_start.shape[0], start)

    def _write_plan(self, plan: SparsePlan | None, rows: int, start: int = 0) -> None:
        if plan is None:
            return
        end = start + rows
        self.buf.recent_start[start:end].copy_(plan.recent_start)
        self.buf.budget[start:end].copy_(plan.budget)
        if plan.listed is not None:
            self.buf.listed[start:end].copy_(plan.listed)
        else:  # the whole static width
            self.buf.listed[start:end].fill_(self.shapes.index_width)
        if plan.indices is not None:
            self._set_indices(plan.indices, start, end)

    def _set_indices(self, indices: torch.Tensor, start: int, end: int) -> None:
        """indices [layers, n, G, k] (k <= K) -> buffer rows start..end-1, -1 padded to K."""
        shape, width = tuple(indices.shape[:3]), indices.shape[3]
        assert shape == (len(self.kv_caches), end - start, self.shapes.index_groups), shape
        assert width <= self.shapes.index_width, f"{width} indices exceed the static width"
        dst = self.buf.indices[:, start:end]
        dst[..., :width].copy_(indices)
        dst[..., width:].fill_(-1)

    # --- per step ---------------------------------------------------------------------------

    def run(self, kind: str, tokens: torch.Tensor, positions: torch.Tensor,
            longest: int | None = None) -> torch.Tensor:
        """tokens, positions [B, n] -> logits [B, n, V] float32 (a view the next run of the
        same kind overwrites); longest: the rows' longest committed length, which picks the
        key width (`use_span`; None: the whole)."""
        self.use_span(longest)
        n = tokens.shape[1]
        self.buf.tokens[n][: self.rows].copy_(tokens)
        self.buf.positions[n][: self.rows].copy_(positions)
        return self._replay(kind)[0][: self.rows]

    def run_spec(self, last: torch.Tensor, lengths: torch.Tensor,
                 sampling: BatchSampling | None = None, gamma: int | None = None,
                 longest: int | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One round of `gamma` drafts (None: γ; else one of shapes.draft_lengths): last,
        lengths [B] -> accepted [B] and emitted [B, gamma+1] as `speculate` returns them, and
        the budget [B] its drafts read (views the next round overwrites). sampling None or
        all greedy: the `spec` graph; else the graph of its host flags (`round_kind`), each
        row sampled with its own settings (set_rows). The verify step's scores are in
        `scores()` after it; with shapes.plans the buffers then hold the next round's plan.
        longest: the rows' longest committed length, which picks the key width (`use_span`;
        None: the whole)."""
        self.use_span(longest)
        most = self.shapes.verify_rows - 1
        gamma = most if gamma is None else gamma
        assert gamma in self.shapes.draft_lengths, f"no round graph drafts {gamma} tokens"
        self.buf.last[: self.rows].copy_(last)
        self.buf.lengths[: self.rows].copy_(lengths)
        self.scored = len(self.shapes.scored(gamma))
        accepted, emitted, budget = self._replay(with_length(round_kind(sampling), gamma,
                                                             most))
        return accepted[: self.rows], emitted[: self.rows], budget[: self.rows]

    def _replay(self, kind: str) -> tuple[torch.Tensor, ...]:
        key = (kind, self.bucket, self.span)
        graph = self.graphs.get(key)
        if graph is None and self.capturing:
            self._capture_now(self.every_length(kind))
            graph = self.graphs[key]
        if graph is None:
            return self._body(kind, self.bucket)
        graph.graph.replay()
        return graph.out

    def scores(self) -> torch.Tensor | None:
        """The last verify step's scores [layers, B, R, G, W], or None if none were asked."""
        return self.scores_of(self.rows)

    def scores_of(self, rows: int, scored: int | None = None) -> torch.Tensor | None:
        """The scores of the first `rows` rows, of the verify step's first `scored` score
        rows (None: the last verify step's)."""
        if not self.shapes.score_rows:
            return None
        width = self.width.pages * self.page_size
        return self.buf.scores[:, :rows, : self.scored if scored is None else scored, :, :width]

    def _body(self, kind: str, rows: int) -> tuple[torch.Tensor, ...]:
        """What a graph of `kind` captures, on the first `rows` buffer rows."""
        base, _, gamma = kind.partition("@")
        if base in ROUNDS:
            return self._speculate(rows, base,
                                   int(gamma) if gamma else self.shapes.verify_rows - 1)
        return (self._forward(kind, rows),)

    def _speculate(self, rows: int, kind: str, gamma: int,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A round of `gamma` drafts (`speculate`) from buf.last at buf.lengths, greedy
        (`spec`) or with each row's sampling settings, then (shapes.plans) the next round's
        selection: accepted [rows], emitted [rows, gamma+1], the budget [rows] the drafts
        read."""
        b = self.buf
        last, lengths = b.last[:rows], b.lengths[:rows]
        budget = b.budget[:rows].clone()
        sampling = None if kind == "spec" else BatchSampling(
            b.temperature[:rows], b.top_k[:rows], b.top_p[:rows], b.seeds[:rows],
            [False] * rows, [kind in ("filtered", "topk")] * rows, [kind == "topk"] * rows)

        def step(step_kind: str, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            n = tokens.shape[1]
            b.tokens[n][:rows].copy_(tokens)
            b.positions[n][:rows].copy_(positions)
            return self._forward(step_kind, rows, raw=True, n=n)

        accepted, emitted = speculate(step, last, lengths, gamma, self.shapes.draft_kind,
                                      sampling)
        if self.shapes.plans:
            self._plan_next(rows, lengths, accepted, len(self.shapes.scored(gamma)))
        return accepted, emitted, budget

    def _plan_next(self, rows: int, lengths: torch.Tensor, accepted: torch.Tensor,
                   scored: int) -> None:
        """The policy's selection from this round's verify pass (row 0 at `lengths`; its
        first `scored` score rows) into the plan buffers, with the host bounds of the static
        shapes (those of γ drafts, whatever the next round drafts)."""
        assert self.policy is not None
        inp = selection_input(self.policy, self.ops, self.attn, self.scores_of(rows, scored),
                              lengths, accepted, lengths + accepted + 1,
                              self.shapes.verify_rows - 1, self.kv_caches,
                              self.buf.page_table[:rows], self.page_size)
        self._write_plan(self.policy.plan(self.bound(inp)), rows)

    def bound(self, inp: SelectionInput, start: int = 0) -> SelectionInput:
        """`inp` with the host bounds of these static shapes, so that the selection reads
        nothing back from the device, and quest's fixed-shape state to fill (from row
        `start`: the plan is for the rows that joined there). The bounds are those of the
        key width that holds inp.max_len (None: the steps' own, `width`)."""
        s = self.shapes
        i = self.span if inp.max_len is None else s.span_for(inp.max_len)
        span = self.widths[i]
        inp.kmax, inp.recent_max = span.kmax, s.recent_max
        inp.rank_width = span.length or None  # the whole width's: rank_width (0: none)
        state = self.buf.state
        inp.quest_state = state if state is None or start == 0 else state.from_row(start)
        return inp

    def _forward(self, kind: str, rows: int, raw: bool = False,
                 n: int | None = None) -> torch.Tensor:
        """One step of the first `rows` buffer rows, n query rows each (None: γ+1 for a
        verify step, else 1): logits [rows, n, V] float32 (raw: in the model's dtype, for a
        round's argmax, top-k and sampling, which the exact float32 cast would not
        change)."""
        if n is None:
            n = self.shapes.verify_rows if kind == "verify" else 1
        ctx = self._context(kind, rows, n)
        hidden = self.model(self.buf.tokens[n][:rows], ctx, self.kv_caches, self.ops, self.attn)
        return self.model.head(hidden, self.ops) if raw else self.model.logits(hidden, self.ops)

    def _context(self, kind: str, rows: int, n: int) -> StepContext:
        pages = self.width.pages
        positions, table = self.buf.positions[n][:rows], self.buf.page_table[:rows, :pages]
        return StepContext(
            positions=positions,
            slot_mapping=step_slots(table, positions, self.page_size), page_table=table,
            page_size=self.page_size, kv_len_max=pages * self.page_size,
            scores=self._score_request(rows, n) if kind == "verify" else None,
            sparse=self._plan(rows) if kind == "draft" else None, draft=kind == "draft")

    def _score_request(self, rows: int, n: int) -> ScoreRequest | None:
        """The scores a verify step of n rows writes: its scored rows' (`shapes.scored`)."""
        s = self.shapes
        if not s.score_rows:
            return None
        scored = self.buf.score_rows[n]
        width = self.width.pages * self.page_size
        return ScoreRequest(scored, self.buf.scores[:, :rows, : scored.shape[0], :, :width],
                            s.score_mode, s.per_kv_head)

    def _plan(self, rows: int) -> SparsePlan:
        b, s, span = self.buf, self.shapes, self.width
        if b.state is None:
            return SparsePlan(b.indices[:, :rows, :, : span.index_width], b.recent_start[:rows],
                              s.recent_max, b.budget[:rows], listed=b.listed[:rows])
        assert self.policy is not None
        selector = self.policy.step_selector(b.state, rows, span.kmax,
                                             span.pages * self.page_size)
        return SparsePlan(None, b.recent_start[:rows], s.recent_max, b.budget[:rows], selector)

    # --- capture ----------------------------------------------------------------------------

    def _capture_all(self, kinds: tuple[str, ...] | None = None) -> None:
        """Every (kind, bucket, key width) not yet captured, largest bucket and width first
        so the smaller ones reuse its pool (kinds None: shapes.kinds)."""
        device = self.buf.page_table.device
        current = self.span
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            for bucket in reversed(buckets_upto(self.capacity)):
                for span in reversed(range(len(self.widths))):
                    self.span = span
                    for kind in self.shapes.kinds if kinds is None else kinds:
                        if (kind, bucket, span) not in self.graphs:
                            self.graphs[(kind, bucket, span)] = self._capture(kind, bucket)
        self.span = current

    def warm(self, kinds: tuple[str, ...] | None = None) -> None:
        """Before any row joins: `kinds` (None: the sampled rounds and the plain step, what
        a server may meet) captured for every bucket on the dummy buffers, so that no
        request waits for their capture."""
        if self.capturing and self.shapes.verify_rows:
            wanted = ("sampled", "filtered", "topk", "plain") if kinds is None else kinds
            self._capture_all(tuple(k for kind in wanted for k in self.every_length(kind)))

    def every_length(self, kind: str) -> tuple[str, ...]:
        """A round kind's graphs of every draft length (adaptive speculation may run any of
        them at any iteration); any other kind alone."""
        base = kind.partition("@")[0]
        if base not in ROUNDS:
            return (kind,)
        longest = self.shapes.verify_rows - 1
        return tuple(with_length(base, g, longest) for g in self.shapes.draft_lengths)

    def _capture(self, kind: str, bucket: int) -> _Graph:
        graph, out = capture(lambda: self._body(kind, bucket), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        return _Graph(graph, out)

    def _capture_now(self, kinds: tuple[str, ...]) -> None:
        """Kinds first met while rows decode (a sampled round's, of every draft length; the
        adaptive plain step; a profiled step): captured for every bucket at once, so that rows
        leaving later (or a round of another length) meet no capture, on the live buffers.
        The warm-up runs write only KV past the committed lengths (rewritten before it is
        read) and plans, which are put back as they were: the replays draft from the plans
        the eager path would."""
        b = self.buf
        plan = (b.indices, b.recent_start, b.budget, b.listed) + \
            (() if b.state is None else b.state.tensors())
        saved = [t.clone() for t in plan]
        self._capture_all(kinds)
        for dst, src in zip(plan, saved):
            dst.copy_(src)
