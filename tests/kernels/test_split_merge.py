"""The splits of the paged and the sparse attention kernels merged by their last split program
(`split_merge.MERGE_IN_KERNEL`) against the separate merge kernel: the same values in every
row (the same bits under the interpreter; compiled, the two programs may contract the
merge's multiply-adds differently), and the election counters left at zero for the next
launch."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    CUDA,
    DEVICE,
    DTYPES,
    generator,
    paged_cache,
    poisoned,
    query_positions,
    randn,
)

from vegas_spec.kernels import split_merge
from vegas_spec.kernels.paged_attention import paged_attention
from vegas_spec.kernels.sparse_attention import sparse_attention


def paged_call(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A verify-shaped call with weight scores (the merge writes the lse the scores need) and
    several splits of 16 keys, one sequence shorter than a split's start."""
    gen = generator(5)
    cache = paged_cache(3, 130, 2, 64, 8, dtype, gen)
    q = randn(3, 7, 8, 64, gen=gen, dtype=dtype)
    positions = query_positions([130, 61, 9], 7).clamp(min=0)
    rows = torch.tensor([0, 6], device=DEVICE)
    scores = poisoned(3, 2, 1, 136)
    out = poisoned(3, 7, 8, 64, dtype=dtype)
    paged_attention(q, cache.k, cache.v, cache.page_table, positions, 8, 130, 0.125, rows,
                    scores, "weight", block_k=16, split_size=32, out=out)
    return {"out": out, "scores": scores}


def sparse_call(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A draft-shaped call over listed positions plus a recent range, several splits."""
    gen = generator(6)
    cache = paged_cache(2, 200, 2, 64, 8, dtype, gen)
    q = randn(2, 1, 4, 64, gen=gen, dtype=dtype)
    positions = torch.tensor([[199], [120]], device=DEVICE)
    listed = torch.stack([torch.randperm(150, generator=gen)[:70].sort().values
                          for _ in range(2)])[:, None, :].to(DEVICE)
    recent_start = torch.tensor([160, 100], device=DEVICE)
    out = poisoned(2, 1, 4, 64, dtype=dtype)
    sparse_attention(q, cache.k, cache.v, cache.page_table, positions, 8, listed, recent_start,
                     40, 0.125, block_k=16, split_size=32, out=out)
    return {"out": out}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("call", [paged_call, sparse_call], ids=["paged", "sparse"])
def test_last_split_program_merges_as_the_merge_kernel(call, dtype: torch.dtype,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(split_merge, "_COUNTERS", {})
    got = {}
    for in_kernel in (False, True):
        monkeypatch.setattr(split_merge, "MERGE_IN_KERNEL", in_kernel)
        got[in_kernel] = call(dtype)
    for name, separate in got[False].items():
        assert not separate.isnan().any(), name
        if CUDA:
            close = 1e-5 if separate.dtype == torch.float32 else 2e-3
            torch.testing.assert_close(got[True][name], separate, atol=close, rtol=close)
        else:
            assert torch.equal(got[True][name], separate), name
    counters = split_merge._COUNTERS[DEVICE if DEVICE.type == "cpu" else got[True]["out"].device]
    assert int(counters.abs().sum()) == 0


def test_counters_are_shared_and_grow() -> None:
    """One zeroed buffer per device, at least as many counters as asked for."""
    small = split_merge.split_counters(10, DEVICE)
    assert small.dtype == torch.int32 and small.numel() >= 10 and int(small.abs().sum()) == 0
    assert split_merge.split_counters(5, DEVICE) is small
    big = split_merge.split_counters(small.numel() + 1, DEVICE)
    assert big.numel() > small.numel() and int(big.abs().sum()) == 0
    assert split_merge.split_counters(3, DEVICE) is big
