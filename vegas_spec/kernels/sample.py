"""Sampling by the exponential trick with counter-based noise: argmax(p / E) over a row,
E = -log(u) with u hashed from (the row's key, the token index).

Oracle: `vegas_spec.sampling.exponential_argmax_ref`, whose integer hash this kernel repeats
bit for bit (on uint32 lanes, where the reference masks int64 products to 32 bits), so both draw the
same uniforms; only log may differ in its last bit. One program a row walks the vocabulary in
blocks of BLOCK tokens, keeping each lane's best ratio and its token, then reduces the lanes:
p is read once (4 bytes a token), where the reference's chain of elementwise ops moves tens
of bytes a token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 lanes (products wrap modulo 2^32, shifts are logical)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _exponential_argmax_kernel(p_ptr, key_ptr, out_ptr, vocab, stride_p,
                               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    key = tl.load(key_ptr + row).to(tl.uint32)
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), -1.0, tl.float32)
    best_token = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, vocab, BLOCK):
        token = start + lanes.to(tl.int64)
        mask = token < vocab
        p = tl.load(p_ptr + row * stride_p + token, mask=mask, other=0.0)
        golden = tl.full((BLOCK,), 0x9E3779B9, tl.uint32)
        h = _mix32(key ^ _mix32(token.to(tl.uint32) + golden))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        ratio = tl.where(mask, p / -tl.log(u), -1.0)
        better = ratio > best  # strict: a lane keeps its first token of a tie
        best = tl.where(better, ratio, best)
        best_token = tl.where(better, token, best_token)
    top = tl.max(best, 0)
    # The first token of the row's best ratio, as torch.argmax returns it.
    first = tl.min(tl.where(best == top, best_token, vocab), 0)
    tl.store(out_ptr + row, first)


def exponential_argmax(p: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """p [R, V] float32 (last dim contiguous), keys [R] int64 in [0, 2^32) -> tokens [R]."""
    assert p.dim() == 2 and p.dtype == torch.float32 and p.stride(-1) == 1, p.shape
    assert keys.shape == (p.shape[0],) and keys.dtype == torch.long
    out = torch.empty(p.shape[0], dtype=torch.long, device=p.device)
    if p.shape[0] == 0:
        return out
    block = min(triton.next_power_of_2(p.shape[1]), 2048)
    _exponential_argmax_kernel[(p.shape[0],)](p, keys.contiguous(), out, p.shape[1],
                                              p.stride(0), BLOCK=block, num_warps=8)
    return out
