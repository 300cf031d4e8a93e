"""Fused residual add + RMSNorm against the decoder's `rms_norm` and `add_rms_norm`.

Bit for bit in every dtype on rows whose squares sum exactly in float32 (then the kernel's
reduction order cannot matter); to float32 tolerance, or one ulp of a half dtype, on any
rows."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import CUDA, DEVICE, DTYPES, generator, nan_empty, randn, tol

from vegas_spec.kernels.rms_norm import rms_norm
from vegas_spec.ops import add_rms_norm
from vegas_spec.ops import rms_norm as rms_norm_ref

EPS = 1e-6
ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1, 64), (2, 7, 96), (3, 7, 576)]  # [B, n, hidden]


def summable(*shape: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Multiples of 1/16 in [-2, 2]: exact in every dtype, and so are a row's sum of squares
    (and of x + residual's) in float32, in any order."""
    return (torch.randint(-32, 33, shape, generator=gen) / 16).to(device=DEVICE, dtype=dtype)


def weight(hidden: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return 1 + 0.2 * randn(hidden, gen=gen, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bit_exact(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = generator(shape[-1])
    x, res = summable(*shape, gen=gen, dtype=dtype), summable(*shape, gen=gen, dtype=dtype)
    w = weight(shape[-1], gen, dtype)
    with nan_empty():
        got = rms_norm(x, w, EPS)
        got_normed, got_h = rms_norm(x, w, EPS, res)
    assert torch.equal(got, rms_norm_ref(x, w, EPS))
    want_normed, want_h = add_rms_norm(x, res, w, EPS)
    assert torch.equal(got_normed, want_normed) and torch.equal(got_h, want_h)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = generator(shape[-1] + 1)
    x, res = 3 * randn(*shape, gen=gen, dtype=dtype), randn(*shape, gen=gen, dtype=dtype)
    w = weight(shape[-1], gen, dtype)
    with nan_empty():
        got = rms_norm(x, w, EPS)
        got_normed, got_h = rms_norm(x, w, EPS, res)
    torch.testing.assert_close(got, rms_norm_ref(x, w, EPS), **tol(dtype))
    want_normed, want_h = add_rms_norm(x, res, w, EPS)
    torch.testing.assert_close(got_normed, want_normed, **tol(dtype))
    assert torch.equal(got_h, want_h)


@pytest.mark.skipif(not CUDA, reason="half-precision rows at large: compiled kernels only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_within_one_ulp(dtype: torch.dtype) -> None:
    """Any rows: only the float32 sum of squares may round differently from torch's."""
    gen = generator(5)
    x, w = randn(64, 7, 576, gen=gen, dtype=dtype), weight(576, gen, dtype)
    got, want = rms_norm(x, w, EPS).float(), rms_norm_ref(x, w, EPS).float()
    ulp = torch.finfo(dtype).eps * want.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((got - want).abs() <= ulp).all()
    assert (got != want).float().mean() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,hkv,dim", [(4, 2, 64), (6, 1, 128)])
def test_heads_of_the_fused_projection(heads: int, hkv: int, dim: int,
                                       dtype: torch.dtype) -> None:
    """Qwen3's q/k norm: [B, n, heads, D] views into the fused qkv output, read in place."""
    gen = generator(dim)
    bsz, n = 2, 7
    qkv = summable(bsz, n, (heads + 2 * hkv) * dim, gen=gen, dtype=dtype)
    q = qkv[..., : heads * dim].view(bsz, n, heads, dim)
    k = qkv[..., heads * dim: (heads + hkv) * dim].view(bsz, n, hkv, dim)
    w = weight(dim, gen, dtype)
    for x in (q, k):
        with nan_empty():
            got = rms_norm(x, w, EPS)
        assert got.is_contiguous() and torch.equal(got, rms_norm_ref(x, w, EPS))
