"""SiLU(gate) * up of the fused gate/up projection, as torch computes `F.silu(gate) * up`.

Oracle: `vegas_spec.ops.silu_mul`. Program (row, j) reads columns j*BLOCK.. (BLOCK: at most
BLOCK_COLUMNS) of the gate half and the up half of one row of gate_up [..., 2I].
silu(g) = g / (1 + exp(-g)) is taken in float32 with a correctly rounded division and
rounded to the dtype, then multiplied by up in float32 and rounded again: torch's two
kernels, one rounding each. exp is the CUDA math library's expf, as torch's kernel calls it
(numpy's exp under the interpreter).

`clamped_swiglu` (CLAMP, a constexpr: off, the kernel is SiLU * up alone) is gpt-oss's
activation, oracle `vegas_spec.ops.clamped_swiglu`: gate clamped to at most `limit`, up to
[-limit, limit], then (up + 1) * (gate * sigmoid(SWIGLU_ALPHA * gate)), each of torch's
steps rounded to the dtype where torch rounds it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from vegas_spec.kernels import interpreting

# gpt-oss's sigmoid slope (`vegas_spec.ops.SWIGLU_ALPHA`).
SWIGLU_ALPHA = 1.702
# Columns of a row a program computes (at most).
BLOCK_COLUMNS = 512


@triton.jit
def _exp(x, LIBDEVICE_EXP: tl.constexpr):
    if LIBDEVICE_EXP:
        e = libdevice.exp(x)
    else:
        e = tl.exp(x)
    return e


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """x (float32) rounded to dtype, back in float32: where torch stores a step's result."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _silu_times_up(gate, up, dtype: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    """SiLU(gate) * up of float32 gate and up (values of dtype), in float32: silu =
    gate / (1 + exp(-gate)) with a correctly rounded division, rounded to dtype, times up
    (torch's two kernels; the caller rounds the product)."""
    return _rounded(tl.math.div_rn(gate, 1.0 + _exp(-gate, LIBDEVICE_EXP)), dtype) * up


@triton.jit
def _clamped_swiglu(gate, up, limit, alpha, dtype: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    """gpt-oss's activation of float32 gate and up (values of dtype), as torch computes
    `ops.clamped_swiglu`: z = gate * alpha, sigmoid(z) = 1 / (1 + exp(-z)), gate * sigmoid,
    up + 1 and the product, each rounded to dtype."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    z = _rounded(gate * alpha, dtype)
    sigmoid = _rounded(tl.math.div_rn(1.0, 1.0 + _exp(-z, LIBDEVICE_EXP)), dtype)
    glu = _rounded(gate * sigmoid, dtype)
    return _rounded(up + 1.0, dtype) * glu


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, limit, alpha, LIBDEVICE_EXP: tl.constexpr,
                     CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        out = _clamped_swiglu(gate, up, limit, alpha, dtype, LIBDEVICE_EXP)
    else:
        out = _silu_times_up(gate, up, dtype, LIBDEVICE_EXP)
    tl.store(out_ptr + row * inter + cols, out.to(dtype), mask=mask)


def _launch(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate_up [..., 2I] (last dim contiguous) -> the activation [..., I], contiguous: SiLU
    * up, or the clamped SwiGLU where limit > 0."""
    assert gate_up.dim() >= 1 and gate_up.stride(-1) == 1 and gate_up.shape[-1] % 2 == 0
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    rows = gate_up.reshape(-1, 2 * inter)
    # 512 columns a program: a decode step's few rows still spread over many SMs (at 2048
    # columns a program, 32 rows of SmolLM2's 1,536 ran on 32 SMs, 16 values a thread).
    block = min(triton.next_power_of_2(inter), BLOCK_COLUMNS)
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out, inter, rows.stride(0), float(limit), SWIGLU_ALPHA,
        LIBDEVICE_EXP=not interpreting(), CLAMP=limit > 0, BLOCK=block, num_warps=4)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (last dim contiguous) -> silu(gate) * up [..., I], contiguous."""
    return _launch(gate_up, 0.0)


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate_up [..., 2I] (last dim contiguous) -> gpt-oss's clamped SwiGLU [..., I]
    (`ops.clamped_swiglu`), limit > 0."""
    assert limit > 0
    return _launch(gate_up, limit)
