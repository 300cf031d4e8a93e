"""Sparse draft attention against `sparse_attention_ref`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernel_cases import (
    DEVICE,
    DTYPES,
    as_sm90,
    generator,
    paged_cache,
    poisoned,
    query_positions,
    randn,
    retune,
    tol,
)

from vegas_spec.attention.torch_backend import sparse_attention_ref, store_kv_ref
from vegas_spec.kernels import split_counters
from vegas_spec.kernels.rope_store import rope_store
from vegas_spec.kernels.sparse_attention import NewKV, sparse_attention
from vegas_spec.ops import apply_rope


@dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]
    n: int
    heads: int
    hkv: int
    dim: int
    per_kv_head: bool = False
    budget: str | float = 0.2  # fraction of the rankable prefix, "none" (all -1), "empty"
    # (K = 0), "dense" (every position before recent_start)
    recent_extra: int = 0  # recent_start = length - n - recent_extra
    recent_slack: int = 0  # recent_max beyond the longest recent range
    shuffled: bool = False  # unsorted lists with -1 anywhere
    page_size: int = 16
    block_k: int | None = None
    split_size: int | None = None
    sinks: bool = False  # a random sink logit per query head (gpt-oss's)
    cut: bool = False  # a per-row `listed` count under the width, valid positions past it


def row_counts(case: Case, indices: torch.Tensor, gen: torch.Generator) -> torch.Tensor | None:
    """With case.cut, each row's listed count: a random cut of its width (positions past it
    are valid, so a kernel that read them would attend to them); else None."""
    if not case.cut:
        return None
    return torch.randint(0, indices.shape[-1] + 1, (indices.shape[0],), generator=gen).to(DEVICE)


CASES = [
    Case((60,), 1, 4, 4, 64),
    Case((203, 37, 130), 1, 12, 4, 128, per_kv_head=True, budget=0.3, recent_extra=3,
         block_k=16, split_size=32),
    Case((100, 61), 7, 8, 2, 64, budget="none", recent_extra=2, page_size=8),
    Case((100, 61), 7, 8, 2, 64, per_kv_head=True, budget="dense"),
    Case((77, 150), 7, 6, 2, 128, per_kv_head=True, shuffled=True, recent_slack=5),
    Case((45, 12, 80), 1, 2, 2, 64, budget="empty", recent_extra=1),
    Case((300,), 7, 8, 2, 64, budget=0.5, block_k=16, split_size=64),
    # 20 rows of 4 heads a kv head: two row blocks, each merging its own splits
    Case((300, 120), 20, 8, 2, 64, budget=0.5, block_k=16, split_size=32),
    # per-row listed counts: rows stop early, in one split and several
    Case((203, 37, 130), 1, 12, 4, 128, per_kv_head=True, budget=0.5, recent_extra=3,
         block_k=16, split_size=32, cut=True),
    Case((300, 90), 7, 8, 2, 64, budget=0.5, block_k=16, split_size=64, cut=True),
    Case((150,), 1, 4, 4, 64, budget="dense", recent_extra=2, cut=True),
]


def case_id(case: Case) -> str:
    g = "G=Hkv" if case.per_kv_head else "G=1"
    return (f"lens{'-'.join(map(str, case.lens))}_n{case.n}_h{case.heads}x{case.hkv}"
            f"_d{case.dim}_{g}_{case.budget}{'_sinks' if case.sinks else ''}"
            f"{'_cut' if case.cut else ''}")


def sink_logits(case: Case, gen: torch.Generator) -> torch.Tensor | None:
    """A sink logit per query head, large enough to take a good share of each softmax."""
    return randn(case.heads, gen=gen) * 2 + 1 if case.sinks else None


def listed(case: Case, recent_start: list[int], gen: torch.Generator) -> torch.Tensor:
    """indices [B, G, K]: a random subset of each rankable prefix, ascending, -1 padded."""
    groups = case.hkv if case.per_kv_head else 1
    if case.budget == "empty":
        return torch.zeros(len(case.lens), groups, 0, dtype=torch.long, device=DEVICE)
    rows = []
    for rank in recent_start:
        count = rank if case.budget == "dense" else 0 if case.budget == "none" else \
            int(rank * float(case.budget))
        rows.append([torch.randperm(rank, generator=gen)[:count].sort().values
                     for _ in range(groups)])
    width = max(max(len(r) for g in rows for r in g), 1)
    out = torch.full((len(rows), groups, width), -1, dtype=torch.long)
    for b, group_rows in enumerate(rows):
        for g, r in enumerate(group_rows):
            out[b, g, : len(r)] = r
            if case.shuffled:
                out[b, g] = out[b, g, torch.randperm(width, generator=gen)]
    return out.to(DEVICE)


def run(case: Case, dtype: torch.dtype, seed: int = 0) -> None:
    gen = generator(seed)
    bsz = len(case.lens)
    cache = paged_cache(bsz, max(case.lens), case.hkv, case.dim, case.page_size, dtype, gen)
    q = randn(bsz, case.n, case.heads, case.dim, gen=gen, dtype=dtype)
    positions = query_positions(list(case.lens), case.n)
    starts = [max(length - case.n - case.recent_extra, 0) for length in case.lens]
    indices = listed(case, starts, gen)
    recent_start = torch.tensor(starts, device=DEVICE)
    recent_max = max(ln - s for ln, s in zip(case.lens, starts, strict=True)) + case.recent_slack
    scale = case.dim ** -0.5
    sinks = sink_logits(case, gen)
    counts = row_counts(case, indices, gen)
    out = sparse_attention(q, cache.k, cache.v, cache.page_table, positions, case.page_size,
                           indices, recent_start, recent_max, scale, block_k=case.block_k,
                           split_size=case.split_size, out=poisoned(*q.shape, dtype=dtype),
                           sinks=sinks, listed=counts)
    want = sparse_attention_ref(q, cache.k, cache.v, cache.page_table, positions,
                                case.page_size, indices, recent_start, recent_max, scale, sinks,
                                counts)
    torch.testing.assert_close(out, want, **tol(dtype))
    # several splits: merged in the launch, every counter left at zero for the next one
    assert int(split_counters(1, q.device).abs().sum()) == 0
    if counts is not None:  # the cut matters: the whole lists attend otherwise
        whole = sparse_attention_ref(q, cache.k, cache.v, cache.page_table, positions,
                                     case.page_size, indices, recent_start, recent_max, scale,
                                     sinks)
        assert not torch.allclose(whole, want, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case: Case, dtype: torch.dtype) -> None:
    run(case, dtype)


# gpt-oss's full-attention layers: a sink per query head, in one split or several (split 0
# holds the sink, counted once by the merge), rows that see only part of the list.
SINK_CASES = [
    Case((60,), 1, 4, 4, 64, sinks=True),
    Case((203, 37, 130), 1, 12, 4, 128, per_kv_head=True, budget=0.3, recent_extra=3,
         block_k=16, split_size=32, sinks=True),
    Case((100, 61), 7, 8, 2, 64, budget="none", recent_extra=2, page_size=8, sinks=True),
    Case((45, 12, 80), 1, 2, 2, 64, budget="empty", recent_extra=1, sinks=True),
    Case((300,), 7, 8, 2, 64, budget=0.5, block_k=16, split_size=64, sinks=True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SINK_CASES, ids=case_id)
def test_sinks_match_reference(case: Case, dtype: torch.dtype) -> None:
    run(case, dtype)


# The interpreter runs a grid's programs in order, so a store by a program after the one that
# reads it shows there (the last case's trailing splits hold no keys: the step's position is in
# an earlier one); on a GPU they run at once.
ONE_ROW = [c for c in CASES if c.n == 1] + [
    Case((90, 131), 1, 9, 3, 64, budget=0.3, recent_extra=6, block_k=16, split_size=32),
    Case((90, 131), 1, 9, 3, 64, budget=0.3, recent_extra=6, recent_slack=70, block_k=16,
         split_size=32),
    Case((90, 131), 1, 9, 3, 64, budget=0.3, recent_extra=6, block_k=16, split_size=32,
         sinks=True),
    Case((90, 131), 1, 9, 3, 64, budget=0.5, recent_extra=6, block_k=16, split_size=32,
         cut=True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ONE_ROW, ids=case_id)
def test_rope_and_store_inside_match_rope_store_then_the_plain_kernel(
        case: Case, dtype: torch.dtype) -> None:
    """With `new`, q before RoPE and the step's own k and v not yet stored: the output and
    both caches are the bits of `rope_store` followed by the plain kernel (the splits that do
    not hold the step's position among them), and the oracle's to rounding. The second
    sequence's row is padding (slot -1): nothing is stored for it."""
    gen = generator(7)
    bsz = len(case.lens)
    cache = paged_cache(bsz, max(case.lens), case.hkv, case.dim, case.page_size, dtype, gen)
    qkv = randn(bsz, 1, (case.heads + 2 * case.hkv) * case.dim, gen=gen, dtype=dtype)
    q = qkv[..., : case.heads * case.dim].view(bsz, 1, case.heads, case.dim)
    k = qkv[..., case.heads * case.dim: (case.heads + case.hkv) * case.dim].view(
        bsz, 1, case.hkv, case.dim)
    v = qkv[..., (case.heads + case.hkv) * case.dim:].view(bsz, 1, case.hkv, case.dim)
    table = 2 * torch.rand(max(case.lens), case.dim, generator=gen).to(DEVICE) - 1
    positions = query_positions(list(case.lens), 1)
    page = cache.page_table.long().gather(1, positions // case.page_size)
    slots = page * case.page_size + positions % case.page_size
    if bsz > 1:
        slots[1] = -1
    starts = [max(length - 1 - case.recent_extra, 0) for length in case.lens]
    indices = listed(case, starts, gen)
    recent_start = torch.tensor(starts, device=DEVICE)
    recent_max = max(ln - s for ln, s in zip(case.lens, starts, strict=True)) + case.recent_slack
    args = (cache.page_table, positions, case.page_size, indices, recent_start, recent_max,
            case.dim ** -0.5)
    sinks = sink_logits(case, gen)
    counts = row_counts(case, indices, gen)
    tiles = {"block_k": case.block_k, "split_size": case.split_size, "sinks": sinks,
             "listed": counts}
    k_want, v_want = cache.k.clone(), cache.v.clone()
    q_rot = rope_store(q, k, v, k_want, v_want, table, positions, slots)
    want = sparse_attention(q_rot, k_want, v_want, *args, **tiles)
    got = sparse_attention(q, cache.k, cache.v, *args, **tiles,
                           out=poisoned(*q.shape, dtype=dtype), new=NewKV(k, v, table, slots))
    assert torch.equal(cache.k, k_want) and torch.equal(cache.v, v_want)
    assert torch.equal(got, want)
    keep = slots >= 0
    k_ref, v_ref = cache.k.clone(), cache.v.clone()
    store_kv_ref(apply_rope(k, table, positions)[keep][None], v[keep][None], k_ref, v_ref,
                 slots[keep][None])
    assert torch.equal(k_ref, cache.k) and torch.equal(v_ref, cache.v)
    oracle = sparse_attention_ref(apply_rope(q, table, positions), k_ref, v_ref, *args, sinks,
                                  counts)
    torch.testing.assert_close(got, oracle, **tol(dtype))


def test_rope_inside_takes_one_row_steps_only() -> None:
    gen = generator(1)
    cache = paged_cache(1, 32, 2, 64, 16, DTYPES[0], gen)
    q = randn(1, 2, 4, 64, gen=gen, dtype=DTYPES[0])
    kv = randn(1, 2, 2, 64, gen=gen, dtype=DTYPES[0])
    positions = query_positions([32], 2)
    with pytest.raises(AssertionError, match="one-row steps only"):
        sparse_attention(q, cache.k, cache.v, cache.page_table, positions, 16,
                         torch.zeros(1, 1, 0, dtype=torch.long, device=DEVICE),
                         torch.tensor([30], device=DEVICE), 2, 0.125,
                         new=NewKV(kv, kv, torch.zeros(40, 64, device=DEVICE),
                                   torch.zeros(1, 2, dtype=torch.long, device=DEVICE)))



@pytest.mark.skipif(DEVICE.type != "cuda", reason="the split rules of GPU launches")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_occupancy_split_of_the_paged_kernel_matches_reference(
        case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other split rule (no programs per SM listed) computes the same attention."""
    import vegas_spec.kernels.sparse_attention as sa
    retune(monkeypatch, sa, programs_per_sm=None)
    run(case, DTYPES[0], seed=2)


@pytest.mark.parametrize("length,programs,head_dim,want", [
    (439, 192, 64, 256),  # SmolLM2 64 x 7.5K: 4 blocks, 3 programs per SM -> 2 splits
    (6617, 32, 64, 640),  # 52 blocks, 396 slots -> 12 splits
    (327, 96, 64, 384),  # SmolLM2 32 x 2K: 288 one-block programs > 132 SMs -> 1 split
    (300, 150, 64, 384),  # at least two blocks per split: 3 blocks -> 1 split
    (200, 8, 64, 128),  # one block a split: 2 x 8 programs fit on the SMs one each
    (327, 24, 64, 128),  # SmolLM2 8 x 2K: 3 x 24 programs
    (1702, 128, 128, 640),  # an unlisted head dim: split_size_for's rule (3 splits)
    (6617, 32, 128, 768),  # (9 splits)
])
def test_sparse_splits_fill_one_wave_of_program_slots(
        length: int, programs: int, head_dim: int, want: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import vegas_spec.kernels as kernels
    import vegas_spec.kernels.sparse_attention as sa
    as_sm90(monkeypatch)
    monkeypatch.setattr(kernels, "sm_count", lambda index: 132)  # an H200
    size = sa.sparse_split_size(length, programs, 128, torch.device("cuda", 0), head_dim)
    assert size == want
    splits = -(-length // size)
    listed = sa.TUNING["sm90"].programs_per_sm or {}
    if head_dim in listed:
        per_sm = listed[head_dim]
        assert splits * programs <= per_sm * 132  # one wave
        assert size == 128 or size >= 256  # one block, or at least two
    assert sa.sparse_split_size(length, programs, 128, torch.device("cpu"), head_dim) == 512


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_wave_tiles_match_reference(dtype: torch.dtype,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's one-wave tiles (512 keys a step, one stage, 8 warps at head dim 64), as
    every launch's: SmolLM2's heads, the list and the recent range in one block, in every
    dtype (float32's tile fits in shared memory at one stage)."""
    import vegas_spec.kernels.sparse_attention as sa
    retune(monkeypatch, sa, by_head_dim=dict(sa.TUNING["sm90"].one_wave), one_wave={})
    run(Case((600, 90), 1, 9, 3, 64, budget=0.4, recent_extra=5, cut=True), dtype, seed=3)


@pytest.mark.parametrize("batch,hkv,n,want", [
    (32, 3, 1, (512, 1, 8)),  # SmolLM2 32 x 2K draft steps: 96 programs on 132 SMs
    (1, 3, 1, (512, 1, 8)),
    (44, 3, 1, (512, 1, 8)),  # 132 programs: one apiece still
    (45, 3, 1, (256, 1, None)),  # 135 programs share SMs: by_head_dim's
    (64, 3, 1, (256, 1, None)),
    (8, 3, 7, (256, 1, None)),  # several query rows: by_head_dim's
])
def test_one_wave_tiles_where_the_programs_fit_on_the_sms(
        batch: int, hkv: int, n: int, want: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft step whose (sequence, kv head) programs fit on the SMs one apiece takes the
    wide one-wave tiles; more programs, or several query rows, take by_head_dim's; the
    interpreter lists neither, and a launch's own block_k overrides both."""
    import vegas_spec.kernels as kernels
    import vegas_spec.kernels.sparse_attention as sa
    as_sm90(monkeypatch)
    monkeypatch.setattr(kernels, "sm_count", lambda index: 132)  # an H100 SXM or H200
    keys = sa.key_tiles(torch.device("cuda", 0), 64, n, batch * hkv)
    assert keys is not None and (keys.block_k, keys.stages, keys.warps) == want
    assert sa.key_tiles(torch.device("cuda", 0), 80, n, batch * hkv) is None  # not listed
    assert sa.key_tiles(torch.device("cpu"), 64, n, batch * hkv) is None
    q = torch.zeros(batch, n, 3 * hkv, 64)
    assert sa._tiles(q, hkv, None).block_k == 32  # the interpreter's
    assert sa._tiles(q, hkv, 16).block_k == 16
