"""RMSNorm, optionally fused with the residual add before it, as transformers computes it.

Oracle: `vegas_spec.ops.rms_norm` and `add_rms_norm`. One program per row of
x [..., N]. With a residual, h = x + residual is the float32 sum rounded to x's dtype (as torch
adds) and is written out as the next residual; the row of h (or x) is normalised in float32,
rounded to x's dtype, and scaled by the weight in that dtype (float32 product, rounded).

Every product and sum is rounded on its own (multiply-add fusion is off), as in torch's
separate kernels. The mean of squares is the only reduction: its float32 sum runs in the
kernel's order, so a row whose partial sums round differently from torch's may differ by one
ulp of the output. The mean itself is taken as torch takes it on the device: the sum divided
by N on the CPU, multiplied by float32(1 / N) on CUDA."""

from __future__ import annotations

from typing import overload

import torch
import triton
import triton.language as tl


@triton.jit
def _rstd(squares, inv_n, n, eps, MEAN_BY_RECIPROCAL: tl.constexpr):
    """1 / sqrt(mean + eps) from a row's float32 sum of squares over n elements: the mean by
    float32(1 / n) on CUDA (as torch takes it there), by n elsewhere."""
    if MEAN_BY_RECIPROCAL:
        mean = squares * inv_n
    else:
        mean = squares / n
    return tl.math.rsqrt(mean + eps)


@triton.jit
def _scaled_norm(x, rstd_x, w, dtype: tl.constexpr):
    """RMSNorm's output from float32 x, its rstd and the weight w (float32 values of dtype):
    x * rstd rounded to dtype, then times w rounded again (transformers' two steps)."""
    return (w * (x * rstd_x).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, inner, N, inv_n, eps,
                     stride_xo, stride_xi, stride_ro, stride_ri,
                     HAS_RESIDUAL: tl.constexpr, MEAN_BY_RECIPROCAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    outer, i = row // inner, row % inner
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + outer * stride_xo + i * stride_xi + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + outer * stride_ro + i * stride_ri + cols, mask=mask, other=0.0)
        h = (x + r.to(tl.float32)).to(dtype)
        tl.store(h_ptr + row * N + cols, h, mask=mask)
        x = h.to(tl.float32)
    row_rstd = _rstd(tl.sum(x * x, axis=0), inv_n, N, eps, MEAN_BY_RECIPROCAL)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, _scaled_norm(x, row_rstd, w, dtype), mask=mask)


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: None = None) -> torch.Tensor: ...


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] (rows contiguous, any strides above), weight [N] -> normed x, contiguous.

    With residual [..., N]: h = x + residual -> (normed h, h), both contiguous."""
    assert x.dim() >= 2 and x.stride(-1) == 1
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous() and weight.dtype == x.dtype
    assert x.device == weight.device
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = None if residual is None else torch.empty_like(out)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(-1) == 1 and residual.device == x.device
    if out.numel() == 0:
        return out if h is None else (out, h)
    rows = x.reshape(-1, x.shape[-2], n)  # [outer, inner, N]: a view for heads of a projection
    res = rows if residual is None else residual.reshape(rows.shape)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows.shape[0] * rows.shape[1],)](
        rows, res, weight, out, out if h is None else h, rows.shape[1], n, 1.0 / n, eps,
        rows.stride(0), rows.stride(1), res.stride(0), res.stride(1),
        HAS_RESIDUAL=residual is not None, MEAN_BY_RECIPROCAL=x.is_cuda, BLOCK=block,
        num_warps=min(max(block // 256, 1), 16), enable_fp_fusion=False)
    return out if h is None else (out, h)
