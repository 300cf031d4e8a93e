"""Writing new K/V into cache slots against `store_kv_ref`."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, generator, randn

from vegas_spec.attention.torch_backend import store_kv_ref
from vegas_spec.kernels.store_kv import store_kv


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bsz,n,hkv,dim", [(1, 1, 4, 64), (3, 7, 2, 128), (2, 33, 3, 64)])
def test_matches_reference(bsz: int, n: int, hkv: int, dim: int, dtype: torch.dtype) -> None:
    gen = generator(n)
    slots = 4 * bsz * n
    # k and v as the model has them: strided views into one fused projection
    fused = randn(bsz, n, 3 * hkv * dim, gen=gen, dtype=dtype)
    k = fused[..., hkv * dim: 2 * hkv * dim].view(bsz, n, hkv, dim)
    v = fused[..., 2 * hkv * dim:].view(bsz, n, hkv, dim)
    slot_mapping = torch.randperm(slots, generator=gen)[: bsz * n].view(bsz, n).to(DEVICE)
    k_cache, v_cache = randn(slots, hkv, dim, gen=gen, dtype=dtype), \
        randn(slots, hkv, dim, gen=gen, dtype=dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    store_kv_ref(k, v, want_k, want_v, slot_mapping)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_negative_slots_are_skipped() -> None:
    gen = generator(0)
    k, v = randn(1, 3, 2, 64, gen=gen), randn(1, 3, 2, 64, gen=gen)
    k_cache, v_cache = torch.zeros(8, 2, 64, device=DEVICE), torch.zeros(8, 2, 64, device=DEVICE)
    store_kv(k, v, k_cache, v_cache, torch.tensor([[5, -1, 2]], device=DEVICE))
    assert torch.equal(k_cache[5], k[0, 0]) and torch.equal(v_cache[2], v[0, 2])
    assert k_cache.abs().sum(dim=(1, 2)).nonzero().flatten().tolist() == [2, 5]
