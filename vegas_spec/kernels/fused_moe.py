"""A mixture of experts in two grouped matmuls, the tokens grouped by expert: every program
computes a block of one expert's (token, slot) pairs and streams that expert's weights once
for them, so a step reads the weights of the experts it hits and no others.

Oracle: `vegas_spec.ops.moe_experts` (to rounding).

Grouping (`group_by_expert`, plain PyTorch of fixed shapes with no read of the routing on the
host, so a decode step can be captured in a CUDA graph): the P = T·k pairs are sorted by
expert (stably), and each expert's run is padded to whole blocks of BLOCK_M rows. At most
min(P, cdiv(P, BLOCK_M) + min(E, P) - 1) blocks are used (each used block holds a pair, and
an expert's last block wastes fewer than BLOCK_M rows), a bound set by the shapes alone: the
launch has that many row blocks, and a block past the last used one (expert -1) reads and
writes nothing. A padding row is pair P, which no program loads or stores.

Then, as vLLM's fused_moe: (1) pair p's gate/up row, x[p // k] @ gate_up[e]^T, into a
[P, 2I] buffer; (2) SiLU(gate) * up (`silu_mul`); (3) pair p's down row times its routing
weight, into [P, H]; (4) each token's k rows summed in slot order. gpt-oss's experts add a
bias per expert to (1) and (3) (inside the matmul kernel, before its rounding: HAS_BIAS) and
take the clamped SwiGLU at (2) (`silu_mul.clamped_swiglu`). Every product is rounded
to x's dtype where transformers rounds it. The tiles depend on P in the default mode only:
in exact mode (`exact=True`) one tiling for every P, and a row's sum over K walks the same
blocks in the same order wherever its pair lands, so a token's output does not depend on the
other tokens of the step (the premise of `exact_matmul`: the dot computes rows alike).

Experts in MXFP4 (`Mxfp4`, gpt-oss checkpoints' format: two e2m1 values a byte, a
power-of-two scale per 32) are read as stored, a quarter of bfloat16's bytes, and decoded in
registers. With bfloat16 rows on a GPU, Triton's scaled dot (`tl.dot_scaled`) takes the
codes and scales: it decodes them to the bfloat16 values of the dequantised weights and
dots those (the same products, summed in its own order: to rounding). Elsewhere (float32 or
float16 rows, the interpreter) each nibble's bits are placed in a float16 (sign, then
exponent and mantissa: the e2m1 value times 2^-14, subnormal for 0.5, exact), widened to
float32 and times 2^(scale - 113), then rounded to x's dtype as the dequantised weights are
(exactly, in bfloat16 and float32): the products of the dequantised weights
(`quant.mxfp4_dequantize`, the oracle) summed in the same order, bit for bit. Scales
outside `quant.MXFP4_MIN_SCALE`..`MXFP4_MAX_SCALE` are not decoded (the scaled dot flushes
bfloat16 subnormals; 2^113 and up overflow the float16 placement): the engine's stacks come
from `quant.mxfp4_exact`, which refuses them at load."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vegas_spec.kernels import for_device, interpreting
from vegas_spec.kernels.exact_matmul import MatmulTiles
from vegas_spec.kernels.silu_mul import clamped_swiglu, silu_mul
from vegas_spec.quant import MXFP4_BLOCK, Mxfp4


@dataclass(frozen=True)
class MoeTuning:
    """The tiles of both grouped matmuls on one device class: `few` where an expert has at
    most `small_block_pairs` pairs on average (decode steps), and for every step in exact
    mode, whose tiles must not follow P (`few_fp4` in their place where a stack is MXFP4);
    `many` otherwise."""

    few: MatmulTiles
    many: MatmulTiles
    small_block_pairs: int
    fp4_dot: int = 0  # MXFP4 stacks: `_expert_matmul_kernel`'s FP4_DOT (1: bfloat16 rows only)
    few_fp4: MatmulTiles | None = None


# sm_90, few: 128-key blocks, measured best or within 2% of the best of eleven settings at 1,
# 16 and 112 tokens of both models' expert shapes (H100; docs/kernel-notes.md); many: a guess.
# MXFP4 experts: Triton's scaled dot, 1.2-1.4x faster than the decode and dot at 1-112 tokens
# (a transposed scaled dot was slower than both), in 256-key blocks of one stage: best of seven
# settings in 4 of 6 cells (both models at 1, 16 and 112 tokens), within 5% in the others
# (H100, docs/kernel-notes.md).
_SM90 = MoeTuning(few=MatmulTiles(16, 64, 128, 4, 3), many=MatmulTiles(64, 64, 64, 4, 3),
                  small_block_pairs=16, fp4_dot=1, few_fp4=MatmulTiles(16, 64, 256, 4, 1))
# By device class (`kernels.device_class`). The interpreter, whose cost is per program and
# loop step: small row blocks, wide column and reduction blocks, whatever the step.
_INTERPRETER_TILES = MatmulTiles(16, 64, 64, 1, 1)
TUNING: dict[str, MoeTuning] = {
    "sm90": _SM90,
    "default": _SM90,
    "interpreter": MoeTuning(few=_INTERPRETER_TILES, many=_INTERPRETER_TILES,
                             small_block_pairs=16),
}


def tuning(device: torch.device) -> MoeTuning:
    """The entry of `TUNING` that launches on `device` read."""
    return for_device(TUNING, device)


def moe_tiles(device: torch.device, pairs: int, experts: int, exact: bool,
              fp4: bool = False) -> MatmulTiles:
    """The tiles of a launch of `pairs` pairs over `experts` experts on `device` (its
    `MoeTuning`, read at every launch); `fp4`: a stack is MXFP4."""
    tiles = tuning(device)
    if not (exact or pairs <= tiles.small_block_pairs * experts):
        return tiles.many
    return tiles.few_fp4 if fp4 and tiles.few_fp4 is not None else tiles.few


def max_blocks(pairs: int, experts: int, block_m: int) -> int:
    """The most blocks of block_m rows that `pairs` pairs over `experts` experts fill."""
    return min(pairs, triton.cdiv(pairs, block_m) + min(experts, pairs) - 1)


# Pairs a step groups in one program (`_group_kernel`); more go through the PyTorch ops.
MAX_GROUP_PAIRS = 1024


def group_by_expert(ids: torch.Tensor, experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] expert ids -> (pair_of [NB * block_m] int32: the pair each block row computes,
    P for padding; expert_of [NB] int32: each block's expert, -1 past the last used block),
    NB = `max_blocks`. Fixed shapes, no host sync. Up to MAX_GROUP_PAIRS pairs (a decode
    step's) in one launch (`_group_kernel`), else `group_by_expert_ref`'s PyTorch ops (two
    dozen launches, a prefill's few)."""
    pairs = ids.numel()
    if pairs > MAX_GROUP_PAIRS or pairs == 0:
        return group_by_expert_ref(ids, experts, block_m)
    nb = max_blocks(pairs, experts, block_m)
    flat = ids.reshape(-1).contiguous()  # a [T, 1] slice views as a strided row
    pair_of = torch.empty(nb * block_m, dtype=torch.int32, device=ids.device)
    expert_of = torch.empty(nb, dtype=torch.int32, device=ids.device)
    block_p = max(16, triton.next_power_of_2(pairs))
    _group_kernel[(1,)](flat, pair_of, expert_of, pairs, experts, nb, BM=block_m,
                        BLOCK_E=max(16, triton.next_power_of_2(experts)),
                        CHUNK=min(block_p, 64), BLOCK_B=64, num_warps=8)
    return pair_of, expert_of


