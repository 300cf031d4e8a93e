"""Packed prefill attention against `prefill_attention_ref`: causal, GQA, ragged pieces, cached
context in shuffled pages, chunk starts that are not page-aligned; the CPU path's SDPA form
against the same reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, generator, paged_cache, poisoned, randn, tol

from vegas_spec.attention.torch_backend import prefill_attention_ref, prefill_attention_sdpa
from vegas_spec.kernels.prefill_attention import (
    PrefillConfig,
    prefill_attention,
    prefill_config,
    prefill_flops,
    prefill_splits,
    prefill_tiles,
)


@dataclass(frozen=True)
class Case:
    lengths: tuple[int, ...]  # queries of each piece
    starts: tuple[int, ...]  # cached positions before each piece
    heads: int
    hkv: int
    dim: int
    page_size: int = 16


CASES = [
    Case((45,), (0,), 4, 4, 64),  # one whole prompt, no GQA, a partial last tile
    Case((70, 9, 33), (0, 0, 0), 6, 2, 64),  # ragged prompts in one launch
    Case((40, 17), (37, 100), 8, 2, 64, page_size=8),  # later chunks, unaligned starts
    Case((64,), (64,), 3, 1, 32),  # a chunk starting on a tile boundary, one kv head
    Case((1, 50), (29, 3), 9, 3, 64),  # SmolLM2's heads; a one-token piece
    Case((20,), (0,), 4, 2, 80),  # a head dim that is not a power of two
]


def _inputs(case: Case, dtype: torch.dtype, seed: int):
    gen = generator(seed)
    ends = [s + n for n, s in zip(case.lengths, case.starts)]
    cache = paged_cache(len(ends), max(ends), case.hkv, case.dim, case.page_size, dtype, gen)
    q = randn(sum(case.lengths), case.heads, case.dim, gen=gen, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32)
    starts = torch.tensor(case.starts, dtype=torch.int32)
    return cache, q, cu.to(DEVICE), starts.to(DEVICE)


def _reference(case: Case, cache, q: torch.Tensor) -> torch.Tensor:
    return prefill_attention_ref(q.float(), cache.k.float(), cache.v.float(), cache.page_table,
                                 case.lengths, case.starts, case.page_size,
                                 case.dim ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_prefill_attention_matches_reference(case: Case, dtype: torch.dtype) -> None:
    cache, q, cu, starts = _inputs(case, dtype, seed=sum(case.lengths) + case.heads)
    cfg = prefill_config(case.dim, q.is_cuda)
    tiles = prefill_tiles(list(case.lengths), list(case.starts), cfg.block_m, q.device)
    out = poisoned(*q.shape, dtype=dtype)
    prefill_attention(q, cache.k, cache.v, cache.page_table, cu, starts, tiles,
                      case.page_size, case.dim ** -0.5, config=cfg, out=out)
    torch.testing.assert_close(out.float(), _reference(case, cache, q), **tol(dtype))


def test_small_tiles_cross_pages_and_the_diagonal() -> None:
    """16-row tiles over 16-key blocks with 4-slot pages: many unmasked blocks, a diagonal
    that starts inside a block, tiles sorted longest first."""
    case = Case((50, 23), (13, 70), 4, 2, 32, page_size=4)
    cache, q, cu, starts = _inputs(case, torch.float32, seed=5)
    cfg = PrefillConfig(16, 16, 1, 1)
    tiles = prefill_tiles(list(case.lengths), list(case.starts), cfg.block_m, q.device)
    assert tiles[0].tolist() == [1, 1, 0, 0, 0, 0]  # piece 1 ends at 93, piece 0 at 63
    assert tiles[1].tolist() == [16, 0, 48, 32, 16, 0]
    out = prefill_attention(q, cache.k, cache.v, cache.page_table, cu, starts, tiles,
                            case.page_size, case.dim ** -0.5, config=cfg)
    torch.testing.assert_close(out, _reference(case, cache, q), **tol(torch.float32))


@pytest.mark.parametrize(("case", "splits"), [(CASES[1], 2), (CASES[2], 5), (CASES[4], 3)])
def test_split_keys_match_reference(case: Case, splits: int) -> None:
    """Each tile's keys cut into runs of whole blocks, one program each, merged: runs that
    start past a row's diagonal (the row sees none of their keys) and runs past the tile's
    last key (empty) leave the result as the reference's."""
    cache, q, cu, starts = _inputs(case, torch.float32, seed=11 + splits)
    cfg = PrefillConfig(16, 16, 1, 1)
    tiles = prefill_tiles(list(case.lengths), list(case.starts), cfg.block_m, q.device)
    out = poisoned(*q.shape, dtype=torch.float32)
    prefill_attention(q, cache.k, cache.v, cache.page_table, cu, starts, tiles,
                      case.page_size, case.dim ** -0.5, config=cfg, out=out, splits=splits)
    torch.testing.assert_close(out, _reference(case, cache, q), **tol(torch.float32))


