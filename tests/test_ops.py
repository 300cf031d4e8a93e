"""`ops.dense_linear`: `F.linear` on every row count, dtype and shape, by whichever product
it takes (weight @ x^T for a few float32 rows on CPU, float32 for many bfloat16 rows);
`ops.exact_linear` in bfloat16: a row's bits the same at every row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vegas_spec.ops import (
    CPU_FEW_ROWS,
    CPU_STREAMED_BYTES,
    CPU_UPCAST_ROWS,
    dense_linear,
    exact_linear,
)

STREAMED = (576, 512)  # float32 weight of 1.1 MiB: over CPU_STREAMED_BYTES


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 21])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_linear_for_every_row_count(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    n, k = STREAMED
    x = torch.randn(rows, k, generator=g)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g) if bias else None
    assert w.numel() * 4 >= CPU_STREAMED_BYTES
    out = dense_linear(x, w, b)
    assert out.shape == (rows, n) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    low, high = CPU_FEW_ROWS
    if low <= rows <= high:  # the transposed product, bit for bit
        want = torch.mm(w, x.t()).t() + (0 if b is None else b)
        assert torch.equal(out, want)


def test_leading_axes_small_weights_and_other_dtypes() -> None:
    """[B, n, K] inputs whose rows fall in CPU_FEW_ROWS keep linear's shape; a weight under
    CPU_STREAMED_BYTES, one with fewer outputs than inputs, and bfloat16 at few rows are
    F.linear's own."""
    low, high = CPU_FEW_ROWS
    n, k = STREAMED
    x, w = torch.randn(1, high, k), torch.randn(n, k)
    out = dense_linear(x, w)
    assert out.shape == (1, high, n)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)
    small, down = torch.randn(48, k), torch.randn(k, 4 * n)
    assert torch.equal(dense_linear(x, small), F.linear(x, small))
    x_down = torch.randn(high, 4 * n)
    assert torch.equal(dense_linear(x_down, down), F.linear(x_down, down))
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(dense_linear(xb, wb), F.linear(xb, wb))  # few rows: bfloat16's own
    empty = dense_linear(torch.randn(0, k), w)
    assert empty.shape == (0, n)
    assert low >= 2  # one row is GEMV's own case, never transposed


@pytest.mark.parametrize("bias", [False, True])
def test_many_bfloat16_rows_run_in_float32_rounded_once(bias: bool) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, CPU_UPCAST_ROWS, 96, generator=g).bfloat16()
    w = torch.randn(160, 96, generator=g).bfloat16()
    b = torch.randn(160, generator=g).bfloat16() if bias else None
    out = dense_linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (2, CPU_UPCAST_ROWS, 160)
    want = F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()
    assert torch.equal(out, want)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=2e-2, atol=2e-2)


def test_bfloat16_exact_linear_rows_do_not_depend_on_the_row_count() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 96, generator=g).bfloat16()
    w, b = torch.randn(160, 96, generator=g).bfloat16(), torch.randn(160, generator=g).bfloat16()
    whole = exact_linear(x, w, b)
    assert whole.dtype == torch.bfloat16
    for rows in (1, 5, 16, 17):
        assert torch.equal(exact_linear(x[:rows], w, b), whole[:rows])
    torch.testing.assert_close(whole, F.linear(x, w, b), rtol=2e-2, atol=2e-2)
