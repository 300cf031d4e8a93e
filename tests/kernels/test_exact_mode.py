"""Exact mode's kernels: a row has the same bits whether it is computed alone (a one-row plain
step), in a verify-shaped step (γ+1 rows, selection scores on) or in a 448-row call, for the
projections and the LM head, full attention and the packed prefill, on both backends (the
Triton kernels under the interpreter on CPU). The default mode's tiling is not held to this."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    CUDA,
    DEVICE,
    as_sm90,
    generator,
    paged_cache,
    query_positions,
    randn,
    tol,
)

from vegas_spec.attention.backend import make_backend
from vegas_spec.attention.context import StepContext
from vegas_spec.attention.torch_backend import (
    paged_attention_ref,
    prefill_attention_exact,
    prefill_attention_ref,
)
from vegas_spec.compute.base import make_ops
from vegas_spec.kernels.exact_matmul import exact_tiles
from vegas_spec.kernels.paged_attention import _split_size, _tiling, paged_attention
from vegas_spec.kernels.prefill_attention import prefill_attention, prefill_config, prefill_tiles
from vegas_spec.ops import silu_mul

DTYPES = [torch.float32, torch.bfloat16]
# The torch backend's exact path is the CPU's (exact mode on CUDA runs the Triton kernels).
BACKENDS = ["triton"] if CUDA else ["torch", "triton"]
HEADS, HKV, DIM, PAGE = 4, 2, 32, 16
BATCH, VERIFY = 64, 7  # 448 query rows


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_projection_and_head_rows_do_not_depend_on_the_row_count(backend: str,
                                                                 dtype: torch.dtype) -> None:
    """448 rows = 64 sequences x 7 verify rows, against 1, 7 and 21 of them."""
    seam = make_ops(backend, exact=True)
    gen = generator(3)
    x = randn(BATCH, VERIFY, 64, gen=gen, dtype=dtype)
    for n in (40, 300):  # a projection's and the LM head's width (in blocks of 32 columns)
        w = randn(n, 64, gen=gen, dtype=dtype) / 8
        b = randn(n, gen=gen, dtype=dtype) if n == 40 else None
        whole = seam.linear(x, w, b)
        assert whole.shape == (BATCH, VERIFY, n)
        torch.testing.assert_close(whole, torch.nn.functional.linear(x, w, b), **tol(dtype))
        assert torch.equal(seam.linear(x[5, :1], w, b), whole[5, :1])  # a plain step's row
        assert torch.equal(seam.linear(x[9], w, b), whole[9])  # one sequence's verify rows
        assert torch.equal(seam.linear(x[3:6], w, b), whole[3:6])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_token_steps_are_row_wise(backend: str, dtype: torch.dtype) -> None:
    """RMSNorm (with the residual add), SiLU * up and RoPE + KV store: a row alone and in
    many (the Triton kernels take a row or a block of elements per program)."""
    seam, attn = make_ops(backend, exact=True), make_backend(backend, exact=True)
    gen = generator(8)
    x, res = randn(48, 96, gen=gen, dtype=dtype), randn(48, 96, gen=gen, dtype=dtype)
    w, gate_up = randn(96, gen=gen, dtype=dtype), randn(448, 2 * 160, gen=gen, dtype=dtype) * 3
    rows = slice(9, 10)
    assert torch.equal(seam.norm(x[rows], w, 1e-6), seam.norm(x, w, 1e-6)[rows])
    pair = seam.add_norm(x, res, w, 1e-6)
    for got, whole in zip(seam.add_norm(x[rows], res[rows], w, 1e-6), pair, strict=True):
        assert torch.equal(got, whole[rows])
    torch.testing.assert_close(seam.silu_mul(gate_up), silu_mul(gate_up), **tol(dtype))
    assert torch.equal(seam.silu_mul(gate_up[rows]), seam.silu_mul(gate_up)[rows])
    q, k = randn(8, 7, HEADS, DIM, gen=gen, dtype=dtype), randn(8, 7, HKV, DIM, gen=gen,
                                                                 dtype=dtype)
    rope = torch.randn(512, DIM, generator=gen).to(DEVICE)
    pos = torch.randint(0, 512, (8, 7), generator=gen).to(DEVICE)

    def rotate(b: slice) -> torch.Tensor:
        cache = torch.zeros(56, HKV, DIM, dtype=dtype, device=DEVICE)
        slots = torch.arange(56, device=DEVICE).view(8, 7)[b]
        ctx = StepContext(positions=pos[b], slot_mapping=slots,
                          page_table=slots, page_size=1, kv_len_max=1)
        return attn.rope_store(q[b], k[b], k[b], cache, cache.clone(), ctx, rope)

    assert torch.equal(rotate(slice(5, 6)), rotate(slice(0, 8))[5:6])


def _attend(backend: str, q: torch.Tensor, cache, table: torch.Tensor, pos: torch.Tensor,
            kv_len: int, scores: bool, sinks: torch.Tensor | None = None,
            window: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One exact full-attention call (scores of rows 0 and n-1, as Collect-2), with a
    layer's sinks and sliding window where given."""
    bsz, n = pos.shape
    rows = torch.tensor([0, n - 1], device=DEVICE) if scores else None
    scale = DIM ** -0.5
    if backend == "torch":
        return paged_attention_ref(q, cache.k, cache.v, table, pos, PAGE, kv_len, scale, rows,
                                   exact=True, sinks=sinks, window=window)
    out = torch.zeros(bsz, 2, 1, kv_len, device=DEVICE) if scores else None
    return paged_attention(q, cache.k, cache.v, table, pos, PAGE, kv_len, scale, rows, out,
                           exact=True, sinks=sinks, window=window), out


