"""Draft weights in FP8: a copy of each projection's weight in float8 e4m3 with one float32
scale per output channel, read by draft steps only.

A draft never reaches the output (every drafted token is verified by the model's own weights
in full precision), so drafting with a lower-precision copy is lossless by construction:
greedy output stays plain decoding's token for token, and sampled output keeps its
distribution because rejection sampling reads the distribution the FP8 drafts were drawn
from. Only how many drafts are accepted can move. At few rows a draft step streams every
weight once, so one byte a weight instead of two halves what the projections read.

Scales are computed at load from the model's own weights: per output row, its largest
magnitude over 448 (e4m3's largest finite value), so each row uses the format's whole range.

Oracle of the kernel (`kernels.skinny_matmul` with an `Fp8Weight`): `fp8_linear_ref`, the
product of x with the e4m3 values (exact in any wider float) accumulated in float32, then
scaled per column."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
DRAFT_WEIGHTS = ("auto", "fp8", "model")


@dataclass
class Fp8Weight:
    """data [N, K] float8_e4m3fn (nn.Linear's layout), scale [N] float32: the weight is
    data * scale[:, None]."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.data.float() * self.scale[:, None]).to(dtype)


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """weight [N, K] (any float dtype) -> its FP8 copy, one scale per output row."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    data = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(data.contiguous(), scale.contiguous())


def fp8_linear_ref(x: torch.Tensor, weight: Fp8Weight,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (data * scale)^T (+ bias) -> [..., N] in x's dtype: the e4m3 values times
    x in float32, scaled per column after the sum (the kernel's order)."""
    out = torch.matmul(x.float(), weight.data.float().t()) * weight.scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor-core conversions: CUDA devices of compute capability 8.9 and up."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
