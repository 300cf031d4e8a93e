"""RoPE on q and k with k/v written into their cache slots, against `apply_rope` then
`store_kv_ref`: bit for bit in every dtype."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, generator, nan_empty, poisoned, randn

from vegas_spec.attention.torch_backend import store_kv_ref
from vegas_spec.kernels.rope_store import rope_store
from vegas_spec.ops import apply_rope

ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MAX_POS = 64


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
              positions: torch.Tensor, slot_mapping: torch.Tensor, slots: int,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated q and NaN caches holding rotated k and v at the non-negative slots."""
    keep = slot_mapping >= 0
    k_cache, v_cache = poisoned(slots, *k.shape[2:], dtype=k.dtype), \
        poisoned(slots, *k.shape[2:], dtype=k.dtype)
    store_kv_ref(apply_rope(k, table, positions)[keep][None], v[keep][None], k_cache, v_cache,
                 slot_mapping[keep][None])
    return apply_rope(q, table, positions), k_cache, v_cache


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("bsz,n,heads,hkv,dim,per_program", [
    (1, 1, 4, 4, 64, None),  # one decode row, no GQA
    (2, 7, 6, 2, 128, None),  # a verify step, 3 query heads per kv head
    (3, 1, 8, 1, 64, None),  # decode, 8 per kv head
    (1, 7, 18, 2, 64, None),  # more heads than one block of 16
    (1, 21, 9, 3, 64, 8),  # a prefill's 8 tokens per program, the last program partial
])
def test_matches_reference(bsz: int, n: int, heads: int, hkv: int, dim: int,
                           per_program: int | None, dtype: torch.dtype) -> None:
    gen = generator(heads * n)
    slots = 4 * bsz * n
    # q, k and v as the model has them: strided views into one fused projection
    qkv = randn(bsz, n, (heads + 2 * hkv) * dim, gen=gen, dtype=dtype)
    q = qkv[..., : heads * dim].view(bsz, n, heads, dim)
    k = qkv[..., heads * dim: (heads + hkv) * dim].view(bsz, n, hkv, dim)
    v = qkv[..., (heads + hkv) * dim:].view(bsz, n, hkv, dim)
    table = 2 * torch.rand(MAX_POS, dim, generator=gen).to(DEVICE) - 1
    positions = torch.randint(0, MAX_POS, (bsz, n), generator=gen).to(DEVICE)
    slot_mapping = torch.randperm(slots, generator=gen)[: bsz * n].view(bsz, n).to(DEVICE)
    skipped = min(bsz * n - 1, 1)  # a padding row (no slot, nothing written) beside others
    slot_mapping.view(-1)[1: 1 + skipped] = -1
    k_cache, v_cache = poisoned(slots, hkv, dim, dtype=dtype), poisoned(slots, hkv, dim,
                                                                       dtype=dtype)
    with nan_empty():
        got_q = rope_store(q, k, v, k_cache, v_cache, table, positions, slot_mapping,
                           per_program)
    want_q, want_k, want_v = reference(q, k, v, table, positions, slot_mapping, slots)
    assert got_q.is_contiguous() and torch.equal(got_q, want_q)
    exact = {"rtol": 0.0, "atol": 0.0, "equal_nan": True}
    torch.testing.assert_close(k_cache, want_k, **exact)
    torch.testing.assert_close(v_cache, want_v, **exact)
    assert k_cache.isnan().all(-1).all(-1).sum() == slots - (bsz * n - skipped)
