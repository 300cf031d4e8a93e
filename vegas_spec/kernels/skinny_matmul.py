"""A projection of few rows (a decode, draft or verify step: M = 1..64) that streams its
weights at the copy bandwidth: y = x W^T (+ b), x [M, K] and W [N, K] row-major (nn.Linear's
layout), float32 accumulation, y in x's dtype.

Oracle: `skinny_linear_ref` (`torch.nn.functional.linear`), to rounding; of the fused
prologues `skinny_norm_linear` and `skinny_silu_linear`: `vegas_spec.ops.norm_linear` and
`ops.silu_linear`.

Bytes: at M <= 64 the product is 2·M flops per weight element, far below what the tensor
cores do per byte, so the time floor is the weight bytes over the copy bandwidth
(N·K·itemsize / bandwidth: 50 MB of Llama-3.1-8B's qkv take 10.5 µs at 4.8 TB/s); x (M·K)
and y (M·N) are a few percent of that. Every weight byte is read once: program j owns
columns j·BLOCK_N.. for all M rows (BLOCK_M, the rows padded to a power of two >= 16, is the
whole step) and walks K in BLOCK_K steps, the W tile [BLOCK_N, BLOCK_K] (a contiguous run of
BLOCK_K elements per weight row) transposed into one `tl.dot` with the x tile, the loads
software-pipelined over `num_stages` buffers (asynchronous copies into shared memory) so that
enough bytes are in flight per SM. Every program also reads all of x, from L2: M/BLOCK_N
bytes per weight byte.

The grid is cdiv(N, BLOCK_N) programs. Where that is few against the SMs (N = 4096: 128
programs of 32 columns on an H200's 132 SMs), `split_k` programs share a column block, each
walking 1/split_k of K, and write float32 partials [split_k, M, N] that a second small kernel
sums in a fixed order (plus bias, cast): 2·split_k·M·N·4 more bytes, mostly in L2."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from vegas_spec.kernels import interpreting

# Rows the kernel takes at most (one row block); callers fall back to F.linear beyond.
MAX_ROWS = 64
# Streaming multiprocessors of an H200, for the default tiles' occupancy guess.
GPU_SMS = 132
# Column blocks the default tiles aim for (about two programs per SM).
COLUMN_PROGRAMS = 256
# Elements per program of the split-K sum.
SUM_BLOCK = 1024


@dataclass(frozen=True)
class SkinnyTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1

    def __post_init__(self) -> None:
        for size in (self.block_n, self.block_k):
            assert size >= 16 and size & (size - 1) == 0, "blocks: powers of two >= 16"
        assert self.num_warps > 0 and self.num_stages > 0 and self.split_k > 0


def block_rows(m: int) -> int:
    """BLOCK_M: the rows padded to a power of two, at least 16 (the smallest dot tile); more
    than MAX_ROWS rows are a ValueError."""
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, not {m}")
    return max(16, triton.next_power_of_2(m))


def skinny_tiles(m: int, n: int, k: int) -> SkinnyTiles:
    """Default tiles for M rows of an [N, K] weight (guesses, to be replaced by measured ones):
    64 columns a program where N still gives COLUMN_PROGRAMS programs, else 32; 256-element
    K steps up to 32 rows, 128 at 64 (the shared memory of 4 stages of x and W tiles stays
    under 200 KB); two splits of K where the column blocks are fewer than the SMs."""
    block_n = 64 if triton.cdiv(n, 64) >= COLUMN_PROGRAMS else 32
    block_k = 256 if block_rows(m) <= 32 else 128
    split_k = 2 if triton.cdiv(n, block_n) < GPU_SMS and k >= 4 * block_k else 1
    return SkinnyTiles(block_n, block_k, num_warps=4, num_stages=4, split_k=split_k)


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, g_ptr, h_ptr, M, N, K, k_split, inv_k,
                   eps, stride_xm, stride_rm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, PROLOGUE: tl.constexpr,
                   HAS_RESIDUAL: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Program (j, s): rows 0..M-1 x columns j*BLOCK_N.. over K range s*k_split.. (all of K
    when SPLIT_K is 1). With SPLIT_K > 1, y is the float32 partials [SPLIT_K, M, N] and the
    bias waits for the sum. PROLOGUE (the x tile before the product, see `_prologue`):
    0 x as it is, NORM rms_norm(x (+ r)) * g (SPLIT_K 1), SILU silu(gate) * up of x =
    gate_up [M, 2K]."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_row = x_ptr + rm[:, None] * stride_xm
    w_row = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    k_lo = tl.program_id(1) * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    squares = tl.zeros([BLOCK_M], tl.float32)
    # the first column block writes h = x + r, which every program forms for its product
    writes_h = tl.program_id(0) == 0
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + rk
        if EVEN_K:
            x_ok = m_ok[:, None]
            w = tl.load(w_row + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k < k_hi
            x_ok = m_ok[:, None] & k_ok[None, :]
            w = tl.load(w_row + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_row + k[None, :], mask=x_ok, other=0.0)
        if PROLOGUE == 1:
            if HAS_RESIDUAL:
                r = tl.load(r_ptr + rm[:, None] * stride_rm + k[None, :], mask=x_ok, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(w.dtype)
                if writes_h:
                    tl.store(h_ptr + rm[:, None] * K + k[None, :], x, mask=x_ok)
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
            g = tl.load(g_ptr + k, mask=k < k_hi, other=0.0).to(tl.float32)
            x = (xf * g[None, :]).to(w.dtype)
        elif PROLOGUE == 2:
            up = tl.load(x_row + K + k[None, :], mask=x_ok, other=0.0)
            x = _silu_times(x, up, LIBDEVICE_EXP)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if PROLOGUE == 1:
        # rms_norm's 1/rms is a factor per row: applied to the product, after the sum over K
        acc = acc * tl.math.rsqrt(squares * inv_k + eps)[:, None]
    if HAS_BIAS and SPLIT_K == 1:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_block = y_ptr + tl.program_id(1).to(tl.int64) * M * stride_ym
    tl.store(y_block + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _silu_times(gate, up, LIBDEVICE_EXP: tl.constexpr):
    """silu(gate) * up rounded as `silu_mul` rounds it (its two roundings, its exp)."""
    g = gate.to(tl.float32)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    silu = tl.math.div_rn(g, 1.0 + e).to(gate.dtype).to(tl.float32)
    return (silu * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _sum_splits_kernel(p_ptr, b_ptr, y_ptr, MN, N, HAS_BIAS: tl.constexpr,
                       SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y [M, N] = sum over s of partials [s, M, N] in order s = 0, 1, .. (+ bias), x's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


PLAIN, NORM, SILU = 0, 1, 2  # the kernel's prologues


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, for at most
    MAX_ROWS rows in all (a ValueError beyond: callers take F.linear there). `tiles`: by
    default `skinny_tiles` of the shape."""
    return _run(x, weight, bias, tiles, PLAIN)


