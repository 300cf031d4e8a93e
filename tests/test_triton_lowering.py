"""The lowering of interpreted launches (`triton_lowering`): a kernel that the interpreter runs
but compiled Triton rejects is reported, with the compiler's message; a sound one is not."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
from triton_lowering import Recorder, compiled_twin

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="compiled Triton checks its own launches")


@triton.jit
def _product(a, b, acc, SWAP: tl.constexpr):
    if SWAP:  # the compiler goes on past this return to the next, with the other shapes
        return tl.dot(b, tl.trans(a), acc)
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _product_once(a, b, acc, SWAP: tl.constexpr):
    if SWAP:
        acc = tl.dot(b, tl.trans(a), acc)
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _outer_kernel(x_ptr, y_ptr, out_ptr, SWAP: tl.constexpr, ONCE: tl.constexpr):
    """out = x y^T (SWAP: its transpose) of a 16 x 32 and a 32 x 32 tile."""
    rm, rn, rk = tl.arange(0, 16), tl.arange(0, 32), tl.arange(0, 32)
    a = tl.load(x_ptr + rm[:, None] * 32 + rk[None, :])
    b = tl.load(y_ptr + rn[:, None] * 32 + rk[None, :])
    if SWAP:
        acc = tl.zeros([32, 16], tl.float32)
    else:
        acc = tl.zeros([16, 32], tl.float32)
    if ONCE:
        acc = _product_once(a, b, acc, SWAP)
    else:
        acc = _product(a, b, acc, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    tl.store(out_ptr + rm[:, None] * 32 + rn[None, :], acc)


def test_a_launch_the_compiler_rejects_is_reported() -> None:
    x, y = torch.randn(16, 32), torch.randn(32, 32)
    recorder = Recorder(prefix=__name__)
    recorder.start()
    try:
        for swap in (False, True):
            for once in (False, True):
                out = torch.empty(16, 32)
                _outer_kernel[(1,)](x, y, out, SWAP=swap, ONCE=once)
                # the interpreter runs every variant, the broken one too
                torch.testing.assert_close(out, x @ y.T, atol=1e-4, rtol=1e-4)
        _outer_kernel[(1,)](x, y, torch.empty(16, 32), SWAP=True, ONCE=True)  # seen: once
        assert len(recorder.pending) == 4
        failures = recorder.check()
        assert recorder.check() == []  # each launch is lowered once
    finally:
        recorder.stop()
    assert [launch for launch, _ in failures] == [
        f"{__name__}._outer_kernel with {{'SWAP': True, 'ONCE': False}}, {{}}"]
    assert "accumulator shape is incompatible" in failures[0][1]


def test_a_launch_is_also_lowered_as_a_gpu_makes_it() -> None:
    int8 = {"w_ptr": ("*i8", None), "HALF_DOT": (None, True), "INT8_PTX": (None, False),
            "MUL_RN": (None, False)}
    twin = compiled_twin(("m", "k", int8, {"num_warps": 4}))
    assert twin == ("m", "k", {**int8, "INT8_PTX": (None, True), "MUL_RN": (None, True)},
                    {"num_warps": 4})
    fp8 = {**int8, "w_ptr": ("*fp8e4nv", None), "MUL_RN": (None, True)}
    assert compiled_twin(("m", "k", fp8, {})) is None  # nothing a GPU sets otherwise
    mxfp4 = {"a_ptr": ("*fp32", None), "FP4": (None, True), "FP4_DOT": (None, 0)}
    assert compiled_twin(("m", "k", mxfp4, {}))[2] == {
        "a_ptr": ("*bf16", None), "FP4": (None, True), "FP4_DOT": (None, 1)}


@triton.jit
def _halve_kernel(x_ptr, out_ptr, MUL_RN: tl.constexpr):
    """out = x / 2 of 16 values; MUL_RN (compiled only): by inline PTX with a misspelt
    instruction, which only ptxas rejects."""
    offs = tl.arange(0, 16)
    x = tl.load(x_ptr + offs)
    if MUL_RN:
        x = tl.inline_asm_elementwise("mulx.rn.f32 $0, $1, 0f3F000000;", "=r,r", [x],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        x = x * 0.5
    tl.store(out_ptr + offs, x)


def test_inline_ptx_of_a_gpu_only_setting_is_compiled_whole() -> None:
    x, out = torch.randn(16), torch.empty(16)
    recorder = Recorder(prefix=__name__)
    recorder.start()
    try:
        _halve_kernel[(1,)](x, out, MUL_RN=False)
        assert [whole for _, whole in recorder.pending.values()] == [False, True]
        failures = recorder.check()
    finally:
        recorder.stop()
    torch.testing.assert_close(out, x / 2)
    assert [launch for launch, _ in failures] == [
        f"{__name__}._halve_kernel with {{'MUL_RN': True}}, {{}}"]
    assert "mulx" in failures[0][1] and "ptxas" in failures[0][1]
