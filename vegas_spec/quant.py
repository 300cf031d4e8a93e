"""Weights in fewer bits: the draft copies (FP8, INT8, INT4) and MXFP4 expert stacks.

Draft weights: a copy of each projection's weight read by draft steps only: float8 e4m3 with
one float32 scale per output channel, or 8-bit or 4-bit integers with one float32 scale per
group of consecutive input channels of each output channel (128, or the first of 64 and 32
that divides K).

A draft never reaches the output (every drafted token is verified by the model's own weights
in full precision), so drafting with a lower-precision copy is lossless by construction:
greedy output stays plain decoding's token for token, and sampled output keeps its
distribution because rejection sampling reads the distribution the drafts were drawn
from. Only how many drafts are accepted can move. At few rows a draft step streams every
weight once, so one byte a weight instead of two halves what the projections read.

Scales are computed at load from the model's own weights: the largest magnitude of a row (FP8)
or of a row's group (INT8, INT4) over the format's largest value (448 for e4m3, 127 for INT8,
7 for INT4), so each uses the format's whole range. The one-byte formats differ in where their
error lies: e4m3 keeps 3 mantissa bits whatever a weight's size (a relative error up to 1/16),
INT8 a uniform step of its group's largest magnitude over 127, finer for all but a group's
smallest weights. On SmolLM2, INT8 copies with a scale a group keep every policy's accepted
tokens within 2% of the model's weights, where a scale a row lost up to 4.7% and e4m3 copies
lose 7-10% (BENCHMARKS.md §1.2); the group scales add 4 bytes per 128 weights (3%).

Oracles of the kernel (`kernels.skinny_matmul`): `row_scaled_linear_ref` (a `RowScaledWeight`:
the product of x with the stored values, exact in any wider float, accumulated in float32,
then scaled per column) and `GroupScaledWeight.ref` (the product with the dequantised
weight)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
INT8_MAX = 127.0  # INT8 copies store -127..127
SCALE_GROUPS = (128, 64, 32)  # INT8 and INT4 group sizes: the first that divides K


@dataclass
class RowScaledWeight:
    """data [N, K], one byte a weight (nn.Linear's layout), scale [N] float32: the weight is
    data * scale[:, None]. `Fp8Weight` says what the bytes are."""

    data: torch.Tensor
    scale: torch.Tensor
    kept: dict = field(default_factory=dict, repr=False, compare=False)  # `on_cpu_once`

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def values(self) -> torch.Tensor:
        """The stored values [N, K] in float32 (exact)."""
        return on_cpu_once(self.kept, self.data, "values", lambda: self.data.float())

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.data.float() * self.scale[:, None]).to(dtype)

    def ref(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return row_scaled_linear_ref(x, self, bias)


@dataclass
class Fp8Weight(RowScaledWeight):
    """data [N, K] float8_e4m3fn, scale [N] float32 (`RowScaledWeight`)."""


def on_cpu_once(kept: dict, data: torch.Tensor, key: object,
                make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """make() -> a float copy of a draft weight for the references: on CPU made once and
    kept (a CPU draft step would otherwise convert every weight of the model again), on
    another device made at each call (kept, it would undo the copy's saving of memory)."""
    if data.device.type != "cpu":
        return make()
    if key not in kept:
        kept[key] = make()
    return kept[key]


def _group_scales(w: torch.Tensor, group: int, largest: float) -> torch.Tensor:
    """w [N, K] float32 -> [N, K / group]: each group's largest magnitude over `largest`."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"groups of {group} do not divide K = {k}")
    amax = w.reshape(n, k // group, group).abs().amax(dim=-1)
    return torch.where(amax > 0, amax / largest, torch.ones_like(amax))


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """weight [N, K] (any float dtype) -> its FP8 copy, one scale per output row."""
    w = weight.float()
    scale = _group_scales(w, w.shape[1], FP8_MAX)[:, 0]  # one group a row
    data = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(data.contiguous(), scale.contiguous())


def row_scaled_linear_ref(x: torch.Tensor, weight: RowScaledWeight,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (data * scale)^T (+ bias) -> [..., N] in x's dtype: the stored values
    times x in float32, scaled per column after the sum (the kernel's order)."""
    out = torch.matmul(x.float(), weight.values().t()) * weight.scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def scale_group(k: int) -> int:
    """The INT8 and INT4 group size for K input channels: the first of SCALE_GROUPS that
    divides K."""
    for group in SCALE_GROUPS:
        if k % group == 0:
            return group
    raise ValueError(f"INT8 and INT4 draft weights need K divisible by {SCALE_GROUPS[-1]}, "
                     f"not {k}")


@dataclass
class GroupScaledWeight:
    """Integers with scale [N, K/group] float32, one per row and group of `group` consecutive
    input channels: the weight is value * scale of its row and group. `values` gives the
    integers [N, K] as float32; `Int8Weight` and `Int4Weight` say how they are stored."""

    data: torch.Tensor
    scale: torch.Tensor
    group: int
    kept: dict = field(default_factory=dict, repr=False, compare=False)  # `on_cpu_once`

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.scale.shape[1] * self.group))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4

    def values(self) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.values() * self.scale.repeat_interleave(self.group, dim=1)).to(dtype)

    def ref_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype `ref` dequantises to for rows x."""
        raise NotImplementedError

    def ref(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ weight^T (+ bias) -> [..., N] in x's dtype: the weight dequantised to
        `ref_dtype`, the products summed in float32. The kernel scales each group's float32
        sum instead: both are the float64 product to x's rounding."""
        dtype = self.ref_dtype(x)
        w = on_cpu_once(self.kept, self.data, dtype, lambda: self.dequantize(dtype).float())
        out = torch.matmul(x.float(), w.t())
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)


