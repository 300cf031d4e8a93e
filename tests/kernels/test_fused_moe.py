"""The fused mixture of experts against its reference (`ops.moe_experts`) at several token
counts, top-k and expert counts; its grouping of tokens by expert (fixed shapes, every pair
once, each block one expert's); and exact mode: a token's output has the same bits whatever
the other tokens of the step; on a GPU, routing, grouping and both kernels captured in one
CUDA graph (fixed shapes, no host sync) replay other routings as eager runs compute them."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_cases import CUDA, DEVICE, DTYPES, as_sm90, generator, nan_empty, randn, tol

from vegas_spec import ops
from vegas_spec.kernels.fused_moe import (
    E2M1_PTX,
    MAX_GROUP_PAIRS,
    TUNING,
    MatmulTiles,
    _e2m1_halves,
    _mxfp4_tile,
    fused_moe,
    group_by_expert,
    group_by_expert_ref,
    max_blocks,
    moe_tiles,
)
from vegas_spec.quant import MXFP4_MAX_SCALE, MXFP4_MIN_SCALE, Mxfp4, mxfp4_dequantize

HIDDEN, INTER = 64, 32


def experts(e: int, gen: torch.Generator, dtype: torch.dtype = torch.float32,
            hidden: int = HIDDEN, inter: int = INTER) -> tuple[torch.Tensor, torch.Tensor]:
    """Random gate_up [E, 2I, H] and down [E, H, I], scaled so outputs stay near 1."""
    return (randn(e, 2 * inter, hidden, gen=gen, dtype=dtype) / hidden ** 0.5,
            randn(e, hidden, inter, gen=gen, dtype=dtype) / inter ** 0.5)


def routed(t: int, e: int, k: int, gen: torch.Generator, dtype: torch.dtype = torch.float32,
           renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.route(randn(t, e, gen=gen, dtype=dtype) * 2, k, renormalize)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (3, 8, 1), (7, 4, 4), (40, 8, 2), (33, 16, 3),
                                   (2, 16, 8)])
def test_matches_reference(t: int, e: int, k: int, dtype: torch.dtype) -> None:
    gen = generator(100 * t + 10 * e + k)
    x = randn(t, HIDDEN, gen=gen, dtype=dtype)
    gate_up, down = experts(e, gen, dtype)
    weights, ids = routed(t, e, k, gen, dtype, renormalize=k > 1)
    with nan_empty():  # a pair the kernels skip would leave NaN in their buffers
        got = fused_moe(x, gate_up, down, weights, ids)
    assert got.shape == (t, HIDDEN) and got.dtype == dtype
    ref = ops.moe_experts(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got, ref, **tol(dtype))


def oss_extras(e: int, gen: torch.Generator, dtype: torch.dtype = torch.float32,
               hidden: int = HIDDEN, inter: int = INTER, biases: bool = True,
               limit: float = 0.5) -> dict:
    """gpt-oss's expert biases and SwiGLU clamp, as `fused_moe` and `ops.moe_experts` take
    them: a limit of 0.5 clamps many of the random activations."""
    extras: dict = {"limit": limit}
    if biases:
        extras["gate_up_bias"] = randn(e, 2 * inter, gen=gen, dtype=dtype) * 0.5
        extras["down_bias"] = randn(e, hidden, gen=gen, dtype=dtype) * 0.5
    return extras


OSS_VARIANTS = {"biases-clamp": (True, 0.5), "biases": (True, 0.0), "clamp": (False, 0.5)}


@pytest.mark.parametrize("variant", OSS_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (7, 4, 4), (40, 8, 2), (33, 16, 3)])
def test_biases_and_clamp_match_reference(t: int, e: int, k: int, dtype: torch.dtype,
                                          variant: str) -> None:
    """gpt-oss's experts: a bias per expert on gate/up and on down, the clamped SwiGLU."""
    gen = generator(100 * t + 10 * e + k + 1)
    x = randn(t, HIDDEN, gen=gen, dtype=dtype)
    gate_up, down = experts(e, gen, dtype)
    weights, ids = routed(t, e, k, gen, dtype)
    biases, limit = OSS_VARIANTS[variant]
    extras = oss_extras(e, gen, dtype, biases=biases, limit=limit)
    with nan_empty():
        got = fused_moe(x, gate_up, down, weights, ids, **extras)
    ref = ops.moe_experts(x, gate_up, down, weights, ids, **extras)
    torch.testing.assert_close(got, ref, **tol(dtype))
    plain = ops.moe_experts(x, gate_up, down, weights, ids)
    assert (ref - plain).abs().max() > 0.05  # the biases and the clamp matter here


