"""MXFP4 weights as gpt-oss checkpoints ship their experts (the OCP microscaling format):
a tensor `X` is stored as `X_blocks` [..., rows, G, 16] uint8, two e2m1 values a byte (the
low nibble first), and `X_scales` [..., rows, G] uint8, one power-of-two exponent (biased by
127) per block of 32 values. `dequantize` (`quant.mxfp4_dequantize`) gives the values
[..., rows, 32 G]; a stored expert tensor's rows are its outputs, so the checkpoint's own
layout ([E, in, out], as transformers saves `gate_up_proj` and `down_proj`) is that
transposed (`expert_tensor`).
Every value is an e2m1 number times a power of two, exact in bfloat16."""

from __future__ import annotations

import torch

from vegas_spec.quant import mxfp4_dequantize as dequantize

BLOCKS, SCALES = "_blocks", "_scales"
__all__ = ["BLOCKS", "SCALES", "dequantize", "expert_tensor", "quantized_names"]


def expert_tensor(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An expert stack's blocks [E, out, G, 16] and scales [E, out, G] -> the tensor the
    checkpoint stands for, [E, in = 32 G, out] bfloat16."""
    return dequantize(blocks, scales).transpose(1, 2).contiguous()


def quantized_names(names: list[str]) -> list[str]:
    """The tensors `X` a checkpoint stores as `X_blocks` (and, if whole, `X_scales`)."""
    return [n[: -len(BLOCKS)] for n in names if n.endswith(BLOCKS)]
