"""The few-row projection against a float64 `F.linear`: every row count of a step up to 64,
column blocks that N leaves partial, K steps that K leaves partial, bias, and K split over
programs (one split left empty); more than 64 rows are refused. On a GPU also the 8B models'
projection shapes in bfloat16. The fused prologues (RMSNorm with and without the residual
add, SiLU * up) against their float64 oracles in `ops`, the residual stream h to the bit."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import CUDA, DEVICE, generator, nan_empty, randn

from vegas_spec import ops
from vegas_spec.kernels.silu_mul import silu_mul
from vegas_spec.kernels.skinny_matmul import (
    GPU_SMS,
    MAX_ROWS,
    SkinnyTiles,
    skinny_linear,
    skinny_linear_ref,
    skinny_norm_linear,
    skinny_silu_linear,
    skinny_tiles,
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,bias,split_k", CASES)
def test_matches_float64_reference(m: int, k: int, bias: bool, split_k: int,
                                   dtype: torch.dtype) -> None:
    gen = generator(m + k)
    x = randn(m, k, gen=gen, dtype=dtype)
    w = randn(N, k, gen=gen, dtype=dtype) / k ** 0.5
    b = randn(N, gen=gen, dtype=dtype) if bias else None
    with nan_empty():  # outputs and partials start as NaN: an unwritten element fails
        got = skinny_linear(x, w, b, tiles=SkinnyTiles(64, 64, 4, 2, split_k))
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


def test_default_tiles_fill_the_gpu_at_8b_shapes() -> None:
    for n, k in SHAPES_8B:
        for m in (1, 16, 64):
            t = skinny_tiles(m, n, k)
            assert -(-n // t.block_n) * t.split_k >= GPU_SMS, (m, n, k, t)


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


# --- fused prologues ------------------------------------------------------------------------

def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,bias,residual", [(1, 256, False, True), (7, 200, True, True),
                                               (16, 256, True, False), (64, 200, False, True)])
def test_norm_prologue_matches_its_oracle(m: int, k: int, bias: bool, residual: bool,
                                          dtype: torch.dtype) -> None:
    """rms_norm(x + residual) * g @ W^T (+ b) and h = x + residual, against `ops.norm_linear`
    in float64 (rows far from unit scale: the 1/rms factor matters); h is the dtype's
    rounded sum, as `ops.add_rms_norm` gives it."""
    gen = generator(3 * m + k)
    x = 4 * randn(m, k, gen=gen, dtype=dtype)
    r = randn(m, k, gen=gen, dtype=dtype) if residual else None
    g = (1 + randn(k, gen=gen, dtype=torch.float32) / 4).to(dtype)
    w = randn(N, k, gen=gen, dtype=dtype) / k ** 0.5
    b = randn(N, gen=gen, dtype=dtype) if bias else None
    with nan_empty():
        got, h = skinny_norm_linear(x, r, g, 1e-5, w, b, tiles=SkinnyTiles(64, 64, 4, 2))
    want, _ = ops.norm_linear(*(None if t is None else t.double() for t in (x, r, g)), 1e-5,
                              w.double(), None if b is None else b.double())
    assert got.shape == (m, N) and got.dtype == dtype
    assert rel(got, want) < REL_TOL[dtype]
    assert torch.equal(h, x if r is None else ops.add_rms_norm(x, r, g, 1e-5)[1])


def test_norm_prologue_never_splits_k() -> None:
    """Tiles that split K are run unsplit (the 1/rms needs the whole row); leading dims."""
    gen = generator(11)
    x, r = randn(2, 3, 128, gen=gen), randn(2, 3, 128, gen=gen)
    g, w = randn(128, gen=gen), randn(40, 128, gen=gen) / 128 ** 0.5
    with nan_empty():
        got, h = skinny_norm_linear(x, r, g, 1e-6, w, tiles=SkinnyTiles(32, 32, 4, 2, 4))
    want, _ = ops.norm_linear(x.double(), r.double(), g.double(), 1e-6, w.double())
    assert got.shape == (2, 3, 40) and h.shape == x.shape
    assert rel(got, want) < REL_TOL[torch.float32] and torch.equal(h, x + r)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,inter,bias,split_k", CASES)
def test_silu_prologue_matches_its_oracle(m: int, inter: int, bias: bool, split_k: int,
                                          dtype: torch.dtype) -> None:
    """(silu(gate) * up) @ W^T (+ b) against F.linear of the SiLU * up kernel's own output in
    float64: the operand is rounded as that kernel rounds it, so only the sum differs."""
    gen = generator(5 * m + inter)
    gate_up = 2 * randn(m, 2 * inter, gen=gen, dtype=dtype)
    w = randn(N, inter, gen=gen, dtype=dtype) / inter ** 0.5
    b = randn(N, gen=gen, dtype=dtype) if bias else None
    with nan_empty():
        got = skinny_silu_linear(gate_up, w, b, tiles=SkinnyTiles(64, 64, 4, 2, split_k))
    want = skinny_linear_ref(silu_mul(gate_up).double(), w.double(),
                             None if b is None else b.double())
    assert got.shape == (m, N) and got.dtype == dtype
    assert rel(got, want) < REL_TOL[dtype]
    assert rel(got, ops.silu_linear(gate_up.double(), w.double(),
                                    None if b is None else b.double())) < 2 * REL_TOL[dtype]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (4096, 14336), (960, 576),
                                 (3072, 576), (576, 1536)])
def test_fused_prologues_at_model_shapes_in_bfloat16(n: int, k: int) -> None:
    """The 8B and SmolLM2 shapes a draft or plain step runs fused, default tiles, against
    the two unfused kernels' path (`ops` oracle in float32)."""
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen, device=DEVICE) / k ** 0.5).to(torch.bfloat16)
    g = (1 + torch.randn(k, generator=gen, device=DEVICE) / 4).to(torch.bfloat16)
    for m in (1, 16, 64):
        x = (4 * torch.randn(m, k, generator=gen, device=DEVICE)).to(torch.bfloat16)
        r = torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16)
        got, h = skinny_norm_linear(x, r, g, 1e-5, w)
        want, _ = ops.norm_linear(x.float(), r.float(), g.float(), 1e-5, w.float())
        assert rel(got, want) < 1e-2 and torch.equal(h, x + r), (m, n, k)
        gate_up = (2 * torch.randn(m, 2 * k, generator=gen, device=DEVICE)).to(torch.bfloat16)
        got = skinny_silu_linear(gate_up, w)
        assert rel(got, skinny_linear_ref(silu_mul(gate_up).float(), w.float())) < 1e-2
