"""A projection of few rows (the draft steps' FP8 weights; M = 1..64 for 16-bit weights)
that streams its weights at the copy bandwidth: y = x W^T (+ b), x [M, K] and W [N, K]
row-major (nn.Linear's layout), float32 accumulation, y in x's dtype.

Oracle: `skinny_linear_ref` (`torch.nn.functional.linear`), to rounding.

Bytes: at M <= 64 the product is 2·M flops per weight element, far below what the tensor
cores do per byte, so the time floor is the weight bytes over the copy bandwidth
(N·K·itemsize / bandwidth: 50 MB of Llama-3.1-8B's qkv at 4.8 TB/s take about 10 us); x (M·K)
and y (M·N) are a few percent of that. Every weight byte is read once: program j owns
columns j·BLOCK_N.. for all M rows (BLOCK_M, the rows padded to a power of two >= 16, is the
whole step) and walks K in BLOCK_K steps, the W tile [BLOCK_N, BLOCK_K] (a contiguous run of
BLOCK_K elements per weight row) transposed into one `tl.dot` with the x tile, the loads
software-pipelined over `num_stages` buffers (asynchronous copies into shared memory) so that
enough bytes are in flight per SM. Every program also reads all of x, from L2: M/BLOCK_N
bytes per weight byte.

The grid is cdiv(N, BLOCK_N) programs. Where that is few against the SMs (N = 4096: 128
programs of 32 columns on 132 SMs), `split_k` programs share a column block, each
walking 1/split_k of K, and write float32 partials [split_k, M, N]; the last of a column
block's programs to finish (a counter a column block, `tl.atomic_add` with acquire-release
order, left at zero for the next launch) sums them in split order 0, 1, .. (plus bias, cast),
so the result does not depend on which program ends last and no second kernel is
launched: 2·split_k·M·N·4 more bytes, mostly in L2.

FP8 weights (`quant.Fp8Weight`, a draft step's copy: e4m3 values and one scale per output
row) stream one byte a weight: each W tile is converted to x's dtype in registers (exact:
e4m3 values are bf16, fp16 and fp32 values), or with bfloat16 rows and `SkinnyTiles.half`
(the GPU's default tiles) to float16 with the x tile rounded to float16 within its range,
one conversion a pair (a draft's numbers only: verification keeps the output exact); the
products accumulate in float32, and the column's scale multiplies the sum. INT8 weights
(`quant.Int8Weight`: one byte a weight, a scale per row and group of 128, 64 or 32 input
channels) take the same path: their values are float16 and bfloat16 values as well, and with
`half` tiles a GPU converts them four a register in five integer and half-precision
instructions (`_int8_to_f16`) instead of one slow conversion each; each K step is taken in
pieces inside one group (the whole step where a group holds it), each piece's float32 dot
scaled by its group's scale of each column before it joins the sum (4 scale bytes a column
and group: 3% more bytes at groups of 128). INT4 weights (`quant.Int4Weight`: two 4-bit
values a byte, one scale per row and group of input channels) stream half a byte a weight:
each BLOCK_K step of a program takes its pieces (a group or a part of one), unpacks a
piece's low and high nibbles into two integer tiles in x's dtype (exact), dots them with the
two contiguous runs of x's channels they hold (the low and the high half of the group's
channels: the layout is made for this) and scales the float32 sum once per column and group
(`_int4_kernel`): no per-weight multiply, no strided loads of x, one scale load per column
and piece, wide K steps for bytes in flight. Draft weights take up to MAX_DRAFT_ROWS rows a
launch. Oracles: `quant.RowScaledWeight.ref`, `quant.GroupScaledWeight.ref`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vegas_spec.kernels import device_sms, for_device, interpreting, split_counters
from vegas_spec.quant import DRAFT_TYPES, DraftWeight, Int4Weight, Int8Weight

# Rows the kernel takes at most (one row block); callers fall back to F.linear beyond.
MAX_ROWS = 64
# Rows of one call on a draft weight (a draft step of up to 128 sequences); more go in
# chunks of these.
MAX_DRAFT_ROWS = 128


@dataclass(frozen=True)
class SkinnyTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    swap: bool = False  # y^T = W x^T: the weight tile as the dot's first operand
    # FP8 weights with bfloat16 rows: the dot in float16 (`_skinny_kernel`'s HALF_DOT)
    half: bool = False

    def __post_init__(self) -> None:
        for size in (self.block_n, self.block_k):
            assert size >= 16 and size & (size - 1) == 0, "blocks: powers of two >= 16"
        assert self.num_warps > 0 and self.num_stages > 0 and self.split_k > 0


@dataclass(frozen=True)
class RowTiles:
    """The tiles of one row bucket (the rows padded to a power of two >= 16): `wide` where N
    gives at least `SkinnyTuning.column_programs` column blocks of its block_n, else
    `narrow`; each one's split_k is the split taken where `skinny_tiles` splits K."""

    wide: SkinnyTiles
    narrow: SkinnyTiles