@dataclass
class Int8Weight(GroupScaledWeight):
    """data [N, K] int8 in -127..127 (nn.Linear's layout), scale [N, K/group] float32 stored
    group by group (strides (1, N)): a kernel's columns of one group are contiguous."""

    def values(self) -> torch.Tensor:
        return self.data.float()

    def ref_dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.float32  # value * scale rounded to bfloat16 would lose INT8's precision


def quantize_int8(weight: torch.Tensor, group: int | None = None) -> Int8Weight:
    """weight [N, K] (any float dtype) -> its INT8 copy, one scale per row and group (by
    default `scale_group`'s, or one a row where no group of 32 divides K), the values rounded
    to the nearest step (-127..127: symmetric, so -x is stored as -v)."""
    w = weight.float()
    k = w.shape[1]
    group = group or (scale_group(k) if k % SCALE_GROUPS[-1] == 0 else k)
    if group != k and group not in SCALE_GROUPS:
        raise ValueError(f"INT8 groups of {group}: one of {SCALE_GROUPS}, or K = {k}")
    scale = _group_scales(w, group, INT8_MAX)
    steps = scale.repeat_interleave(group, dim=1)
    data = torch.round(w / steps).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(data.contiguous(), scale.t().contiguous().t(), group)


@dataclass
class Int4Weight(GroupScaledWeight):
    """data [N, K/2] uint8: two 4-bit values a byte, each value u in 0..15 standing for
    u - 8; a group's G = `group` consecutive input channels fill its G/2 bytes, byte i
    holding channel i of the group in the low nibble and channel i + G/2 in the high (so a
    kernel dots each nibble with a contiguous run of x); scale [N, K/group] float32."""

    def values(self) -> torch.Tensor:
        """The stored integers [N, K] in -8..7 (float32)."""
        n, half = self.data.shape[0], self.group // 2
        packed = self.data.view(n, -1, half)  # [N, groups, G/2]
        low = (packed & 15).float() - 8
        high = (packed >> 4).float() - 8
        return torch.cat([low, high], dim=-1).view(n, -1)

    def ref_dtype(self, x: torch.Tensor) -> torch.dtype:
        return x.dtype  # (u - 8) * scale: 4 bits times a scale, near x's rounding anyway


