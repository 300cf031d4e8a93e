"""Plain-PyTorch ops: the references of `vegas_spec.ops` (in exact mode their row-invariant
forms), the CPU path and the oracle of the Triton ops."""

from __future__ import annotations

import torch

from vegas_spec.compute.base import Ops
from vegas_spec.ops import (
    add_rms_norm,
    dense_linear,
    exact_linear,
    exact_silu_mul,
    moe_experts,
    rms_norm,
    silu_mul,
)
from vegas_spec.quant import DRAFT_TYPES, DraftWeight, Mxfp4


class TorchOps(Ops):
    """A draft copy runs its reference (correct, not fast); in exact mode the projections
    and the experts' products run `ops.exact_linear` (slow) and SiLU * up `exact_silu_mul`."""

    name = "torch"

    def linear(self, x: torch.Tensor, weight: torch.Tensor | DraftWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, DRAFT_TYPES):
            return weight.ref(x, bias)
        if self.exact:
            return exact_linear(x, weight, bias)
        return dense_linear(x, weight, bias)

    def experts(self, x: torch.Tensor, gate_up: torch.Tensor | Mxfp4,
                down: torch.Tensor | Mxfp4, weights: torch.Tensor, ids: torch.Tensor,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                limit: float = 0.0) -> torch.Tensor:
        """`ops.moe_experts`, in exact mode its row-invariant products; MXFP4 stacks
        dequantised first (correct, not fast)."""
        gate_up, down = (w.dequantize(x.dtype) if isinstance(w, Mxfp4) else w
                         for w in (gate_up, down))
        return moe_experts(x, gate_up, down, weights, ids, self.exact, gate_up_bias, down_bias,
                           limit)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return exact_silu_mul(gate_up) if self.exact else silu_mul(gate_up)
