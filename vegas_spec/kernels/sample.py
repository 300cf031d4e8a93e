"""Sampling by the exponential trick with counter-based noise: argmax(p / E) over a row,
E = -log(u) with u hashed from (the row's key, the token index).

Oracle: `vegas_spec.sampling.exponential_argmax_ref`, whose integer hash this kernel repeats
bit for bit (on uint32 lanes, where the reference masks int64 products to 32 bits), so both draw the
same uniforms; only log may differ in its last bit. One program a row walks the vocabulary in
blocks of BLOCK tokens, keeping each lane's best ratio and its token, then reduces the lanes:
p is read once (4 bytes a token), where the reference's chain of elementwise ops moves tens
of bytes a token. With an index (`sampling.Candidates`) the row's weights are those of the
listed token ids, hashed by id, so a candidate row draws what its vocabulary-wide row would.
Ties go to the lowest token id in both."""

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
def _exponential_argmax_kernel(p_ptr, index_ptr, key_ptr, out_ptr, width, stride_p,
                               stride_index, INDEXED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    key = tl.load(key_ptr + row).to(tl.uint32)
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), -1.0, tl.float32)
    best_token = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, width, BLOCK):
        col = start + lanes.to(tl.int64)
        mask = col < width
        p = tl.load(p_ptr + row * stride_p + col, mask=mask, other=0.0)
        if INDEXED:  # candidates: the token ids of the weights
            token = tl.load(index_ptr + row * stride_index + col, mask=mask, other=0)
        else:
            token = col
        golden = tl.full((BLOCK,), 0x9E3779B9, tl.uint32)
        h = _mix32(key ^ _mix32(token.to(tl.uint32) + golden))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        ratio = tl.where(mask, p / -tl.log(u), -1.0)
        # a lane keeps the lowest token of a tie (in vocabulary order: its first)
        better = (ratio > best) | ((ratio == best) & (token < best_token))
        best = tl.where(better, ratio, best)
        best_token = tl.where(better, token, best_token)
    top = tl.max(best, 0)
    # The lowest token of the row's best ratio, as torch.argmax returns it over a row.
    first = tl.min(tl.where(best == top, best_token, 0x7FFFFFFFFFFFFFFF), 0)
    tl.store(out_ptr + row, first)


def exponential_argmax(p: torch.Tensor, keys: torch.Tensor,
                       index: torch.Tensor | None = None) -> torch.Tensor:
    """p [R, V] float32 weights (last dim contiguous), keys [R] int64 in [0, 2^32) ->
    tokens [R]; with index [R, W] int64, p [R, W] are the weights of those token ids."""
    assert p.dim() == 2 and p.dtype == torch.float32 and p.stride(-1) == 1, p.shape
    assert keys.shape == (p.shape[0],) and keys.dtype == torch.long
    assert index is None or (index.shape == p.shape and index.dtype == torch.long
                             and index.stride(-1) == 1)
    out = torch.empty(p.shape[0], dtype=torch.long, device=p.device)
    if p.shape[0] == 0:
        return out
    block = min(triton.next_power_of_2(p.shape[1]), 2048)
    _exponential_argmax_kernel[(p.shape[0],)](
        p, p if index is None else index, keys.contiguous(), out, p.shape[1], p.stride(0),
        0 if index is None else index.stride(0), INDEXED=index is not None, BLOCK=block,
        num_warps=8 if index is None else 2)
    return out