def skinny_norm_linear(x: torch.Tensor, residual: torch.Tensor | None,
                       norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, *, tiles: SkinnyTiles | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm and the projection after it in one kernel: h = x + residual (x without one)
    -> (rms_norm(h) * norm_weight @ weight^T (+ bias), h), for at most MAX_ROWS rows.

    Each program forms h for the K tiles it walks (the first column block also stores it),
    takes the product of h * norm_weight and scales it by each row's 1/rms, summed from the
    same tiles, at the end: rms_norm's output is never stored, and its rounding differs from
    the two kernels' (rms_norm then skinny_linear) by that of a bfloat16 product. The split
    of K is off (the 1/rms needs the whole row)."""
    assert norm_weight.shape == (x.shape[-1],) and norm_weight.is_contiguous()
    assert norm_weight.dtype == x.dtype
    cfg = dataclasses.replace(tiles or skinny_tiles(math.prod(x.shape[:-1]), weight.shape[0],
                                                    x.shape[-1]), split_k=1)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else x
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(-1) == 1
    y = _run(x, weight, bias, cfg, NORM, residual, norm_weight, h, eps)
    return y, h


def skinny_silu_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, *, tiles: SkinnyTiles | None = None,
                       ) -> torch.Tensor:
    """SiLU * up and the projection after it in one kernel: gate_up [..., 2I] ->
    (silu(gate) * up) @ weight [N, I]^T (+ bias), for at most MAX_ROWS rows. The product's
    operand is rounded as `silu_mul` rounds it, so only the product's summation order
    differs from the two kernels'."""
    assert gate_up.shape[-1] == 2 * weight.shape[1]
    return _run(gate_up, weight, bias, tiles, SILU)


def _run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         tiles: SkinnyTiles | None, prologue: int, residual: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, h: torch.Tensor | None = None,
         eps: float = 0.0) -> torch.Tensor:
    """The kernel launch: x [..., K] (SILU: [..., 2K]) -> [..., N]."""
    assert weight.dim() == 2 and weight.stride(-1) == 1
    assert x.dtype == weight.dtype and x.device == weight.device
    assert bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous())
    (n, k) = weight.shape
    assert x.shape[-1] == (2 * k if prologue == SILU else k)
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    block_m = block_rows(m)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    res = None if residual is None else residual.reshape(-1, k)
    if h is not None and h is not x:
        assert h.is_contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    cfg = tiles or skinny_tiles(m, n, k)
    # K per split, a whole number of K steps; trailing splits may be empty (they write zeros).
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    partials = out if cfg.split_k == 1 else torch.empty(cfg.split_k, m, n, dtype=torch.float32,
                                                        device=x.device)
    b = weight if bias is None else bias
    _skinny_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        rows, weight, b, partials, rows if res is None else res,
        weight if norm_weight is None else norm_weight, rows if h is None else h,
        m, n, k, k_split, 1.0 / k, eps, rows.stride(0),
        rows.stride(0) if res is None else res.stride(0), weight.stride(0), n,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, EVEN_K=k % cfg.block_k == 0, PROLOGUE=prologue,
        HAS_RESIDUAL=res is not None, LIBDEVICE_EXP=not interpreting(),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.split_k > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
            partials, b, out, m * n, n, HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k,
            BLOCK=SUM_BLOCK, num_warps=4)
    return out.view(*x.shape[:-1], n)


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: `F.linear`."""
    return F.linear(x, weight, bias)