def test_odd_sizes_and_no_tokens() -> None:
    """Sizes off the tiles (hidden 40, intermediate 24) and a step of no tokens."""
    gen = generator(5)
    gate_up, down = experts(6, gen, hidden=40, inter=24)
    x = randn(9, 40, gen=gen)
    weights, ids = routed(9, 6, 2, gen)
    torch.testing.assert_close(fused_moe(x, gate_up, down, weights, ids),
                               ops.moe_experts(x, gate_up, down, weights, ids), **tol(x.dtype))
    none = fused_moe(x[:0], gate_up, down, weights[:0], ids[:0])
    assert none.shape == (0, 40)
    extras = oss_extras(6, gen, hidden=40, inter=24)
    torch.testing.assert_close(fused_moe(x, gate_up, down, weights, ids, **extras),
                               ops.moe_experts(x, gate_up, down, weights, ids, **extras),
                               **tol(x.dtype))


def test_reference_is_transformers_routing() -> None:
    """The router: softmax in float32, top-k, renormalised only where asked."""
    gen = generator(3)
    logits = randn(5, 8, gen=gen)
    for renormalize in (False, True):
        weights, ids = ops.route(logits, 3, renormalize)
        probs = torch.softmax(logits, -1)
        top = probs.topk(3, -1)
        want = top.values / top.values.sum(-1, keepdim=True) if renormalize else top.values
        assert torch.equal(ids, top.indices)
        torch.testing.assert_close(weights, want)


GROUPINGS = [(1, 8, 2, 16), (40, 8, 2, 16), (5, 64, 4, 16), (100, 4, 2, 16), (50, 8, 3, 4),
             (1, 128, 8, 16), (16, 128, 8, 16), (128, 128, 8, 16), (129, 128, 8, 16),
             (300, 32, 4, 64)]


def random_ids(t: int, e: int, k: int) -> torch.Tensor:
    gen = generator(t + e)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(DEVICE)
    if t == 100:  # most pairs on one expert: its run spans several blocks
        ids[:, 0] = 0
    return ids


