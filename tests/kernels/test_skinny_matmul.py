"""The few-row projection against a float64 `F.linear`: every row count of a step up to 64,
column blocks that N leaves partial, K steps that K leaves partial, bias, and K split over
programs (one split left empty); more than 64 rows are refused. On a GPU also the 8B models'
projection shapes in bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import CUDA, DEVICE, as_sm90, generator, nan_empty, randn

import vegas_spec.kernels as kernels
from vegas_spec.kernels.skinny_matmul import (
    MAX_DRAFT_ROWS,
    MAX_ROWS,
    SkinnyTiles,
    skinny_linear,
    skinny_linear_ref,
    skinny_tiles,
    split_counters,
)
from vegas_spec.quant import (
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    row_scaled_linear_ref,
    scale_group,
)

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
# Relative error bounds (Frobenius norms): an fp32 sum of products rounded once to the dtype.
REL_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
N = 96  # one full and one half column block of 64
# (rows, K, bias, split_k): K = 200 leaves a partial K step of 64; three splits of K = 256
# in steps of 64 are two of 128 and an empty one.
CASES = [(1, 256, False, 1), (7, 200, True, 2), (16, 256, True, 3), (64, 200, False, 1)]


def rel_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
              b: torch.Tensor | None) -> float:
    want = skinny_linear_ref(x.double(), w.double(), None if b is None else b.double())
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("swap", [False, True], ids=["xw", "wx"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,bias,split_k", CASES)
def test_matches_float64_reference(m: int, k: int, bias: bool, split_k: int,
                                   dtype: torch.dtype, swap: bool) -> None:
    gen = generator(m + k)
    x = randn(m, k, gen=gen, dtype=dtype)
    w = randn(N, k, gen=gen, dtype=dtype) / k ** 0.5
    b = randn(N, gen=gen, dtype=dtype) if bias else None
    with nan_empty():  # outputs and partials start as NaN: an unwritten element fails
        got = skinny_linear(x, w, b, tiles=SkinnyTiles(64, 64, 4, 2, split_k, swap))
    assert got.shape == (m, N) and got.dtype == dtype
    assert rel_error(got, x, w, b) < REL_TOL[dtype]


def test_default_tiles_and_leading_dims() -> None:
    """A [B, n, K] step (B·n rows) with the tiles chosen from the shape."""
    gen = generator(5)
    x = randn(3, 5, 128, gen=gen, dtype=torch.float16)
    w = randn(80, 128, gen=gen, dtype=torch.float16) / 128 ** 0.5
    with nan_empty():
        got = skinny_linear(x, w)
    assert got.shape == (3, 5, 80)
    assert rel_error(got, x, w, None) < REL_TOL[torch.float16]


def test_more_than_64_rows_are_refused() -> None:
    w = torch.ones(32, 16, device=DEVICE)
    for shape in ((MAX_ROWS + 1, 16), (5, 13, 16)):
        with pytest.raises(ValueError, match="at most 64 rows"):
            skinny_linear(torch.ones(*shape, device=DEVICE), w)


# (N, K) of Llama-3.1-8B and Qwen3-8B: qkv, o_proj, gate_up, down, LM head (the first two
# are the same in both).
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
             (24576, 4096), (4096, 12288), (151936, 4096)]


@pytest.mark.parametrize("sms", [132, 114, 78])  # an H100 SXM or H200, an H100 PCIe, an H20
def test_default_tiles_split_k_only_within_one_wave(sms: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the default tiles split K where the split grid still fits one program an SM
    (the device's own count) and K holds enough steps, and nowhere else; the interpreter
    assumes 132 SMs."""
    as_sm90(monkeypatch)
    monkeypatch.setattr(kernels, "sm_count", lambda index: sms)
    for device, count in ((torch.device("cuda", 0), sms), (torch.device("cpu"), 132)):
        for n, k in SHAPES_8B:
            for m in (1, 16, 32, 64):
                t = skinny_tiles(m, n, k, device)
                columns = -(-n // t.block_n)
                fits = columns * 2 <= count and k >= 4 * t.block_k
                assert t.split_k == (2 if fits else 1), (device, m, n, k, t)


@pytest.mark.parametrize("quantize", [None, quantize_fp8, quantize_int8, quantize_int4],
                         ids=["float32", "fp8", "int8", "int4"])
@pytest.mark.parametrize("swap", [False, True], ids=["xw", "wx"])
def test_split_k_sums_the_splits_in_order_in_one_launch(quantize, swap: bool) -> None:  # noqa: ANN001
    """Three splits of K (64 channels each, the last column block partial): the column
    block's last program sums the partials in split order 0, 1, 2 and adds the bias, the
    float32 result of each split's K range computed alone, added in that order, to the bit;
    the counters are back at zero for the next launch (a CUDA graph's replay)."""
    if quantize is quantize_int4 and swap:
        pytest.skip("the INT4 kernel has no transposed product")
    gen = generator(191)
    x = randn(5, 192, gen=gen)
    w = randn(80, 192, gen=gen) / 16
    b = randn(80, gen=gen)
    weight = w if quantize is None else quantize(w, 64) if quantize is quantize_int4 \
        else quantize(w)
    with nan_empty():
        got = skinny_linear(x, weight, b, tiles=SkinnyTiles(32, 64, 4, 2, 3, swap))
    dense = w if quantize is None else weight.dequantize(torch.float32)
    ref = quantize if quantize in (quantize_fp8, quantize_int8) else None
    parts = []
    for s in range(3):
        cut = slice(64 * s, 64 * (s + 1))
        if ref is None:
            one = dense[:, cut]
        else:  # the FP8 / INT8 kernel scales each split's sum: the same values, scale after
            one = weight.values()[:, cut]
        with nan_empty():
            part = skinny_linear(x[:, cut].contiguous(), one.contiguous(),
                                 tiles=SkinnyTiles(32, 64, 4, 2, 1, swap))
        if ref is not None:  # FP8: a scale a column; INT8: K = 192 takes groups of 64, one a split
            part = part * (weight.scale if quantize is quantize_fp8 else weight.scale[:, s])
        parts.append(part)
    want = (parts[0] + parts[1]) + parts[2] + b
    if quantize is quantize_int4:  # group scales inside the sum: to rounding
        assert float((got - want).norm() / want.norm()) < 1e-6
    else:
        assert torch.equal(got, want)
    assert int(split_counters(1, x.device).abs().sum()) == 0


def test_split_counters_outgrown_stay_alive() -> None:
    """A launch needing more column blocks than the counters hold gets a larger buffer; the
    smaller one is kept (a CUDA graph captured with it still writes there) and zeroed."""
    device = torch.device(DEVICE)
    first = split_counters(1, device)
    larger = split_counters(first.numel() + 1, device)
    assert larger.numel() > first.numel() and split_counters(1, device) is larger
    assert any(t is first for t in kernels._COUNTERS[device])
    assert int(first.abs().sum()) == int(larger.abs().sum()) == 0


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", SHAPES_8B)
def test_8b_shapes_in_bfloat16_match_cublas(n: int, k: int) -> None:
    """The default tiles and two others (one splitting K in four), against F.linear."""
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)  # an LM head's 0.6 G values
    w = (torch.randn(n, k, generator=gen, device=DEVICE) / k ** 0.5).to(torch.bfloat16)
    for m in (1, 4, 16, 33, 64):
        x = torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16)
        want = skinny_linear_ref(x, w).float()
        for tiles in (None, SkinnyTiles(32, 128, 4, 4, 1), SkinnyTiles(64, 256, 4, 3, 4)):
            got = skinny_linear(x, w, tiles=tiles).float()
            err = float((got - want).norm() / want.norm())
            assert err < 1e-2, (m, tiles, err)


