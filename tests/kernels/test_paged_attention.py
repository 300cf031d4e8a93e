"""Paged attention (and its fused selection scores) against `paged_attention_ref`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from kernel_cases import (
    CUDA,
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

import vegas_spec.kernels.paged_attention as pa
from vegas_spec.attention.torch_backend import paged_attention_ref, paged_attention_sdpa
from vegas_spec.kernels.paged_attention import paged_attention


@dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]  # sequence lengths once this step's n tokens are written
    n: int
    heads: int
    hkv: int
    dim: int
    page_size: int = 16
    rows: str | tuple[int, ...] | None = None  # "ends" = (0, n-1), "all", explicit, None
    mode: str = "weight"
    per_kv_head: bool = False
    block_k: int | None = None
    split_size: int | None = None
    kv_extra: int = 0  # host bound kv_len beyond the longest sequence
    window: int = 0  # a sliding window (gpt-oss's every other layer), 0: none
    sinks: bool = False  # a random sink logit per query head (gpt-oss's)

    def score_rows(self) -> list[int] | None:
        if self.rows is None:
            return None
        if self.rows == "ends":
            return sorted({0, self.n - 1})
        return list(range(self.n)) if self.rows == "all" else list(self.rows)


CASES = [
    Case((37,), 1, 4, 4, 64, block_k=16),
    Case((203, 37, 130), 1, 12, 4, 128, rows="ends", block_k=32),
    Case((100, 61), 7, 8, 2, 64, page_size=8, rows="ends", per_kv_head=True),
    Case((100, 61), 7, 8, 2, 64, page_size=8, rows="ends", mode="logit"),
    Case((77, 150), 7, 6, 2, 128, rows="all", mode="logit", per_kv_head=True, kv_extra=5),
    Case((150, 77), 7, 2, 2, 64, rows="all", block_k=16, split_size=32),
    Case((45,), 7, 4, 1, 128, rows="ends", kv_extra=3),
    Case((40,), 40, 8, 2, 64, rows=(39,)),  # a whole prompt: several row blocks, causal
    Case((70,), 33, 6, 2, 64, rows="ends", mode="logit", per_kv_head=True),  # a later chunk
    Case((1, 9, 16), 1, 8, 2, 64, rows="ends", per_kv_head=True, block_k=16),
    Case((58, 23), 7, 8, 2, 64, rows=(6, 0, 6), mode="weight"),  # a row asked for twice
    # several sequences, kv heads and row blocks: programs side by side by row block
    Case((50, 29), 20, 8, 2, 64, rows="ends", per_kv_head=True),
]


def case_id(case: Case) -> str:
    g = "G=Hkv" if case.per_kv_head else "G=1"
    rows = "" if case.rows is None else f"_rows{case.rows}_{case.mode}_{g}"
    oss = (f"_w{case.window}" if case.window else "") + ("_sinks" if case.sinks else "")
    return (f"lens{'-'.join(map(str, case.lens))}_n{case.n}_h{case.heads}x{case.hkv}"
            f"_d{case.dim}{rows}{oss}")


def score_tol(case: Case, dtype: torch.dtype) -> dict[str, float]:
    if case.mode == "logit":
        return {"atol": 1e-3, "rtol": 1e-4} if dtype == torch.float32 else \
            {"atol": 0.1, "rtol": 2e-2}
    return {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else \
        {"atol": 2e-3, "rtol": 2e-2}


def sink_logits(case: Case, gen: torch.Generator) -> torch.Tensor | None:
    """A sink logit per query head, large enough to take a good share of each softmax."""
    return randn(case.heads, gen=gen) * 2 + 1 if case.sinks else None


def run(case: Case, dtype: torch.dtype, seed: int = 0) -> None:
    gen = generator(seed)
    bsz, kv_len = len(case.lens), max(case.lens) + case.kv_extra
    cache = paged_cache(bsz, kv_len, case.hkv, case.dim, case.page_size, dtype, gen)
    q = randn(bsz, case.n, case.heads, case.dim, gen=gen, dtype=dtype)
    positions = query_positions(list(case.lens), case.n)
    sinks = sink_logits(case, gen)
    rows = case.score_rows()
    scale = case.dim ** -0.5
    groups = case.hkv if case.per_kv_head else 1
    score_rows = None if rows is None else torch.tensor(rows, device=DEVICE)
    scores = None if rows is None else poisoned(bsz, len(rows), groups, kv_len + 4)
    out = paged_attention(q, cache.k, cache.v, cache.page_table, positions, case.page_size,
                          kv_len, scale, score_rows, scores, case.mode, block_k=case.block_k,
                          split_size=case.split_size,
                          out=poisoned(*q.shape, dtype=dtype), sinks=sinks, window=case.window)
    want, want_scores = paged_attention_ref(
        q, cache.k, cache.v, cache.page_table, positions, case.page_size, kv_len, scale,
        score_rows, case.mode, case.per_kv_head, sinks=sinks, window=case.window)
    torch.testing.assert_close(out, want, **tol(dtype))
    if scores is not None:
        assert want_scores is not None
        expected = torch.zeros_like(scores)
        expected[..., :kv_len] = want_scores
        torch.testing.assert_close(scores, expected, **score_tol(case, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case: Case, dtype: torch.dtype) -> None:
    run(case, dtype)


# gpt-oss's layers: sinks, a sliding window (contexts longer than it, windows not a multiple
# of the key block, rows at its edge), both. Default splits: a window call is one split;
# explicit ones cut the keys from key 0, the splits before every row's window empty (with
# sinks split 0 still holds the sink, counted once by the merge).
OSS_CASES = [
    Case((100, 61), 1, 8, 2, 64, block_k=16, window=20),
    Case((100, 61), 1, 8, 2, 64, block_k=16, window=20, sinks=True),
    Case((37,), 1, 4, 4, 64, block_k=16, split_size=16, sinks=True),  # sinks, 3 splits
    Case((203, 37, 130), 1, 12, 4, 128, rows="ends", block_k=32, window=45, sinks=True),
    Case((100, 61), 7, 8, 2, 64, page_size=8, rows="ends", window=24, sinks=True),
    Case((100, 61), 7, 8, 2, 64, page_size=8, rows="ends", per_kv_head=True, window=33),
    Case((45,), 7, 4, 1, 128, rows="ends", kv_extra=3, sinks=True),
    Case((150, 77), 7, 6, 2, 128, rows="all", mode="logit", per_kv_head=True, block_k=16,
         split_size=32, window=40, sinks=True),
    Case((150, 77), 7, 2, 2, 64, rows="all", block_k=16, split_size=32, window=17),
    Case((9, 130), 7, 8, 2, 64, rows="ends", per_kv_head=True, block_k=16, split_size=64,
         window=8, sinks=True),  # a window about the rows' count; a context inside it
    Case((64, 33), 4, 4, 2, 64, rows="all", block_k=16, window=1, sinks=True),  # itself only
    Case((40,), 7, 4, 2, 64, rows="ends", kv_extra=5, window=128, sinks=True),  # wider
    Case((70,), 33, 6, 2, 64, rows="ends", mode="logit", window=16, sinks=True),  # a chunk
    Case((50, 29), 20, 8, 2, 64, rows="ends", per_kv_head=True, block_k=16, window=12,
         split_size=32),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", OSS_CASES, ids=case_id)
def test_sinks_and_windows_match_reference(case: Case, dtype: torch.dtype) -> None:
    run(case, dtype)


@pytest.mark.parametrize("case", [c for c in OSS_CASES if c.rows is not None and c.window],
                         ids=case_id)
def test_sinks_and_windows_with_the_store_of_whole_blocks(
        case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU tiles' store leaves logits of the blocks the window skips unwritten: the
    finalise kernel scores only the window's keys."""
    use_store(monkeypatch, "f32-blocks")
    run(case, torch.float32)


