"""RoPE on a step's q and k, with k and v written into their paged-cache slots, in one pass.

Oracle: `vegas_spec.ops.apply_rope` on q and k, then
`vegas_spec.attention.torch_backend.store_kv_ref`. Program (tokens, j) takes a block of q
heads (j < q_blocks) or of kv heads of BLOCK_T consecutive tokens, read through any
batch/token/head strides (views into the fused qkv projection). Each head's halves x1, x2
become x1*cos - x2*sin and x2*cos + x1*sin, with apply_rope's roundings in x's dtype:
cos/sin rounded to it, each product and the sum rounded to it, so the result is
bit-identical to the oracle's (float32 products are exact for half inputs; multiply-add
fusion is off, as torch's separate kernels never fuse). Rotated q goes to a new contiguous
tensor; rotated k and v go to row slot_mapping[b, i] of each cache (cast to the cache
dtype), skipped for a negative slot, as `store_kv` does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _f32_rn(op: tl.constexpr, a, b):
    """a op b in float32 as one PTX `op.rn.f32` (no flush of subnormals), which the compiler
    never fuses into a multiply-add."""
    return tl.inline_asm_elementwise(op + ".rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _rope_sum(x, partner, c, s, MUL_RN: tl.constexpr):
    """x * c + partner * s in x's dtype, as apply_rope rounds it: float32 products of the
    values and of c, s (already rounded to that dtype), each product and the sum rounded to
    it on its own. MUL_RN: the products and the sum as `mul.rn` / `add.rn` (`_f32_rn`), for
    kernels compiled with multiply-add fusion on (the interpreter runs no PTX and never
    fuses)."""
    dtype = x.dtype
    a, b = x.to(tl.float32), partner.to(tl.float32)
    if MUL_RN:
        a, b = _f32_rn("mul", a, c), _f32_rn("mul", b, s)
    else:
        a, b = a * c, b * s
    a, b = a.to(dtype).to(tl.float32), b.to(dtype).to(tl.float32)
    if MUL_RN:
        return _f32_rn("add", a, b).to(dtype)
    return (a + b).to(dtype)


@triton.jit
def _rotate(x_ptrs, mask, cos, sin, HALF: tl.constexpr):
    """[BH, BLOCK_HALF] pointers to the first halves of heads -> their rotated halves
    (x1 * cos - x2 * sin, x2 * cos + x1 * sin)."""
    x1 = tl.load(x_ptrs, mask=mask, other=0.0)
    x2 = tl.load(x_ptrs + HALF, mask=mask, other=0.0)
    c = cos.to(x1.dtype).to(tl.float32)[None, :]
    s = sin.to(x1.dtype).to(tl.float32)[None, :]
    return _rope_sum(x1, x2, c, -s, False), _rope_sum(x2, x1, c, s, False)


@triton.jit
def tile_operands(x_ptrs, partner_ptrs, cos_ptrs, mask, HALF: tl.constexpr):
    """`rotate_tile`'s loads alone (elements, partners, cos, sin as stored), so that a
    kernel can issue other loads before the rotation waits for these."""
    xa = tl.load(x_ptrs, mask=mask, other=0.0)
    xb = tl.load(partner_ptrs, mask=mask, other=0.0)
    c = tl.load(cos_ptrs, mask=mask, other=0.0)
    s = tl.load(cos_ptrs + HALF, mask=mask, other=0.0)
    return xa, xb, c, s


@triton.jit
def rotate_loaded(xa, xb, c, s, first_half, MUL_RN: tl.constexpr):
    """`rotate_tile`'s rotation of the values `tile_operands` loaded."""
    c = c.to(xa.dtype).to(tl.float32)
    s = s.to(xa.dtype).to(tl.float32)
    return _rope_sum(xa, xb, c, tl.where(first_half, -s, s), MUL_RN)


