"""The row-invariant projection: against `torch.nn.functional.linear`, and the same bits for a
row whether it is computed alone, in a verify-sized call or in a 448-row call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import DTYPES, generator, randn, tol

from vegas_spec.kernels.exact_matmul import exact_linear


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,n,bias", [(1, 64, 96, False), (7, 200, 130, True),
                                        (40, 96, 64, False)])
def test_matches_reference(m: int, k: int, n: int, bias: bool, dtype: torch.dtype) -> None:
    gen = generator(m + k + n)
    x = randn(m, k, gen=gen, dtype=dtype)
    w = randn(n, k, gen=gen, dtype=dtype) / k ** 0.5
    b = randn(n, gen=gen, dtype=dtype) if bias else None
    got = exact_linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got, F.linear(x, w, b), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_has_the_same_bits_in_every_row_count(dtype: torch.dtype) -> None:
    gen = generator(7)
    k, n = 192, 160
    w = randn(n, k, gen=gen, dtype=dtype) / k ** 0.5
    big = randn(448, k, gen=gen, dtype=dtype)
    whole = exact_linear(big, w)
    for rows in (slice(5, 6), slice(3, 10), slice(100, 164), slice(0, 448)):
        part = exact_linear(big[rows], w)
        assert torch.equal(part, whole[rows]), rows
    # the leading dims of a step ([B, n, K]) do not matter either
    assert torch.equal(exact_linear(big.view(64, 7, k), w).view(448, n), whole)