@dataclass(frozen=True)
class SkinnyTuning:
    """The default tiles (`skinny_tiles`) on one device class.

    `by_rows`: the tiles of each row bucket (keys 16..MAX_DRAFT_ROWS). K is split (the
    tiles' split_k) where the split grid still fits one program an SM (`sms`, None: the
    device's own count) and K holds at least `split_min_steps` K steps."""

    by_rows: Mapping[int, RowTiles]
    column_programs: int
    split_min_steps: int
    sms: int | None


def _rows(block_n: int, block_n_narrow: int, block_k: int) -> RowTiles:
    """Wide and narrow tiles alike but for their column blocks, K split in two."""
    return RowTiles(SkinnyTiles(block_n, block_k, 4, 4, 2), SkinnyTiles(block_n_narrow, block_k,
                                                                         4, 4, 2))


# sm_90, up to 32 rows: FP8 weights dotted in float16 (best or within 4% of the best of nine
# settings for each of the 8B projections at 1, 16 and 32 rows, H100; docs/kernel-notes.md):
# the transposed product of 64 columns and 256-wide K steps, but for the wide weights of up
# to 16 rows, which stream best in 512-wide steps untransposed. 64 and 128 rows: untimed.
_HALF_SWAP = SkinnyTiles(64, 256, 4, 4, 2, swap=True, half=True)
_SM90 = SkinnyTuning(by_rows={16: RowTiles(SkinnyTiles(64, 512, 4, 3, half=True), _HALF_SWAP),
                              32: RowTiles(dataclasses.replace(_HALF_SWAP, split_k=1),
                                           _HALF_SWAP),
                              64: _rows(64, 32, 128), 128: _rows(64, 32, 64)},
                     column_programs=256, split_min_steps=4, sms=None)
# By device class (`kernels.device_class`). The interpreter has no SMs: it assumes an H100's
# or H200's 132, so that it runs the tiles those GPUs choose.
TUNING: dict[str, SkinnyTuning] = {
    "sm90": _SM90,
    "default": _SM90,
    "interpreter": dataclasses.replace(_SM90, sms=132),
}


def tuning(device: torch.device) -> SkinnyTuning:
    """The entry of `TUNING` that launches on `device` read."""
    return for_device(TUNING, device)


def block_rows(m: int, most: int = MAX_ROWS) -> int:
    """BLOCK_M: the rows padded to a power of two, at least 16 (the smallest dot tile); more
    than `most` rows are a ValueError."""
    if m > most:
        raise ValueError(f"skinny_linear takes at most {most} rows, not {m}")
    return max(16, triton.next_power_of_2(m))


def skinny_tiles(m: int, n: int, k: int, device: torch.device) -> SkinnyTiles:
    """Default tiles for M rows of an [N, K] weight on `device` (`SkinnyTuning`)."""
    table = tuning(device)
    bucket = table.by_rows[block_rows(m, MAX_DRAFT_ROWS)]
    wide = triton.cdiv(n, bucket.wide.block_n) >= table.column_programs
    tiles = bucket.wide if wide else bucket.narrow
    sms = table.sms or device_sms(device)
    split = (triton.cdiv(n, tiles.block_n) * tiles.split_k <= sms
             and k >= table.split_min_steps * tiles.block_k)
    return dataclasses.replace(tiles, split_k=tiles.split_k if split else 1)


