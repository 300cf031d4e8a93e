"""`ops.dense_linear`: `F.linear` on every row count, dtype and shape, by whichever product
it takes (weight @ x^T for a few float32 rows on CPU, float32 for many bfloat16 rows);
`ops.exact_linear` in bfloat16: a row's bits the same at every row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vegas_spec.ops import CPU_FEW_ROWS, CPU_UPCAST_ROWS, dense_linear, exact_linear


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 21])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_linear_for_every_row_count(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w, b = torch.randn(160, 96, generator=g), torch.randn(160, generator=g) if bias else None
    out = dense_linear(x, w, b)
    assert out.shape == (rows, 160) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_leading_axes_and_other_dtypes_keep_linears_shape() -> None:
    """[B, n, K] inputs whose rows fall in CPU_FEW_ROWS, and bfloat16 (left to F.linear)."""
    low, high = CPU_FEW_ROWS
    x = torch.randn(1, high, 64)
    w = torch.randn(48, 64)
    out = dense_linear(x, w)
    assert out.shape == (1, high, 48)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(dense_linear(xb, wb), F.linear(xb, wb))  # few rows: bfloat16's own
    empty = dense_linear(torch.randn(0, 64), w)
    assert empty.shape == (0, 48)
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
