"""Plain-PyTorch references of the per-token steps around attention: RMSNorm (with the
residual add before it), SiLU * up, RoPE, and the row-invariant projection of exact mode.

They are the model's and the attention seam's default implementations and the oracles of
the fused kernels; kept apart from both so that `models` and `attention` need not import
each other. Imports only `torch`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers: normalise in float32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual -> (rms_norm(h), h): the residual add before a norm."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> silu(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def exact_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul` with each element's bits independent of the tensor's size (exact mode).

    torch's elementwise exp (in F.silu) runs vectorised over the bulk of each thread's range
    and as a scalar function on its tail, which may round differently, so the path an element
    takes depends on the tensor's size and the thread count. A softmax over a last axis of
    two, [g, 0], is sigmoid(g) computed by the same per-row vectorised code for every
    element. Products and casts are correctly rounded on either path."""
    gate, up = gate_up.chunk(2, dim=-1)
    g = gate.float()
    sigmoid = torch.softmax(torch.stack([g, torch.zeros_like(g)], dim=-1), dim=-1)[..., 0]
    return (g * sigmoid).to(gate.dtype) * up


def apply_rope(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [B, n, heads, D], positions [B, n] -> rotated x (rotate-half convention); table
    [max_pos, D] float32 holds cos in the first half of the last axis, sin in the second."""
    half = x.shape[-1] // 2
    cs = table[positions][:, :, None, :].to(x.dtype)  # [B, n, 1, D]
    cos, sin = cs[..., :half].repeat(1, 1, 1, 2), cs[..., half:].repeat(1, 1, 1, 2)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# Rows per call of the row-invariant projection: every call has this many rows.
EXACT_ROWS = 16


def exact_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N], each row's bits independent of
    the number of rows (the CPU path of exact mode; `kernels.exact_matmul` on a GPU).

    A BLAS chooses its kernel, blocking, threading and split of the reduction from the shape,
    so `F.linear` on 1 row and on 448 rows may sum a row's K products in different orders.
    Here the rows are padded with zeros to a multiple of EXACT_ROWS and every block of
    EXACT_ROWS rows is one `F.linear` call of the same shape [EXACT_ROWS, K]: one shape, one
    kernel and one order of summation, in which a row's result depends only on that row (a
    GEMM's inner loop runs over K the same way for every row of the block)."""
    flat = x.reshape(-1, x.shape[-1])
    m, n = flat.shape[0], weight.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    pad = -m % EXACT_ROWS
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    out = torch.cat([F.linear(block, weight, bias) for block in flat.split(EXACT_ROWS)])
    return out[:m].view(*x.shape[:-1], n)