def test_sinks_and_windows_change_the_result() -> None:
    """The cases above test something: the reference moves with the sinks and the window."""
    gen = generator(4)
    cache = paged_cache(1, 100, 2, 64, 16, torch.float32, gen)
    q = randn(1, 7, 8, 64, gen=gen)
    positions = query_positions([100], 7)
    args = (q, cache.k, cache.v, cache.page_table, positions, 16, 100, 0.125)
    plain, _ = paged_attention_ref(*args)
    for kwargs in ({"window": 20}, {"sinks": randn(8, gen=gen) * 2 + 1}):
        moved, _ = paged_attention_ref(*args, **kwargs)
        assert (moved - plain).abs().max() > 0.05, kwargs


@pytest.mark.parametrize("split_size", [None, 32])
@pytest.mark.parametrize("n", [1, 7])
def test_a_window_reads_no_block_before_it(n: int, split_size: int | None) -> None:
    """K and V of the keys before the key block of the rows' first window key are NaN: a
    program that read them would give NaN (p = 0 times NaN). The output is the clean
    cache's, bit for bit."""
    gen = generator(6)
    lens, window, block = [150, 97], 20, 16
    cache = paged_cache(2, 150, 2, 64, 8, torch.float32, gen)
    q = randn(2, n, 8, 64, gen=gen)
    positions = query_positions(lens, n)
    sinks = randn(8, gen=gen)
    args = (cache.page_table, positions, 8, 150, 0.125)
    kwargs = dict(block_k=block, split_size=split_size, sinks=sinks, window=window)
    clean = paged_attention(q, cache.k, cache.v, *args, **kwargs)
    k, v = cache.k.clone(), cache.v.clone()
    for b, length in enumerate(lens):
        first = (length - n - window + 1) // block * block  # the first row's window block
        keys = torch.arange(first, device=DEVICE)
        slots = cache.page_table[b].long()[keys // 8] * 8 + keys % 8
        k[slots], v[slots] = float("nan"), float("nan")
    got = paged_attention(q, k, v, *args, **kwargs)
    assert torch.equal(got, clean)


@pytest.mark.parametrize("case", [c for c in CASES if c.rows is None] + [
    Case((100, 61), 7, 8, 2, 64, page_size=8), Case((45, 3), 7, 6, 2, 128, kv_extra=3),
    Case((30, 90), 4, 4, 4, 32)], ids=case_id)
def test_sdpa_form_matches_reference(case: Case) -> None:
    """The torch backend's unscored full attention (torch's fused attention) against the
    reference, rows that see no key included (they give 0 in both)."""
    gen = generator(5)
    bsz, kv_len = len(case.lens), max(case.lens) + case.kv_extra
    cache = paged_cache(bsz, kv_len, case.hkv, case.dim, case.page_size, torch.float32, gen)
    q = randn(bsz, case.n, case.heads, case.dim, gen=gen, dtype=torch.float32)
    positions = query_positions(list(case.lens), case.n)
    args = (q, cache.k, cache.v, cache.page_table, positions, case.page_size, kv_len,
            case.dim ** -0.5)
    want, _ = paged_attention_ref(*args)
    torch.testing.assert_close(paged_attention_sdpa(*args), want, **tol(torch.float32))
    blind = positions.clone()
    blind[0] = -1  # the first sequence's rows see no key
    args = (*args[:4], blind, *args[5:])
    got, (want, _) = paged_attention_sdpa(*args), paged_attention_ref(*args)
    assert (got[0] == 0).all() and (want[0] == 0).all()
    torch.testing.assert_close(got, want, **tol(torch.float32))


def test_scores_sum_to_heads() -> None:
    """Weights of one row summed over keys give the number of query heads it sums over."""
    gen = generator(1)
    cache = paged_cache(2, 90, 2, 64, 16, torch.float32, gen)
    q = randn(2, 3, 8, 64, gen=gen)
    positions = query_positions([90, 41], 3)
    scores = poisoned(2, 1, 2, 90)
    paged_attention(q, cache.k, cache.v, cache.page_table, positions, 16, 90, 0.125,
                    torch.tensor([2], device=DEVICE), scores, "weight")
    torch.testing.assert_close(scores.sum(-1), torch.full_like(scores.sum(-1), 4.0))
    assert (scores[1, :, :, 41:] == 0).all()


def use_store(monkeypatch: pytest.MonkeyPatch, store: str) -> None:
    """Every score tiling of every device class (the interpreter's too) stores its weight-mode
    logits with `store`."""
    for key, entry in list(pa.TUNING.items()):
        monkeypatch.setitem(pa.TUNING, key, dataclasses.replace(
            entry, score_tiles={dim: dataclasses.replace(tiles, store=store)
                                for dim, tiles in entry.score_tiles.items()},
            score_tiles_other=dataclasses.replace(entry.score_tiles_other, store=store)))


SCORED = [case for case in CASES if case.rows is not None]


@pytest.mark.parametrize("case", SCORED, ids=case_id)
def test_score_store_of_whole_blocks(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits stored as whole key blocks (the GPU tiles' store, which the interpreter does not
    otherwise run) give the reference's scores (and the same attention output)."""
    use_store(monkeypatch, "f32-blocks")
    run(case, torch.float32)


@pytest.mark.parametrize("store", sorted(pa.SCORE_STORES))
def test_score_stores_give_the_same_scores(store: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every store of the weight-mode logits gives the scores of the float32 descriptor; the
    store the tiles name is the one that runs (a float32 scratch, a descriptor or none, a
    scratch of whole key blocks where the store masks by lane only)."""
    jobs, descriptors = [], []

    def score_job(*args, **kwargs):  # type: ignore[no-untyped-def]
        job = score_job_of(*args, **kwargs)
        jobs.append((job, args[4].block_k))
        return job

    def descriptor(*args, **kwargs):  # type: ignore[no-untyped-def]
        descriptors.append(args[0])
        return descriptor_of(*args, **kwargs)

    score_job_of, descriptor_of = pa._score_job, pa._descriptor
    monkeypatch.setattr(pa, "_score_job", score_job)
    monkeypatch.setattr(pa, "_descriptor", descriptor)
    gen = generator(2)
    cache = paged_cache(2, 100, 2, 64, 8, torch.float16, gen)
    q = randn(2, 7, 8, 64, gen=gen, dtype=torch.float16)
    positions = query_positions([100, 61], 7)
    rows = torch.tensor([0, 6], device=DEVICE)
    got = {}
    for name in ("f32-descriptor", store):
        use_store(monkeypatch, name)
        jobs.clear()
        descriptors.clear()
        got[name] = poisoned(2, 2, 2, 104)
        paged_attention(q, cache.k, cache.v, cache.page_table, positions, 8, 100, 0.125,
                        rows, got[name], "weight")
        kind = pa.SCORE_STORES[name]
        assert [job.scratch.dtype for job, _ in jobs] == [torch.float32]
        assert len(descriptors) == kind.descriptor  # one row block: the descriptor if named
        if kind.whole_blocks:  # the last key block (96..127 of 100) fits the scratch
            assert [job.scratch.shape[-1] % block_k for job, block_k in jobs] == [0]
    torch.testing.assert_close(got[store], got["f32-descriptor"], atol=1e-6, rtol=1e-5)
    assert (got[store][:, :, :, 100:] == 0).all()


# Every score-pass tiling of the table, whatever its device class and head dim.
SCORE_TILINGS = list(dict.fromkeys(tiles for entry in pa.TUNING.values()
                                   for tiles in (*entry.score_tiles.values(),
                                                 entry.score_tiles_other)))


@pytest.mark.skipif(not CUDA, reason="the interpreter runs its own tiles only")
@pytest.mark.parametrize("tiles", SCORE_TILINGS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_score_tiling(case: Case, tiles: pa.ScoreTiles,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Every score-pass tiling (register caps, the occupancy split) at each case's shape: the
    reference's output and scores."""
    retune(monkeypatch, pa, score_tiles={}, score_tiles_other=tiles)
    for dtype in DTYPES:
        run(case, dtype)


def test_score_tiles_refuse_an_unknown_store() -> None:
    with pytest.raises(ValueError, match="unknown score store"):
        pa.ScoreTiles(128, 3, None, None, "f16-pointers")
    assert pa.ScoreTiles(128, 3, None, None, "f32-blocks").store == "f32-blocks"


class _GpuQuery:
    """What the store and tile choices read of q [B, n, H, D] on a GPU, without one."""

    def __init__(self, dim: int, n: int = 7) -> None:
        self.shape, self.is_cuda, self.dtype = (16, n, 32, dim), True, torch.bfloat16
        self.device = torch.device("cuda")


def test_store_follows_the_tiles_of_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a scored pass stores its logits as its head dim's score tiles say, exact mode
    as the exact tiles; the interpreter as its other head dims' tiles whatever the head
    dim."""
    as_sm90(monkeypatch)
    sm90, interpreter = pa.TUNING["sm90"], pa.TUNING["interpreter"]
    for dim in (*sm90.score_tiles, 96):
        gpu: torch.Tensor = _GpuQuery(dim)  # type: ignore[assignment]
        assert pa._score_store(gpu, False) == sm90.score_tiles_at(dim).store
        assert pa._score_store(gpu, True) == sm90.exact_tiles.store
        cpu = torch.empty(1, 1, 1, dim)
        assert pa._score_store(cpu, False) == interpreter.score_tiles_other.store


def test_verify_tiles_apply_to_unscored_calls_of_several_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU an unscored call of 2..decode_rows rows runs its head dim's verify tiles; a
    plain step, a scored pass, a prompt's rows, exact mode, an explicit block_k and an
    unlisted head dim run the tiles they ran before."""
    as_sm90(monkeypatch)
    verify = pa.VerifyTiles(32, 3, 96)
    sm90 = pa.TUNING["sm90"]
    monkeypatch.setitem(pa.TUNING, "sm90", dataclasses.replace(sm90, verify_tiles={64: verify}))

    def tiling(dim: int = 64, n: int = 7, scored: bool = False, block_k: int | None = None,
               exact: bool = False) -> tuple[int, int, int | None]:
        gpu: torch.Tensor = _GpuQuery(dim, n)  # type: ignore[assignment]
        cfg, _ = pa._tiling(gpu, 8, scored, block_k, exact)
        return cfg.block_k, cfg.num_stages, cfg.maxnreg

    assert tiling() == (32, 3, 96) == tiling(n=sm90.decode_rows) == tiling(n=2)
    plain = pa.tile_config(_GpuQuery(64, 1), 8)  # type: ignore[arg-type]
    assert tiling(n=1) == (plain.block_k, plain.num_stages, None)
    scored = sm90.score_tiles_at(64)
    assert tiling(scored=True) == (scored.block_k, scored.stages, scored.maxnreg)
    assert tiling(n=sm90.decode_rows + 1)[0] == plain.block_k
    assert tiling(exact=True)[:2] == (sm90.exact_tiles.block_k, sm90.exact_tiles.stages)
    assert tiling(block_k=128)[::2] == (128, None)
    assert tiling(dim=128)[2] is None
    cpu = torch.empty(1, 7, 32, 64)
    assert pa.verify_tiles(cpu, False) is None


@pytest.mark.skipif(not CUDA, reason="verify tiles apply on GPUs only")
@pytest.mark.parametrize("tiles", [pa.VerifyTiles(64, 2), pa.VerifyTiles(64, 3, 128),
                                   pa.VerifyTiles(128, 3, 168)], ids=str)
def test_every_verify_tiling(tiles: pa.VerifyTiles, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unscored several-row calls under other tiles: the reference's output."""
    retune(monkeypatch, pa, verify_tiles={64: tiles, 128: tiles})
    for case in (Case((150, 77), 7, 8, 2, 64, page_size=8), Case((45,), 7, 4, 1, 128, kv_extra=3),
                 Case((3000, 2100), 7, 9, 3, 64), Case((900,), 16, 8, 2, 128)):
        for dtype in DTYPES:
            run(case, dtype)


def test_launch_options_name_a_register_cap_only_when_set() -> None:
    cfg = pa.tile_config(torch.empty(1, 7, 8, 64), 2)
    assert cfg.launch_options() == {"num_warps": 4, "num_stages": 1}
    capped = dataclasses.replace(cfg, maxnreg=128)
    assert capped.launch_options() == {"num_warps": 4, "num_stages": 1, "maxnreg": 128}


@pytest.mark.skipif(not CUDA, reason="the wave split sizes GPU launches only")
@pytest.mark.parametrize("case", [Case((6000, 5000, 4100, 7000), 1, 32, 8, 128),
                                  Case((3000,) * 3, 7, 32, 8, 128, rows="ends")], ids=case_id)
def test_the_wave_split_reads_the_compiled_kernel(case: Case) -> None:
    """A long decode call is split by whole waves of the compiled variant's resident
    programs (learned from it once), and still matches the reference."""
    pa._RESIDENT.clear()
    run(case, torch.bfloat16)
    assert len(pa._RESIDENT) == 1 and 1 <= next(iter(pa._RESIDENT.values())) <= 32