def test_splits_fill_the_gpu_and_stay_bounded() -> None:
    assert prefill_splits(9, 300, torch.device("cpu")) == 1  # the interpreter: asked for
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        assert prefill_splits(32, 512, dev) == 1  # a large chunk fills the GPU alone
        assert 2 <= prefill_splits(9, 9, dev) <= 16  # 1K tokens of SmolLM2: 81 programs


@pytest.mark.parametrize("case", CASES[:3])
def test_sdpa_form_matches_reference(case: Case) -> None:
    cache, q, _, _ = _inputs(case, torch.float32, seed=3)
    out = prefill_attention_sdpa(q, cache.k, cache.v, cache.page_table, case.lengths,
                                 case.starts, case.page_size, case.dim ** -0.5)
    torch.testing.assert_close(out, _reference(case, cache, q), **tol(torch.float32))


def test_reference_is_plain_causal_attention() -> None:
    """The reference itself, on one contiguous prompt, equals softmax(q k^T) v with a causal
    mask written out by hand (GQA by repeating the kv heads)."""
    case = Case((12,), (5,), 4, 2, 16, page_size=4)
    cache, q, _, _ = _inputs(case, torch.float32, seed=9)
    slots = (cache.page_table[0].long()[:, None] * 4 + torch.arange(4, device=DEVICE)).flatten()
    k = cache.k[slots[:17]].repeat_interleave(2, dim=1)  # [17, 4, 16]
    v = cache.v[slots[:17]].repeat_interleave(2, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q, k) * 16 ** -0.5
    mask = torch.arange(17)[None, :] <= (5 + torch.arange(12))[:, None]
    p = torch.softmax(s.masked_fill(~mask.to(DEVICE), float("-inf")), -1)
    expected = torch.einsum("hnl,lhd->nhd", p, v)
    torch.testing.assert_close(_reference(case, cache, q), expected, **tol(torch.float32))


def test_flops_count_causal_pairs() -> None:
    # 2 queries after 3 cached keys see 4 and 5 keys: 9 pairs, 4·H·D FLOPs each
    assert prefill_flops([2], [3], heads=2, dim=8) == 4 * 2 * 8 * 9


SINK_CASES = [
    (Case((45,), (0,), 4, 2, 32, page_size=8), 8, False),  # gpt-oss's window, no sinks
    (Case((40, 17), (37, 100), 4, 2, 32, page_size=8), 8, True),  # later chunks, both
    (Case((33,), (20,), 4, 4, 32), 0, True),  # sinks alone
    (Case((50,), (5,), 4, 2, 32, page_size=4), 40, True),  # a window wider than a block
]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case,window,sinks", SINK_CASES)
def test_sinks_and_sliding_windows_match_reference(case: Case, window: int, sinks: bool,
                                                   splits: int) -> None:
    """gpt-oss's attention: a sink logit per head in the denominator, the keys of the last
    `window` positions; the key axis whole or split."""
    cache, q, cu, starts = _inputs(case, torch.float32, seed=7 + window)
    sink = randn(case.heads, gen=generator(3)) * 2 if sinks else None
    cfg = prefill_config(case.dim, q.is_cuda)
    tiles = prefill_tiles(list(case.lengths), list(case.starts), cfg.block_m, q.device)
    out = prefill_attention(q, cache.k, cache.v, cache.page_table, cu, starts, tiles,
                            case.page_size, case.dim ** -0.5, config=cfg, splits=splits,
                            sinks=sink, window=window)
    ref = prefill_attention_ref(q, cache.k, cache.v, cache.page_table, case.lengths,
                                case.starts, case.page_size, case.dim ** -0.5, sink, window)
    plain = prefill_attention_ref(q, cache.k, cache.v, cache.page_table, case.lengths,
                                  case.starts, case.page_size, case.dim ** -0.5)
    assert (ref - plain).abs().max() > 0.05  # the sinks and the window matter here
    torch.testing.assert_close(out, ref, **tol(torch.float32))
