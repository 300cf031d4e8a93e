"""Tile and split settings of the paged attention kernel at one verify/decode shape (CUDA).

Times `paged_attention` for n = 7 query rows with and without selection scores (weight mode,
rows 0 and 6) and for n = 1, over key blocks of 64 and 128, 2-3 pipeline stages, 4 warps
(or `--warps`), two split sizes, how scored passes store their logits (`--stores`,
`SCORE_STORES`), a scored pass's cap on the registers per thread (`--maxnregs`) and on its
split (`--score-split-max`), on random bf16 K/V behind a shuffled page table. Each
figure is the median per call of 20 replays of a CUDA graph of 30 calls (the kernel count of
one step of a 30-layer model), with the registers, spills and shared memory of the kernel
variants each setting compiled. What it decided: `paged_attention.PagedTuning.score_tiles`.
`--kernel sparse` times the draft step's sparse attention instead, `--kernel quest`
quest's page scores (`quest_scores.QuestTuning`) and its top-k (`topk.TopkTuning`), and
`--kernel topk` vegas's ranking of a round's scores, and
`--kernel merge` the split merge alone (`split_merge.SplitTuning`'s merge_* fields).

    python benchmarks/tile_sweep.py --out tile_sweep.json
    python benchmarks/tile_sweep.py --kernel quest --warps 2 4 8 --out quest_sweep.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import graph_us  # noqa: E402

import vegas_spec.kernels.paged_attention as pa  # noqa: E402
import vegas_spec.kernels.quest_scores as qs  # noqa: E402
import vegas_spec.kernels.sparse_attention as sa  # noqa: E402
import vegas_spec.kernels.topk as tk  # noqa: E402
from vegas_spec import ops  # noqa: E402
from vegas_spec.kernels import split_merge, tuned  # noqa: E402


def cycling(items: list[tuple], fn: Callable[..., object]) -> Callable[[], object]:
    """A call of fn on the next item's fields each time, starting over after the last."""
    counter = itertools.count()
    return lambda: fn(*items[next(counter) % len(items)])


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


def with_tiles(block_k: int, stages: int, warps: int, maxnreg: int | None,
               split_max: int | None, store: str, head_dim: int) -> contextlib.ExitStack:
    """Inside the returned context the kernel wrapper builds its tiles with `stages` pipeline
    stages and `warps` warps per program, and its scored passes with `block_k` keys per
    block, `maxnreg` registers per thread, splits of at most `split_max` keys and their
    weight-mode logits stored with `store` (`kernels.tuned`)."""
    stack = contextlib.ExitStack()
    stack.enter_context(tuned(split_merge, stages=stages, warps=warps))
    stack.enter_context(tuned(pa, score_tiles={
        head_dim: pa.ScoreTiles(block_k, stages, split_max, maxnreg, store)}))
    return stack


