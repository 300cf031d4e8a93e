"""The repairs of Triton's interpreter that `vegas_spec.kernels` installs where kernels run on
CPU tensors: here, that a launch patches the language once, device functions inside it run on
the launch's patches, and everything is restored when the launch ends."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import vegas_spec.kernels as kernels

pytestmark = pytest.mark.skipif(not kernels.interpreting(), reason="the interpreter's repairs")


@triton.jit
def _scaled(x, k):  # a device function: runs inside the launch's patches
    return x * k + tl.full(x.shape, 1.0, tl.float32)


@triton.jit
def _twice(x):  # a device function calling another
    return _scaled(x, 2.0)


@triton.jit
def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    total = tl.sum(tl.where(mask, x, 0.0), axis=0) + tl.sum(x, axis=0)  # triton's device code
    tl.store(out_ptr + offs, _twice(x) + total * 0.0, mask=mask)


def _language() -> dict[str, object]:
    """Every member of the modules a launch patches and restores, as they are now (Triton's
    own device functions, as `tl.sum`, patch `triton.language.core` and leave it patched)."""
    modules = (tl, tl.tensor, tl.math)
    return {f"{m.__name__}.{name}": getattr(m, name)
            for m in modules for name in dir(m) if not name.startswith("__")}


def test_device_functions_run_on_the_launchs_patches_and_all_is_restored() -> None:
    before = _language()
    x = torch.arange(37, dtype=torch.float32)
    for _ in range(3):  # the wrapped builtins are reused launch after launch
        out = torch.full_like(x, float("nan"))
        _kernel[(triton.cdiv(37, 16),)](x, out, 37, BLOCK=16)
        assert torch.equal(out, x * 2.0 + 1.0)
    after = _language()
    assert after.keys() == before.keys()
    assert [k for k in before if after[k] is not before[k]] == []


def test_a_launch_patches_once_whatever_its_device_functions_call() -> None:
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "_once_per_launch", False)
    calls = []
    core = interpreter._patch_lang_core  # called once per language module a patch covers

    def counting(lang, scope):  # noqa: ANN001, ANN202
        calls.append(lang)
        return core(lang, scope)

    interpreter._patch_lang_core = counting
    try:
        x = torch.arange(8, dtype=torch.float32)
        out = torch.empty_like(x)
        _kernel[(1,)](x, out, 8, BLOCK=8)  # one program calling device functions
        assert torch.equal(out, x * 2.0 + 1.0)
    finally:
        interpreter._patch_lang_core = core
    # the launch's patch, then the first `tl.sum`'s (triton.language.core, with
    # triton.language where Triton's module holds it by then); none for the second `tl.sum`,
    # _twice or _scaled (unrepaired: core twice, and six patches or more)
    assert calls[0] is tl
    assert calls.count(tl.core) == 1
    assert len(calls) <= 3, calls


def test_block_types_are_shared_and_tensors_take_their_shapes() -> None:
    core = tl.core
    a = core.block_type(tl.float32, [4, tl.constexpr(8)])
    assert a is core.block_type(tl.float32, [tl.constexpr(4), 8])
    assert a.shape == (4, 8) and a.numel == 32 and a.element_ty == tl.float32
    assert core.block_type(tl.float32, [8, 4]) is not a
    assert core.block_type(tl.bfloat16, [4, 8]) is not a
    pointers = core.block_type(core.pointer_type(tl.float32), [16])
    assert pointers is core.block_type(core.pointer_type(tl.float32), [16])
    assert pointers is not core.block_type(core.pointer_type(tl.float16), [16])
    assert pointers is not core.block_type(core.pointer_type(tl.float32, const=True), [16])
    first, second = core.tensor(None, a), core.tensor(None, a)
    for t in (first, second):
        assert [s.value for s in t.shape] == [4, 8] and t.numel.value == 32
        assert t.dtype == tl.float32 and t.type is a
    scalar = core.tensor(None, tl.int32)
    assert len(scalar.shape) == 0 and scalar.numel.value == 1 and scalar.dtype == tl.int32
