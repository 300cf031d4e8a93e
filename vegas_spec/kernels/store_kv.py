"""Write a step's new K and V into their paged-cache slots.

Oracle: `vegas_spec.attention.torch_backend.store_kv_ref`. One program per token copies its
[Hkv, D] rows of K and V (read through any batch/token/head strides, e.g. views into the fused
qkv projection) into row slot_mapping[b, i] of each cache, casting to the cache dtype. A
negative slot means "no slot" (padding) and is skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, n, Hkv,
                     stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                     stride_sb, stride_sn, stride_cs, stride_ch,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0) // n
    i = tl.program_id(0) % n
    slot = tl.load(slot_ptr + b * stride_sb + i * stride_sn).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = ((h < Hkv)[:, None] & (d < HEAD_DIM)[None, :]) & (slot >= 0)
    k = tl.load(k_ptr + b * stride_kb + i * stride_kn + h[:, None] * stride_kh + d[None, :],
                mask=mask)
    v = tl.load(v_ptr + b * stride_vb + i * stride_vn + h[:, None] * stride_vh + d[None, :],
                mask=mask)
    dst = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [B, n, Hkv, D] -> k_cache, v_cache [num_slots, Hkv, D] at rows slot_mapping [B, n]."""
    assert k.dim() == 4 and k.shape == v.shape and k_cache.shape == v_cache.shape
    bsz, n, hkv, dim = k.shape
    assert k_cache.dim() == 3 and k_cache.shape[1:] == (hkv, dim)
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.shape == (bsz, n) and not slot_mapping.is_floating_point()
    assert k.device == k_cache.device == slot_mapping.device
    if bsz * n == 0:
        return
    block_h = min(triton.next_power_of_2(hkv), 8)
    grid = (bsz * n, triton.cdiv(hkv, block_h))
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, n, hkv,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        slot_mapping.stride(0), slot_mapping.stride(1), k_cache.stride(0), k_cache.stride(1),
        HEAD_DIM=dim, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(dim), num_warps=4)
