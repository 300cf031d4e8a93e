"""Warming L2 with the head of the next projection's weights, from a kernel that runs before it.

At a few rows a projection streams its weights from HBM, and the small kernels between two
projections (a norm, RoPE + store, the split merge, SiLU · up) leave the memory idle for a few
microseconds each, while each projection spends its first microseconds filling its pipeline.
Hopper's bulk prefetch (`cp.async.bulk.prefetch.L2.global`, fire and forget: nothing waits
for it) lets a program of the small kernel ask for the first `row_bytes` of each weight row,
the bytes every program of the projection reads first, so that they are in L2, or on their
way, when the projection starts.

`prefetch_rows` is called by extra programs of a kernel (it only issues requests); on a
machine without CUDA (the interpreter) it does nothing. There is no output to check: a
prefetch changes when bytes arrive, never what a kernel computes."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def prefetch_rows(base_ptr, rows, row_stride, row_bytes, program, programs,
                  BLOCK: tl.constexpr, ENABLED: tl.constexpr):
    """Program `program` of `programs` asks L2 for bytes [0, row_bytes) of its share of the
    `rows` rows starting at base_ptr (`row_stride` elements apart; row_bytes a multiple of 16,
    rows 16-byte aligned)."""
    if ENABLED:
        per = tl.cdiv(rows, programs)
        lo = program * per
        hi = tl.minimum(lo + per, rows)
        size = tl.full([BLOCK], row_bytes, tl.int32)
        for r0 in range(lo, hi, BLOCK):
            r = r0 + tl.arange(0, BLOCK)
            ptrs = base_ptr + tl.minimum(r, hi - 1).to(tl.int64) * row_stride
            tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(w_ptr, rows, row_stride, row_bytes, BLOCK: tl.constexpr,
                     ENABLED: tl.constexpr):
    prefetch_rows(w_ptr, rows, row_stride, row_bytes, tl.program_id(0), tl.num_programs(0),
                  BLOCK=BLOCK, ENABLED=ENABLED)


def prefetch_l2(weight, row_bytes: int, programs: int = 32) -> None:  # noqa: ANN001
    """Ask L2 for the first row_bytes of every row of weight [N, K] (row-major, on CUDA), as a
    kernel of its own (`prefetch_rows` is the same inside another kernel)."""
    assert weight.dim() == 2 and weight.stride(-1) == 1 and row_bytes % 16 == 0
    row_bytes = min(row_bytes, weight.shape[1] * weight.element_size())
    if row_bytes <= 0 or not weight.is_cuda:
        return
    _prefetch_kernel[(programs,)](weight, weight.shape[0], weight.stride(0), row_bytes,
                                  BLOCK=128, ENABLED=True, num_warps=4)