@pytest.mark.parametrize("group", [group_by_expert, group_by_expert_ref], ids=["kernel", "ref"])
@pytest.mark.parametrize("t,e,k,block", GROUPINGS)
def test_grouping_puts_every_pair_once_in_a_block_of_its_expert(t: int, e: int, k: int,
                                                                block: int, group) -> None:  # noqa: ANN001
    ids = random_ids(t, e, k)
    pair_of, expert_of = group(ids, e, block)
    nb = max_blocks(t * k, e, block)
    assert pair_of.shape == (nb * block,) and expert_of.shape == (nb,)
    rows = pair_of.view(nb, block).long()
    real = rows < t * k
    assert sorted(rows[real].tolist()) == list(range(t * k))
    flat = ids.reshape(-1)
    used = expert_of >= 0
    for b in range(nb):
        assert bool(used[b]) == bool(real[b].any())
        assert (flat[rows[b][real[b]]] == expert_of[b]).all()
    assert used.long().diff().le(0).all(), "unused blocks come last"
    blocks = -(-torch.bincount(flat, minlength=e) // block)
    assert int(used.sum()) == int(blocks.sum())


@pytest.mark.parametrize("t,e,k,block", GROUPINGS)
def test_the_grouping_kernel_gives_the_references_groups(t: int, e: int, k: int,
                                                         block: int) -> None:
    """Up to MAX_GROUP_PAIRS pairs one launch groups them as the sort does, row for row
    (the stable order within an expert included); past it the reference's ops run."""
    ids = random_ids(t, e, k)
    with nan_empty():
        got = group_by_expert(ids, e, block)
    want = group_by_expert_ref(ids, e, block)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("k", [1, 3])
def test_ids_sliced_from_a_wider_tensor_group_as_their_values(k: int) -> None:
    """ids taken as the first k columns of a sort's [T, E] result (strided; a [T, 1] slice
    flattens to a strided view) group as a contiguous copy of them."""
    wide = torch.stack([torch.randperm(8, generator=generator(t)) for t in range(5)]).to(DEVICE)
    ids = wide[:, :k]
    assert not ids.is_contiguous()
    with nan_empty():
        got = group_by_expert(ids, 8, 16)
    want = group_by_expert_ref(ids.contiguous(), 8, 16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_groupings_cover_both_paths() -> None:
    pairs = [t * k for t, _, k, _ in GROUPINGS]
    assert min(pairs) == 2 and max(pairs) > MAX_GROUP_PAIRS >= 1024 >= 128 * 8


def test_slots_sum_in_order_with_each_sum_rounded() -> None:
    """A token's top-k rows are added in slot order, each sum rounded to the dtype (torch's
    chain of adds); a float32 sum rounded once differs."""
    from vegas_spec.kernels.fused_moe import _sum_slots

    gen = generator(8)
    y = (randn(3, 8, 96, gen=gen) * 100).to(torch.float16)
    want = ops.sum_slots(y)
    got = _sum_slots(y)
    assert got.dtype == torch.float16 and torch.equal(got, want)
    assert not torch.equal(y.float().sum(1).half(), want)
    assert torch.equal(_sum_slots(y[:, :1].contiguous()), y[:, 0])


@pytest.mark.parametrize("oss", [False, True], ids=["plain", "biases-clamp"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_exact_mode_rows_do_not_depend_on_the_step(dtype: torch.dtype, oss: bool) -> None:
    """Kernel (exact=True) and reference (exact=True): a token's output has the same bits
    alone, in a verify-sized step and in a large one, where its pairs sit in other blocks
    beside other tokens (gpt-oss's biases and clamp too)."""
    gen = generator(11)
    e, k, t = 8, 2, 48
    gate_up, down = experts(e, gen, dtype)
    x = randn(t, HIDDEN, gen=gen, dtype=dtype)
    weights, ids = routed(t, e, k, gen, dtype)
    extras = oss_extras(e, gen, dtype) if oss else {}
    for run in (lambda *a: fused_moe(*a, exact=True, **extras),
                lambda *a: ops.moe_experts(*a, exact=True, **extras)):
        whole = run(x, gate_up, down, weights, ids)
        for rows in (slice(5, 6), slice(3, 10), slice(20, 45)):
            part = run(x[rows], gate_up, down, weights[rows], ids[rows])
            assert torch.equal(part, whole[rows]), rows


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need CUDA")
def test_a_captured_step_replays_other_routings() -> None:
    gen = generator(13)
    t, e, k = 24, 64, 4
    gate_up, down = experts(e, gen, torch.bfloat16)
    x = randn(t, HIDDEN, gen=gen, dtype=torch.bfloat16)
    logits = randn(t, e, gen=gen, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        return fused_moe(x, gate_up, down, *ops.route(logits, k, True))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x.copy_(randn(t, HIDDEN, gen=gen, dtype=torch.bfloat16))
        logits.copy_(randn(t, e, gen=gen, dtype=torch.bfloat16) * 3)
        graph.replay()
        assert torch.equal(out, step())


def mxfp4_stack(e: int, rows: int, k: int, gen: torch.Generator, low: int = 120,
                high: int = 124) -> Mxfp4:
    """Random MXFP4 experts [E, rows, K]: every byte value, scales 2^(low-127)..2^(high-128)."""
    blocks = torch.randint(0, 256, (e, rows, k // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(low, high, (e, rows, k // 32), dtype=torch.uint8, generator=gen)
    return Mxfp4(blocks.to(DEVICE), scales.to(DEVICE))


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
@pytest.mark.parametrize("oss", [False, True], ids=["silu", "gpt-oss"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (7, 4, 4), (33, 16, 3)])
def test_mxfp4_experts_give_the_products_of_their_dequantised_weights(
        t: int, e: int, k: int, dtype: torch.dtype, oss: bool, exact: bool) -> None:
    """Experts read as stored and decoded in the kernel (`fp4_dot` 0, the form of float32
    rows and the interpreter) give, bit for bit, what the same kernel gives on the
    dequantised stacks (`quant.mxfp4_dequantize`), and the reference's output to rounding."""
    gen = generator(7 * t + e + k)
    gate_up, down = mxfp4_stack(e, 2 * INTER, HIDDEN, gen), mxfp4_stack(e, HIDDEN, INTER, gen)
    dense = gate_up.dequantize(dtype), down.dequantize(dtype)
    x = randn(t, HIDDEN, gen=gen, dtype=dtype)
    weights, ids = routed(t, e, k, gen, dtype, renormalize=k > 1)
    extras = oss_extras(e, gen, dtype) if oss else {}
    with nan_empty():
        got = fused_moe(x, gate_up, down, weights, ids, exact, fp4_dot=0, **extras)
    assert torch.equal(got, fused_moe(x, *dense, weights, ids, exact, **extras))
    ref = ops.moe_experts(x, *dense, weights, ids, exact, **extras)
    torch.testing.assert_close(got, ref, **tol(dtype))


@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [BLOCK_N, K] of MXFP4 bytes and scales decoded by the kernel's `_mxfp4_tile`."""
    rn = tl.arange(0, BLOCK_N)
    w_row = w_ptr + rn[:, None] * (K // 2)
    s_row = s_ptr + rn[:, None] * (K // 32)
    for k0 in range(0, K, BLOCK_K):
        values = _mxfp4_tile(w_row, s_row, k0, K, rn < BLOCK_N, BLOCK_N, BLOCK_K)
        tl.store(out_ptr + rn[:, None] * K + k0 + tl.arange(0, BLOCK_K)[None, :], values)


def test_the_kernel_decodes_every_code_at_every_scale_exactly() -> None:
    """Every byte (both nibbles, so every e2m1 code with either neighbour) at every scale
    the kernel takes, 2^-127 (subnormal results) to 2^113: the float32 values of
    `quant.mxfp4_dequantize`, bit for bit (0.0 and -0.0 apart)."""
    rows, k = 16, 512  # 256 blocks of 32 values
    blocks = torch.arange(256, dtype=torch.uint8).repeat(16).view(rows, k // 32, 16)
    scales = torch.cat([torch.arange(MXFP4_MAX_SCALE + 1),
                        torch.arange(256 - MXFP4_MAX_SCALE - 1)]).to(torch.uint8)
    scales = scales.view(rows, k // 32)
    want = mxfp4_dequantize(blocks, scales, torch.float32).view(rows, k)
    got = torch.empty(rows, k, device=DEVICE)
    _decode_kernel[(1,)](blocks.to(DEVICE), scales.to(DEVICE), got, k, BLOCK_N=rows,
                         BLOCK_K=64)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got.cpu().signbit(), want.signbit())


@pytest.mark.skipif(not CUDA, reason="Triton's scaled dot runs on a GPU only")
@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (7, 4, 4), (33, 16, 3)])
def test_the_scaled_dot_gives_the_products_of_the_dequantised_weights(
        t: int, e: int, k: int, exact: bool) -> None:
    """bfloat16 rows against MXFP4 experts through Triton's scaled dot (`fp4_dot` 1):
    gpt-oss's experts, what the kernel gives on the dequantised stacks, to rounding, and in
    exact mode a token's output whatever the other tokens of the step."""
    gen = generator(11 * t + e + k)
    dtype = torch.bfloat16
    gate_up, down = mxfp4_stack(e, 2 * INTER, HIDDEN, gen), mxfp4_stack(e, HIDDEN, INTER, gen)
    dense = gate_up.dequantize(dtype), down.dequantize(dtype)
    x = randn(t, HIDDEN, gen=gen, dtype=dtype)
    weights, ids = routed(t, e, k, gen, dtype, renormalize=k > 1)
    extras = oss_extras(e, gen, dtype)
    with nan_empty():
        got = fused_moe(x, gate_up, down, weights, ids, exact, fp4_dot=1, **extras)
    want = fused_moe(x, *dense, weights, ids, exact, **extras)
    torch.testing.assert_close(got, want, **tol(dtype))
    if exact:
        for row in range(t):
            alone = fused_moe(x[row:row + 1], gate_up, down, weights[row:row + 1],
                              ids[row:row + 1], True, fp4_dot=1, **extras)
            assert torch.equal(alone, got[row:row + 1])


@triton.jit
def _scaled_dot_decode_kernel(w_ptr, s_ptr, out_ptr, K, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
    """Rows [BLOCK_N, K] of MXFP4 bytes and scales through the scaled dot with an identity
    block of bfloat16 rows: out [K, BLOCK_N] is their values, one product each."""
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    eye = (rk[:, None] == rk[None, :]).to(tl.bfloat16)
    for k0 in range(0, K, BLOCK_K):
        packed = tl.load(w_ptr + rn[:, None] * (K // 2) + k0 // 2
                         + tl.arange(0, BLOCK_K // 2)[None, :])
        scale = tl.load(s_ptr + rn[:, None] * (K // 32) + k0 // 32
                        + tl.arange(0, BLOCK_K // 32)[None, :])
        values = tl.dot_scaled(eye, None, "bf16", tl.trans(packed), scale, "e2m1",
                               fast_math=True)
        tl.store(out_ptr + (k0 + rk)[:, None] * BLOCK_N + rn[None, :], values)


@pytest.mark.skipif(not CUDA, reason="Triton's scaled dot runs on a GPU only")
def test_the_scaled_dot_decodes_every_code_at_every_scale_exactly() -> None:
    """The scaled dot's decoding (`fp4_dot` 1) at every code and scale the engine
    keeps packed: `quant.mxfp4_dequantize`'s bfloat16 values, bit for bit."""
    rows, k = 16, 512
    blocks = torch.arange(256, dtype=torch.uint8).repeat(16).view(rows, k // 32, 16)
    scales = torch.cat([torch.arange(MXFP4_MIN_SCALE, MXFP4_MAX_SCALE + 1),
                        torch.arange(MXFP4_MIN_SCALE, MXFP4_MIN_SCALE + 256
                                     - (MXFP4_MAX_SCALE + 1 - MXFP4_MIN_SCALE))])
    scales = scales.to(torch.uint8).view(rows, k // 32)
    want = mxfp4_dequantize(blocks, scales, torch.bfloat16).view(rows, k).float()
    got = torch.empty(k, rows, device=DEVICE)
    _scaled_dot_decode_kernel[(1,)](blocks.to(DEVICE), scales.to(DEVICE), got, k,
                                    BLOCK_N=rows, BLOCK_K=64)
    assert torch.equal(got.T.cpu(), want)


def _run_ptx(text: str, operands: list[int]) -> list[int]:
    """The 32-bit registers `text` leaves in $0.. given its inputs (`operands`: $n.. after the
    outputs), by the meaning PTX gives the instructions it uses: mov, and, shl, shr, lop3 and
    prmt (default mode: 4-bit selectors in the low 16 bits of c, a set bit 3 replicating the
    selected byte's sign bit)."""
    regs: dict[str, int] = {f"${n}": v for n, v in enumerate(operands, start=4)}
    mask = 0xFFFFFFFF

    def value(token: str) -> int:
        return int(token, 0) if token[0].isdigit() else regs[token]

    for line in text.strip("{} \n").split(";"):
        words = line.replace(",", " ").split()
        if not words or words[0] == ".reg":
            continue
        op, dst, args = words[0].split(".")[0], words[1], [value(w) for w in words[2:]]
        if op == "mov":
            result = args[0]
        elif op == "and":
            result = args[0] & args[1]
        elif op == "shl":
            result = (args[0] << args[1]) & mask
        elif op == "shr":
            result = args[0] >> args[1]
        elif op == "lop3":
            a, b, c, lut = args
            result = sum(((lut >> (((a >> i & 1) << 2) | ((b >> i & 1) << 1) | (c >> i & 1))) & 1)
                         << i for i in range(32))
        elif op == "prmt":
            pool = args[0] | (args[1] << 32)
            result = 0
            for k in range(4):
                sel = (args[2] >> (4 * k)) & 0xF
                byte = (pool >> (8 * (sel & 7))) & 0xFF
                if sel & 8:
                    byte = 0xFF if byte & 0x80 else 0
                result |= byte << (8 * k)
        else:
            raise AssertionError(f"no meaning for {op}")
        regs[dst] = result
    return [regs[f"${n}"] for n in range(4)]


def test_the_ptx_decode_gives_every_code_in_every_place() -> None:
    """`E2M1_PTX`, run by the PTX emulator on every byte in each of the four places of its
    input register (the others random): each nibble's bfloat16 value as
    `quant.mxfp4_dequantize` gives it at scale 1 (-0.0 for the negative zero), the low
    nibbles' values in $0-$1 and the high nibbles' in $2-$3, in element order."""
    values = mxfp4_dequantize(torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16)
                              .reshape(1, 16, 16), torch.full((1, 16), 127, dtype=torch.uint8),
                              torch.bfloat16).view(256, 2).view(torch.int16).tolist()
    gen = generator(5)
    for place in range(4):
        others = torch.randint(0, 256, (256, 4), generator=gen).tolist()
        for byte in range(256):
            parts = others[byte]
            parts[place] = byte
            word = sum(b << (8 * i) for i, b in enumerate(parts))
            out = _run_ptx(E2M1_PTX.value, [word])
            halves = [(r >> (16 * h)) & 0xFFFF for r in out for h in range(2)]
            lo, hi = halves[:4], halves[4:]
            for i, b in enumerate(parts):
                assert [lo[i], hi[i]] == [v & 0xFFFF for v in values[b]], (place, byte, i)


@triton.jit
def _halves_kernel(w_ptr, lo_ptr, hi_ptr, N: tl.constexpr, PTX: tl.constexpr):
    """N MXFP4 bytes -> `_e2m1_halves`' two tiles, as float32."""
    offs = tl.arange(0, N)
    lo, hi = _e2m1_halves(tl.load(w_ptr + offs[None, :]), PTX)
    tl.store(lo_ptr + offs[None, :], lo.to(tl.float32))
    tl.store(hi_ptr + offs[None, :], hi.to(tl.float32))


def test_the_unscaled_decode_gives_every_code_exactly() -> None:
    """`_e2m1_halves` on every byte (by PTX on a GPU, by bit operations in the
    interpreter): the values of its low and high nibbles at scale 1, bit for bit, signs
    of zero too."""
    blocks = torch.arange(256, dtype=torch.uint8)
    want = mxfp4_dequantize(blocks.view(1, 16, 16), torch.full((1, 16), 127, dtype=torch.uint8),
                            torch.float32).view(256, 2)
    lo, hi = torch.empty(256, device=DEVICE), torch.empty(256, device=DEVICE)
    _halves_kernel[(1,)](blocks.to(DEVICE), lo, hi, N=256, PTX=CUDA)
    got = torch.stack([lo.cpu(), hi.cpu()], dim=1)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,e,k,block_k", [(1, 8, 2, 64), (7, 4, 4, 128), (33, 16, 3, 32)])
def test_blocks_decoded_unscaled_give_the_products_of_the_dequantised_weights(
        t: int, e: int, k: int, block_k: int, dtype: torch.dtype, exact: bool) -> None:
    """MXFP4 experts a block of 32 channels at a time, decoded unscaled and scaled after the
    block's dot (`fp4_dot` 2): gpt-oss's experts, what the kernel gives on the dequantised
    stacks to rounding (the blocks' sums add in another order), one or several blocks a K
    step, and in exact mode a token's output whatever the other tokens of the step."""
    gen = generator(13 * t + e + k)
    gate_up, down = mxfp4_stack(e, 2 * INTER, HIDDEN, gen), mxfp4_stack(e, HIDDEN, INTER, gen)
    dense = gate_up.dequantize(dtype), down.dequantize(dtype)
    x = randn(t, HIDDEN, gen=gen, dtype=dtype)
    weights, ids = routed(t, e, k, gen, dtype, renormalize=k > 1)
    extras = oss_extras(e, gen, dtype)
    tiles = MatmulTiles(16, 32, block_k, 4, 1)
    with nan_empty():
        got = fused_moe(x, gate_up, down, weights, ids, exact, fp4_dot=2, tiles=tiles, **extras)
    want = fused_moe(x, *dense, weights, ids, exact, tiles=tiles, **extras)
    torch.testing.assert_close(got, want, **tol(dtype))
    if exact:
        for row in (0, t - 1):
            alone = fused_moe(x[row:row + 1], gate_up, down, weights[row:row + 1],
                              ids[row:row + 1], True, fp4_dot=2, tiles=tiles, **extras)
            assert torch.equal(alone, got[row:row + 1])


def test_mxfp4_stacks_take_their_own_decode_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """On sm_90 a decode step (at most 16 pairs an expert on average) and every exact-mode
    step take `few_fp4` where a stack is MXFP4 and `few` where none is; a prefill's many
    pairs take `many` in default mode either way."""
    as_sm90(monkeypatch)
    gpu, table = torch.device("cuda", 0), TUNING["sm90"]
    assert table.few_fp4 is not None and table.few_fp4.block_k % 32 == 0
    for pairs, exact, fp4, want in [(64, False, True, table.few_fp4), (64, False, False, table.few),
                                    (10_000, True, True, table.few_fp4),
                                    (10_000, False, True, table.many)]:
        assert moe_tiles(gpu, pairs, 32, exact, fp4) == want, (pairs, exact, fp4)