@triton.jit
def _group_kernel(ids_ptr, pair_ptr, expert_ptr, P, E, NB, BM: tl.constexpr,
                  BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program: `group_by_expert_ref`'s result for P pairs. Each expert's count (a
    comparison of every pair with every expert), its blocks and their running sum (the
    first block of each expert); every block's expert (the experts whose blocks end at or
    before it: -1 past the last one) and padding rows; then each pair's row: its expert's
    first block x BM + the earlier pairs of its expert (the stable sort's rank)."""
    ex = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for q0 in range(0, P, CHUNK):
        q = q0 + tl.arange(0, CHUNK)
        eq = tl.load(ids_ptr + q, mask=q < P, other=-1).to(tl.int32)
        counts += tl.sum((eq[None, :] == ex[:, None]).to(tl.int32), axis=1)
    blocks = (counts + BM - 1) // BM
    block_end = tl.cumsum(blocks, axis=0)
    block_start = block_end - blocks
    for b0 in range(0, NB, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        b_ok = b < NB
        owner = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ptr + b, tl.where(owner < E, owner, -1), mask=b_ok)
        rows = b[:, None] * BM + tl.arange(0, BM)[None, :]
        tl.store(pair_ptr + rows, tl.zeros([BLOCK_B, BM], tl.int32) + P, mask=b_ok[:, None])
    tl.debug_barrier()  # the padding is written before the pairs overwrite their rows
    for p0 in range(0, P, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        ep = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
        rank = tl.zeros([CHUNK], tl.int32)
        for q0 in range(0, p0 + CHUNK, CHUNK):
            q = q0 + tl.arange(0, CHUNK)
            eq = tl.load(ids_ptr + q, mask=q < P, other=-2).to(tl.int32)
            earlier = (eq[None, :] == ep[:, None]) & (q[None, :] < p[:, None])
            rank += tl.sum(earlier.to(tl.int32), axis=1)
        first = tl.sum(tl.where(ex[None, :] == ep[:, None], block_start[None, :], 0), axis=1)
        tl.store(pair_ptr + first * BM + rank, p, mask=p < P)


def group_by_expert_ref(ids: torch.Tensor, experts: int,
                        block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_by_expert` in PyTorch ops of fixed shapes: a stable sort by expert, each
    expert's run padded to whole blocks; the kernel's oracle."""
    flat = ids.reshape(-1)
    pairs, dev = flat.numel(), flat.device
    counts = torch.zeros(experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)  # [E] one past each expert's last block
    first_pair = torch.cumsum(counts, 0) - counts  # [E] its first place in the sorted order
    order = torch.sort(flat, stable=True).indices
    expert = flat[order]
    rank = torch.arange(pairs, device=dev) - first_pair[expert]  # within its expert
    dest = (block_end - blocks)[expert] * block_m + rank
    nb = max_blocks(pairs, experts, block_m)
    pair_of = torch.full((nb * block_m,), pairs, dtype=torch.int64, device=dev)
    pair_of.scatter_(0, dest, order)
    expert_of = torch.searchsorted(block_end, torch.arange(nb, device=dev), right=True)
    expert_of = torch.where(expert_of < experts, expert_of, -1)
    return pair_of.int(), expert_of.int()


@triton.jit
def _mxfp4_load(w_row, s_row, k0, K, n_ok, BLOCK_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of MXFP4 rows (w_row [BLOCK_N, 1] pointers to their bytes,
    s_row to their scales) as stored -> (bytes [BLOCK_N, BLOCK_K / 2], scales [BLOCK_N,
    BLOCK_K / 32]), zeros past K."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_row + kb[None, :], mask=n_ok[:, None] & (kb < K // 2)[None, :], other=0)
    kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scale = tl.load(s_row + kg[None, :], mask=n_ok[:, None] & (kg < K // 32)[None, :], other=0)
    return packed, scale


@triton.jit
def _e2m1_times_2_14(packed):
    """MXFP4 bytes [..., n] -> [..., n, 2] float32, the values of their low and high nibbles
    times 2^-14, exact: each code's bits placed in a float16 (sign to bit 15, exponent and
    mantissa to bits 10..9 and 9; 0.5 a subnormal) and widened."""
    codes = tl.join(packed & 0x0F, packed >> 4).to(tl.int16)
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _mxfp4_tile(w_row, s_row, k0, K, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of MXFP4 rows (`_mxfp4_load`) -> [BLOCK_N, BLOCK_K]
    float32, the exact values (0 past K)."""
    packed, scale = _mxfp4_load(w_row, s_row, k0, K, n_ok, BLOCK_K)
    values = _e2m1_times_2_14(packed)  # [BLOCK_N, BLOCK_K / 2, 2]
    factor = ((scale.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # 2^(s - 113)
    values = tl.reshape(values, [BLOCK_N, BLOCK_K // 32, 32]) * factor[:, :, None]
    return tl.reshape(values, [BLOCK_N, BLOCK_K])


# e2m1 codes -> bfloat16 by byte tables (`prmt`), 8 values (4 bytes) in 19 instructions, 4 of
# them constants: m = the magnitudes' 3 bits of each nibble; a magnitude selects its value's
# high byte from 00 3F 3F 3F 40 40 40 40 and its low byte from 00 00 80 C0 00 40 80 C0 (0, 0.5,
# 1, 1.5, 2, 3, 4, 6); the sign (bit 3 of a nibble) becomes the msb of a byte (the nibble's
# byte, or that byte shifted up by 4 for a low nibble) that `prmt`'s sign mode replicates, or'd
# into the high bytes; the last four `prmt` pair each value's low and high byte, the low
# nibbles' values ($0, $1: elements 2j) apart from the high nibbles' ($2, $3: 2j + 1).
# `tests/kernels/test_fused_moe.py` runs this text on every byte in a small PTX emulator.
E2M1_PTX = tl.constexpr("""{
        .reg .b32 m, mh, up, s0, s1, h0, h1, l0, l1, tha, thb, tla, tlb;
        mov.b32 tha, 0x3F3F3F00;
        mov.b32 thb, 0x40404040;
        mov.b32 tla, 0xC0800000;
        mov.b32 tlb, 0xC0804000;
        and.b32 m, $4, 0x77777777;
        shr.b32 mh, m, 16;
        prmt.b32 h0, tha, thb, m;
        prmt.b32 l0, tla, tlb, m;
        prmt.b32 h1, tha, thb, mh;
        prmt.b32 l1, tla, tlb, mh;
        shl.b32 up, $4, 4;
        prmt.b32 s0, up, $4, 0xD9C8;
        prmt.b32 s1, up, $4, 0xFBEA;
        lop3.b32 h0, h0, s0, 0x80808080, 0xF8;
        lop3.b32 h1, h1, s1, 0x80808080, 0xF8;
        prmt.b32 $0, l0, h0, 0x6240;
        prmt.b32 $1, l1, h1, 0x6240;
        prmt.b32 $2, l0, h0, 0x7351;
        prmt.b32 $3, l1, h1, 0x7351;
        }""")  # a kernel reads only constexpr globals


@triton.jit
def _e2m1_halves(packed, E2M1_PTX_DECODE: tl.constexpr):
    """MXFP4 bytes [..., n] -> the unscaled e2m1 values of their low and of their high nibbles
    ([..., n] each: elements 2j and 2j + 1 of the row), exact: bfloat16 by `E2M1_PTX` where
    E2M1_PTX_DECODE (a GPU), else float32 by `_e2m1_times_2_14` scaled back by 2^14."""
    if E2M1_PTX_DECODE:
        lo, hi = tl.inline_asm_elementwise(E2M1_PTX, "=r,=r,=r,=r,r", [packed],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                           pack=4)
    else:
        lo, hi = tl.split(_e2m1_times_2_14(packed) * 16384.0)
    return lo, hi


@triton.jit
def _mxfp4_group(acc, a_row, w_row, s_row, kg, K, m_ok, n_ok, BLOCK_N: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, E2M1_PTX_DECODE: tl.constexpr):
    """acc + the product of the rows' channels kg .. kg + 31 (one MXFP4 block: kg a multiple
    of 32; none past K) and the columns' block there (`_mxfp4_load`'s pointers): its 16 bytes
    decoded unscaled (`_e2m1_halves`), the low nibbles dotted with the even channels and the
    high with the odd, the sum times the block's scale 2^(s - 127) of each column (exact: a
    power of two), so the scale costs one multiply a column, not one a weight."""
    kb = kg // 2 + tl.arange(0, 16)
    b_ok = kb < K // 2
    packed = tl.load(w_row + kb[None, :], mask=n_ok[:, None] & b_ok[None, :], other=0)
    lo, hi = _e2m1_halves(packed, E2M1_PTX_DECODE)
    even = tl.load(a_row + 2 * kb[None, :], mask=m_ok[:, None] & b_ok[None, :], other=0.0)
    odd = tl.load(a_row + 2 * kb[None, :] + 1, mask=m_ok[:, None] & b_ok[None, :], other=0.0)
    part = tl.dot(even, tl.trans(lo.to(even.dtype)), input_precision=DOT_PRECISION)
    part = tl.dot(odd, tl.trans(hi.to(odd.dtype)), part, input_precision=DOT_PRECISION)
    scale = tl.load(s_row + kg // 32, mask=n_ok[:, None] & (kg < K), other=0)  # [BLOCK_N, 1]
    factor = (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127)
    return acc + part * tl.reshape(factor, [1, BLOCK_N])


# P stays a runtime value: a one-token step and a many-token step run one compiled program.
@triton.jit(do_not_specialize=["num_pairs"])
def _expert_matmul_kernel(a_ptr, w_ptr, s_ptr, b_ptr, r_ptr, y_ptr, pair_ptr, expert_ptr,
                          num_pairs, N, K, stride_am, stride_we, stride_wn, stride_se,
                          stride_sn, stride_be, stride_ym,
                          PAIRS_PER_ROW: tl.constexpr, WEIGHTED: tl.constexpr,
                          HAS_BIAS: tl.constexpr, FP4: tl.constexpr, FP4_DOT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, E2M1_PTX_DECODE: tl.constexpr):
    """Program (j, b): y[p, j*BLOCK_N..] = a[p // PAIRS_PER_ROW] @ w[e]^T (+ b[e] where
    HAS_BIAS, added to the float32 sum before it is rounded, as a biased linear) for the
    pairs p of block b, e its expert (times r[p] where WEIGHTED). A block of expert -1 loops
    zero times and stores nothing. FP4: w is MXFP4 blocks [E, N, K / 2] with scales s [E, N,
    K / 32] (`Mxfp4`; BLOCK_K a multiple of 32), read in one of three forms (FP4_DOT): 0,
    decoded by `_mxfp4_tile` and dotted; 1, Triton's scaled dot (bfloat16 rows, a GPU); 2, a
    block of 32 channels at a time, decoded unscaled (by PTX where E2M1_PTX_DECODE) and
    scaled after its dot (`_mxfp4_group`)."""
    block = tl.program_id(1)
    expert = tl.load(expert_ptr + block)
    pairs = tl.load(pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pairs < num_pairs
    rows = (pairs // PAIRS_PER_ROW).to(tl.int64)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    a_row = a_ptr + rows[:, None] * stride_am
    w_row = w_ptr + expert.to(tl.int64) * stride_we + rn.to(tl.int64)[:, None] * stride_wn
    s_row = s_ptr + expert.to(tl.int64) * stride_se + rn.to(tl.int64)[:, None] * stride_sn
    k_end = tl.where(expert >= 0, K, 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        if FP4_DOT == 2:
            for g in tl.static_range(BLOCK_K // 32):
                acc = _mxfp4_group(acc, a_row, w_row, s_row, k0 + g * 32, K, m_ok, n_ok,
                                   BLOCK_N, DOT_PRECISION, E2M1_PTX_DECODE)
        else:
            k = k0 + rk
            k_ok = k < K
            a = tl.load(a_row + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if FP4_DOT == 1:
                packed, scale = _mxfp4_load(w_row, s_row, k0, K, n_ok, BLOCK_K)
                acc = tl.dot_scaled(a, None, "bf16", tl.trans(packed), scale, "e2m1", acc,
                                    fast_math=True)
            else:
                if FP4:
                    w = _mxfp4_tile(w_row, s_row, k0, K, n_ok, BLOCK_N, BLOCK_K).to(a.dtype)
                else:
                    w = tl.load(w_row + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                                other=0.0)
                acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert.to(tl.int64) * stride_be + rn, mask=n_ok & (expert >= 0),
                       other=0.0)
        acc += bias.to(tl.float32)[None, :]
    dtype = y_ptr.dtype.element_ty
    y = acc.to(dtype)
    if WEIGHTED:  # rounded as torch's product of two dtype values: in float32, then cast
        r = tl.load(r_ptr + pairs, mask=m_ok, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * r[:, None]).to(dtype)
    tl.store(y_ptr + pairs.to(tl.int64)[:, None] * stride_ym + rn[None, :], y,
             mask=m_ok[:, None] & n_ok[None, :])


def _expert_matmul(a: torch.Tensor, w: torch.Tensor | Mxfp4, out: torch.Tensor,
                   groups: tuple[torch.Tensor, torch.Tensor], pairs_per_row: int,
                   cfg: MatmulTiles, r: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, fp4_dot: int = 0) -> None:
    """out [P, N] = a [rows, K] rows by pair @ w [E, N, K]^T (+ bias [E, N]) by the pairs'
    experts (* r [P]); `fp4_dot`: the kernel's FP4_DOT for MXFP4 stacks (1 only with bfloat16
    rows on a GPU; 0 otherwise)."""
    pair_of, expert_of = groups
    _, n, k = w.shape
    fp4 = isinstance(w, Mxfp4)
    # the scaled dot (1) takes bfloat16 rows on a GPU; the unscaled decode (2) any rows
    scaled_dot = a.dtype == torch.bfloat16 and not interpreting()
    fp4_dot = fp4_dot if fp4 and (fp4_dot == 2 or scaled_dot) else 0
    data, scales = (w.blocks, w.scales) if fp4 else (w, out)
    assert not fp4 or cfg.block_k % MXFP4_BLOCK == 0
    _expert_matmul_kernel[(triton.cdiv(n, cfg.block_n), expert_of.numel())](
        a, data, scales, out if bias is None else bias, out if r is None else r, out, pair_of,
        expert_of, out.shape[0], n, k, a.stride(0), data.stride(0), data.stride(1),
        scales.stride(0) if fp4 else 0, scales.stride(1) if fp4 else 0,
        0 if bias is None else bias.stride(0), out.stride(0), PAIRS_PER_ROW=pairs_per_row,
        WEIGHTED=r is not None, HAS_BIAS=bias is not None, FP4=fp4, FP4_DOT=fp4_dot,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        E2M1_PTX_DECODE=not interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _check_bias(bias: torch.Tensor | None, shape: tuple[int, int], x: torch.Tensor) -> None:
    assert bias is None or (bias.shape == shape and bias.stride(-1) == 1
                            and bias.dtype == x.dtype and bias.device == x.device)


def _check_experts(w: torch.Tensor | Mxfp4, x: torch.Tensor) -> None:
    if isinstance(w, Mxfp4):  # its scales were checked where it was made (`mxfp4_exact`)
        assert w.device == x.device
    else:
        assert w.dtype == x.dtype and w.is_contiguous()


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor | Mxfp4, down: torch.Tensor | Mxfp4,
              weights: torch.Tensor, ids: torch.Tensor, exact: bool = False, *,
              tiles: MatmulTiles | None = None, fp4_dot: int | None = None,
              gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None, limit: float = 0.0) -> torch.Tensor:
    """x [T, H] through its experts -> [T, H] (`ops.moe_experts`'s contract): gate_up
    [E, 2I, H], down [E, H, I] (in x's dtype, or `Mxfp4` stacks read as stored), weights
    [T, k] in x's dtype, ids [T, k] expert ids. gpt-oss's experts: biases gate_up_bias
    [E, 2I] and down_bias [E, H] (x's dtype) added to each expert's products, and with
    limit > 0 the clamped SwiGLU (`clamped_swiglu`) in place of SiLU(gate) * up."""
    (t, hidden), (experts, two_i, _) = x.shape, gate_up.shape
    assert gate_up.shape[2] == hidden and down.shape == (experts, hidden, two_i // 2)
    assert ids.shape == weights.shape and ids.shape[0] == t and weights.dtype == x.dtype
    assert x.stride(-1) == 1
    _check_experts(gate_up, x)
    _check_experts(down, x)
    _check_bias(gate_up_bias, (experts, two_i), x)
    _check_bias(down_bias, (experts, hidden), x)
    top_k = ids.shape[1]
    pairs = t * top_k
    if pairs == 0:
        return x.new_zeros(t, hidden)
    fp4 = isinstance(gate_up, Mxfp4) or isinstance(down, Mxfp4)
    cfg = tiles or moe_tiles(x.device, pairs, experts, exact, fp4)
    groups = group_by_expert(ids, experts, cfg.block_m)
    gate_up_out = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
    form = tuning(x.device).fp4_dot if fp4_dot is None else fp4_dot
    assert form in (0, 1, 2), f"fp4_dot {form}: 0 (decode and dot), 1 (scaled dot), 2 (blocks)"
    _expert_matmul(x, gate_up, gate_up_out, groups, top_k, cfg, bias=gate_up_bias,
                   fp4_dot=form)
    act = clamped_swiglu(gate_up_out, limit) if limit > 0 else silu_mul(gate_up_out)  # [P, I]
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _expert_matmul(act, down, out, groups, 1, cfg, weights.reshape(-1).contiguous(),
                   bias=down_bias, fp4_dot=form)
    return _sum_slots(out.view(t, top_k, hidden))


def _sum_slots(y: torch.Tensor) -> torch.Tensor:
    """y [T, k, H] (contiguous) -> y[:, 0] + y[:, 1] + ... in slot order, each sum rounded to
    y's dtype as torch's adds round it (`ops.sum_slots`), in one launch."""
    t, k, hidden = y.shape
    if k == 1:
        return y[:, 0]
    out = torch.empty(t, hidden, dtype=y.dtype, device=y.device)
    block = min(triton.next_power_of_2(hidden), 1024)
    _sum_slots_kernel[(t, triton.cdiv(hidden, block))](y, out, hidden, SLOTS=k, BLOCK=block,
                                                        num_warps=4)
    return out


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, H, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token, column block): the token's SLOTS rows added in order, each float32
    sum rounded to the dtype."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    dtype = out_ptr.dtype.element_ty
    row = y_ptr + token * SLOTS * H + cols
    total = tl.load(row, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(1, SLOTS):
        total = (total + tl.load(row + j * H, mask=ok, other=0.0).to(tl.float32))
        total = total.to(dtype).to(tl.float32)
    tl.store(out_ptr + token * H + cols, total.to(dtype), mask=ok)
