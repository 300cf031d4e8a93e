"""The projections of a draft step with FP8, INT8 or INT4 weights against the model's bf16
weights, per 8B projection shape and row count: µs per call and the weight bytes' share of the
card's copy bandwidth.

Each cell cycles through `--layers` weights of its own (as a model's layers do, so that no
call finds its weight in L2), in a CUDA graph of one call per weight, median over replays.
Rows: `skinny_linear` on the copies `--kinds` names, FP8 (`quant.Fp8Weight`), INT8
(`quant.Int8Weight`: a scale per row and group of 128 inputs; `int8-row`, one scale a row, the
copies before group scales) and INT4 (`quant.Int4Weight`), or on the bf16 weight itself
(`bf16`, up to `MAX_ROWS` rows), each with the default tiles and, for the kinds
`--tile-kinds` names (FP8 alone by default), every `--tiles` setting, and cuBLAS (`F.linear`)
on the bf16 weight beside them. `--shapes smollm2`: SmolLM2-135M's projections instead of
the 8B ones.

    python benchmarks/fp8_gemm.py --out fp8_gemm.json
    python benchmarks/fp8_gemm.py --rows 16 32 --tiles 64:256:4:4:1 32:512:4:3:2 --out t.json
    python benchmarks/fp8_gemm.py --shapes smollm2 --rows 1 8 32 --kinds bf16 --tile-kinds bf16 \
        --tiles 16:64:4:3:1 16:64:4:3:1:swap --layers 30 --out small.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from common import copy_bandwidth, graph_us

from vegas_spec.kernels.skinny_matmul import MAX_ROWS, SkinnyTiles, skinny_linear, skinny_tiles
from vegas_spec.quant import QUANTIZERS, DraftWeight, quantize_int8

# (name, N, K) of Llama-3.1-8B's fused projections (Qwen3-8B: the same but gate_up 24576 and
# down K 12288).
SHAPES = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336), ("qwen3 gate_up", 24576, 4096), ("qwen3 down", 4096, 12288)]
# SmolLM2-135M's (a draft step of the embedded model).
SMOLLM2 = [("qkv", 960, 576), ("o_proj", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
SHAPE_SETS = {"8b": SHAPES, "smollm2": SMOLLM2}

def int8_row(weight: torch.Tensor) -> DraftWeight:
    """An INT8 copy with one scale a row (a group of K): the group scales' cost, side by side."""
    return quantize_int8(weight, weight.shape[1])


COPIES = {**QUANTIZERS, "int8-row": int8_row}
KINDS = [*COPIES, "bf16"]  # bf16: the kernel on the model's own weight


def tiles_arg(text: str) -> SkinnyTiles:
    """BLOCK_N:BLOCK_K:WARPS:STAGES:SPLIT_K, then :swap for the transposed product and :half
    for the dot in float16."""
    parts = text.split(":")
    n, k, warps, stages, split = (int(v) for v in parts[:5])
    flags = set(parts[5:])
    assert flags <= {"swap", "half"}, f"unknown flags in {text}"
    return SkinnyTiles(n, k, warps, stages, split, swap="swap" in flags, half="half" in flags)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 128])
    ap.add_argument("--tiles", type=tiles_arg, nargs="*", default=[],
                    help="BLOCK_N:BLOCK_K:WARPS:STAGES:SPLIT_K settings beside the default")
    ap.add_argument("--kinds", nargs="+", default=list(QUANTIZERS), choices=KINDS,
                    help="the draft copies timed (bf16: the kernel on the bf16 weight)")
    ap.add_argument("--tile-kinds", nargs="+", default=["fp8"], choices=KINDS,
                    help="the copies the --tiles settings run on")
    ap.add_argument("--shapes", default="8b", choices=list(SHAPE_SETS),
                    help="the 8B models' projections or SmolLM2-135M's")
    ap.add_argument("--layers", type=int, default=8, help="weights a cell cycles through")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    rows = []
    for name, n, k in SHAPE_SETS[args.shapes]:
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        weights = [(torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5)
                   .to(torch.bfloat16) for _ in range(args.layers)]
        copies = {kind: weights if kind == "bf16" else [COPIES[kind](w) for w in weights]
                  for kind in args.kinds}
        for m in args.rows:
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            calls = [("cublas bf16", None, lambda i, x=x, ws=weights: F.linear(x, ws[i]),
                      2 * n * k)]
            for kind, held in copies.items():
                if kind == "bf16" and m > MAX_ROWS:
                    continue  # the kernel takes at most MAX_ROWS rows of a 16-bit weight
                nbytes = held[0].nbytes
                settings = [None, *(args.tiles if kind in args.tile_kinds else [])]
                for t in settings:
                    if kind == "int4" and t is not None and t.swap:
                        continue  # the INT4 kernel has no transposed product
                    label = f"{kind} " + ("default" if t is None else
                                          f"{t.block_n}:{t.block_k}:{t.num_warps}:"
                                          f"{t.num_stages}:{t.split_k}"
                                          + (":swap" if t.swap else "")
                                          + (":half" if t.half else ""))
                    calls.append((label, t, lambda i, t=t, x=x, cs=held:
                                  skinny_linear(x, cs[i], tiles=t), nbytes))
            for label, t, fn, nbytes in calls:
                state = {"i": 0}

                def one(fn=fn, state=state) -> None:
                    fn(state["i"] % args.layers)
                    state["i"] += 1

                try:
                    us = graph_us(one, calls=args.layers, reps=20)
                except triton.runtime.errors.OutOfResources as err:  # tiles too big here
                    print(json.dumps({"shape": name, "rows": m, "kernel": label,
                                      "skipped": str(err)[:80]}), flush=True)
                    continue
                chosen = t or (skinny_tiles(m, n, k, torch.device("cuda"))
                               if label.split()[0] in copies else None)
                row = {"shape": name, "n": n, "k": k, "rows": m, "kernel": label, "us": us,
                       "share_of_copy_bandwidth": nbytes / (us * 1e-6) / bandwidth,
                       "tiles": None if chosen is None else chosen.__dict__}
                rows.append(row)
                print(json.dumps({k2: round(v, 3) if isinstance(v, float) else v
                                  for k2, v in row.items()}), flush=True)
        del weights, copies
        torch.cuda.empty_cache()
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "copy_bandwidth_bytes_per_s": bandwidth}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
