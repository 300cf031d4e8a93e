"""Selection policies against brute-force versions of their definitions (METHOD.md).

Each expected selection is recomputed here with plain loops and numpy from the random scores,
keys and queries, never with the policies' own helpers. Three sequences of different lengths:
one long (sparse), one medium (budget = min_tokens) and one shorter than the budget (dense)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from vegas_spec.attention.context import SparsePlan, StepContext
from vegas_spec.attention.torch_backend import paged_attention_ref
from vegas_spec.config import METHODS, ConfigError, SpecConfig, option_names
from vegas_spec.ops import topk_positions
from vegas_spec.speculative.policies import (
    POLICIES,
    SelectionInput,
    budget,
    make_policy,
    window_width,
)

LAYERS, HKV, GROUP, DIM, GAMMA, PAGE_SIZE = 3, 2, 2, 8, 4, 8
HEADS = HKV * GROUP
BASE = dict(gamma=GAMMA, ratio=0.07, min_tokens=40)


def spec(method: str = "vegas", granularity: str | None = None, **settings: Any) -> SpecConfig:
    """BASE's settings, the pure top-k (window 0) unless set where the method has a window,
    and a granularity where the method has one (vegas)."""
    if "window" in option_names(method):
        settings.setdefault("window", 0)
    if granularity is not None and "granularity" in option_names(method):
        settings["granularity"] = granularity
    return SpecConfig(method=method, **BASE, **settings)


@dataclass
class Case:
    """One batch after a prefill (accepted 0, R = 1) or a verify pass of GAMMA + 1 rows."""

    row_pos: list[int]
    accepted: list[int]
    prefill: bool
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    page_table: list[list[int]]

    @property
    def lengths(self) -> list[int]:
        return [r + a + 1 for r, a in zip(self.row_pos, self.accepted)]

    @property
    def width(self) -> int:
        """Key axis of the scores: the verify pass reaches row_pos + GAMMA."""
        return max(self.lengths) if self.prefill else max(self.row_pos) + GAMMA + 1

    def key(self, layer: int, b: int, pos: int) -> np.ndarray:
        """[Hkv, D] key of position pos of sequence b, looked up through its pages."""
        slot = self.page_table[b][pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        return self.caches[layer][0][slot].double().numpy()

    def selection_input(self, scores: np.ndarray | None) -> SelectionInput:
        return SelectionInput(
            None if scores is None else torch.from_numpy(scores).float(),
            torch.tensor(self.row_pos), torch.tensor(self.accepted),
            torch.tensor(self.lengths), GAMMA, self.caches,
            torch.tensor(self.page_table, dtype=torch.int32), PAGE_SIZE)


def make_case(seed: int, prefill: bool, row_pos: list[int] | None = None) -> Case:
    rng = np.random.default_rng(seed)
    row_pos = row_pos or [int(rng.integers(700, 1000)), int(rng.integers(300, 500)),
                          int(rng.integers(10, 30))]
    accepted = [0] * 3 if prefill else [int(a) for a in rng.integers(0, GAMMA + 1, 3)]
    # Pages for exactly the positions the verify pass wrote, scattered over the cache.
    need = [math.ceil((r + GAMMA + 1) / PAGE_SIZE) for r in row_pos]
    perm = [int(p) for p in rng.permutation(sum(need))]
    table, start = [], 0
    for n in need:
        table.append(perm[start:start + n] + [0] * (max(need) - n))
        start += n
    gen = torch.Generator().manual_seed(seed)
    caches = [(torch.randn(sum(need) * PAGE_SIZE, HKV, DIM, generator=gen),
               torch.randn(sum(need) * PAGE_SIZE, HKV, DIM, generator=gen))
              for _ in range(LAYERS)]
    return Case(row_pos, accepted, prefill, caches, table)


def random_scores(seed: int, rows: int, groups: int, width: int,
                  rankable: list[int]) -> np.ndarray:
    """[LAYERS, B, rows, groups, width] distinct values; positions a policy must not rank
    (>= rankable) get the largest scores, so ranking them would change the selection."""
    rng = np.random.default_rng(seed)
    scores = rng.random((LAYERS, len(rankable), rows, groups, width)).astype(np.float32)
    for b, r in enumerate(rankable):
        scores[:, b, :, :, r:] += 5.0
    return scores


def expected_budget(cfg: SpecConfig, length: int, rankable: int) -> int:
    """k = clamp(ceil(ratio * L), min_tokens, rankable) in exact arithmetic."""
    k = math.ceil(Fraction(str(cfg.ratio)) * length)
    return min(max(k, cfg.min_tokens), rankable)


def best(values: np.ndarray | list[float], candidates: range, n: int) -> list[int]:
    """The n candidates with the largest values, ascending."""
    ranked = sorted(candidates, key=lambda i: -float(values[i]))
    return sorted(ranked[:n])


def check_row(row: torch.Tensor, expected: list[int], recent_start: int) -> None:
    """Valid positions first (strictly ascending, < recent_start), -1 padding after."""
    got = row.tolist()
    n = sum(v >= 0 for v in got)
    assert all(v >= 0 for v in got[:n]) and all(v == -1 for v in got[n:]), got
    assert all(a < b for a, b in zip(got[:n], got[1:n])), "not ascending or duplicated"
    assert all(v < recent_start for v in got[:n]), "selected a recent position"
    assert got[:n] == expected


def check_plan(plan: SparsePlan, case: Case, recent_start: list[int], k: list[int]) -> None:
    assert plan.recent_start.tolist() == recent_start
    assert plan.budget.tolist() == k
    span = max(length + GAMMA - s for length, s in zip(case.lengths, recent_start))
    assert plan.recent_max == span


# --- budget ------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.05, 0.07, 0.1, 0.3, 1.0])
@pytest.mark.parametrize("min_tokens", [1, 16, 256])
def test_budget_is_clamped_ceil_of_ratio(ratio: float, min_tokens: int) -> None:
    cfg = SpecConfig(ratio=ratio, min_tokens=min_tokens)
    lengths = list(range(1, 4000))
    rankable = [max(length - 1 - (length % 5), 0) for length in lengths]
    got = budget(cfg, torch.tensor(lengths), torch.tensor(rankable)).tolist()
    want = [expected_budget(cfg, n, r) for n, r in zip(lengths, rankable)]
    assert got == want


# --- vegas -------------------------------------------------------------------------------


@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("granularity", ["layer", "kv_head"])
@pytest.mark.parametrize("collect", ["2", "all"])
@pytest.mark.parametrize("score", ["weight", "logit"])
def test_vegas_is_top_k_of_aggregated_scores(score: str, collect: str, granularity: str,
                                             prefill: bool) -> None:
    cfg = spec("vegas", granularity, score=score, collect=collect)
    policy = make_policy(cfg)
    n = GAMMA + 1
    rows = policy.score_rows(n, prefill)
    assert rows == ([n - 1] if prefill else [0, n - 1] if collect == "2" else list(range(n)))
    assert policy.wants_scores and policy.score_mode == score
    assert policy.per_kv_head == (granularity == "kv_head")

    case = make_case(1, prefill)
    groups = HKV if policy.per_kv_head else 1
    scores = random_scores(2, len(rows), groups, case.width, case.row_pos)
    plan = policy.plan(case.selection_input(scores))
    assert plan is not None and plan.selector is None

    k = [expected_budget(cfg, n, r) for n, r in zip(case.lengths, case.row_pos)]
    assert k[0] < case.row_pos[0] and k[2] == case.row_pos[2]  # one sparse, one dense
    check_plan(plan, case, case.row_pos, k)
    assert plan.indices.shape[:3] == (LAYERS, 3, groups)
    for layer in range(LAYERS):
        for b in range(3):
            for g in range(groups):
                total = [sum(float(scores[layer, b, r, g, i]) for r in range(len(rows)))
                         for i in range(case.width)]
                want = best(total, range(case.row_pos[b]), k[b])
                check_row(plan.indices[layer, b, g], want, case.row_pos[b])
    assert plan.indices[0, 2, 0, : case.row_pos[2]].tolist() == list(range(case.row_pos[2]))


@pytest.mark.parametrize("granularity", ["layer", "kv_head"])
@pytest.mark.parametrize("collect", ["2", "all"])
@pytest.mark.parametrize("score", ["weight", "logit"])
def test_vegas_through_attention_scores(score: str, collect: str, granularity: str) -> None:
    """Scores emitted by the reference attention for the rows and mode the policy asks for
    select the top-k of the definition computed from q and k directly."""
    cfg = spec("vegas", granularity, score=score, collect=collect)
    policy = make_policy(cfg)
    case = make_case(3, prefill=False)
    n, scale = GAMMA + 1, DIM ** -0.5
    rows = policy.score_rows(n, False)
    gen = torch.Generator().manual_seed(4)
    queries = torch.randn(LAYERS, 3, n, HEADS, DIM, generator=gen)
    positions = torch.tensor(case.row_pos)[:, None] + torch.arange(n)
    table = torch.tensor(case.page_table, dtype=torch.int32)
    per_layer = []
    for layer, (k_cache, v_cache) in enumerate(case.caches):
        _, sc = paged_attention_ref(queries[layer], k_cache, v_cache, table, positions,
                                    PAGE_SIZE, case.width, scale, torch.tensor(rows), score,
                                    policy.per_kv_head)
        per_layer.append(sc)
    plan = policy.plan(case.selection_input(torch.stack(per_layer).numpy()))
    assert plan is not None

    groups = HKV if policy.per_kv_head else 1
    for layer in range(LAYERS):
        for b in range(3):
            agg = _attention_aggregate(case, queries[layer, b].double().numpy(), layer, b, rows,
                                       score, scale, groups)
            k = expected_budget(cfg, case.lengths[b], case.row_pos[b])
            for g in range(groups):
                got = [v for v in plan.indices[layer, b, g].tolist() if v >= 0]
                assert len(got) == k and all(v < case.row_pos[b] for v in got)
                rest = sorted(set(range(case.row_pos[b])) - set(got))
                if rest:  # a top-k set: nothing left out scores above anything kept
                    assert agg[g, got].min() >= agg[g, rest].max() - 1e-5


def _attention_aggregate(case: Case, q: np.ndarray, layer: int, b: int, rows: list[int],
                         score: str, scale: float, groups: int) -> np.ndarray:
    """q [n, H, D] -> [groups, row_pos] sum over rows and query heads of softmax weights or
    raw logits q.k, each row seeing the keys up to its own position."""
    agg = np.zeros((groups, case.row_pos[b]))
    last = case.row_pos[b] + max(rows)
    keys = np.stack([case.key(layer, b, j) for j in range(last + 1)])  # [last+1, Hkv, D]
    for r in rows:
        pos = case.row_pos[b] + r
        for h in range(HEADS):
            logits = keys[: pos + 1, h // GROUP] @ q[r, h]
            weights = np.exp(scale * logits - np.logaddexp.reduce(scale * logits))
            values = weights if score == "weight" else logits
            agg[h // GROUP if groups > 1 else 0] += values[: case.row_pos[b]]
    return agg


@pytest.mark.parametrize("method,granularity", [("vegas", "layer"), ("vegas", "kv_head"),
                                                ("lastq", "layer")])
@pytest.mark.parametrize("summing", [False, True], ids=["topk", "topk_sum"])
def test_the_backends_top_k_selects_what_the_reference_selects(method: str, granularity: str,
                                                               summing: bool) -> None:
    """A SelectionInput carrying the Triton top-k (the interpreter here), and the kernel that
    sums vegas's rows as it loads them, gives the plan of the reference top-k on scores
    without ties."""
    from vegas_spec.attention.triton_backend import topk_sum_by_width
    from vegas_spec.kernels.topk import topk_positions_triton

    policy = make_policy(spec(method, granularity))
    case = make_case(3, False)
    rows = policy.score_rows(GAMMA + 1, False)
    groups = HKV if policy.per_kv_head else 1
    scores = random_scores(4, len(rows), groups, case.width, case.row_pos)
    want = policy.plan(case.selection_input(scores))
    inp = case.selection_input(scores)
    inp.topk = topk_positions_triton
    if summing:
        inp.topk_sum = topk_sum_by_width
    got = policy.plan(inp)
    assert want is not None and got is not None
    assert torch.equal(got.indices, want.indices)
    assert torch.equal(got.budget, want.budget)


@pytest.mark.parametrize("method,prefill", [("vegas", False), ("vegas", True),
                                            ("lastq", False), ("lastq", True)])
def test_a_rank_width_narrows_the_top_k_rows_not_the_plan(method: str, prefill: bool) -> None:
    """rank_width (a host bound >= every rankable position) hands the top-k rows of that
    width, and the plan is the one ranked over the whole key width."""
    policy = make_policy(spec(method))
    case = make_case(8, prefill)
    rows = policy.score_rows(GAMMA + 1, prefill)
    start = case.row_pos if method == "vegas" or prefill else \
        [r + a for r, a in zip(case.row_pos, case.accepted)]
    # a static key width past the keys, as the round graphs' (positions past rankable score
    # highest, so ranking them would show)
    scores = random_scores(9, len(rows), 1, case.width + PAGE_SIZE, start)
    want = policy.plan(case.selection_input(scores))
    widths: list[int] = []

    def top(s: torch.Tensor, *args: object) -> torch.Tensor:
        widths.append(s.shape[-1])
        return topk_positions(s, *args)

    inp = case.selection_input(scores)
    inp.topk, inp.rank_width = top, max(start) + 1
    got = policy.plan(inp)
    assert widths == [max(start) + 1] and max(start) + 1 < scores.shape[-1]
    assert want is not None and got is not None
    assert torch.equal(got.indices, want.indices) and torch.equal(got.budget, want.budget)


# --- lastq, specextend -------------------------------------------------------------------


@pytest.mark.parametrize("prefill", [False, True])
def test_lastq_uses_the_last_committed_row(prefill: bool) -> None:
    for setting in ({"score": "logit"}, {"granularity": "kv_head"}, {"collect": "all"}):
        with pytest.raises(ConfigError, match="method 'lastq' has no setting"):
            SpecConfig(method="lastq", **setting)  # its own rows, weights, layers: not vegas's
    cfg = spec("lastq")
    policy = make_policy(cfg)
    n = GAMMA + 1
    assert policy.score_rows(n, prefill) == ([n - 1] if prefill else list(range(n)))
    assert policy.score_mode == "weight" and not policy.per_kv_head and policy.wants_scores

    case = make_case(5, prefill)
    assert prefill or any(case.accepted)
    start = [r + a for r, a in zip(case.row_pos, case.accepted)]
    scores = random_scores(6, len(policy.score_rows(n, prefill)), 1, case.width, start)
    plan = policy.plan(case.selection_input(scores))
    k = [expected_budget(cfg, n, r) for n, r in zip(case.lengths, start)]
    check_plan(plan, case, start, k)
    for layer in range(LAYERS):
        for b in range(3):
            row = 0 if prefill else case.accepted[b]
            want = best(scores[layer, b, row, 0], range(start[b]), k[b])
            check_row(plan.indices[layer, b, 0], want, start[b])


def test_specextend_chunks_of_the_last_layer_row() -> None:
    cfg = spec("specextend")
    policy = make_policy(cfg)
    n, c = GAMMA + 1, cfg.options.chunk
    assert policy.score_rows(n, False) == list(range(n)) and not policy.per_kv_head

    case = make_case(7, prefill=False, row_pos=[900, 420, 20])
    start = [r + a for r, a in zip(case.row_pos, case.accepted)]
    scores = random_scores(8, n, 1, case.width, start)
    for b, s in enumerate(start[:2]):
        # a short last chunk (4..8 tokens) with the best mean but a small sum: the score is
        # the mean, so it must be chosen
        assert 0 < s % c <= 8
        scores[:, b, :, :, s - s % c: s] += 1.0
    plan = policy.plan(case.selection_input(scores))
    k = [expected_budget(cfg, n, r) for n, r in zip(case.lengths, start)]
    check_plan(plan, case, start, k)
    for b in range(3):
        last = scores[-1, b, case.accepted[b], 0]
        n_chunks = math.ceil(start[b] / c)
        means = [float(np.mean(last[i * c: min((i + 1) * c, start[b])]))
                 for i in range(n_chunks)]
        dense = k[b] >= start[b]
        assert dense or k[b] >= c
        chosen = best(means, range(n_chunks), n_chunks if dense else k[b] // c)
        want = [i * c + j for i in chosen for j in range(c) if i * c + j < start[b]]
        for layer in range(LAYERS):  # one set for every layer
            check_row(plan.indices[layer, b, 0], want, start[b])


# --- local context: window and pool (vegas, lastq) ------------------------------------------


def local_expected(values: np.ndarray | list[float], rankable: int, k: int, window: int,
                   pool: int) -> tuple[list[float], list[int], int]:
    """By hand: the last min(window, 3k/4) positions before the selection row are the start
    of the recent range, so the ranked ones are those before it; each of them scores the max
    over its pool // 2 neighbours each side that are ranked too; the k - that many best
    (ties to the lowest positions, as the Triton kernel breaks them). -> (the pooled scores,
    the selection, the recent range's start)."""
    half, near = pool // 2, min(window, 3 * k // 4)
    ranked = rankable - near
    pooled = [max(float(values[j]) for j in range(max(0, i - half), min(ranked, i + half + 1)))
              for i in range(ranked)]
    return pooled, best(pooled, range(ranked), k - near), ranked


def check_local_row(row: torch.Tensor, pooled: list[float], want: list[int], ranked: int,
                    exact: bool) -> None:
    """A top-k set of the pooled scores (the hand's own selection when `exact`; torch.topk
    may break ties at the threshold otherwise), all before the recent range."""
    got = [v for v in row.tolist() if v >= 0]
    assert len(got) == len(want)
    if exact:
        check_row(row, want, ranked)
    else:
        check_row(row, got, ranked)  # ascending, -1 padded, nothing in the recent range
        assert sorted(pooled[i] for i in got) == sorted(pooled[i] for i in want)


LOCAL = [(8, 1), (0, 3), (8, 7), (64, 3), (10**6, 5)]  # 64 and 10**6: windows past some k


def local_case(method: str, granularity: str, prefill: bool, seed: int
               ) -> tuple[SpecConfig, Case, list[int], np.ndarray]:
    cfg = spec(method, granularity)
    policy = make_policy(cfg)
    case = make_case(seed, prefill)
    start = case.row_pos if method == "vegas" or prefill else \
        [r + a for r, a in zip(case.row_pos, case.accepted)]
    groups = HKV if policy.per_kv_head else 1
    # positions >= rankable score highest: pooling them in or ranking them would show
    scores = random_scores(seed + 1, len(policy.score_rows(GAMMA + 1, prefill)), groups,
                           case.width, start)
    return cfg, case, start, scores


def aggregated(method: str, case: Case, scores: np.ndarray, layer: int, b: int,
               g: int) -> np.ndarray:
    """What vegas ranks (the sum over its rows) or lastq (the last committed token's row)."""
    if method == "vegas":
        return scores[layer, b, :, g].astype(np.float64).sum(0).astype(np.float32)
    return scores[layer, b, 0 if scores.shape[2] == 1 else case.accepted[b], g]


@pytest.mark.parametrize("window,pool", LOCAL, ids=lambda v: str(v))
@pytest.mark.parametrize("method,granularity,prefill", [
    ("vegas", "layer", False), ("vegas", "layer", True), ("vegas", "kv_head", False),
    ("lastq", "layer", False), ("lastq", "layer", True)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_local_context_keeps_the_window_and_pools_inside_the_budget(
        backend: str, method: str, granularity: str, prefill: bool, window: int,
        pool: int) -> None:
    """The last min(window, 3k/4) positions before the selection row start the recent range,
    the rest of the budget is the top of the max-pooled scores before them, the budget is
    the pure top-k's, so the drafts read as many positions; the Triton top-k (the
    interpreter here) selects what the hand does, ties included."""
    from vegas_spec.attention.triton_backend import topk_by_width, topk_sum_by_width

    base, case, start, scores = local_case(method, granularity, prefill, 20)
    cfg = dataclasses.replace(base, window=window, pool=pool)
    inp = case.selection_input(scores)
    if backend == "triton":
        inp.topk, inp.topk_sum = topk_by_width, topk_sum_by_width
    plan = make_policy(cfg).plan(inp)
    pure = make_policy(base).plan(case.selection_input(scores))
    assert plan is not None and pure is not None
    k = [expected_budget(cfg, n, r) for n, r in zip(case.lengths, start)]
    ranked = [r - min(window, 3 * kb // 4) for r, kb in zip(start, k)]
    check_plan(plan, case, ranked, k)
    assert torch.equal(plan.budget, pure.budget)
    assert plan.indices.shape[:3] == pure.indices.shape[:3]
    assert plan.indices.shape[3] <= pure.indices.shape[3]
    assert k[0] < start[0] and 40 == k[1] < start[1] and k[2] == start[2]  # sparse, dense
    for b in range(3):  # listed + the window: the pure top-k's count
        assert int((plan.indices[0, b, 0] >= 0).sum()) + start[b] - ranked[b] == k[b]
    for layer in range(LAYERS):
        for b in range(3):
            for g in range(plan.indices.shape[2]):
                values = aggregated(method, case, scores, layer, b, g)
                pooled, want, first = local_expected(values, start[b], k[b], window, pool)
                assert first == ranked[b]
                check_local_row(plan.indices[layer, b, g], pooled, want, first,
                                exact=backend == "triton")


def test_pooling_and_the_window_rank_as_the_hand_says() -> None:
    """One row of 12 scores, 10 before the selection row: a peak of 9 at 5 with a 3 at 4, and
    100s at and past the selection row, which must neither be taken nor pooled in. With a
    window the plan's recent range starts that many positions earlier and the rest of the
    budget is ranked before it."""
    from vegas_spec.kernels.topk import topk_positions_triton
    from vegas_spec.speculative.policies import pooled

    row = [1.0, 0.0, 0.0, 0.0, 3.0, 9.0, 0.0, 0.0, 2.0, 0.5, 100.0, 100.0]
    scores = torch.tensor(row).view(1, 1, 1, 12)
    rankable = torch.tensor([10])
    for top in (topk_positions, topk_positions_triton):
        def pick(pool: int, k: int, ranked: int = 10, top=top) -> list[int]:
            r, kk = torch.tensor([ranked]), torch.tensor([k])
            s = scores if pool == 1 else pooled(scores, r, pool)
            return top(s, r, kk).view(-1).tolist()

        assert pick(1, 3) == [4, 5, 8]  # pure top-k
        assert pick(3, 3) == [4, 5, 6]  # the peak and its neighbours
        assert pick(5, 5) == [3, 4, 5, 6, 7]  # 9 over 3..7
        assert pick(3, 3, ranked=9) == [4, 5, 6]  # a window of 1: 9 is recent, 8 not pooled
        assert pick(1, 1, ranked=8) == [5]  # a window of 2
    assert pooled(scores, rankable, 3).view(-1)[:10].tolist() == \
        [1.0, 1.0, 0.0, 3.0, 9.0, 9.0, 9.0, 2.0, 2.0, 2.0]
    assert pooled(scores, torch.tensor([9]), 3).view(-1)[:9].tolist()[-1] == 2.0


@pytest.mark.parametrize("method", ["vegas", "lastq"])
@pytest.mark.parametrize("window", [1, 4, 10**6])
def test_the_window_starts_the_recent_range(method: str, window: int) -> None:
    """The plan's recent range starts min(window, 3k/4) positions before the selection row, its
    host bound grows by the window, and the pure top-k's budget is spent the same."""
    case = make_case(33, prefill=False)
    cfg = spec(method, window=window)
    policy = make_policy(cfg)
    scores = random_scores(34, len(policy.score_rows(GAMMA + 1, False)), 1, case.width,
                           case.row_pos)
    plan = policy.plan(case.selection_input(scores))
    start = case.row_pos if method == "vegas" else \
        [r + a for r, a in zip(case.row_pos, case.accepted)]
    k = [expected_budget(cfg, n, r) for n, r in zip(case.lengths, start)]
    assert plan is not None
    assert plan.recent_start.tolist() == [r - min(window, 3 * kb // 4)
                                          for r, kb in zip(start, k)]
    assert policy.recent_max(GAMMA) == 2 * GAMMA + 1 + window
    listed = (plan.indices[0, :, 0] >= 0).sum(-1).tolist()
    assert [n + min(window, 3 * kb // 4) for n, kb in zip(listed, k)] == k


@pytest.mark.parametrize("window", [0, 16, 192])
def test_a_windows_positions_are_not_listed(window: int) -> None:
    """The static index width is the most positions a budget up to kmax lists, kmax less
    its window's (the recent range holds those), so every budget's list fits it; a plan
    made without scores (after plain steps) still keeps the sink and the k - sink most
    recent positions, the window's now in the recent range."""
    policy = make_policy(spec("vegas", window=window))
    for kmax in (1, 8, 50, 300, 1000):
        width = policy.index_width(kmax)
        assert width == kmax - min(window, 3 * kmax // 4)
        assert all(k - window_width(k, window) <= width for k in range(1, kmax + 1))
    case = make_case(35, prefill=False)
    plan = policy.plan(case.selection_input(None))
    assert plan is not None
    sink = policy.options.sink
    for b, row in enumerate(case.row_pos):
        k = expected_budget(policy.cfg, case.lengths[b], row)
        listed = {int(p) for p in plan.indices[0, b, 0] if p >= 0}
        recent = set(range(int(plan.recent_start[b]), row))
        assert not listed & recent and len(listed) + len(recent) == k
        assert listed | recent == set(range(min(sink, k))) | set(range(row - k + sink, row))


@pytest.mark.parametrize("method", ["vegas", "lastq"])
def test_pure_top_k_is_todays_path(method: str) -> None:
    """window 0 and pool 1 take today's path: vegas hands its collected rows to the
    backend's row-summing top-k unsummed, with a window too (it only moves the ranked range);
    with pooling the sum is ranked by the plain top-k."""
    case = make_case(30, prefill=False)
    policy = make_policy(spec(method))
    scores = random_scores(31, len(policy.score_rows(GAMMA + 1, False)), 1, case.width,
                           case.row_pos)
    calls: list[tuple[str, int]] = []

    def top(s: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(("topk", s.dim()))
        return topk_positions(s, *args)

    def top_sum(s: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(("topk_sum", s.dim()))
        return topk_positions(s.sum(-3), *args)

    for window, pool in ((0, 1), (4, 1), (0, 3)):
        calls.clear()
        inp = case.selection_input(scores)
        inp.topk, inp.topk_sum = top, top_sum
        cfg = spec(method, window=window, pool=pool)
        plan = make_policy(cfg).plan(inp)
        assert plan is not None
        pure = window == 0 and pool == 1
        # a window only moves the ranked range: the row-summing top-k still ranks it
        assert calls == [("topk_sum", 5) if pool == 1 and method == "vegas" else ("topk", 4)]
        if pure:
            want = policy.plan(case.selection_input(scores))
            assert want is not None and torch.equal(plan.indices, want.indices)


@pytest.mark.parametrize("method", ["vegas", "lastq"])
def test_local_context_with_host_bounds_is_the_dynamic_selection(method: str) -> None:
    """kmax and rank_width (the static shapes' host bounds, no host sync) give the dynamic
    plan, -1 padded to the most positions a budget of kmax lists (kmax less its window's,
    which the recent range holds), over a key width past the context (the Triton top-k,
    whose ties at the threshold do not depend on the row's width as torch.topk's may)."""
    from vegas_spec.attention.triton_backend import topk_by_width

    cfg = spec(method, window=16, pool=5)
    policy = make_policy(cfg)
    case = make_case(40, prefill=False)
    start = case.row_pos if method == "vegas" else \
        [r + a for r, a in zip(case.row_pos, case.accepted)]
    scores = random_scores(41, len(policy.score_rows(GAMMA + 1, False)), 1,
                           case.width + PAGE_SIZE, start)
    inp = case.selection_input(scores)
    inp.topk = topk_by_width
    dynamic = policy.plan(inp)
    inp = case.selection_input(scores)
    kmax = 80
    inp.topk, inp.kmax, inp.rank_width = topk_by_width, kmax, max(start) + 1
    static = policy.plan(inp)
    assert dynamic is not None and static is not None
    assert static.indices.shape[-1] == policy.index_width(kmax) == kmax - 16 \
        > dynamic.indices.shape[-1]
    width = dynamic.indices.shape[-1]
    assert torch.equal(static.indices[..., :width], dynamic.indices)
    assert bool((static.indices[..., width:] == -1).all())


# --- stream, quest, full -----------------------------------------------------------------


@pytest.mark.parametrize("sink", [0, 4, 64])
def test_stream_is_sink_plus_window(sink: int) -> None:
    cfg = spec("stream", sink=sink)
    policy = make_policy(cfg)
    assert not policy.wants_scores and not policy.per_kv_head
    case = make_case(9, prefill=False)
    plan = policy.plan(case.selection_input(None))
    k = [expected_budget(cfg, n, r) for n, r in zip(case.lengths, case.row_pos)]
    check_plan(plan, case, case.row_pos, k)
    for b, (r, kb) in enumerate(zip(case.row_pos, k)):
        first = min(sink, kb)
        want = sorted(set(range(first)) | set(range(r - (kb - first), r)))
        assert len(want) == kb
        for layer in range(LAYERS):
            check_row(plan.indices[layer, b, 0], want, r)


@pytest.mark.parametrize("row_pos", [None, [881, 401, 17]])
@pytest.mark.parametrize("prefill", [False, True])
def test_quest_pages_by_min_max_bound(prefill: bool, row_pos: list[int] | None) -> None:
    """Quest pages (16 tokens) are larger than cache pages (8 slots); with row_pos 881 the
    last quest page runs past the cache pages the sequence holds."""
    cfg = spec("quest", page=16)
    policy = make_policy(cfg)
    assert not policy.wants_scores and policy.per_kv_head
    case = make_case(11, prefill, row_pos)
    plan = policy.plan(case.selection_input(None))
    assert plan is not None and plan.indices is None and plan.selector is not None
    k = [expected_budget(cfg, n, r) for n, r in zip(case.lengths, case.row_pos)]
    check_plan(plan, case, case.row_pos, k)

    gen = torch.Generator().manual_seed(12)
    lengths = torch.tensor(case.lengths)  # the first draft step writes position `lengths`
    slots = [[case.page_table[b][n // PAGE_SIZE] * PAGE_SIZE + n % PAGE_SIZE]
             for b, n in enumerate(case.lengths)]
    ctx = StepContext(lengths[:, None], lengths + 1, torch.tensor(slots),
                      torch.tensor(case.page_table, dtype=torch.int32), PAGE_SIZE,
                      int(lengths.max()) + 1, sparse=plan)
    for layer in range(LAYERS):
        q = torch.randn(3, 1, HEADS, DIM, generator=gen)
        got = plan.selector(layer, q, ctx)
        assert got.shape[:2] == (3, HKV)
        for b in range(3):
            for h in range(HKV):
                want = _quest_expected(case, layer, b, h, q[b, 0].double().numpy(), k[b],
                                       cfg.options.page)
                check_row(got[b, h], want, case.row_pos[b])


def _quest_expected(case: Case, layer: int, b: int, h: int, q: np.ndarray, k: int,
                    page: int) -> list[int]:
    rankable = case.row_pos[b]
    pages = math.ceil(rankable / page)
    page_scores = []
    for p in range(pages):
        keys = np.stack([case.key(layer, b, j)[h]
                         for j in range(p * page, min((p + 1) * page, rankable))])
        lo, hi = keys.min(0), keys.max(0)
        page_scores.append(sum(float(np.maximum(q[qh] * lo, q[qh] * hi).sum())
                               for qh in range(h * GROUP, (h + 1) * GROUP)))
    dense = k >= rankable
    assert dense or k >= page
    chosen = best(page_scores, range(pages), pages if dense else k // page)
    return [p * page + j for p in chosen for j in range(page) if p * page + j < rankable]


def test_full_drafts_with_full_attention() -> None:
    policy = make_policy(spec("full"))
    assert not policy.wants_scores
    assert policy.plan(make_case(13, prefill=False).selection_input(None)) is None


def test_every_speculative_method_is_registered() -> None:
    names = {m for m in METHODS if m != "vanilla"}
    assert set(POLICIES) == names
    for name in names:
        assert make_policy(SpecConfig(method=name)).name == name
