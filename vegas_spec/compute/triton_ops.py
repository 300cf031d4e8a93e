"""Triton ops: the same semantics as TorchOps (their oracle), each per-token step one fused
kernel of `vegas_spec.kernels` (add + RMSNorm, SiLU * up), a mixture of experts `route` and
`fused_moe`.
Runs on CUDA, or on CPU under Triton's interpreter (slow: tests only)."""

from __future__ import annotations

import torch

from vegas_spec.compute.base import Ops
from vegas_spec.kernels.exact_matmul import exact_linear
from vegas_spec.kernels.fused_moe import fused_moe
from vegas_spec.kernels.rms_norm import rms_norm
from vegas_spec.kernels.route import route as route_kernel
from vegas_spec.kernels.silu_mul import silu_mul
from vegas_spec.kernels.skinny_matmul import skinny_linear
from vegas_spec.ops import dense_linear
from vegas_spec.quant import DRAFT_TYPES, DraftWeight, Mxfp4


class TritonOps(Ops):
    """A draft step's FP8 or INT4 copy of a weight runs `skinny_linear` on a GPU (any rows,
    in chunks of MAX_DRAFT_ROWS), its reference elsewhere; other projections run cuBLAS in
    the default mode and `exact_linear` (one tiling for every row count) in exact mode, the
    LM head included. The per-token kernels work one row (or element) at a time, so they are
    row-invariant in both modes."""

    name = "triton"

    def linear(self, x: torch.Tensor, weight: torch.Tensor | DraftWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, DRAFT_TYPES):  # a draft copy: the FP8 or INT4 kernel on a GPU
            return skinny_linear(x, weight, bias) if x.is_cuda else weight.ref(x, bias)
        if self.exact:
            return exact_linear(x, weight, bias)
        return dense_linear(x, weight, bias)

    def experts(self, x: torch.Tensor, gate_up: torch.Tensor | Mxfp4,
                down: torch.Tensor | Mxfp4, weights: torch.Tensor, ids: torch.Tensor,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                limit: float = 0.0) -> torch.Tensor:
        """The fused kernel, gpt-oss's experts (biases, clamped SwiGLU) included; MXFP4
        stacks read as stored."""
        return fused_moe(x, gate_up, down, weights, ids, self.exact,
                         gate_up_bias=gate_up_bias, down_bias=down_bias, limit=limit)

    def route(self, logits: torch.Tensor, top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel a step (`kernels.route`; the softmax's five launches before)."""
        return route_kernel(logits.contiguous(), top_k, renormalize)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, weight, eps, residual)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)