@triton.jit
def _output(total, y_ptr, rm, rn, ok, stride_ym):
    """The float32 sum (bias added) rounded to y's dtype and stored."""
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], total.to(y_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def _finish(acc, y_ptr, p_ptr, cnt_ptr, b_ptr, rm, rn, M, N, stride_ym,
            HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] float32, this program's rows x columns (its split's part of K)
    -> y [M, N] in y's dtype (+ bias). With SPLIT_K > 1 acc goes to the partials
    p [SPLIT_K, M, N] and the column block's last program to arrive (its counter at
    cnt_ptr[column block]) sums them in split order, adds the bias, stores y and sets the
    counter back to zero."""
    ok = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        _output(acc, y_ptr, rm, rn, ok, stride_ym)
    else:
        part = rm[:, None] * N + rn[None, :]
        tl.store(p_ptr + tl.program_id(1).to(tl.int64) * M * N + part, acc, mask=ok)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        counter = cnt_ptr + tl.program_id(0)
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.load(p_ptr + part, mask=ok, other=0.0, cache_modifier=".cg")
            for split in tl.static_range(1, SPLIT_K):
                total += tl.load(p_ptr + split * M * N + part, mask=ok, other=0.0,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            _output(total, y_ptr, rm, rn, ok, stride_ym)
            tl.atomic_xchg(counter, 0)


@triton.jit
def _int8_to_f16(w):
    """int8 values -> float16, exact, four a 32-bit register in five fast instructions (PTX
    `cvt.rn.f16.s8` takes one slow conversion a value): v + 128 as a byte, placed under the
    exponent byte 0x64 of a float16 gives 1024 + (v + 128); subtracting 1152 leaves v."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 u, m;
        xor.b32 u, $2, 0x80808080;
        prmt.b32 $0, u, 0x64646464, 0x4140;
        prmt.b32 $1, u, 0x64646464, 0x4342;
        mov.b32 m, 0x64806480;
        sub.f16x2 $0, $0, m;
        sub.f16x2 $1, $1, m;
        }""", "=r,=r,r", [w], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _dot_step(acc, x_row, w_row, k0, k_hi, m_ok, n_ok, WIDTH: tl.constexpr,
              EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALED: tl.constexpr,
              SWAP: tl.constexpr, HALF_DOT: tl.constexpr, INT8_PTX: tl.constexpr):
    """acc + the product of channels k0..k0+WIDTH-1 (those below k_hi) of the x rows and W
    columns: the tiles loaded, W's converted where SCALED (and x's where HALF_DOT), one dot."""
    k = k0 + tl.arange(0, WIDTH)
    if EVEN_K:
        x = tl.load(x_row + k[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_row + k[None, :], mask=n_ok[:, None], other=0.0)
    else:
        k_ok = k < k_hi
        x = tl.load(x_row + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_row + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    if HALF_DOT:
        if INT8_PTX:
            w = _int8_to_f16(w)
        else:
            w = w.to(tl.float16)
        x = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    elif SCALED:
        w = w.to(x.dtype)
    if SWAP:  # one return: the compiler does not stop at a return inside a constexpr branch
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K, k_split,
                   stride_xm, stride_wn, stride_sg, stride_ym, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   SCALED: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr,
                   SWAP: tl.constexpr, HALF_DOT: tl.constexpr, INT8_PTX: tl.constexpr):
    """Program (j, s): rows 0..M-1 x columns j*BLOCK_N.. over K range s*k_split.. (all of K
    when SPLIT_K is 1), finished by `_finish`. SCALED: W holds FP8 or INT8 values, converted to x's
    dtype as loaded, and s_ptr the scales that multiply the sums: one a column where GROUP is
    0, else one a column and group of GROUP channels (a group's scales contiguous over the
    columns, groups stride_sg apart: one coalesced load a piece), each K step then
    taken in BLOCK_K // SUB pieces inside one group (SUB divides GROUP), each piece's dot
    scaled by its group's scales. SWAP: the
    product is computed transposed, y^T = W x^T, the W tile as the dot's first operand (the
    one that may come from registers, where the converted FP8 tile already is) and the rows
    as its narrow side. HALF_DOT (SCALED, bfloat16 x): the dot in float16, the FP8 tile
    converted to float16 (one instruction a pair, where bfloat16 takes several) and the x
    tile rounded to float16 within its range (a draft's numbers only: verification keeps the
    output exact); INT8 tiles (HALF_DOT) convert through `_int8_to_f16` where INT8_PTX (a GPU,
    not the interpreter)."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    x_row = x_ptr + rm[:, None] * stride_xm
    w_row = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    k_lo = tl.program_id(1) * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if GROUP == 0:
            acc = _dot_step(acc, x_row, w_row, k0, k_hi, m_ok, n_ok, BLOCK_K, EVEN_K,
                            DOT_PRECISION, SCALED, SWAP, HALF_DOT, INT8_PTX)
        else:
            for piece in tl.static_range(BLOCK_K // SUB):
                first = k0 + piece * SUB
                part = _dot_step(tl.zeros_like(acc), x_row, w_row, first, k_hi, m_ok, n_ok,
                                 SUB, EVEN_K, DOT_PRECISION, SCALED, SWAP, HALF_DOT,
                                 INT8_PTX)
                scale = tl.load(s_ptr + (first // GROUP) * stride_sg + rn,
                                mask=n_ok & (first < k_hi), other=0.0)
                if SWAP:
                    acc += part * scale[:, None]
                else:
                    acc += part * scale[None, :]
    if SWAP:  # acc [BLOCK_N, BLOCK_M]
        if SCALED and GROUP == 0:
            acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[:, None]
        acc = tl.trans(acc)
    elif SCALED and GROUP == 0:
        acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    _finish(acc, y_ptr, p_ptr, cnt_ptr, b_ptr, rm, rn, M, N, stride_ym, HAS_BIAS, SPLIT_K)


@triton.jit(do_not_specialize=["M"])
def _int4_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, cnt_ptr, M, N, k_split, K,
                 stride_xm, stride_wn, stride_sn, stride_ym, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, SUB: tl.constexpr, SPLIT_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Program (j, s): rows 0..M-1 x columns j*BLOCK_N.. over the bytes of K range
    s*k_split.. (a whole number of BLOCK_K steps), finished by `_finish`. A step is
    BLOCK_K // SUB pieces of SUB/2 bytes, each inside one group (SUB divides GROUP): its
    bytes [BLOCK_N, SUB/2] become two integer tiles in x's dtype (exact: -8..7), the low
    nibbles dotted with x's channels g*GROUP + j.. and the high with g*GROUP + GROUP/2 + j..
    (j: the piece's first byte in its group g), and the float32 sum is scaled once by the
    group's scale of each column."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, SUB // 2)
    m_ok, n_ok = rm < M, rn < N
    x_row = x_ptr + rm[:, None] * stride_xm
    w_row = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    s_col = s_ptr + rn.to(tl.int64) * stride_sn
    b_lo = tl.program_id(1) * (k_split // 2)
    b_hi = tl.minimum(b_lo + k_split // 2, K // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for b0 in range(b_lo, b_hi, BLOCK_K // 2):
        for piece in tl.static_range(BLOCK_K // SUB):
            first = b0 + piece * (SUB // 2)  # the piece's first byte
            group = first // (GROUP // 2)
            low_k = group * GROUP + first % (GROUP // 2) + half  # its low nibbles' channels
            ok = first + half < b_hi
            packed = tl.load(w_row + (first + half)[None, :], mask=n_ok[:, None] & ok[None, :],
                             other=136)
            x_ok = m_ok[:, None] & ok[None, :]
            x_low = tl.load(x_row + low_k[None, :], mask=x_ok, other=0.0)
            x_high = tl.load(x_row + (low_k + GROUP // 2)[None, :], mask=x_ok, other=0.0)
            low = ((packed & 15).to(tl.int32) - 8).to(x_ptr.dtype.element_ty)
            high = ((packed >> 4).to(tl.int32) - 8).to(x_ptr.dtype.element_ty)
            part = tl.dot(x_low, tl.trans(low), input_precision=DOT_PRECISION)
            part = tl.dot(x_high, tl.trans(high), part, input_precision=DOT_PRECISION)
            scale = tl.load(s_col + group, mask=n_ok & (first < b_hi), other=0.0)
            acc += part * scale[None, :]
    _finish(acc, y_ptr, p_ptr, cnt_ptr, b_ptr, rm, rn, M, N, stride_ym, HAS_BIAS, SPLIT_K)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor | DraftWeight,
                  bias: torch.Tensor | None = None, *,
                  tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, for at most
    MAX_ROWS rows in all (a ValueError beyond: callers take F.linear there); a draft weight
    (FP8 or INT4) takes any number of rows, MAX_DRAFT_ROWS a launch. `tiles`: by default
    `skinny_tiles` of the shape and device."""
    draft = isinstance(weight, DRAFT_TYPES)
    n, k = weight.shape
    w = weight.data if draft else weight
    assert w.dim() == 2 and x.shape[-1] == k and w.stride(-1) == 1
    assert x.device == w.device and (draft or x.dtype == w.dtype)
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    step = MAX_DRAFT_ROWS if draft else max(rows.shape[0], 1)
    for start in range(0, rows.shape[0], step):  # one launch unless draft rows exceed a block
        _launch(rows[start:start + step], weight, bias, out[start:start + step], tiles)
    return out.view(*x.shape[:-1], n)


def _launch(rows: torch.Tensor, weight: torch.Tensor | DraftWeight, bias: torch.Tensor | None,
            out: torch.Tensor, tiles: SkinnyTiles | None) -> None:
    """One launch: rows [M, K] (M <= one row block) into out [M, N]."""
    draft = isinstance(weight, DRAFT_TYPES)
    (m, k), n = rows.shape, weight.shape[0]
    block_m = block_rows(m, MAX_DRAFT_ROWS if draft else MAX_ROWS)
    cfg = tiles or skinny_tiles(m, n, k, rows.device)
    # K per split, a whole number of K steps; trailing splits may be empty (they add zeros).
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    if cfg.split_k == 1:
        partials = counters = out
    else:
        partials = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=rows.device)
        counters = split_counters(grid[0], rows.device)
    b = rows if bias is None else bias
    precision = "ieee" if rows.dtype == torch.float32 else "tf32"
    if isinstance(weight, Int4Weight):
        sub = min(cfg.block_k, weight.group)  # a piece of a step inside one group
        assert sub >= 32 and weight.group % sub == 0, \
            "INT4: K steps and groups of at least 32 channels, powers of two"
        _int4_kernel[grid](
            rows, weight.data, weight.scale, b, out, partials, counters, m, n, k_split, k,
            rows.stride(0), weight.data.stride(0), weight.scale.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP=weight.group, SUB=sub, SPLIT_K=cfg.split_k,
            DOT_PRECISION=precision,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        w, scale = (weight.data, weight.scale) if draft else (weight, None)
        # INT8 with a scale a group; one a row (group K) takes the per-column path
        group = weight.group if isinstance(weight, Int8Weight) and weight.group < k else 0
        assert scale is None or scale.stride(0) == 1, "scales: contiguous over the columns"
        sub = min(cfg.block_k, group) if group else cfg.block_k  # a piece inside one group
        assert group % sub == 0, "INT8: K steps and groups, powers of two"
        half = draft and cfg.half and rows.dtype == torch.bfloat16
        _skinny_kernel[grid](
            rows, w, w if scale is None else scale, b, out, partials, counters, m, n, k,
            k_split, rows.stride(0), w.stride(0), scale.stride(1) if group else 0,
            out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, EVEN_K=k % cfg.block_k == 0,
            DOT_PRECISION=precision, SCALED=draft, GROUP=group, SUB=sub, SWAP=cfg.swap,
            HALF_DOT=half, INT8_PTX=half and w.dtype == torch.int8 and not interpreting(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: `F.linear`."""
    return F.linear(x, weight, bias)
