"""KV-selection policies for the draft steps: small registered objects, tensors in, indices out.

Every policy sees the same `SelectionInput` after a full-attention pass (prefill or verify) and
returns a `SparsePlan`: per (layer, sequence[, kv head]) a list of positions before
`recent_start`, plus the recent range [recent_start, length) that drafts always read.

Positions are ranked only if the selection row can see them; the row itself and everything
after it form the recent range."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vegas_spec import config
from vegas_spec.attention.context import DynamicSelector, SparsePlan, StepContext
from vegas_spec.cache import gather_slots, slots_of
from vegas_spec.config import ConfigError, PolicyOptions, SpecConfig
from vegas_spec.ops import cat_padded, quest_page_scores_ref, sorted_positions, topk_positions


@dataclass
class SelectionInput:
    """scores:    [layers, B, R, G, W] float32 from the full pass, or None.
    row_pos:   [B] position of query row 0 of that pass (x0 in verify, the last prompt
               token in prefill).
    accepted:  [B] accepted drafts (0 after prefill): the last committed token is row `accepted`.
    lengths:   [B] committed KV length (positions 0..lengths-1 are exact).
    gamma:     draft steps that will read this plan.
    kmax, recent_max, max_len: host bounds for fixed shapes (None: read from the tensors, a
               host sync). kmax >= every budget fixes the index width, recent_max >= every
               recent range (2γ+1), max_len >= every length sizes quest's page bounds.
    rank_width: host bound on the rankable positions (None: the scores' width W): vegas and
               lastq rank scores[..., :rank_width] only, so that a key width rounded up past
               the context (W = max_model_len + γ + 1 in pages) does not widen the top-k's
               rows (the Triton backend's kernel holds rows of up to 8,192 scores).
    topk:      the attention backend's top-k, with `topk_positions`' contract (None: that
               reference): vegas and lastq rank their scores with it.
    topk_sum:  the backend's top-k of scores summed over their rows (dim -3), as
               `topk_positions(scores.sum(-3), ...)` (None: that sum, then `topk`): vegas
               ranks its collected rows' sum with it.
    """

    scores: torch.Tensor | None
    row_pos: torch.Tensor
    accepted: torch.Tensor
    lengths: torch.Tensor
    gamma: int
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    page_table: torch.Tensor
    page_size: int
    kmax: int | None = None
    recent_max: int | None = None
    max_len: int | None = None
    rank_width: int | None = None
    quest_state: QuestState | None = None
    topk: Callable[..., torch.Tensor] | None = None
    topk_sum: Callable[..., torch.Tensor] | None = None


@dataclass
class QuestState:
    """Fixed-shape home of quest's selection for captured draft steps: per layer the page
    bounds lo, hi [layers, C, NP, Hkv, D] in the cache's dtype (min and max of stored keys
    are themselves stored values, so nothing is rounded) and per sequence rankable (tokens),
    pages (the pages they fill) and n_pages (pages to keep) [C] int64, for C >= B rows and
    NP pages (the static key width over the quest page). A plan fills rows [:B] in place;
    the captured draft graph's selector reads them, so a draft step computes none of them."""

    lo: torch.Tensor
    hi: torch.Tensor
    rankable: torch.Tensor
    pages: torch.Tensor
    n_pages: torch.Tensor

    @classmethod
    def empty(cls, layers: int, rows: int, pages: int, hkv: int, dim: int,
              device: torch.device, dtype: torch.dtype = torch.float32) -> QuestState:
        keys, i64 = dict(dtype=dtype, device=device), dict(dtype=torch.long, device=device)
        shape = (layers, rows, pages, hkv, dim)
        return cls(torch.zeros(shape, **keys), torch.zeros(shape, **keys),
                   *(torch.zeros(rows, **i64) for _ in range(3)))

    def from_row(self, start: int) -> QuestState:
        """The same state from row `start` on (views: a plan for rows that joined there
        writes into this state's rows)."""
        return QuestState(self.lo[:, start:], self.hi[:, start:], self.rankable[start:],
                          self.pages[start:], self.n_pages[start:])

    def selector(self, rows: int, page: int, max_pages: int,
                 width: int | None = None) -> QuestSelector:
        """The selector of the first `rows` rows, reading this state's first `width` pages
        (None: all; a narrower key width scores the pages its rows can reach only)."""
        bounds = [(self.lo[i, :rows, :width], self.hi[i, :rows, :width])
                  for i in range(self.lo.shape[0])]
        return QuestSelector(bounds, self.rankable[:rows], self.n_pages[:rows], page, max_pages,
                             self.pages[:rows])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.lo, self.hi, self.rankable, self.pages, self.n_pages)

    def reset(self, rows: slice) -> None:
        """Rows with nothing to rank (dummy rows of a batch bucket)."""
        for counts in (self.rankable, self.pages, self.n_pages):
            counts[rows].zero_()

    def move_rows(self, src: torch.Tensor, rows: int) -> None:
        """Row src[j] -> row j for j < rows: each sequence's state moves with it."""
        self.lo[:, :rows], self.hi[:, :rows] = self.lo[:, src], self.hi[:, src]
        for counts in (self.rankable, self.pages, self.n_pages):
            counts[:rows] = counts[src]


