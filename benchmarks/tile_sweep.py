"""Tile and split settings of the paged attention kernel at one verify/decode shape (CUDA).

Times `paged_attention` for n = 7 query rows with and without selection scores (weight mode,
rows 0 and 6) and for n = 1, over key blocks of 64 and 128, 2-3 pipeline stages, 4 warps
(or `--warps`) and two split sizes, on random bf16 K/V behind a shuffled page table. Each
figure is the median per call of 20 replays of a CUDA graph of 30 calls (the kernel count of
one step of a 30-layer model), with the registers, spills and shared memory of the kernel
variants each setting compiled. What it decided: the `SCORE_*` tiles of `paged_attention`.

    python benchmarks/tile_sweep.py --out tile_sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vegas_spec.kernels.paged_attention as pa  # noqa: E402
from vegas_spec.graphs import capture  # noqa: E402
from vegas_spec.kernels.split_merge import tile_config  # noqa: E402

SCORE_STAGES = pa.SCORE_STAGES


def graph_us(fn: Callable[[], object], calls: int = 30, reps: int = 20) -> float:
    """Median µs per call of `calls` calls captured in one CUDA graph."""
    graph, _ = capture(lambda: [fn() for _ in range(calls)], None)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def compiled() -> dict[int, object]:
    """Every compiled variant of the paged kernel so far, by object id."""
    return {id(kern): kern for cache, *_ in pa._paged_split_kernel.device_caches.values()
            for kern in cache.values()}


def paged_cache(bsz: int, hkv: int, dim: int, context: int, page: int = 16,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Random bf16 K/V caches behind a shuffled page table, with the engine's static key width
    at this context: (page_table [B, P], k_cache, v_cache [slots, Hkv, D], kv_len)."""
    kv_len = -(-(context + 52) // page) * page
    pages = kv_len // page
    table = torch.randperm(bsz * pages, device="cuda").int().view(bsz, pages).contiguous()
    k = torch.randn(bsz * pages * page, hkv, dim, device="cuda", dtype=torch.bfloat16)
    return table, k, torch.randn_like(k), kv_len


def with_tiles(stages: int, warps: int) -> None:
    """Make the kernel wrapper build its tiles with `stages` pipeline stages and `warps`
    warps per program."""
    pa.tile_config = lambda q, hkv, block_k=None: dataclasses.replace(  # type: ignore[assignment]
        tile_config(q, hkv, block_k), num_stages=stages, num_warps=warps)
    pa.SCORE_STAGES = stages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=7500)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "tile_sweep times CUDA kernels"
    torch.manual_seed(0)
    dev, page = "cuda", 16
    bsz, heads, hkv, dim, ctx = args.batch, args.heads, args.kv_heads, args.head_dim, args.context
    table, k, v, kv_len = paged_cache(bsz, hkv, dim, ctx, page)
    scale = dim ** -0.5
    rows: list[dict] = []
    for n, modes in ((7, ("weight", "none")), (1, ("none",))):
        q = torch.randn(bsz, n, heads, dim, device=dev, dtype=torch.bfloat16)
        pos = torch.full((bsz, 1), ctx, device=dev) + torch.arange(n, device=dev)
        score_rows = torch.tensor([0, n - 1], device=dev)
        scores = torch.empty(bsz, 2, 1, kv_len, device=dev)
        out = torch.empty_like(q)
        for mode in modes:
            for block_k, stages, warps, split in itertools.product(
                    (64, 128), (2, 3), args.warps, (None, 2048)):
                extra = (score_rows, scores, "weight") if mode == "weight" else ()
                before = compiled()
                with_tiles(stages, warps)
                us = graph_us(lambda: pa.paged_attention(  # noqa: B023
                    q, k, v, table, pos, page, kv_len, scale, *extra,  # noqa: B023
                    block_k=block_k, split_size=split, out=out))  # noqa: B023
                pa.tile_config, pa.SCORE_STAGES = tile_config, SCORE_STAGES
                row = {"n": n, "mode": mode, "block_k": block_k, "stages": stages,
                       "warps": warps, "split": split, "us": us}
                new = [kern for i, kern in compiled().items() if i not in before]
                if new:  # the variants this setting compiled: registers per thread
                    row["compiled"] = [{"registers": kern.n_regs, "spills": kern.n_spills,
                                        "shared_bytes": kern.metadata.shared}
                                       for kern in new]
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
            "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