def quantize_int4(weight: torch.Tensor, group: int | None = None) -> Int4Weight:
    """weight [N, K] (any float dtype) -> its INT4 copy, one scale per row and group."""
    n, k = weight.shape
    group = group or scale_group(k)
    if k % group or group % 2:
        raise ValueError(f"INT4 groups of {group} do not divide K = {k}")
    w = weight.float()
    scale = _group_scales(w, group, 7)
    w = w.view(n, k // group, group)
    u = (torch.round(w / scale[..., None]).clamp(-8, 7) + 8).to(torch.uint8)
    data = (u[..., :group // 2] | (u[..., group // 2:] << 4)).view(n, k // 2)
    return Int4Weight(data.contiguous(), scale.contiguous(), group)


DraftWeight = RowScaledWeight | GroupScaledWeight
DRAFT_TYPES = (RowScaledWeight, GroupScaledWeight)
# Rows up to which a draft step reads the copy; a wider one reads the model's weights. At the
# 8B shape (H100) the draft step on FP8 copies took 0.76x / 0.78x the model-weight step's time
# at 32 rows (2K / 8K) and 0.69x at 8 and 16; 64 rows: not timed (docs/kernel-notes.md, draft
# weights).
DRAFT_COPY_ROWS = 32
QUANTIZERS = {"fp8": quantize_fp8, "int8": quantize_int8, "int4": quantize_int4}


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor-core conversions: CUDA devices of compute capability 8.9 and up."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# MXFP4, the OCP microscaling format gpt-oss checkpoints ship their experts in: two e2m1
# codes a byte (the low nibble first), one power-of-two scale byte per 32 values (2^(s - 127)).
# Every value is an e2m1 number times a power of two, exact in bfloat16.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 codes 0..15
MXFP4_SCALE_BIAS = 127
MXFP4_BLOCK = 32  # values a scale
MXFP4_MAX_SCALE = 240  # the largest scale byte `kernels.fused_moe` decodes
MXFP4_MIN_SCALE = 2  # the least (below it 0.5 x 2^(s - 127) is a bfloat16 subnormal)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., 32 G] in dtype."""
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert blocks.shape[:-1] == scales.shape and 2 * blocks.shape[-1] == MXFP4_BLOCK
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    exponent = scales.to(torch.int32) - MXFP4_SCALE_BIAS
    values = torch.ldexp(values.flatten(-2), exponent[..., None].float())  # [..., G, 32]
    return values.flatten(-2).to(dtype)


@dataclass(frozen=True)
class Mxfp4:
    """An expert stack [E, N, K] kept in MXFP4, rows by output (the fused MoE kernel reads it
    as stored, a quarter of bfloat16's bytes): blocks [E, N, K / 32, 16] and scales
    [E, N, K / 32], uint8, contiguous."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        assert self.blocks.dtype == torch.uint8 and self.scales.dtype == torch.uint8
        assert self.blocks.dim() == 4 and 2 * self.blocks.shape[3] == MXFP4_BLOCK
        assert self.blocks.shape[:3] == self.scales.shape
        assert self.blocks.is_contiguous() and self.scales.is_contiguous()

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, rows, groups = self.scales.shape
        return experts, rows, MXFP4_BLOCK * groups

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The stack [E, N, K] in dtype (`mxfp4_dequantize`)."""
        return mxfp4_dequantize(self.blocks, self.scales, dtype)


def random_mxfp4(experts: int, rows: int, cols: int, device: torch.device,
                 gen: torch.Generator) -> Mxfp4:
    """A stack [E, rows, cols] of random MXFP4 codes, scales 2^-7..2^-5 (weights about as
    large as 0.02-wide normal ones): timing runs' experts."""
    groups = cols // MXFP4_BLOCK
    blocks = torch.randint(0, 256, (experts, rows, groups, MXFP4_BLOCK // 2), generator=gen,
                           device=device, dtype=torch.uint8)
    scales = torch.randint(120, 123, (experts, rows, groups), generator=gen, device=device,
                           dtype=torch.uint8)
    return Mxfp4(blocks, scales)


MXFP4_MAGNITUDES = FP4_VALUES[:8]  # codes 0..7; 8..15 are their negatives


def mxfp4_exact(w: torch.Tensor) -> Mxfp4 | None:
    """An expert stack w [E, N, K] whose values are exactly MXFP4 (an MXFP4 checkpoint's,
    dequantised) -> that `Mxfp4`, whose `dequantize` gives w back bit for bit; None where a
    block of 32 is not e2m1 codes times one power of two within the kernel's scales (weights
    that never were MXFP4). A block's scale is the least that brings its largest magnitude
    to at most 6. Works one expert at a time, so the float32 temporaries stay small."""
    if w.dim() != 3 or w.shape[2] % MXFP4_BLOCK or not w.is_floating_point():
        return None
    table = torch.tensor(MXFP4_MAGNITUDES, dtype=torch.float32, device=w.device)
    blocks, scales = [], []
    for expert in w:
        v = expert.float().reshape(expert.shape[0], -1, MXFP4_BLOCK)  # [N, G, 32]
        top = v.abs().amax(-1)
        exp = torch.where(top > 0, torch.ceil(torch.log2(top / 6.0)), 0.0)  # all zero: 2^0
        scale = exp + MXFP4_SCALE_BIAS
        if bool(((scale < MXFP4_MIN_SCALE) | (scale > MXFP4_MAX_SCALE)).any()):
            return None
        mags = torch.ldexp(v.abs(), -exp[..., None])
        idx = torch.searchsorted(table, mags.contiguous()).clamp_(max=len(table) - 1)
        if not bool((table[idx] == mags).all()):
            return None
        codes = (idx | (torch.signbit(v).long() << 3)).to(torch.uint8)
        blocks.append(codes[..., 0::2] | (codes[..., 1::2] << 4))
        scales.append(scale.to(torch.uint8))
    return Mxfp4(torch.stack(blocks).contiguous(), torch.stack(scales).contiguous())