def budget(cfg: SpecConfig, lengths: torch.Tensor, rankable: torch.Tensor) -> torch.Tensor:
    """k = clamp(ceil(ratio * L), min_tokens, rankable): [B] int64."""
    # ratio is a decimal in binary: 0.07 * 100 = 7.000000000000001 must still give 7
    k = torch.ceil(lengths.double() * cfg.ratio - 1e-9).long().clamp(min=cfg.min_tokens)
    return torch.minimum(k, rankable.long())


def pages_of(rankable: torch.Tensor, size: int) -> torch.Tensor:
    """Blocks of `size` tokens that hold the rankable positions (the last one partial)."""
    return torch.ceil(rankable / size).long()


def units(k: torch.Tensor, rankable: torch.Tensor, size: int) -> torch.Tensor:
    """Whole blocks of `size` tokens that fit the budget k (all of them when dense)."""
    dense = pages_of(rankable, size)
    return torch.where(k >= rankable, dense, torch.clamp(k // size, min=1))


def recent_bound(lengths: torch.Tensor, recent_start: torch.Tensor, gamma: int) -> int:
    # The last draft step writes position lengths + gamma - 1, so reads up to there.
    return int((lengths + gamma - recent_start).max())


def max_budget(cfg: SpecConfig, max_len: int) -> int:
    """The largest budget any sequence of at most max_len tokens can reach."""
    return min(max(math.ceil(max_len * cfg.ratio), cfg.min_tokens), max_len)


class Policy:
    """Base: subclasses pick score rows and turn a SelectionInput into a SparsePlan."""

    name = "base"
    wants_scores = False
    per_kv_head = False
    full_drafts = False  # drafts attend to everything (no plan)
    selects_in_step = False  # a per-layer selector runs inside every draft step (quest)

    def __init__(self, cfg: SpecConfig) -> None:
        self.cfg = cfg
        self.options: Any = cfg.options  # the method's own settings (config.POLICY_OPTIONS)

    @property
    def window(self) -> int:
        """Positions just before the selection row that every plan keeps, inside the
        budget, as the start of its recent range (0: none)."""
        return 0

    def recent_max(self, gamma: int) -> int:
        """Host bound on a plan's recent range: the 2γ+1 positions from the selection row to
        the last draft step's, and the window before it."""
        return 2 * gamma + 1 + self.window

    @property
    def score_mode(self) -> str:
        return "weight"

    def score_rows(self, n: int, prefill: bool) -> list[int]:
        """Rows of an n-row full pass whose scores this policy needs."""
        return [n - 1] if prefill else [0, n - 1]

    def selection_row(self, inp: SelectionInput) -> torch.Tensor:
        """[B] position of the query row the selection is made from."""
        return inp.row_pos

    def index_width(self, kmax: int) -> int:
        """Width of the plan's indices when budgets stay <= kmax (0: no indices)."""
        return self.listed_max(kmax)

    def listed_max(self, kmax: int) -> int:
        """The most positions a plan lists when budgets stay <= kmax: a budget less the
        positions its window keeps in the recent range, which grows with the budget."""
        return kmax - window_width(kmax, self.window)

    def listed_bound(self, inp: SelectionInput) -> int | None:
        """`listed_max` of the input's host bound kmax (None: none given)."""
        return None if inp.kmax is None else self.listed_max(inp.kmax)

    def plan(self, inp: SelectionInput) -> SparsePlan | None:
        """None means: draft with full attention. A policy that selects from scores, given
        none (a round after plain steps, whose last plan no longer reaches the newest
        tokens), keeps the sink and the most recent positions for that round, as stream."""
        start = self.selection_row(inp)
        k = budget(self.cfg, inp.lengths, start)
        # the window's positions join the recent range; the rest of the budget is listed
        near = window_positions(k, self.window) if self.window else 0
        ranked, listed = start - near, k - near
        if self.wants_scores and inp.scores is None:
            groups = inp.kv_caches[0][0].shape[1] if self.per_kv_head else 1
            indices = recent_positions(inp, ranked, listed, self.options.sink,
                                       self.listed_bound(inp)).expand(-1, -1, groups, -1)
        else:
            indices = self.indices(inp, ranked, listed)
        recent = inp.recent_max if inp.recent_max is not None \
            else recent_bound(inp.lengths, ranked, inp.gamma)
        return SparsePlan(indices, ranked, recent, k, self.selector(inp, ranked, listed),
                          listed if indices is not None else None)

    def indices(self, inp: SelectionInput, rankable: torch.Tensor,
                k: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    def selector(self, inp: SelectionInput, rankable: torch.Tensor, k: torch.Tensor):  # noqa: ANN201
        return None

    def step_state(self, layers: int, rows: int, tokens: int,
                   kv_cache: torch.Tensor) -> QuestState | None:
        """The fixed-shape state a captured draft step's in-step selection reads, for `rows`
        rows of up to `tokens` positions (None: the policy selects outside its steps)."""
        return None

    def step_selector(self, state: QuestState, rows: int, kmax: int,
                      tokens: int | None = None) -> Any:
        """The per-layer selector of the first `rows` rows over that state, budgets at most
        kmax, positions below `tokens` (None: the state's whole width)."""
        raise NotImplementedError


def window_positions(k: torch.Tensor, window: int) -> torch.Tensor:
    """Positions of a budget k that a window keeps: min(window, 3k/4 rounded down), so that
    the ranked selection always has a quarter of the budget (a window as wide as the budget
    would leave a plan of recent positions alone, without even stream's sink)."""
    return torch.clamp(k * 3 // 4, max=window)


def window_width(k: int, window: int) -> int:
    """`window_positions` of one budget on the host."""
    return min(k * 3 // 4, window)


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """A built-in method's class (its name is one of config.METHODS); a policy of one's
    own is registered with `register_method`."""
    POLICIES[cls.name] = cls
    return cls


def make_policy(cfg: SpecConfig) -> Policy:
    return POLICIES[cfg.method](cfg)


def register_method(cls: type[Policy],
                    options: type[PolicyOptions] | None = None) -> type[Policy]:
    """A policy of one's own (a variant of a method, an ablation) as a method under its own
    name `cls.name`, in this process: `SpecConfig(method=cls.name, ...)` accepts it, with
    the settings of `options` (default: those of the nearest registered method `cls` derives
    from, else none), and the engine runs it like any method -> cls (usable as a decorator).

    A name that another class holds is refused; registering the same class again does
    nothing. Processes started afresh (tensor-parallel workers) do not see it."""
    name = getattr(cls, "name", None)
    if not (isinstance(cls, type) and issubclass(cls, Policy) and isinstance(name, str)
            and name):
        raise ConfigError(f"register_method takes a Policy subclass with a name, got {cls!r}")
    if POLICIES.get(name) is cls:
        return cls
    if name in config.POLICY_OPTIONS:
        raise ConfigError(f"method {name!r} is taken; give {cls.__name__} a name of its own")
    if options is None:
        options = next((config.POLICY_OPTIONS[base.name] for base in cls.__mro__[1:]
                        if POLICIES.get(getattr(base, "name", None)) is base), PolicyOptions)
    config.POLICY_OPTIONS[name] = options
    return register(cls)


@register
class Vegas(Policy):
    """Top-k of the verify pass's attention, aggregated over query heads and the collected
    rows (first and last, or all), per layer or per kv head; with its options' pool, of those
    scores max-pooled over neighbours (`pooled`); with its window, the positions just
    before the selection row kept in the recent range and the rest of the budget ranked."""

    name = "vegas"
    wants_scores = True

    @property
    def window(self) -> int:  # type: ignore[override]
        return self.options.window

    @property
    def per_kv_head(self) -> bool:  # type: ignore[override]
        return self.options.granularity == "kv_head"

    @property
    def score_mode(self) -> str:
        return self.options.score

    def score_rows(self, n: int, prefill: bool) -> list[int]:
        if prefill:
            return [n - 1]
        return list(range(n)) if self.options.collect == "all" else sorted({0, n - 1})

    def indices(self, inp: SelectionInput, rankable: torch.Tensor,
                k: torch.Tensor) -> torch.Tensor:
        top = inp.topk or topk_positions
        if self.options.pool == 1:
            if inp.topk_sum is not None:
                return inp.topk_sum(_ranked(inp), rankable, k, self.listed_bound(inp))
            return top(_ranked(inp).sum(2), rankable, k, self.listed_bound(inp))
        return top(pooled(_ranked(inp).sum(2), rankable, self.options.pool), rankable, k,
                   self.listed_bound(inp))


@register
class LastQ(Vegas):
    """Like vegas, but from the single query row of the last committed token."""

    name = "lastq"
    per_kv_head = False

    @property
    def score_mode(self) -> str:
        return "weight"

    def score_rows(self, n: int, prefill: bool) -> list[int]:
        return [n - 1] if prefill else list(range(n))

    def selection_row(self, inp: SelectionInput) -> torch.Tensor:
        return inp.row_pos + inp.accepted

    def indices(self, inp: SelectionInput, rankable: torch.Tensor,
                k: torch.Tensor) -> torch.Tensor:
        top = inp.topk or topk_positions
        scores = _row(_ranked(inp), inp.accepted)
        if self.options.pool > 1:
            scores = pooled(scores, rankable, self.options.pool)
        return top(scores, rankable, k, self.listed_bound(inp))


def pooled(scores: torch.Tensor, rankable: torch.Tensor, pool: int) -> torch.Tensor:
    """Aggregated scores [layers, B, G, W] float32 -> each position's max over its `pool`
    neighbours (pool // 2 each side, pool odd) among the positions < rankable[b] (SnapKV's
    pooling), so that a top-k takes the neighbours of a strong position too. Fixed shapes,
    no host sync (capturable); positions from rankable on are left to the top-k's mask."""
    pos = torch.arange(scores.shape[-1], device=scores.device)
    visible = (pos < rankable[:, None])[None, :, None]  # [1, B, 1, W]
    masked = torch.where(visible, scores, float("-inf"))  # no pooling past rankable
    flat = masked.reshape(-1, 1, scores.shape[-1])
    return F.max_pool1d(flat, pool, stride=1, padding=pool // 2).view(scores.shape)


def _ranked(inp: SelectionInput) -> torch.Tensor:
    """The scores [layers, B, R, G, W'] of the positions a selection may rank (W' = W, or
    rank_width where that is less)."""
    assert inp.scores is not None
    width = inp.rank_width
    return inp.scores if width is None or width >= inp.scores.shape[-1] \
        else inp.scores[..., :width]


def _row(scores: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """scores [layers, B, R, G, W], row [B] -> [layers, B, G, W] (R == 1: row ignored)."""
    if scores.shape[2] == 1:
        return scores[:, :, 0]
    index = row.view(1, -1, 1, 1, 1).expand(scores.shape[0], -1, 1, *scores.shape[3:])
    return scores.gather(2, index)[:, :, 0]


@register
class SpecExtend(LastQ):
    """Last layer's attention of the last committed token (mean over heads), scored per
    32-token chunk by the mean; the top chunks up to k tokens serve every layer."""

    name = "specextend"

    def index_width(self, kmax: int) -> int:
        return math.ceil(self.listed_max(kmax) / self.options.chunk) * self.options.chunk

    def indices(self, inp: SelectionInput, rankable: torch.Tensor,
                k: torch.Tensor) -> torch.Tensor:
        assert inp.scores is not None
        c = self.options.chunk
        last = _row(inp.scores[-1:], inp.accepted)[0, :, 0]  # [B, W]
        chunk_scores = _chunk_means(last, rankable, c)  # [B, C]
        n_chunks = units(k, rankable, c)
        listed = self.listed_bound(inp)
        most = None if listed is None else math.ceil(listed / c)
        pos = topk_positions(chunk_scores[:, None], pages_of(rankable, c), n_chunks, most, c,
                             rankable)  # [B, 1, n * c]
        pos = sorted_positions(pos)
        return pos.unsqueeze(0).expand(len(inp.kv_caches), -1, -1, -1)


def _chunk_means(scores: torch.Tensor, rankable: torch.Tensor, c: int) -> torch.Tensor:
    """scores [B, W] -> mean over each c-token chunk of the positions < rankable: [B, C]."""
    bsz, width = scores.shape
    n = math.ceil(width / c)
    pad = torch.zeros(bsz, n * c, device=scores.device)
    pad[:, :width] = scores
    valid = (torch.arange(n * c, device=scores.device) < rankable[:, None]).float()
    total = (pad * valid).view(bsz, n, c).sum(-1)
    return total / valid.view(bsz, n, c).sum(-1).clamp(min=1)


def recent_positions(inp: SelectionInput, rankable: torch.Tensor, k: torch.Tensor,
                     sink: int, width: int | None) -> torch.Tensor:
    """The first min(sink, k) positions and the last k - sink before rankable, -1 padded:
    [layers, B, 1, width] (width: the host bound of every k, or None: read from k)."""
    kmax = max(int(k.max()), 1) if width is None else width
    j = torch.arange(kmax, device=k.device)[None, :]
    first = torch.clamp(k, max=sink)[:, None]
    window_pos = rankable[:, None] - (k[:, None] - j)  # the last k - sink positions
    pos = torch.where(j < first, j, window_pos)
    pos = torch.where(j < k[:, None], pos, -1)
    return pos[None, :, None, :].expand(len(inp.kv_caches), -1, 1, -1)


@register
class Stream(Policy):
    """StreamingLLM / MagicDec-Stream: attention sink + sliding window, same budget."""

    name = "stream"

    def indices(self, inp: SelectionInput, rankable: torch.Tensor,
                k: torch.Tensor) -> torch.Tensor:
        return recent_positions(inp, rankable, k, self.options.sink, self.listed_bound(inp))


@register
class Full(Policy):
    """Oracle: drafts attend to everything (greedy acceptance must be 100%)."""

    name = "full"
    full_drafts = True

    def index_width(self, kmax: int) -> int:
        return 0

    def plan(self, inp: SelectionInput) -> SparsePlan | None:
        return None


@register
class Quest(Policy):
    """Quest / MagicDec-Quest: per page of `page` tokens the elementwise min and max key;
    at every draft step page score = sum_d max(q_d min_d, q_d max_d), summed over the query
    heads of each kv head; the top pages up to k tokens. Selection runs in every draft step."""

    name = "quest"
    per_kv_head = True
    selects_in_step = True

    def index_width(self, kmax: int) -> int:
        return 0  # the selector picks positions inside every draft step

    def indices(self, inp: SelectionInput, rankable: torch.Tensor,
                k: torch.Tensor) -> torch.Tensor | None:
        return None

    def step_state(self, layers: int, rows: int, tokens: int,
                   kv_cache: torch.Tensor) -> QuestState:
        return QuestState.empty(layers, rows, math.ceil(tokens / self.options.page),
                                *kv_cache.shape[1:], kv_cache.device, kv_cache.dtype)

    def step_selector(self, state: QuestState, rows: int, kmax: int,
                      tokens: int | None = None) -> QuestSelector:
        page = self.options.page
        width = None if tokens is None else math.ceil(tokens / page)
        return state.selector(rows, page, math.ceil(kmax / page), width)

    def selector(self, inp: SelectionInput, rankable: torch.Tensor,
                 k: torch.Tensor) -> QuestSelector:
        page = self.options.page
        most = None if inp.kmax is None else math.ceil(inp.kmax / page)
        n_pages, pages = units(k, rankable, page), pages_of(rankable, page)
        state = inp.quest_state
        if state is None:
            return QuestSelector(page_bounds(inp, rankable, page), rankable, n_pages, page, most,
                                 pages)
        assert most is not None, "a fixed-shape quest selection needs the host bound kmax"
        rows = rankable.shape[0]
        for layer, (lo, hi) in enumerate(page_bounds(inp, rankable, page, state.lo.shape[2])):
            state.lo[layer, :rows].copy_(lo)
            state.hi[layer, :rows].copy_(hi)
        state.rankable[:rows].copy_(rankable)
        state.pages[:rows].copy_(pages)
        state.n_pages[:rows].copy_(n_pages)
        return state.selector(rows, page, most)


def page_bounds(inp: SelectionInput, rankable: torch.Tensor, page: int,
                n_pages: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (min, max) keys of every page of rankable positions: [B, NP, Hkv, D] in the
    cache's dtype (NP = n_pages, or enough pages for the longest sequence; pages past a
    sequence's rankable positions hold +inf / -inf)."""
    if n_pages is None:
        longest = int(rankable.max()) if inp.max_len is None else inp.max_len
        n_pages = max(math.ceil(longest / page), 1)
    pos = torch.arange(n_pages * page, device=rankable.device).expand(rankable.shape[0], -1)
    valid = (pos < rankable[:, None])[:, :, None, None]
    # Quest pages may end past the cache pages a sequence holds: look those slots up clamped,
    # they are masked as invalid anyway.
    top = inp.page_table.shape[1] * inp.page_size - 1
    slots = slots_of(inp.page_table, pos.clamp(max=top), inp.page_size)
    bounds = []
    for k_cache, _ in inp.kv_caches:
        # [B, NP*page, Hkv, D]: min and max exact in the cache dtype
        keys = gather_slots(k_cache, slots)
        lo = keys.masked_fill(~valid, float("inf")).unflatten(1, (n_pages, page)).amin(2)
        hi = keys.masked_fill(~valid, float("-inf")).unflatten(1, (n_pages, page)).amax(2)
        bounds.append((lo, hi))
    return bounds


class QuestSelector:
    """bounds: per layer (lo, hi) [B, NP, Hkv, D]; rankable [B] tokens; n_pages [B] pages to
    keep; pages [B] the pages the rankable tokens fill (None: computed here). Everything
    that does not depend on the layer is made once, with the selector (or by the plan that
    fills a QuestState), so a layer runs the page scores and the top-k, nothing else."""

    def __init__(self, bounds: list[tuple[torch.Tensor, torch.Tensor]], rankable: torch.Tensor,
                 n_pages: torch.Tensor, page: int, max_pages: int | None = None,
                 pages: torch.Tensor | None = None) -> None:
        self.bounds, self.rankable, self.page = bounds, rankable, page
        self.n_pages = n_pages
        self.pages = pages_of(rankable, page) if pages is None else pages
        self.max_pages = max_pages  # host bound on n_pages (None: read it, a host sync)

    def __call__(self, layer: int, q: torch.Tensor, ctx: StepContext,
                 backend: Any = None, rope: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, 1, H, D] -> positions [B, Hkv, K * page] (`expand_pages`' layout). With a
        backend, its page-score kernel and top-k (if it has one) replace the references; the
        Triton top-k expands the pages in its own kernel. With rope (the RoPE table), q is
        before RoPE, rotated at ctx.positions by the page scores."""
        lo, hi = self.bounds[layer]
        positions = None if rope is None else ctx.positions
        if backend is None:
            page_scores = quest_page_scores_ref(q, lo, hi, self.pages, rope, positions)
        else:
            page_scores = backend.quest_page_scores(q, lo, hi, self.pages, rope, positions)
        top = topk_positions if backend is None or backend.topk is None else backend.topk
        return top(page_scores, self.pages, self.n_pages, self.max_pages, self.page,
                   self.rankable)

    def take(self, idx: torch.Tensor) -> QuestSelector:
        return QuestSelector([(lo[idx], hi[idx]) for lo, hi in self.bounds], self.rankable[idx],
                             self.n_pages[idx], self.page, self.max_pages, self.pages[idx])

    def cat(self, other: DynamicSelector) -> QuestSelector:
        """Page bounds [B, NP, Hkv, D] padded to the wider NP with empty pages (lo +inf, hi
        -inf: they never rank, and lie past each row's rankable pages anyway)."""
        assert isinstance(other, QuestSelector), "one method per batch"
        bounds = [(cat_padded(la, lb, float("inf"), dim=0, axis=1),
                   cat_padded(ha, hb, float("-inf"), dim=0, axis=1))
                  for (la, ha), (lb, hb) in zip(self.bounds, other.bounds, strict=True)]
        most = (None if self.max_pages is None or other.max_pages is None
                else max(self.max_pages, other.max_pages))
        return QuestSelector(bounds, torch.cat([self.rankable, other.rankable]),
                             torch.cat([self.n_pages, other.n_pages]), self.page, most,
                             torch.cat([self.pages, other.pages]))
