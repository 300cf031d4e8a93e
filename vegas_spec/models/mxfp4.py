"""MXFP4 weights as gpt-oss checkpoints ship their experts (the OCP microscaling format):
a tensor `X` is stored as `X_blocks` [..., rows, G, 16] uint8, two e2m1 values a byte (the
low nibble first), and `X_scales` [..., rows, G] uint8, one power-of-two exponent (biased by
127) per block of 32 values. `dequantize` gives the values [..., rows, 32 G]; a stored
expert tensor's rows are its outputs, so the checkpoint's own layout ([E, in, out], as
transformers saves `gate_up_proj` and `down_proj`) is that transposed (`expert_tensor`).
Every value is an e2m1 number times a power of two, exact in bfloat16."""

from __future__ import annotations

import torch

BLOCKS, SCALES = "_blocks", "_scales"
# e2m1 codes 0..15: sign bit 3, then exponent and mantissa
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
VALUES_PER_BYTE, BLOCK = 2, 32


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., 32 G] in dtype."""
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] * VALUES_PER_BYTE == BLOCK
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., G, 32]
    exponent = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponent[..., None].float())
    return values.flatten(-2).to(dtype)


def expert_tensor(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An expert stack's blocks [E, out, G, 16] and scales [E, out, G] -> the tensor the
    checkpoint stands for, [E, in = 32 G, out] bfloat16."""
    return dequantize(blocks, scales).transpose(1, 2).contiguous()


def quantized_names(names: list[str]) -> list[str]:
    """The tensors `X` a checkpoint stores as `X_blocks` (and, if whole, `X_scales`)."""
    return [n[: -len(BLOCKS)] for n in names if n.endswith(BLOCKS)]
