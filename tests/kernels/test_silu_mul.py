"""SiLU(gate) * up against the decoder's `silu_mul`, and gpt-oss's clamped SwiGLU against
`ops.clamped_swiglu`: bit for bit in bfloat16 for every finite gate value; to float32
tolerance otherwise (exp's last bit is the platform's)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, generator, nan_empty, randn, tol

from vegas_spec import ops
from vegas_spec.kernels.silu_mul import SWIGLU_ALPHA, clamped_swiglu, silu_mul
from vegas_spec.ops import silu_mul as silu_mul_ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 7, 96), (3, 1, 3000)])  # [B, n, I]
def test_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = generator(shape[-1])
    # as the model has it: the output of the fused gate/up projection, [B, n, 2I]
    gate_up = 3 * randn(*shape[:-1], 2 * shape[-1], gen=gen, dtype=dtype)
    with nan_empty():
        got = silu_mul(gate_up)
    assert got.shape == shape and got.is_contiguous()
    torch.testing.assert_close(got, silu_mul_ref(gate_up), **tol(dtype))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, interpreting
def test_bfloat16_bit_exact_for_every_gate() -> None:
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    gate = bits.view(torch.bfloat16)
    gate = gate[gate.isfinite()].view(-1, 256)  # 65280 values (all but the 256 inf/NaN)
    up = randn(*gate.shape, gen=generator(0), dtype=torch.bfloat16)
    gate_up = torch.cat([gate.to(DEVICE), up], dim=-1)
    with nan_empty():
        got = silu_mul(gate_up)
    assert torch.equal(got, silu_mul_ref(gate_up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("limit", [7.0, 1.5])
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 7, 96), (3, 1, 3000)])  # [B, n, I]
def test_clamped_swiglu_matches_reference(shape: tuple[int, ...], limit: float,
                                          dtype: torch.dtype) -> None:
    """Gates and ups on both sides of the clamp."""
    gen = generator(shape[-1] + int(limit))
    gate_up = 3 * randn(*shape[:-1], 2 * shape[-1], gen=gen, dtype=dtype)
    with nan_empty():
        got = clamped_swiglu(gate_up, limit)
    assert got.shape == shape and got.is_contiguous()
    want = ops.clamped_swiglu(gate_up, limit)
    torch.testing.assert_close(got, want, **tol(dtype))
    assert (want - ops.clamped_swiglu(gate_up, 1e4)).abs().max() > 0.1  # the clamp bites


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, interpreting
def test_clamped_swiglu_bfloat16_bit_exact_for_every_gate() -> None:
    assert SWIGLU_ALPHA == ops.SWIGLU_ALPHA
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    gate = bits.view(torch.bfloat16)
    gate = gate[gate.isfinite()].view(-1, 256)
    up = 4 * randn(*gate.shape, gen=generator(1), dtype=torch.bfloat16)
    gate_up = torch.cat([gate.to(DEVICE), up], dim=-1)
    with nan_empty():
        got = clamped_swiglu(gate_up, 7.0)
    assert torch.equal(got, ops.clamped_swiglu(gate_up, 7.0))
