"""SiLU(gate) * up of the fused gate/up projection, as torch computes `F.silu(gate) * up`.

Oracle: `vegas_spec.ops.silu_mul`. Program (row, j) reads columns j*BLOCK.. of the
gate half and the up half of one row of gate_up [..., 2I]. silu(g) = g / (1 + exp(-g)) is
taken in float32 with a correctly rounded division and rounded to the dtype, then multiplied
by up in float32 and rounded again: torch's two kernels, one rounding each. exp is the CUDA
math library's expf, as torch's kernel calls it (numpy's exp under the interpreter)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from vegas_spec.kernels import interpreting


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, LIBDEVICE_EXP: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + e).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (silu * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (last dim contiguous) -> silu(gate) * up [..., I], contiguous."""
    assert gate_up.dim() >= 1 and gate_up.stride(-1) == 1 and gate_up.shape[-1] % 2 == 0
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    rows = gate_up.reshape(-1, 2 * inter)
    block = min(triton.next_power_of_2(inter), 2048)
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out, inter, rows.stride(0), LIBDEVICE_EXP=not interpreting(), BLOCK=block,
        num_warps=4)
    return out
