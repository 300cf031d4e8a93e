"""Achieved memory bandwidth of the Triton kernels against the card's copy bandwidth.

Decode, verify and draft attention are memory-bound: their cost is the bytes they move. This
script times every kernel of `vegas_spec.kernels` over model-like shapes and reports

    achieved bandwidth = bytes the kernel must move / median time,

next to the bandwidth of a large device-to-device copy (read + written bytes). Bytes counted:

  paged attention   K and V of every visited position once per kv head (B·Hkv·L·D·2·itemsize),
                    queries read, outputs written, the page table (one int32 per page) and the
                    positions. With scores also the float32 scratch (written by the attention
                    pass, read back by the finalise kernel), the log-sum-exp (weight mode, also
                    written and read) and the [B, R, 1, L] scores written. Flash-decoding
                    partials (key splits) are overhead, not counted (in the JSON as
                    `partials_bytes`).
  sparse attention  K and V of the positions actually visited (listed + visible recent) once
                    per kv head, the int64 lists, one int32 page-table entry per visited
                    position, queries, outputs, positions.
  top-k             the float32 scores read once (the kernel holds a row in registers) and the
                    int64 positions written; rows of at most topk.RESIDENT_MAX_WIDTH scores,
                    the only ones the kernel takes (wider rows: the reference, not timed).
  store_kv          the new K and V read and written, the slot map.

Every kernel is first run against its PyTorch reference at a small size (a failing check marks
its rows FAIL and they are not timed). The references are also timed at a few small sizes.

    python benchmarks/kernel_bench.py --out kernels.json          # CUDA: the full sweep
    python benchmarks/kernel_bench.py --smoke --out /tmp/k.json   # CPU, Triton interpreter, tiny
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    # The interpreter must be chosen before triton is first imported.
    assert "triton" not in sys.modules, "triton imported before TRITON_INTERPRET was set"
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import vegas_spec.kernels  # noqa: F401  (interpreter patch, before any kernel runs)
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import vegas_spec.kernels  # noqa: F401

import triton  # noqa: E402
import triton.testing  # noqa: E402

from vegas_spec.attention.torch_backend import (  # noqa: E402
    paged_attention_ref,
    sparse_attention_ref,
    store_kv_ref,
)
from vegas_spec.kernels import interpreting  # noqa: E402
from vegas_spec.kernels.paged_attention import paged_attention  # noqa: E402
from vegas_spec.kernels.sparse_attention import sparse_attention  # noqa: E402
from vegas_spec.kernels.split_merge import split_size_for, tile_config  # noqa: E402
from vegas_spec.kernels.store_kv import store_kv  # noqa: E402
from vegas_spec.kernels.topk import RESIDENT_MAX_WIDTH, topk_positions_triton  # noqa: E402
from vegas_spec.ops import topk_positions  # noqa: E402

GiB = 1 << 30
PAGE = 16
RECENT = 13  # recent range of a draft step with γ 6


@dataclass(frozen=True)
class Model:
    key: str
    name: str
    hkv: int
    heads: int
    dim: int
    layers: int


MODELS = {
    "smollm2": Model("smollm2", "SmolLM2", 3, 9, 64, 30),
    "llama8b": Model("llama8b", "Llama-3.1-8B", 8, 32, 128, 32),
}


@dataclass
class Sweep:
    models: list[str]
    contexts: list[int]
    batches: list[int]
    ns: list[int]
    copy_bytes: int
    check_lens: tuple[int, ...]
    budget_min: int
    topk_layers: dict[str, int]
    ref_configs: list[tuple[int, int]]  # (context, batch) the references are timed at


def full_sweep() -> Sweep:
    return Sweep(["smollm2", "llama8b"], [2048, 8192, 32768, 131072], [1, 16, 64], [1, 7],
                 2 * GiB, (1504, 1100, 700), 256, {m: MODELS[m].layers for m in MODELS},
                 [(2048, 1), (8192, 16)])


def smoke_sweep() -> Sweep:
    return Sweep(["smollm2", "llama8b"], [96], [1], [1, 7], 16 << 20, (40, 21), 16,
                 {m: 2 for m in MODELS}, [(96, 1)])


@dataclass
class Bench:
    device: torch.device
    dtype: torch.dtype
    sweep: Sweep
    warmup_ms: float
    rep_ms: float
    deadline: float
    max_kv_bytes: float
    copy_bw: float = float("nan")  # bytes / s
    rows: list[dict[str, Any]] = field(default_factory=list)
    refs: list[dict[str, Any]] = field(default_factory=list)
    checks: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def itemsize(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    def time_ms(self, fn: Callable[[], Any]) -> float:
        """Median milliseconds of fn (L2 flushed before every run on CUDA)."""
        if self.device.type == "cuda":
            return float(triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms,
                                                 return_mode="median"))
        start = time.perf_counter()  # the interpreter: one run, the figure means nothing
        fn()
        return (time.perf_counter() - start) * 1e3

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def error_text(exc: BaseException) -> str:
    text = " ".join(traceback.format_exception_only(type(exc), exc)).split()
    return " ".join(text)[:600]


# ---------------------------------------------------------------- inputs


def randn(bench: Bench, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.randn(*shape, device=bench.device, dtype=dtype or bench.dtype)


def kv_bytes(model: Model, bsz: int, ctx: int, itemsize: int) -> int:
    return 2 * bsz * ctx * model.hkv * model.dim * itemsize


@dataclass
class Pool:
    """One paged K/V pool per model, large enough for its largest config; every config takes
    a random set of its pages (so pages of a sequence are scattered, as after a long run)."""

    k: torch.Tensor
    v: torch.Tensor
    pages: int

    @classmethod
    def make(cls, bench: Bench, model: Model, tokens: int) -> Pool:
        pages = -(-tokens // PAGE) + 2
        shape = (pages * PAGE, model.hkv, model.dim)
        return cls(randn(bench, *shape), randn(bench, *shape), pages)

    def table(self, bsz: int, ctx: int) -> torch.Tensor:
        per_seq = -(-ctx // PAGE)
        order = torch.randperm(self.pages, device=self.k.device)[: bsz * per_seq]
        return order.view(bsz, per_seq).to(torch.int32)


def last_positions(lens: list[int], n: int, device: torch.device) -> torch.Tensor:
    """[B, n]: the last n positions of each sequence (a decode or verify step)."""
    return (torch.tensor(lens)[:, None] - n + torch.arange(n)).to(device)


def listed_positions(bench: Bench, rankable: list[int], budget: list[int]) -> torch.Tensor:
    """indices [B, 1, K]: a random subset of each rankable prefix, ascending, -1 padded (what
    the selection's top-k hands the draft steps)."""
    width = max(max(budget), 1)
    out = torch.full((len(rankable), 1, width), -1, dtype=torch.int64, device=bench.device)
    for b, (rank, k) in enumerate(zip(rankable, budget, strict=True)):
        k = min(k, rank)
        if k > 0:
            pick = torch.rand(rank, device=bench.device).topk(k).indices.sort().values
            out[b, 0, :k] = pick
    return out


def sparse_budget(bench: Bench, ctx: int) -> int:
    return min(max(bench.sweep.budget_min, int(0.05 * ctx)), max(ctx - RECENT, 0))


# ---------------------------------------------------------------- correctness checks


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else \
        {"atol": 2e-2, "rtol": 2e-2}


def score_tol(mode: str, dtype: torch.dtype) -> dict[str, float]:
    if mode == "logit":
        return {"atol": 1e-3, "rtol": 1e-4} if dtype == torch.float32 else \
            {"atol": 0.1, "rtol": 2e-2}
    return {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else \
        {"atol": 2e-3, "rtol": 2e-2}


def nan_buffer(bench: Bench, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=bench.device)


def small_case(bench: Bench, model: Model, n: int,
               ) -> tuple[list[int], int, Pool, torch.Tensor, torch.Tensor, torch.Tensor]:
    lens = list(bench.sweep.check_lens)
    kv_len = max(lens)
    pool = Pool.make(bench, model, len(lens) * (-(-kv_len // PAGE)) * PAGE)
    table = pool.table(len(lens), kv_len)
    q = randn(bench, len(lens), n, model.heads, model.dim)
    return lens, kv_len, pool, table, q, last_positions(lens, n, bench.device)


def other_splits(q: torch.Tensor, model: Model, length: int) -> tuple[int | None, int]:
    """The wrapper's own split size, then one that takes the other path: a single split where
    the heuristic cuts the keys, splits of one key block where it does not."""
    cfg = tile_config(q, model.hkv)
    programs = q.shape[0] * model.hkv * -(-q.shape[1] // cfg.block_n)
    size = split_size_for(length, programs, cfg.block_k, q.device)
    if size >= length:
        return None, cfg.block_k
    return None, -(-length // cfg.block_k) * cfg.block_k


def check_paged(bench: Bench, model: Model, n: int, mode: str | None) -> None:
    lens, kv_len, pool, table, q, positions = small_case(bench, model, n)
    scale = model.dim ** -0.5
    rows = torch.tensor(sorted({0, n - 1}), device=bench.device)
    for split_size in other_splits(q, model, kv_len):
        scores = None if mode is None else nan_buffer(bench, len(lens), len(rows), 1, kv_len + 4)
        out = paged_attention(q, pool.k, pool.v, table, positions, PAGE, kv_len, scale,
                              None if mode is None else rows, scores, mode or "weight",
                              split_size=split_size, out=nan_buffer(bench, *q.shape,
                                                                    dtype=q.dtype))
        want, want_scores = paged_attention_ref(q, pool.k, pool.v, table, positions, PAGE,
                                                kv_len, scale, None if mode is None else rows,
                                                mode or "weight", False)
        torch.testing.assert_close(out, want, **tol(bench.dtype))
        if mode is not None:
            assert scores is not None and want_scores is not None
            expected = torch.zeros_like(scores)
            expected[..., :kv_len] = want_scores
            torch.testing.assert_close(scores, expected, **score_tol(mode, bench.dtype))


def check_sparse(bench: Bench, model: Model, n: int) -> None:
    lens, _, pool, table, q, positions = small_case(bench, model, n)
    starts = [max(length - RECENT, 0) for length in lens]
    indices = listed_positions(bench, starts, [s // 5 for s in starts])
    recent_start = torch.tensor(starts, device=bench.device)
    scale = model.dim ** -0.5
    for split_size in other_splits(q, model, int(indices.shape[2]) + RECENT):
        out = sparse_attention(q, pool.k, pool.v, table, positions, PAGE, indices, recent_start,
                               RECENT, scale, split_size=split_size,
                               out=nan_buffer(bench, *q.shape, dtype=q.dtype))
        want = sparse_attention_ref(q, pool.k, pool.v, table, positions, PAGE, indices,
                                    recent_start, RECENT, scale)
        torch.testing.assert_close(out, want, **tol(bench.dtype))


def check_topk(bench: Bench, layers: int) -> None:
    lens = list(bench.sweep.check_lens)
    width = max(lens)
    scores = torch.rand(layers, len(lens), 1, width, device=bench.device)
    rankable = torch.tensor(lens, device=bench.device)
    k = torch.tensor([max(length // 20, 1) for length in lens], device=bench.device)
    got = topk_positions_triton(scores, rankable, k)
    want = topk_positions(scores, rankable, k)
    assert got.shape == want.shape and torch.equal(got, want), "top-k positions differ"


def check_store(bench: Bench, model: Model, n: int) -> None:
    bsz = 3
    slots = 8 * bsz * n
    k = randn(bench, bsz, n, model.hkv, model.dim)
    v = randn(bench, bsz, n, model.hkv, model.dim)
    mapping = torch.randperm(slots, device=bench.device)[: bsz * n].view(bsz, n)
    k_cache = randn(bench, slots, model.hkv, model.dim)
    v_cache = randn(bench, slots, model.hkv, model.dim)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, mapping)
    store_kv_ref(k, v, want_k, want_v, mapping)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), "cache rows differ"


def checked(bench: Bench, key: str, fn: Callable[..., None], *args: Any) -> str:
    """Runs the correctness check fn(bench, *args) once per key; 'ok' or the failure."""
    if key not in bench.checks:
        try:
            fn(bench, *args)
            bench.sync()
            bench.checks[key] = "ok"
        except Exception as exc:
            bench.checks[key] = error_text(exc)
            log(f"CHECK FAILED {key}: {bench.checks[key]}")
    return bench.checks[key]


# ---------------------------------------------------------------- bandwidth of the card


def copy_bandwidth(bench: Bench) -> dict[str, float]:
    size = bench.sweep.copy_bytes
    a = torch.empty(size, dtype=torch.uint8, device=bench.device)
    b = torch.empty(size, dtype=torch.uint8, device=bench.device)
    a.fill_(1)
    b.fill_(2)
    pair = [a, b]
    turn = [0]

    def copy() -> None:  # alternate the direction, so no buffer stays warm
        src, dst = pair[turn[0] % 2], pair[1 - turn[0] % 2]
        turn[0] += 1
        dst.copy_(src)

    copy_ms = bench.time_ms(copy)
    floats = a.view(torch.float32)
    read_ms = bench.time_ms(lambda: floats.sum())
    return {"buffer_bytes": size, "copy_ms": copy_ms, "copy_bytes_per_s": 2 * size / copy_ms * 1e3,
            "read_ms": read_ms, "read_bytes_per_s": size / read_ms * 1e3}


# ---------------------------------------------------------------- rows


def new_row(kernel: str, model: Model, ctx: int, bsz: int, n: int, variant: str) -> dict:
    return {"kernel": kernel, "model": model.name, "ctx": ctx, "batch": bsz, "n": n,
            "variant": variant, "status": "pending"}


def finish(bench: Bench, row: dict, time_ms: float, moved: dict[str, int]) -> None:
    total = sum(moved.values())
    row.update(status="ok", time_us=time_ms * 1e3, bytes=moved, total_bytes=total,
               bytes_per_s=total / time_ms * 1e3,
               frac_copy=total / time_ms * 1e3 / bench.copy_bw)


def guarded(bench: Bench, row: dict, check: str, body: Callable[[dict], None]) -> dict:
    bench.rows.append(row)
    if check != "ok":
        row["status"] = "FAIL"
        row["error"] = check
        return row
    if bench.out_of_time():
        row["status"] = "skipped (time)"
        return row
    try:
        body(row)
    except Exception as exc:
        row["status"] = "error"
        row["error"] = error_text(exc)
        log(f"ERROR {row['kernel']} {row['model']} ctx {row['ctx']} B {row['batch']} "
            f"n {row['n']} {row['variant']}: {row['error']}")
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    if row["status"] == "ok":
        log(f"{row['kernel']:6} {row['model']:13} ctx {row['ctx']:>6} B {row['batch']:>2} "
            f"n {row['n']} {row['variant']:6} {row['time_us']:10.1f} us "
            f"{row['bytes_per_s'] / 1e12:6.3f} TB/s ({100 * row['frac_copy']:.0f}% of copy)")
    return row


def paged_rows(bench: Bench, model: Model, pool: Pool, ctx: int, bsz: int, n: int) -> None:
    table = pool.table(bsz, ctx)
    q = randn(bench, bsz, n, model.heads, model.dim)
    positions = last_positions([ctx] * bsz, n, bench.device)
    out = torch.empty_like(q)
    item = bench.itemsize
    # the occupancy split's count (a GPU's decode calls may take the wave split instead): an
    # estimate of the partials' bytes
    cfg = tile_config(q, model.hkv)
    size = split_size_for(ctx, bsz * model.hkv * -(-n // cfg.block_n), cfg.block_k, q.device)
    splits = -(-ctx // size)
    partials = 0 if splits == 1 else 2 * 4 * splits * bsz * n * model.heads * (model.dim + 2)
    base = {"kv": kv_bytes(model, bsz, ctx, item),
            "q_out": 2 * bsz * n * model.heads * model.dim * item,
            "table_positions": 4 * table.numel() + 8 * positions.numel()}
    inputs = (q, table, positions, out, base, splits, partials)
    plain = paged_variant(bench, model, pool, ctx, bsz, n, None, inputs, None)
    for mode in ("weight", "logit"):
        paged_variant(bench, model, pool, ctx, bsz, n, mode, inputs, plain)


def paged_variant(bench: Bench, model: Model, pool: Pool, ctx: int, bsz: int, n: int,
                  mode: str | None, inputs: tuple, plain: dict | None) -> dict:
    q, table, positions, out, base, splits, partials = inputs
    scale = model.dim ** -0.5
    rows = torch.tensor(sorted({0, n - 1}), device=bench.device)
    num_rows = rows.numel()
    check = checked(bench, f"paged {model.key} n{n} {mode or 'plain'}",
                    check_paged, model, n, mode)
    row = new_row("paged", model, ctx, bsz, n, mode or "plain")
    row.update(splits=splits, partials_bytes=partials, score_rows=num_rows)

    def body(row: dict) -> None:
        moved = dict(base)
        if mode is None:
            fn = lambda: paged_attention(q, pool.k, pool.v, table, positions, PAGE, ctx, scale,
                                         out=out)
        else:
            score_out = torch.empty(bsz, num_rows, 1, ctx, dtype=torch.float32,
                                    device=bench.device)
            planes = model.heads if mode == "weight" else model.hkv
            moved["score_scratch"] = 2 * 4 * bsz * num_rows * planes * ctx
            moved["score_out"] = 4 * score_out.numel()
            if mode == "weight":
                moved["lse"] = 2 * 4 * bsz * n * model.heads
            fn = lambda: paged_attention(q, pool.k, pool.v, table, positions, PAGE, ctx, scale,
                                         rows, score_out, mode, out=out)
        finish(bench, row, bench.time_ms(fn), moved)
        if plain is not None and plain.get("status") == "ok":
            row["overhead_vs_plain"] = row["time_us"] / plain["time_us"] - 1

    return guarded(bench, row, check, body)


def sparse_rows(bench: Bench, model: Model, pool: Pool, ctx: int, bsz: int, n: int) -> None:
    check = checked(bench, f"sparse {model.key} n{n}", check_sparse, model, n)
    row = new_row("sparse", model, ctx, bsz, n, "draft")

    def body(row: dict) -> None:
        table = pool.table(bsz, ctx)
        q = randn(bench, bsz, n, model.heads, model.dim)
        positions = last_positions([ctx] * bsz, n, bench.device)
        start = max(ctx - RECENT, 0)
        budget = sparse_budget(bench, ctx)
        indices = listed_positions(bench, [start] * bsz, [budget] * bsz)
        recent_start = torch.full((bsz,), start, dtype=torch.int64, device=bench.device)
        out = torch.empty_like(q)
        scale = model.dim ** -0.5
        item = bench.itemsize
        visited = budget + min(RECENT, ctx - start)  # all recent positions <= ctx - 1 are seen
        moved = {"kv": kv_bytes(model, bsz, visited, item),
                 "q_out": 2 * bsz * n * model.heads * model.dim * item,
                 "indices": 8 * indices.numel(),
                 "table_positions": 4 * bsz * visited + 8 * positions.numel() + 8 * bsz}
        cfg = tile_config(q, model.hkv)
        length = indices.shape[2] + RECENT
        size = split_size_for(length, bsz * model.hkv * -(-n // cfg.block_n), cfg.block_k,
                              q.device)
        row.update(budget=budget, visited=visited, splits=-(-length // size))
        fn = lambda: sparse_attention(q, pool.k, pool.v, table, positions, PAGE, indices,
                                      recent_start, RECENT, scale, out=out)
        finish(bench, row, bench.time_ms(fn), moved)
        full = next((r for r in bench.rows if r["kernel"] == "paged" and r["variant"] == "plain"
                     and r["model"] == model.name and (r["ctx"], r["batch"], r["n"])
                     == (ctx, bsz, n) and r["status"] == "ok"), None)
        if full is not None:
            row["time_vs_full"] = row["time_us"] / full["time_us"]

    guarded(bench, row, check, body)


def store_rows(bench: Bench, model: Model, pool: Pool, bsz: int, n: int) -> None:
    check = checked(bench, f"store_kv {model.key} n{n}", check_store, model, n)
    row = new_row("store_kv", model, 0, bsz, n, "write")

    def body(row: dict) -> None:
        k = randn(bench, bsz, n, model.hkv, model.dim)
        v = randn(bench, bsz, n, model.hkv, model.dim)
        mapping = torch.randperm(pool.k.shape[0], device=bench.device)[: bsz * n].view(bsz, n)
        moved = {"kv": 2 * 2 * k.numel() * bench.itemsize, "slots": 8 * mapping.numel()}
        finish(bench, row, bench.time_ms(lambda: store_kv(k, v, pool.k, pool.v, mapping)),
               moved)

    guarded(bench, row, check, body)


def topk_rows(bench: Bench, model: Model, ctx: int, bsz: int) -> None:
    layers = bench.sweep.topk_layers[model.key]
    check = checked(bench, f"topk L{layers}", check_topk, layers)
    row = new_row("topk", model, ctx, bsz, 1, f"L{layers}")

    def body(row: dict) -> None:
        scores = torch.rand(layers, bsz, 1, ctx, device=bench.device)
        rankable = torch.full((bsz,), ctx, dtype=torch.int64, device=bench.device)
        k = torch.full((bsz,), max(int(0.05 * ctx), 1), dtype=torch.int64, device=bench.device)
        row.update(k=int(k[0]), layers=layers)
        moved = {"scores": 4 * scores.numel(), "positions_out": 8 * layers * bsz * int(k[0])}
        finish(bench, row, bench.time_ms(lambda: topk_positions_triton(scores, rankable, k)),
               moved)

    guarded(bench, row, check, body)


# ---------------------------------------------------------------- references


def ref_rows(bench: Bench, model: Model, pool: Pool) -> None:
    """The PyTorch references at small sizes, next to the kernel at the same size."""
    for ctx, bsz in bench.sweep.ref_configs:
        if bench.out_of_time():
            return
        ref_config(bench, model, pool, ctx, bsz)


def ref_config(bench: Bench, model: Model, pool: Pool, ctx: int, bsz: int) -> None:
    n = max(bench.sweep.ns)
    table = pool.table(bsz, ctx)
    q = randn(bench, bsz, n, model.heads, model.dim)
    positions = last_positions([ctx] * bsz, n, bench.device)
    scale = model.dim ** -0.5
    rows = torch.tensor(sorted({0, n - 1}), device=bench.device)
    start = max(ctx - RECENT, 0)
    indices = listed_positions(bench, [start] * bsz, [sparse_budget(bench, ctx)] * bsz)
    recent_start = torch.full((bsz,), start, dtype=torch.int64, device=bench.device)
    layers = bench.sweep.topk_layers[model.key]
    scores = torch.rand(layers, bsz, 1, ctx, device=bench.device)
    rankable = torch.full((bsz,), ctx, dtype=torch.int64, device=bench.device)
    k = torch.full((bsz,), max(int(0.05 * ctx), 1), dtype=torch.int64, device=bench.device)
    kv_new = randn(bench, bsz, n, model.hkv, model.dim)
    mapping = torch.randperm(pool.k.shape[0], device=bench.device)[: bsz * n].view(bsz, n)
    cases = {
        ("paged", "plain"): lambda: paged_attention_ref(
            q, pool.k, pool.v, table, positions, PAGE, ctx, scale),
        ("paged", "weight"): lambda: paged_attention_ref(
            q, pool.k, pool.v, table, positions, PAGE, ctx, scale, rows, "weight"),
        ("sparse", "draft"): lambda: sparse_attention_ref(
            q, pool.k, pool.v, table, positions, PAGE, indices, recent_start, RECENT, scale),
        ("topk", f"L{layers}"): lambda: topk_positions(scores, rankable, k),
        ("store_kv", "write"): lambda: store_kv_ref(kv_new, kv_new, pool.k, pool.v, mapping),
    }
    for (kernel, variant), fn in cases.items():
        shown_ctx = 0 if kernel == "store_kv" else ctx
        shown_n = 1 if kernel == "topk" else n
        ref = {"kernel": kernel, "variant": variant, "model": model.name, "ctx": shown_ctx,
               "batch": bsz, "n": shown_n}
        try:
            ref["ref_us"] = bench.time_ms(fn) * 1e3
        except Exception as exc:
            ref["error"] = error_text(exc)
            if bench.device.type == "cuda":
                torch.cuda.empty_cache()
        mine = next((r for r in bench.rows if (r["kernel"], r["variant"], r["model"], r["ctx"],
                                               r["batch"], r["n"])
                     == (kernel, variant, model.name, shown_ctx, bsz, shown_n)
                     and r["status"] == "ok"), None)
        if mine is not None:
            ref["kernel_us"] = mine["time_us"]
            if "ref_us" in ref:
                ref["speedup"] = ref["ref_us"] / mine["time_us"]
        bench.refs.append(ref)


# ---------------------------------------------------------------- sweep


def attempt(bench: Bench, label: str, fn: Callable[..., None], *args: Any) -> None:
    """Runs one block of rows, fn(bench, *args); a failure outside the timed body is logged,
    not fatal."""
    try:
        fn(bench, *args)
    except Exception as exc:
        bench.errors.append(f"{label}: {error_text(exc)}")
        log(f"ERROR {label}: {error_text(exc)}")
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()


def run_all(bench: Bench) -> None:
    """Both models' pools are kept, so every context length is run for both models before
    the next (shorter) one: if the time runs out, the short, least telling rows go."""
    sweep = bench.sweep
    item = bench.itemsize
    plans: dict[str, tuple[Model, list[tuple[int, int]], Pool]] = {}
    for key in sweep.models:
        model = MODELS[key]
        configs = [(ctx, bsz) for ctx in sweep.contexts for bsz in sweep.batches
                   if kv_bytes(model, bsz, ctx, item) <= bench.max_kv_bytes]
        for ctx in sweep.contexts:
            for bsz in sweep.batches:
                if (ctx, bsz) not in configs:
                    log(f"skip {model.name} ctx {ctx} B {bsz}: K/V over "
                        f"{bench.max_kv_bytes / 1e9:.0f} GB")
        if not configs:
            continue
        tokens = max(bsz * -(-ctx // PAGE) * PAGE for ctx, bsz in configs)
        tokens = max(tokens, max(b * c for c, b in sweep.ref_configs))
        try:
            pool = Pool.make(bench, model, tokens)
        except Exception as exc:
            bench.errors.append(f"{model.name} pool: {error_text(exc)}")
            log(f"ERROR {model.name} pool of {tokens} tokens: {error_text(exc)}")
            continue
        log(f"{model.name}: pool of {2 * pool.k.numel() * item / 1e9:.2f} GB K/V")
        plans[key] = (model, configs, pool)
    for ctx in sorted(sweep.contexts, reverse=True):
        for model, configs, pool in plans.values():
            for bsz in sorted(sweep.batches, reverse=True):
                if (ctx, bsz) not in configs:
                    continue
                for n in sweep.ns:
                    label = f"{model.name} ctx {ctx} B {bsz} n {n}"
                    attempt(bench, f"paged {label}",
                            paged_rows, model, pool, ctx, bsz, n)
                    attempt(bench, f"sparse {label}",
                            sparse_rows, model, pool, ctx, bsz, n)
    for model, configs, pool in plans.values():
        for ctx, bsz in sorted(configs, key=lambda c: (-c[0], -c[1])):
            if ctx > RESIDENT_MAX_WIDTH:  # the backend ranks these rows with the reference
                continue
            attempt(bench, f"topk {model.name} ctx {ctx} B {bsz}",
                    topk_rows, model, ctx, bsz)
        for bsz in sweep.batches:
            for n in sweep.ns:
                attempt(bench, f"store_kv {model.name} B {bsz} n {n}",
                        store_rows, model, pool, bsz, n)
        attempt(bench, f"refs {model.name}", ref_rows, model, pool)
    plans.clear()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- report


def ctx_label(ctx: int) -> str:
    return f"{ctx // 1024}K" if ctx >= 1024 and ctx % 1024 == 0 else str(ctx)


def fmt_us(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["status"] != "ok":
        return row["status"].split()[0]
    us = row["time_us"]
    return f"{us:.0f}" if us >= 100 else f"{us:.1f}"


def fmt_pct(x: float | None, signed: bool = False) -> str:
    if x is None or math.isnan(x):
        return "-"
    return f"{100 * x:+.1f}%" if signed else f"{100 * x:.0f}%"


def get(row: dict | None, key: str) -> float | None:
    return None if row is None or row["status"] != "ok" else row.get(key)


def markdown(bench: Bench, copy: dict[str, float]) -> str:
    def find(kernel: str, model: str, ctx: int, bsz: int, n: int, variant: str) -> dict | None:
        return next((r for r in bench.rows if (r["kernel"], r["model"], r["ctx"], r["batch"],
                                               r["n"], r["variant"])
                     == (kernel, model, ctx, bsz, n, variant)), None)

    order = {m.name: i for i, m in enumerate(MODELS.values())}
    keys = sorted({(r["model"], r["ctx"], r["batch"], r["n"]) for r in bench.rows
                   if r["kernel"] in ("paged", "sparse")},
                  key=lambda k: (order[k[0]], k[1], k[2], k[3]))
    lines = [
        f"device: {torch.cuda.get_device_name() if bench.device.type == 'cuda' else 'cpu'}"
        f" ({'interpreter, timings meaningless' if interpreting() else bench.dtype})",
        f"copy bandwidth: {copy['copy_bytes_per_s'] / 1e12:.3f} TB/s "
        f"({copy['buffer_bytes'] / GiB:.2f} GiB D2D, read + written bytes); "
        f"read-only (sum): {copy['read_bytes_per_s'] / 1e12:.3f} TB/s",
        "",
        "Full attention (paged; +w/+l: score emission, rows [0, n-1], weight/logit, G=1, "
        "over the plain time; goal <= +5%) and sparse draft attention (5% budget, min "
        f"{bench.sweep.budget_min}, + recent {RECENT}; sp/full: its time over the plain one):",
        "",
        "| model | ctx | B | n | splits | full us | TB/s | %copy | +w | +l | sparse us | "
        "sp TB/s | sp %copy | sp/full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, ctx, bsz, n in keys:
        plain = find("paged", model, ctx, bsz, n, "plain")
        weight = find("paged", model, ctx, bsz, n, "weight")
        logit = find("paged", model, ctx, bsz, n, "logit")
        sparse = find("sparse", model, ctx, bsz, n, "draft")
        bw = get(plain, "bytes_per_s")
        sbw = get(sparse, "bytes_per_s")
        ratio = get(sparse, "time_vs_full")
        lines.append(
            f"| {model} | {ctx_label(ctx)} | {bsz} | {n} | "
            f"{plain.get('splits', '-') if plain else '-'} | {fmt_us(plain)} | "
            f"{'-' if bw is None else f'{bw / 1e12:.2f}'} | {fmt_pct(get(plain, 'frac_copy'))} | "
            f"{fmt_pct(get(weight, 'overhead_vs_plain'), True)} | "
            f"{fmt_pct(get(logit, 'overhead_vs_plain'), True)} | {fmt_us(sparse)} | "
            f"{'-' if sbw is None else f'{sbw / 1e12:.2f}'} | "
            f"{fmt_pct(get(sparse, 'frac_copy'))} | "
            f"{'-' if ratio is None else f'{ratio:.3f}'} |"
        )
    topk = [r for r in bench.rows if r["kernel"] == "topk"]
    if topk:
        lines += ["", "Top-k (threshold select; scores [layers, B, 1, L] float32, k = 5% of L, "
                      "L at most the kernel's RESIDENT_MAX_WIDTH; bandwidth on the scores, "
                      "read once):", "",
                  "| model | layers | ctx | B | k | us | GB/s | %copy |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(topk, key=lambda r: (order[r["model"]], r["ctx"], r["batch"])):
            bw = get(r, "bytes_per_s")
            lines.append(f"| {r['model']} | {r['variant'][1:]} | {ctx_label(r['ctx'])} | "
                         f"{r['batch']} | {r.get('k', '-')} | {fmt_us(r)} | "
                         f"{'-' if bw is None else f'{bw / 1e9:.0f}'} | "
                         f"{fmt_pct(get(r, 'frac_copy'))} |")
    store = [r for r in bench.rows if r["kernel"] == "store_kv"]
    if store:
        lines += ["", "store_kv (one layer's new K/V into the cache):", "",
                  "| model | B | n | us | GB/s |", "|---|---:|---:|---:|---:|"]
        for r in sorted(store, key=lambda r: (order[r["model"]], r["batch"], r["n"])):
            bw = get(r, "bytes_per_s")
            lines.append(f"| {r['model']} | {r['batch']} | {r['n']} | {fmt_us(r)} | "
                         f"{'-' if bw is None else f'{bw / 1e9:.1f}'} |")
    if bench.refs:
        lines += ["", "PyTorch references vs the kernels at the same size:", "",
                  "| kernel | model | ctx | B | n | ref us | kernel us | speedup |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in bench.refs:
            ref_us = r.get("ref_us")
            mine = r.get("kernel_us")
            speed = r.get("speedup")
            lines.append(
                f"| {r['kernel']} {r['variant']} | {r['model']} | {ctx_label(r['ctx'])} | "
                f"{r['batch']} | {r['n']} | {'err' if ref_us is None else f'{ref_us:.0f}'} | "
                f"{'-' if mine is None else f'{mine:.1f}'} | "
                f"{'-' if speed is None else f'{speed:.1f}x'} |")
    failed = {k: v for k, v in bench.checks.items() if v != "ok"}
    lines += ["", f"correctness checks: {len(bench.checks) - len(failed)}/{len(bench.checks)} "
                  "passed" + "".join(f"\n  FAIL {k}: {v}" for k, v in failed.items())]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="write the full results (JSON) here")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes (CPU under the Triton interpreter): checks the script runs")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None)
    p.add_argument("--contexts", nargs="+", type=int, default=None)
    p.add_argument("--batches", nargs="+", type=int, default=None)
    p.add_argument("--max-kv-gb", type=float, default=40.0,
                   help="skip (context, batch) pairs whose K/V exceed this")
    p.add_argument("--warmup-ms", type=float, default=5.0)
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument("--time-budget-s", type=float, default=420.0,
                   help="rows not started by then are marked skipped")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not interpreting()
    device = torch.device("cuda" if cuda else "cpu")
    sweep = smoke_sweep() if args.smoke or not cuda else full_sweep()
    if args.models:
        sweep.models = args.models
    if args.contexts:
        sweep.contexts = args.contexts
    if args.batches:
        sweep.batches = args.batches
    started = time.monotonic()
    bench = Bench(device, torch.bfloat16 if cuda else torch.float32, sweep, args.warmup_ms,
                  args.rep_ms, started + args.time_budget_s, args.max_kv_gb * 1e9)
    torch.manual_seed(0)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "dtype": str(bench.dtype), "page_size": PAGE,
        "smoke": not cuda or args.smoke, "timer": "triton.testing.do_bench median, L2 flushed"
        if cuda else "one run (interpreter)", "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
    }
    copy: dict[str, float] = {}
    try:
        copy = copy_bandwidth(bench)
        bench.copy_bw = copy["copy_bytes_per_s"]
        if cuda:
            torch.cuda.empty_cache()
        log(f"copy {copy['copy_bytes_per_s'] / 1e12:.3f} TB/s, "
            f"read {copy['read_bytes_per_s'] / 1e12:.3f} TB/s")
        run_all(bench)
    finally:
        result.update(copy=copy, rows=bench.rows, refs=bench.refs, checks=bench.checks,
                      errors=bench.errors,
                      elapsed_s=time.monotonic() - started)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(markdown(bench, copy))
    print(f"\n{len(bench.rows)} rows in {time.monotonic() - started:.0f} s; JSON: {args.out}")


if __name__ == "__main__":
    main()
