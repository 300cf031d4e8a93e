"""The verify step's paged attention at one shape, with and without selection scores, for a
kernel profiler (CUDA). Each variant runs twice: the first call compiles, the second is the
one to profile, e.g. with Nsight Compute:

    ncu --clock-control none -k regex:_paged_split_kernel --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
        python benchmarks/verify_kernel_once.py --score-tiles 128:3:2048:0

(launches in order: without scores, with scores, without, with; skip the first two).
Shape (default; see the options): SmolLM2 (9 query heads, 3 kv heads, head dim 64), batch 64,
7 query rows at 7,500 tokens,
weight scores of rows 0 and 6, random bf16 K/V behind a shuffled page table (as tile_sweep.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from tile_sweep import paged_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vegas_spec.kernels.paged_attention as pa  # noqa: E402
from vegas_spec.kernels import tuned  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--score-tiles", default=None,
                    help="BLOCK_K:STAGES:SPLIT_MAX:MAXNREG of the score-emitting call (0: the "
                         "occupancy split, ptxas's registers; default: the library's at this "
                         "head dim)")
    ap.add_argument("--store", choices=sorted(pa.SCORE_STORES),
                    help="how the scored pass keeps its logits (tile_sweep.py; default: the "
                         "library's at this head dim)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=7500)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this script runs CUDA kernels"
    bsz, heads, hkv, dim = args.batch, args.heads, args.kv_heads, args.head_dim
    tiles = pa.tuning(torch.device("cuda")).score_tiles_at(dim)
    store = args.store or tiles.store
    if args.score_tiles:
        block_k, stages, split_max, maxnreg = map(int, args.score_tiles.split(":"))
        tiles = pa.ScoreTiles(block_k, stages, split_max or None, maxnreg or None, store)
    page, ctx, n = 16, args.context, 7
    table, k, v, kv_len = paged_cache(bsz, hkv, dim, ctx, page)
    q = torch.randn(bsz, n, heads, dim, device="cuda", dtype=torch.bfloat16)
    pos = torch.full((bsz, 1), ctx, device="cuda") + torch.arange(n, device="cuda")
    rows = torch.tensor([0, n - 1], device="cuda")
    scores = torch.empty(bsz, 2, 1, kv_len, device="cuda")
    with tuned(pa, score_tiles={dim: dataclasses.replace(tiles, store=store)}):
        for _ in range(2):
            pa.paged_attention(q, k, v, table, pos, page, kv_len, dim ** -0.5)
            pa.paged_attention(q, k, v, table, pos, page, kv_len, dim ** -0.5, rows, scores,
                               "weight")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
