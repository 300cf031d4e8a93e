"""A projection whose every output row is computed the same way whatever the number of rows:
y = x W^T (+ b) with one tile shape for every M and no split of the reduction.

Oracle: `torch.nn.functional.linear` (to rounding; the point of the kernel is not to match
it bit for bit but to match itself across row counts).

cuBLAS picks its algorithm, tile and split-K from the shape, so a row's sum over the hidden
size runs in a different order in a 1-row decode step, a 7-row verify step and a 448-row
batch, and the bf16 results can differ in the last bit. Here every program owns BLOCK_M rows
x BLOCK_N columns and walks the reduction in BLOCK_K steps from 0 to K, accumulating in
float32 on the tensor cores with the same instruction shape for every M (padding rows are
zeros that no one reads), so a row's bits depend on that row and the weights only.

Bytes: the weights are read once per BLOCK_M rows, as a cuBLAS GEMM would at M <= BLOCK_M;
past that the tile reuses them from L2. The column block follows the weight's N (never M),
so that a decode step's single row block still spreads over the SMs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vegas_spec.kernels import for_device


@dataclass(frozen=True)
class MatmulTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ExactMatmulTuning:
    """The tiles of `exact_tiles` on one device class: block_m x BLOCK_N x block_k, BLOCK_N
    the power of two between block_n_min and block_n_max that cuts N into about
    column_blocks programs, so that a step of few rows (one row block) still spreads its
    weight reads over the SMs without splitting K; `warps` and `stages` a program."""

    block_m: int
    block_k: int
    block_n_min: int
    block_n_max: int
    column_blocks: int
    warps: int
    stages: int


_SM90 = ExactMatmulTuning(block_m=64, block_k=64, block_n_min=32, block_n_max=128,
                          column_blocks=256, warps=4, stages=3)
# By device class (`kernels.device_class`). The interpreter, whose cost is per program and
# loop step: few rows (a decode step has few) and wide column and reduction blocks.
TUNING: dict[str, ExactMatmulTuning] = {
    "sm90": _SM90,
    "default": _SM90,
    "interpreter": ExactMatmulTuning(block_m=16, block_k=64, block_n_min=128, block_n_max=128,
                                     column_blocks=256, warps=1, stages=1),
}


def tuning(device: torch.device) -> ExactMatmulTuning:
    """The entry of `TUNING` that launches on `device` read."""
    return for_device(TUNING, device)


def exact_tiles(device: torch.device, n: int = 1 << 20) -> MatmulTiles:
    """One configuration for every row count (the invariance needs it): it may depend on the
    weight's N (a layer's own), never on M (`ExactMatmulTuning` of `device`)."""
    tiles = tuning(device)
    by_n = triton.next_power_of_2(triton.cdiv(n, tiles.column_blocks))
    block_n = min(tiles.block_n_max, max(tiles.block_n_min, by_n))
    return MatmulTiles(tiles.block_m, block_n, tiles.block_k, tiles.warps, tiles.stages)


# M stays a runtime value: Triton would otherwise compile M = 1 as a constant, another program
# for a one-row step than for a many-row one.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_row = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_row = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_row + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_row + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 tiles: MatmulTiles | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, each row the same
    bits whatever the number of rows."""
    assert weight.dim() == 2 and x.shape[-1] == weight.shape[1]
    assert weight.stride(-1) == 1 and x.dtype == weight.dtype and x.device == weight.device
    assert bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous())
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    cfg = tiles or exact_tiles(x.device, n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _matmul_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))](
            rows, weight, weight if bias is None else bias, out, m, n, k, rows.stride(0),
            weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.view(*x.shape[:-1], n)