# --- FP8 and INT8 weights (a draft step's copy) ------------------------------------------

BYTE_WEIGHTS = pytest.mark.parametrize("quantize", [quantize_fp8, quantize_int8],
                                       ids=["fp8", "int8"])

# (rows, N, K, bias, split_k): 1..128 rows, a partial column block (N = 96 in blocks of 64),
# a partial K step (K = 200 in steps of 64), K split with an empty split. INT8 copies take
# groups of 128 (K = 256, 128) or a scale a row (K = 200 and 72: no group of 32 divides them).
FP8_CASES = [(1, 96, 256, False, 1), (7, 96, 200, True, 2), (16, 80, 256, True, 3),
             (64, 96, 200, False, 1), (128, 96, 128, True, 1), (37, 33, 72, False, 1)]


def byte_weight_error(got: torch.Tensor, x: torch.Tensor, q, b: torch.Tensor | None) -> float:  # noqa: ANN001
    """got's relative error (Frobenius) against the float64 product with the copy's weight."""
    return rel_error(got, x, q.dequantize(torch.float64), b)


@BYTE_WEIGHTS
@pytest.mark.parametrize("swap", [False, True], ids=["xw", "wx"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k,bias,split_k", FP8_CASES)
def test_byte_weights_match_their_reference(m: int, n: int, k: int, bias: bool, split_k: int,
                                            dtype: torch.dtype, swap: bool,
                                            quantize) -> None:  # noqa: ANN001
    """e4m3 or INT8 values times x summed in float32 and scaled per column (and group): the
    float64 product with the copy's weight to the dtype's rounding, and so is the copy's
    reference (how close the copy is to the weight: the quantizers' tests)."""
    gen = generator(m * n + k)
    x = randn(m, k, gen=gen, dtype=dtype)
    w = randn(n, k, gen=gen) / k ** 0.5
    w[3] *= 50.0  # rows of different magnitudes get scales of their own
    q = quantize(w.to(DEVICE))
    b = randn(n, gen=gen, dtype=dtype) if bias else None
    with nan_empty():
        got = skinny_linear(x, q, b, tiles=SkinnyTiles(64, 64, 4, 2, split_k, swap))
    assert got.shape == (m, n) and got.dtype == dtype
    assert byte_weight_error(got, x, q, b) < REL_TOL[dtype]
    assert byte_weight_error(q.ref(x, b), x, q, b) < REL_TOL[dtype]


def test_row_scaled_reference_scales_after_the_sum() -> None:
    """`row_scaled_linear_ref` (the FP8 copies' CPU product): the stored values times x in
    float32, then the column's scale, equal to the float64 product to float32's rounding."""
    gen = generator(17)
    x = randn(5, 96, gen=gen)
    q = quantize_fp8(randn(40, 96, gen=gen) / 10)
    got = row_scaled_linear_ref(x, q)
    assert torch.equal(got, torch.matmul(x, q.values().t()) * q.scale)
    assert byte_weight_error(got, x, q, None) < REL_TOL[torch.float32]


@BYTE_WEIGHTS
@pytest.mark.parametrize("swap", [False, True], ids=["xw", "wx"])
@pytest.mark.parametrize("m,n,k,bias,split_k", FP8_CASES)
def test_byte_weights_in_a_float16_dot(m: int, n: int, k: int, bias: bool, split_k: int,
                                       swap: bool, quantize) -> None:  # noqa: ANN001
    """`SkinnyTiles.half`: bfloat16 rows against FP8 or INT8 weights dotted in float16 give
    the float64 product to bfloat16's rounding (both formats' values are float16 values);
    rows past float16's range stay finite (x is clamped to it) and their products follow the
    clamped rows."""
    gen = generator(m * n + k + 1)
    dtype = torch.bfloat16
    x = randn(m, k, gen=gen, dtype=dtype)
    q = quantize((randn(n, k, gen=gen) / k ** 0.5).to(DEVICE))
    b = randn(n, gen=gen, dtype=dtype) if bias else None
    tiles = SkinnyTiles(64, 64, 4, 2, split_k, swap, half=True)
    with nan_empty():
        got = skinny_linear(x, q, b, tiles=tiles)
    assert byte_weight_error(got, x, q, b) < REL_TOL[dtype]
    big = x.clone()
    big[0, 0] = 1e6
    with nan_empty():
        got = skinny_linear(big, q, b, tiles=tiles)
    clamped = big.double().clamp(-65504, 65504)
    assert bool(got.isfinite().all())
    assert byte_weight_error(got, clamped, q, b) < REL_TOL[dtype]


# (rows, N, K, bias, split_k, group) of INT8 copies with a scale a group, K steps of 64: a
# group of 128 over two steps, groups of 64 one a step, groups of 32 two a step (K = 96 split
# in four: a step and a half, then two empty splits), every row count, a partial column block.
INT8_CASES = [(1, 96, 256, False, 1, 128), (7, 96, 192, True, 2, 64),
              (16, 80, 96, True, 4, 32), (64, 96, 256, False, 1, 64),
              (128, 64, 128, True, 1, 128), (37, 33, 160, False, 1, 32)]


@pytest.mark.parametrize("half", [False, True], ids=["dtype", "f16"])
@pytest.mark.parametrize("swap", [False, True], ids=["xw", "wx"])
@pytest.mark.parametrize("m,n,k,bias,split_k,group", INT8_CASES)
def test_int8_group_scales_match_their_reference(m: int, n: int, k: int, bias: bool,
                                                 split_k: int, group: int, swap: bool,
                                                 half: bool) -> None:
    """Each piece of a K step inside one group is scaled by that group's scale of each column
    (a group of far larger weights makes a wrong scale show): the float64 product with the
    dequantised weight to the rows' rounding, float32 rows, or bfloat16 rows in a float16 dot."""
    gen = generator(m * n + k + group)
    dtype = torch.bfloat16 if half else torch.float32
    x = randn(m, k, gen=gen, dtype=dtype)
    w = randn(n, k, gen=gen) / k ** 0.5
    w[:, group:2 * group] *= 40.0
    w[2] *= 30.0
    q = quantize_int8(w.to(DEVICE), group)
    assert q.scale.shape == (n, k // group)
    b = randn(n, gen=gen, dtype=dtype) if bias else None
    with nan_empty():
        got = skinny_linear(x, q, b, tiles=SkinnyTiles(64, 64, 4, 2, split_k, swap, half=half))
    assert got.shape == (m, n) and got.dtype == dtype
    assert byte_weight_error(got, x, q, b) < REL_TOL[dtype]


@pytest.mark.parametrize("m,k", [(1, 1024), (7, 576), (16, 1536), (64, 576), (128, 576)])
def test_int8_default_tiles_take_several_groups_a_step(m: int, k: int) -> None:
    """The default tiles' K steps (256-512 up to 32 rows, 64-128 beyond) hold several groups
    or part of one (SmolLM2's K = 576: groups of 64; 1536: 128), K not always a whole number
    of steps: each channel gets its own group's scale."""
    gen = generator(m + k)
    x = randn(m, k, gen=gen)
    w = randn(40, k, gen=gen) / k ** 0.5
    q0 = quantize_int8(w)
    w[:, q0.group:2 * q0.group] *= 50.0  # a group whose scale differs from its neighbours'
    q = quantize_int8(w.to(DEVICE))
    assert q.group == q0.group == scale_group(k)
    with nan_empty():
        got = skinny_linear(x, q)
    assert byte_weight_error(got, x, q, None) < REL_TOL[torch.float32]


@pytest.mark.parametrize("quantize", [quantize_fp8, quantize_int8, quantize_int4],
                         ids=["fp8", "int8", "int4"])
def test_draft_rows_past_a_block_run_in_chunks(quantize) -> None:  # noqa: ANN001
    """300 rows of an FP8, INT8 or INT4 weight: three launches of at most MAX_DRAFT_ROWS, the
    leading dims kept; default tiles."""
    gen = generator(300)
    x = randn(3, 100, 64, gen=gen)
    q = quantize(randn(48, 64, gen=gen) / 8)
    with nan_empty():
        got = skinny_linear(x, q)
    assert got.shape == (3, 100, 48) and MAX_DRAFT_ROWS < 300
    want = skinny_linear_ref(x.double(), q.dequantize(torch.float64))
    assert float((got.double() - want).norm() / want.norm()) < REL_TOL[torch.float32]


def test_quantize_fp8_per_output_row() -> None:
    """Each row's largest magnitude maps to 448; a zero row keeps scale 1; dequantised rows
    are within e4m3's relative step (2^-3) of the weight."""
    w = torch.randn(6, 40, generator=generator(2))
    w[1] *= 1e3
    w[4] = 0.0
    q = quantize_fp8(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    assert torch.allclose(q.data.float().abs().amax(1)[[0, 1, 2, 3, 5]], torch.tensor(448.0))
    assert q.scale[4] == 1.0 and bool((q.data[4].float() == 0).all())
    back = q.dequantize(torch.float32)
    assert bool(((back - w).abs() <= w.abs() * 2 ** -3 + q.scale[:, None] * 2 ** -9).all())
    assert q.nbytes == 6 * 40 + 6 * 4


def test_quantize_int8_per_row_and_group() -> None:
    """Each group's largest magnitude maps to 127 (its sign kept); a zero group keeps scale 1;
    dequantised values are within half a step (the group's scale / 2) of the weight, and -w is
    stored as the negated values; a scale per 128, 64 or 32 inputs, the first that divides K,
    else one a row (group K); 4 bytes a group more than a byte a weight; the scales stored
    group by group."""
    w = torch.randn(6, 256, generator=generator(3))
    w[1] *= 1e3
    w[4, 128:] = 0.0
    q = quantize_int8(w)
    assert q.data.dtype == torch.int8 and q.scale.dtype == torch.float32
    assert q.group == 128 and q.scale.shape == (6, 2) and q.shape == (6, 256)
    assert q.scale.stride() == (1, 6)  # a group's scales contiguous over the rows
    amax = q.data.float().view(6, 2, 128).abs().amax(-1)
    assert torch.equal(amax[amax > 0], torch.full((11,), 127.0))
    assert int(q.data.min()) >= -127
    assert q.scale[4, 1] == 1.0 and bool((q.data[4, 128:] == 0).all())
    back = q.dequantize(torch.float32)
    assert bool(((back - w).abs() <= q.scale.repeat_interleave(128, 1) * (0.5 + 1e-6)).all())
    assert torch.equal(quantize_int8(-w).data, -q.data)
    assert q.nbytes == 6 * 256 + 12 * 4
    assert [quantize_int8(torch.ones(2, k)).group for k in (4096, 576, 1536, 96, 200)] \
        == [128, 64, 128, 32, 200]
    assert quantize_int8(w, 32).scale.shape == (6, 8)
    for group in (48, 512):
        with pytest.raises(ValueError, match=f"groups of {group}"):
            quantize_int8(w, group)


# (rows, N, K, bias, split_k, group): 1..128 rows, a partial column block, every group size,
# K split with an empty split (K = 96 in three splits of whole groups of 32: 32, 32, 32, 0
# past the end for split 4).
INT4_CASES = [(1, 96, 256, False, 1, 128), (7, 96, 192, True, 2, 64), (16, 80, 96, True, 4, 32),
              (64, 96, 256, False, 1, 64), (128, 64, 128, True, 1, 128), (37, 33, 64, False, 1, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k,bias,split_k,group", INT4_CASES)
def test_int4_weights_match_their_reference(m: int, n: int, k: int, bias: bool, split_k: int,
                                            group: int, dtype: torch.dtype) -> None:
    """K steps narrower than a group (64 against 128) and wider (64 against 32): the float64
    product with the dequantised weight, to the dtype's rounding; the reference in the
    kernel's order agrees."""
    gen = generator(m * n + k + group)
    x = randn(m, k, gen=gen, dtype=dtype)
    w = randn(n, k, gen=gen) / k ** 0.5
    w[2] *= 30.0
    q = quantize_int4(w.to(DEVICE), group)
    b = randn(n, gen=gen, dtype=dtype) if bias else None
    with nan_empty():
        got = skinny_linear(x, q, b, tiles=SkinnyTiles(32, 64, 4, 2, split_k))
    assert got.shape == (m, n) and got.dtype == dtype
    want = skinny_linear_ref(x.double(), q.dequantize(torch.float64),
                             None if b is None else b.double())
    assert float((got.double() - want).norm() / want.norm()) < REL_TOL[dtype]
    ref = q.ref(x, b)
    assert float((ref.double() - want).norm() / want.norm()) < REL_TOL[dtype]


@pytest.mark.parametrize("m,k,group", [(3, 1024, 128), (16, 576, 64), (128, 576, 32)])
def test_int4_default_tiles_take_several_groups_a_step(m: int, k: int, group: int) -> None:
    """The default tiles' K steps (256 up to 32 rows, 64 at 128) hold several groups or part
    of one, K not a whole number of steps (576, SmolLM2's hidden size): each channel gets its
    own group's scale."""
    gen = generator(m + k)
    x = randn(m, k, gen=gen)
    w = randn(40, k, gen=gen) / k ** 0.5
    w[:, group:2 * group] *= 50.0  # a group whose scale differs from its neighbours'
    q = quantize_int4(w.to(DEVICE), group)
    with nan_empty():
        got = skinny_linear(x, q)
    want = skinny_linear_ref(x.double(), q.dequantize(torch.float64))
    assert float((got.double() - want).norm() / want.norm()) < REL_TOL[torch.float32]


def test_quantize_int4_per_row_and_group() -> None:
    """Each group's largest magnitude maps to ±7; values within half a step of the weight;
    byte i of a group of 64 holds its channel i in the low nibble and i + 32 in the high (the
    second group's bytes from byte 32 on); a zero group keeps scale 1;
    the group is the first of 128, 64, 32 that divides K (SmolLM2's K = 576: 64)."""
    w = torch.randn(4, 128, generator=generator(3))
    w[1, 64:] = 0.0
    w[3] *= 1e3
    q = quantize_int4(w, 64)
    assert q.data.dtype == torch.uint8 and q.data.shape == (4, 64) and q.scale.shape == (4, 2)
    assert q.shape == (4, 128) and q.nbytes == 4 * 64 + 8 * 4
    values = q.values()
    assert float(values.abs().amax()) == 7.0 and float(values.amin()) >= -8
    assert q.scale[1, 1] == 1.0 and bool((values[1, 64:] == 0).all())
    back = q.dequantize(torch.float32)
    step = q.scale.repeat_interleave(64, dim=1)
    assert bool(((back - w).abs() <= step / 2 + 1e-6 * w.abs()).all())
    for byte, channels in ((5, (5, 37)), (40, (72, 104))):
        low, high = (q.data[0, byte] & 15).item() - 8, (q.data[0, byte] >> 4).item() - 8
        assert (low, high) == tuple(values[0, c].item() for c in channels)
        assert (low, high) == tuple(torch.round(w[0, c] / q.scale[0, c // 64]).item()
                                    for c in channels)
    assert [scale_group(k) for k in (4096, 576, 1536, 96)] == [128, 64, 128, 32]
    with pytest.raises(ValueError, match="divisible by 32"):
        scale_group(100)


def _prmt(a: np.ndarray, b: int, selector: int) -> np.ndarray:
    """PTX `prmt.b32 d, a, b, selector` (default mode): byte i of d is byte n_i of the
    eight bytes {b, a} (a's bytes 0-3, b's 4-7), n_i the selector's nibble i."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [np.full_like(a, (b >> (8 * i)) & 0xFF)
                                                        for i in range(4)]
    return sum(pool[(selector >> (4 * i)) & 7] << (8 * i) for i in range(4))


def test_int8_to_f16_bit_steps_give_every_value() -> None:
    """`_int8_to_f16`'s PTX (run on GPUs only; the interpreter converts plainly), its steps
    emulated on every int8 value in each of the four byte lanes: xor 0x80 a byte, the bytes
    under 0x64 by the two selectors, minus 1152 in float16, give the values exactly and in
    order (lane i of the register is element i)."""
    values = np.arange(-128, 128, dtype=np.int64)
    for lane in range(4):
        others = (lane + 1) % 4
        packed = ((values & 0xFF) << (8 * lane)) | (0x7F << (8 * others))
        u = packed ^ 0x80808080
        halves = []
        for selector in (0x4140, 0x4342):
            word = _prmt(u, 0x64646464, selector).astype("<u4")
            pair = word.view("<f2").reshape(-1, 2)  # the low half first: elements 2i, 2i + 1
            halves.append(pair.astype(np.float32) - np.float32(1152.0))
        got = np.concatenate(halves, axis=1)  # [256, 4]: elements 0..3
        assert np.array_equal(got[:, lane], values.astype(np.float32))
        assert np.array_equal(got[:, others], np.full(256, 127.0, dtype=np.float32))