def sparse_sweep(args: argparse.Namespace) -> list[dict]:
    """The draft step's sparse attention (n = 1) over a sorted random `--ratio` of each
    sequence's positions plus `--recent` trailing ones: µs per call and TB/s of the K/V rows
    it must read.
    With `--layers` L > 1 the calls of a graph cycle through L caches and lists of their own,
    as a model's layers do, so that the gathered rows come from HBM and not from L2."""
    torch.manual_seed(0)
    bsz, heads, hkv, dim, ctx = args.batch, args.heads, args.kv_heads, args.head_dim, args.context
    budget, recent = int(args.ratio * ctx), args.recent
    start = ctx - recent
    layers = []
    for _ in range(args.layers):
        table, k, v, _ = paged_cache(bsz, hkv, dim, ctx, 16)
        idx = torch.stack([torch.randperm(start, device="cuda")[:budget].sort().values
                           for _ in range(bsz)])[:, None, :].contiguous()
        layers.append((table, k, v, idx))
    q = torch.randn(bsz, 1, heads, dim, device="cuda", dtype=torch.bfloat16)
    pos = torch.full((bsz, 1), ctx - 1, device="cuda")
    recent_start = torch.full((bsz,), start, dtype=torch.int64, device="cuda")
    out = torch.empty_like(q)
    moved = 2 * bsz * hkv * (budget + recent) * dim * layers[0][1].element_size()
    rows = []
    splits = [x if x in ("auto", "paged") else int(x) for x in args.splits]
    per_sm = sa.tuning(torch.device("cuda")).programs_per_sm
    for block_k, stages, warps, split in itertools.product(
            args.block_k, args.stages, args.warps, splits):
        if isinstance(split, int) and split % block_k:
            continue
        size = split if isinstance(split, int) else None
        # paged: the paged kernel's occupancy split instead of the sparse kernel's own
        with tuned(sa, programs_per_sm=None if split == "paged" else per_sm), \
                tuned(split_merge, stages=stages, warps=warps):
            us = graph_us(cycling(layers, lambda table, k, v, idx, bk=block_k, sp=size: (
                sa.sparse_attention(q, k, v, table, pos, 16, idx, recent_start, recent,
                                    dim ** -0.5, block_k=bk, split_size=sp, out=out))))
        row = {"kernel": "sparse", "block_k": block_k, "stages": stages, "warps": warps,
               "split": split, "layers": args.layers,
               "budget": budget, "us": us, "tb_per_s": moved / us / 1e6}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def quest_sweep(args: argparse.Namespace, page: int = 16) -> list[dict]:
    """quest's per-layer work in a draft step: the page scores over the bounds of every page
    (µs per call and TB/s of the bounds) for pages per program x warps, and the top-k of
    those scores with the pages expanded for several warp counts of the resident kernel."""
    torch.manual_seed(0)
    bsz, heads, hkv, dim, ctx = args.batch, args.heads, args.kv_heads, args.head_dim, args.context
    num_pages = -(-(ctx + 52) // page)
    lo = torch.randn(bsz, num_pages, hkv, dim, device="cuda", dtype=torch.bfloat16)
    hi = lo + torch.rand_like(lo)
    q = torch.randn(bsz, 1, heads, dim, device="cuda", dtype=torch.bfloat16)
    pages = torch.full((bsz,), ctx // page, device="cuda")
    moved = 2 * lo.numel() * lo.element_size()
    rows = []
    for block_p, warps in itertools.product(args.quest_pages, args.warps):
        with tuned(qs, tiles={dim: (block_p, warps)}):
            us = graph_us(lambda: qs.quest_page_scores(q, lo, hi, pages))  # noqa: B023
        row = {"kernel": "quest_scores", "block_p": block_p, "warps": warps, "us": us,
               "tb_per_s": moved / us / 1e6}
        rows.append(row)
        print(json.dumps(row), flush=True)
    scores = qs.quest_page_scores(q, lo, hi, pages)
    keep = max(int(args.ratio * ctx) // page, 1)
    k = torch.full((bsz,), keep, device="cuda")
    rankable = pages * page
    for per_warp, least in itertools.product(args.topk_keys_per_warp, args.topk_min_warps):
        with tuned(tk, keys_per_warp=per_warp, min_warps=least):
            us = graph_us(lambda: tk.topk_positions_triton(scores, pages, k, keep, page,
                                                           rankable))
            warps = tk.resident_warps(triton.next_power_of_2(num_pages), scores.device)
        row = {"kernel": "quest_topk", "keys_per_warp": per_warp, "min_warps": least,
               "warps": warps, "width": num_pages, "keep_pages": keep, "us": us}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def topk_sweep(args: argparse.Namespace) -> list[dict]:
    """vegas's ranking of one round: scores [layers, B, 2, 1, W] (the verify step's two
    collected rows of softmax weights, W the static key width) -> the top 5% below the
    context, with the rows summed by PyTorch first or inside the kernel, and by the reference
    (torch.topk and a sort)."""
    torch.manual_seed(0)
    layers, bsz, ctx = args.layers, args.batch, args.context
    width = ctx + 64
    weights = torch.rand(layers, bsz, 2, 1, width, device="cuda") ** 8  # a long tail
    scores = weights[..., :ctx]
    rankable = torch.full((bsz,), ctx, device="cuda")
    keep = max(-(-int(args.ratio * ctx * 1000) // 1000), 256)
    k = torch.full((bsz,), keep, device="cuda")
    calls = {"reference": lambda: ops.topk_positions(scores.sum(-3), rankable, k, keep)}
    want = calls["reference"]()
    calls["summed first"] = lambda: tk.topk_positions_triton(scores.sum(-3), rankable, k, keep)
    calls["summed in the kernel"] = lambda: tk.topk_row_sum_triton(scores, rankable, k, keep)
    rows = []
    for _ in range(args.repeat):
        for name, fn in calls.items():
            assert torch.equal(fn(), want), name
            us = graph_us(fn)
            row = {"kernel": "vegas_topk", "way": name, "layers": layers, "batch": bsz,
                   "width": ctx, "keep": keep, "us": us}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def merge_sweep(args: argparse.Namespace) -> list[dict]:
    """The split merge alone: for each shape SxRxHxD (splits, rows = B x n, heads, head dim)
    random partials merged with each `--merge-tiles` setting, µs per call and TB/s of the
    partials it reads.
    With `--layers` L > 1 the calls cycle through L sets of partials, so that they come from
    HBM and not from L2 (in a step they were just written by the split kernel)."""
    torch.manual_seed(0)
    rows = []
    for shape in args.merge_shapes:
        splits, flat, heads, dim = (int(x) for x in shape.split("x"))
        sets = []
        for _ in range(args.layers):
            parts = split_merge.Partials.empty(splits, flat, heads, dim, torch.device("cuda"))
            parts.acc.normal_()
            parts.m.normal_()
            parts.l.uniform_(0.5, 2.0)
            sets.append((parts,))
        out = torch.empty(flat, 1, heads, dim, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(flat, heads, device="cuda")
        moved = sets[0][0].acc.numel() * 4 + 2 * sets[0][0].m.numel() * 4 + out.numel() * 2
        for tile in args.merge_tiles:
            with tuned(split_merge, merge_tile=tile):
                block_s, block_h, used = split_merge.merge_tiling(splits, heads, dim,
                                                                  out.device)
                us = graph_us(cycling(sets, lambda parts, o=out, e=lse: (
                    split_merge.merge_splits(parts, o, e))))
            row = {"kernel": "merge", "shape": shape, "tile": tile,
                   "block_s": block_s, "block_h": block_h, "warps_run": used,
                   "layers": args.layers, "us": us,
                   "tb_per_s": moved / us / 1e6}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=7500)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--block-k", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--splits", nargs="+", default=["auto", "2048"],
                    help="split sizes in keys, or 'auto' (the kernel's rule; sparse: also "
                         "'paged', the paged kernel's occupancy split)")
    ap.add_argument("--stores", nargs="+", choices=sorted(pa.SCORE_STORES),
                    help="how weight-mode passes keep their logits (default: the library's "
                         "at this head dim)")
    ap.add_argument("--maxnregs", type=int, nargs="+",
                    help="paged, weight scores: registers per thread ptxas may use (0: its "
                         "own choice; default: the library's at this head dim)")
    ap.add_argument("--score-split-max", type=int, nargs="+",
                    help="paged, weight scores: the largest split of an 'auto' split in keys "
                         "(0: the occupancy split alone; default: the library's at this head "
                         "dim)")
    ap.add_argument("--kernel", choices=["paged", "sparse", "quest", "topk", "merge"],
                    default="paged",
                    help="sparse: the draft step's attention over a --ratio budget plus --recent; "
                         "quest: quest's page scores and top-k of one layer; topk: vegas's "
                         "ranking of a round's scores (--layers of them); merge: the split merge "
                         "alone (--merge-shapes)")
    ap.add_argument("--layers", type=int, default=1,
                    help="sparse: caches the calls of a graph cycle through (30: rows from "
                         "HBM, as in a model's draft step)")
    ap.add_argument("--quest-pages", type=int, nargs="+", default=[32, 64, 128, 256],
                    help="quest: pages per program of the page-score kernel")
    ap.add_argument("--topk-keys-per-warp", type=int, nargs="+", default=[128, 256, 512],
                    help="quest: scores per warp of the resident top-k")
    ap.add_argument("--topk-min-warps", type=int, nargs="+",
                    help="quest: the fewest warps of the resident top-k "
                         "(topk.TopkTuning.min_warps, default: the library's; repeat to "
                         "interleave)")
    ap.add_argument("--merge-shapes", nargs="+", default=["16x112x32x128"],
                    help="merge: splits x rows x heads x head dim of the partials")
    ap.add_argument("--merge-tiles", type=int, nargs="+",
                    help="merge: float32 elements of a step's tile "
                         "(split_merge.SplitTuning.merge_tile, default: the library's)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="topk: times the settings are timed, interleaved")
    ap.add_argument("--ratio", type=float, default=0.05,
                    help="sparse, quest, topk: tokens kept")
    ap.add_argument("--recent", type=int, default=64,
                    help="sparse: trailing positions walked after the list (vegas's window)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "tile_sweep times CUDA kernels"
    gpu = torch.device("cuda")
    args.topk_min_warps = args.topk_min_warps or [tk.tuning(gpu).min_warps]
    args.merge_tiles = args.merge_tiles or [split_merge.tuning(gpu).merge_tile]
    if args.kernel in ("sparse", "quest", "topk", "merge"):
        sweep = {"sparse": sparse_sweep, "quest": quest_sweep, "topk": topk_sweep,
                 "merge": merge_sweep}
        rows = sweep[args.kernel](args)
        meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
                "args": {k: str(v) for k, v in vars(args).items()}}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return
    torch.manual_seed(0)
    dev, page = "cuda", 16
    bsz, heads, hkv, dim, ctx = args.batch, args.heads, args.kv_heads, args.head_dim, args.context
    table, k, v, kv_len = paged_cache(bsz, hkv, dim, ctx, page)
    library = pa.tuning(gpu).score_tiles_at(dim)
    maxnregs = args.maxnregs or [library.maxnreg or 0]
    split_maxes = args.score_split_max or [library.split_max or 0]
    stores_weight = args.stores or [library.store]
    scale = dim ** -0.5
    rows: list[dict] = []
    for n, modes in ((7, ("weight", "none")), (1, ("none",))):
        q = torch.randn(bsz, n, heads, dim, device=dev, dtype=torch.bfloat16)
        pos = torch.full((bsz, 1), ctx, device=dev) + torch.arange(n, device=dev)
        score_rows = torch.tensor([0, n - 1], device=dev)
        scores = torch.empty(bsz, 2, 1, kv_len, device=dev)
        out = torch.empty_like(q)
        splits = [None if x == "auto" else int(x) for x in args.splits]
        for mode in modes:
            stores = stores_weight if mode == "weight" else [library.store]
            # Register and split caps apply to scored passes only.
            regs, caps = (maxnregs, split_maxes) if mode == "weight" else ([0], [0])
            for store, block_k, stages, warps, split, maxnreg, cap in itertools.product(
                    stores, args.block_k, args.stages, args.warps, splits, regs, caps):
                extra = (score_rows, scores, "weight") if mode == "weight" else ()
                before = compiled()
                with with_tiles(block_k, stages, warps, maxnreg or None, cap or None, store,
                                dim):
                    us = graph_us(lambda: pa.paged_attention(  # noqa: B023
                        q, k, v, table, pos, page, kv_len, scale, *extra,  # noqa: B023
                        block_k=block_k, split_size=split, out=out))  # noqa: B023
                row = {"n": n, "mode": mode, "store": store, "block_k": block_k,
                       "stages": stages, "warps": warps, "split": split,
                       "maxnreg": maxnreg or None, "score_split_max": cap or None, "us": us}
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