@triton.jit
def rotate_tile(x_ptrs, partner_ptrs, cos_ptrs, first_half, mask, HALF: tl.constexpr,
                MUL_RN: tl.constexpr):
    """Rotated elements of whole heads at once, with `_rotate`'s roundings (the same bits):
    x_ptrs point at elements d of heads, partner_ptrs at their partners d ± HALF, cos_ptrs
    at the table's cos entries of (position, d mod HALF), sin HALF further; first_half
    marks d < HALF (x1 * cos - x2 * sin there, x2 * cos + x1 * sin beyond). MUL_RN: as
    `_rope_sum`'s."""
    xa, xb, c, s = tile_operands(x_ptrs, partner_ptrs, cos_ptrs, mask, HALF)
    return rotate_loaded(xa, xb, c, s, first_half, MUL_RN)


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, table_ptr,
                       pos_ptr, slot_ptr, n, total, H, Hkv, q_blocks,
                       stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                       stride_vb, stride_vn, stride_vh, stride_pb, stride_pn,
                       stride_sb, stride_sn, stride_t, stride_cs, stride_ch,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    j = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    for r in tl.static_range(BLOCK_T):
        token = tl.program_id(0).to(tl.int64) * BLOCK_T + r
        live = token < total
        b, i = token // n, token % n
        pos = tl.load(pos_ptr + b * stride_pb + i * stride_pn, mask=live, other=0).to(tl.int64)
        cos = tl.load(table_ptr + pos * stride_t + d, mask=d_ok, other=0.0)
        sin = tl.load(table_ptr + pos * stride_t + HALF + d, mask=d_ok, other=0.0)
        if j < q_blocks:
            h = j * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = (h < H)[:, None] & d_ok[None, :] & live
            src = q_ptr + b * stride_qb + i * stride_qn + h[:, None] * stride_qh + d[None, :]
            lo, hi = _rotate(src, mask, cos, sin, HALF)
            dst = q_out_ptr + (token * H + h[:, None]) * (2 * HALF) + d[None, :]
            tl.store(dst, lo, mask=mask)
            tl.store(dst + HALF, hi, mask=mask)
        else:  # names apart from the q branch's: Triton wants one type per name across branches
            slot = tl.load(slot_ptr + b * stride_sb + i * stride_sn, mask=live,
                           other=-1).to(tl.int64)
            kv_h = (j - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
            kv_mask = (kv_h < Hkv)[:, None] & d_ok[None, :] & (slot >= 0)
            k_src = k_ptr + b * stride_kb + i * stride_kn + kv_h[:, None] * stride_kh \
                + d[None, :]
            k_lo, k_hi = _rotate(k_src, kv_mask, cos, sin, HALF)
            row = slot * stride_cs + kv_h[:, None] * stride_ch + d[None, :]
            k_dtype = k_cache_ptr.dtype.element_ty
            tl.store(k_cache_ptr + row, k_lo.to(k_dtype), mask=kv_mask)
            tl.store(k_cache_ptr + row + HALF, k_hi.to(k_dtype), mask=kv_mask)
            v_src = v_ptr + b * stride_vb + i * stride_vn + kv_h[:, None] * stride_vh \
                + d[None, :]
            v_lo = tl.load(v_src, mask=kv_mask)
            v_hi = tl.load(v_src + HALF, mask=kv_mask)
            v_dtype = v_cache_ptr.dtype.element_ty
            tl.store(v_cache_ptr + row, v_lo.to(v_dtype), mask=kv_mask)
            tl.store(v_cache_ptr + row + HALF, v_hi.to(v_dtype), mask=kv_mask)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, table: torch.Tensor, positions: torch.Tensor,
               slot_mapping: torch.Tensor, tokens_per_program: int | None = None,
               ) -> torch.Tensor:
    """q [B, n, H, D], k, v [B, n, Hkv, D], table [max_pos, D] float32 (cos | sin), positions
    [B, n] -> rotated q [B, n, H, D] (contiguous); rotated k and v -> k_cache, v_cache
    [num_slots, Hkv, D] at rows slot_mapping [B, n] (negative: skipped)."""
    assert q.dim() == 4 and k.dim() == 4 and k.shape == v.shape
    bsz, n, heads, dim = q.shape
    hkv = k.shape[2]
    assert k.shape[:2] == (bsz, n) and k.shape[3] == dim and dim % 2 == 0
    assert q.dtype == k.dtype and k_cache.shape == v_cache.shape
    assert k_cache.dim() == 3 and k_cache.shape[1:] == (hkv, dim)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert table.dtype == torch.float32 and table.dim() == 2 and table.shape[1] == dim
    assert table.stride(-1) == 1
    assert positions.shape == (bsz, n) and not positions.is_floating_point()
    assert slot_mapping.shape == (bsz, n) and not slot_mapping.is_floating_point()
    assert q.device == k_cache.device == table.device == positions.device == slot_mapping.device
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if bsz * n == 0:
        return q_out
    block_h = min(triton.next_power_of_2(max(heads, hkv)), 16)
    q_blocks = triton.cdiv(heads, block_h)
    # A prefill's thousands of tokens: 8 per program (few, fuller programs); a decode step's
    # few: one each (more programs in flight).
    block_t = tokens_per_program or (8 if bsz * n >= 4096 else 1)
    grid = (triton.cdiv(bsz * n, block_t), q_blocks + triton.cdiv(hkv, block_h))
    _rope_store_kernel[grid](
        q, k, v, q_out, k_cache, v_cache, table, positions, slot_mapping, n, bsz * n, heads,
        hkv,
        q_blocks, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), positions.stride(0), positions.stride(1),
        slot_mapping.stride(0), slot_mapping.stride(1), table.stride(0), k_cache.stride(0),
        k_cache.stride(1), HALF=dim // 2, BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(dim // 2), BLOCK_T=block_t, num_warps=4,
        enable_fp_fusion=False)
    return q_out