class _GpuQuery:
    """What the tiling reads of q [B, n, H, D] on a GPU, without one."""

    def __init__(self, bsz: int, n: int) -> None:
        self.shape, self.is_cuda, self.dtype = (bsz, n, 32, 128), True, torch.bfloat16
        self.device = torch.device("cuda")


def test_gpu_tiling_is_one_for_every_step_in_exact_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles, pipeline and keys per split on a GPU (sm_90's): a one-row plain step at batch 1
    and a scored verify step at batch 64 over 32K keys get the same in exact mode (the
    default mode sizes them by occupancy and by the scores)."""
    as_sm90(monkeypatch)
    steps = [(1, 1, False, 100), (64, 7, True, 32768), (16, 4, False, 5000)]
    got = set()
    for b, n, scored, kv in steps:
        q = _GpuQuery(b, n)
        cfg, tiles = _tiling(q, 8, scored, None, True)  # type: ignore[arg-type]
        got.add((cfg, tiles, _split_size(q, 8, cfg, tiles, None, kv, True,  # type: ignore[arg-type]
                                         None)))
    assert len(got) == 1
    cfg, _, split = got.pop()
    assert split % cfg.block_k == 0 and cfg.block_n * cfg.group_pad >= 16
    # the projections' tiles follow the weight's N only (exact_tiles takes no M)
    gpu = torch.device("cuda")
    assert [exact_tiles(gpu, n).block_n for n in (960, 6144, 28672, 128256)] == \
        [32, 32, 128, 128]


# (backend, dtype): the interpreter is slow, so the Triton kernel runs in bf16 only (its float32
# logic is the same code).
ATTENTION_CASES = [("triton", torch.float32), ("triton", torch.bfloat16)] if CUDA else [
    ("torch", torch.float32), ("torch", torch.bfloat16), ("triton", torch.bfloat16)]
# (sequences, shortest, longest + 1, key bound): 448 rows in one split; or several splits of
# the key axis (128 keys each under the interpreter), merged, against rows in a single one.
SHAPES = {"448-rows": (BATCH, 20, 122, 128), "splits": (4, 200, 330, 336)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend,dtype", ATTENTION_CASES,
                         ids=[f"{b}-{str(d)[6:]}" for b, d in ATTENTION_CASES])
def test_attention_rows_are_the_same_in_plain_verify_and_batch_steps(
        backend: str, dtype: torch.dtype, shape: str) -> None:
    """A verify step (7 rows a sequence, lengths unequal) with scores on, against each row
    alone as a plain step with a tight key bound, and against one sequence's verify step
    without scores."""
    _check_rows(backend, dtype, shape)


# gpt-oss's layers: a sink per query head, a sliding window of 40 keys (under the
# interpreter the splits before it hold none of a row's keys), both.
OSS_LAYERS = {"sinks": (True, 0), "window": (False, 40), "sinks-window": (True, 40)}


@pytest.mark.parametrize("layer", OSS_LAYERS)
@pytest.mark.parametrize("backend,dtype", ATTENTION_CASES,
                         ids=[f"{b}-{str(d)[6:]}" for b, d in ATTENTION_CASES])
def test_sink_and_window_rows_are_the_same_in_plain_verify_and_batch_steps(
        backend: str, dtype: torch.dtype, layer: str) -> None:
    """As above, for gpt-oss's attention over several splits of the key axis."""
    sinks, window = OSS_LAYERS[layer]
    _check_rows(backend, dtype, "splits", sinks, window)


def _check_rows(backend: str, dtype: torch.dtype, shape: str, sinks: bool = False,
                window: int = 0) -> None:
    bsz, low, high, width = SHAPES[shape]
    gen = generator(11)
    lens = torch.randint(low, high, (bsz,), generator=gen).tolist()
    cache = paged_cache(bsz, width, HKV, DIM, PAGE, dtype, gen)
    pos = query_positions(lens, VERIFY)
    q = randn(bsz, VERIFY, HEADS, DIM, gen=gen, dtype=dtype)
    layer = dict(sinks=randn(HEADS, gen=gen) * 2 + 1 if sinks else None, window=window)
    whole, scores = _attend(backend, q, cache, cache.page_table, pos, width, True, **layer)
    ref, _ = paged_attention_ref(q, cache.k, cache.v, cache.page_table, pos, PAGE, width,
                                 DIM ** -0.5, **layer)
    torch.testing.assert_close(whole, ref, **tol(dtype))
    assert scores is not None
    for b, i in ((0, 0), (1, 3), (bsz - 1, 6), (bsz // 2, 0)):
        alone, _ = _attend(backend, q[b:b + 1, i:i + 1], cache, cache.page_table[b:b + 1],
                           pos[b:b + 1, i:i + 1], lens[b] - VERIFY + i + 1, False, **layer)
        assert torch.equal(alone[0, 0], whole[b, i]), (b, i)
    one, _ = _attend(backend, q[1:2], cache, cache.page_table[1:2], pos[1:2], lens[1], False,
                     **layer)
    assert torch.equal(one[0], whole[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_rows_do_not_depend_on_chunks_or_packing(backend: str,
                                                        dtype: torch.dtype) -> None:
    """A 90-token prompt prefilled as one piece, and cut into pieces of 37 and 53 tokens
    packed after other prompts' pieces: the same bits for every row."""
    gen = generator(5)
    cache = paged_cache(3, 128, HKV, DIM, PAGE, dtype, gen)
    q = randn(90, HEADS, DIM, gen=gen, dtype=dtype)
    other = randn(64, HEADS, DIM, gen=gen, dtype=dtype)

    def run(q_packed: torch.Tensor, seqs: list[int], lengths: list[int],
            starts: list[int]) -> torch.Tensor:
        table = cache.page_table[seqs]
        scale = DIM ** -0.5
        if backend == "torch":
            return prefill_attention_exact(q_packed, cache.k, cache.v, table, tuple(lengths),
                                           tuple(starts), PAGE, scale)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                          device=DEVICE)
        st = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
        tiles = prefill_tiles(lengths, starts, prefill_config(DIM, CUDA).block_m, DEVICE)
        return prefill_attention(q_packed, cache.k, cache.v, table, cu, st, tiles, PAGE, scale)

    whole = run(q, [0], [90], [0])
    ref = prefill_attention_ref(q, cache.k, cache.v, cache.page_table[:1], (90,), (0,), PAGE,
                                DIM ** -0.5)
    torch.testing.assert_close(whole, ref, **tol(dtype))
    first = run(torch.cat([other[:20], q[:37]]), [1, 0], [20, 37], [5, 0])
    second = run(torch.cat([q[37:], other[20:64]]), [0, 2], [53, 44], [37, 0])
    assert torch.equal(torch.cat([first[20:], second[:53]]), whole)
