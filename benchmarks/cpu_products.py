"""The CPU path's products against plain torch, side by side in one run: `ops.dense_linear`
against `F.linear` for a model's projection shapes at each row count, in float32 and
bfloat16, and `cache.gather_slots` against advanced indexing for a decode step's KV gather.
Every weight is one of several copies that together exceed the last-level cache, so each
call streams its weight from memory as a decode step does (a loop over one weight would
time the cache instead).

    python benchmarks/cpu_products.py --threads 1 --out cpu_products.json

Prints one line a shape and row count: milliseconds a call, torch's and ours, and their
ratio (BENCHMARKS.md §6)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vegas_spec.cache import gather_slots  # noqa: E402
from vegas_spec.ops import dense_linear  # noqa: E402

# SmolLM2-135M's projections (out, in): fused q/k/v, o, gate/up, down, LM head
SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def best_ms(calls: list[Callable[[], object]], reps: int) -> float:
    """The least mean milliseconds a call over `reps` passes through `calls`."""
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for call in calls:
            call()
        best = min(best, (time.perf_counter() - start) / len(calls) * 1e3)
    return best


def copies(shape: tuple[int, ...], dtype: torch.dtype, stream_bytes: int) -> list[torch.Tensor]:
    """At least two random tensors of `shape`, as many as `stream_bytes` holds (at most 256)."""
    size = torch.empty(shape, dtype=dtype).nbytes
    return [torch.randn(shape).to(dtype) for _ in range(min(256, max(2, stream_bytes // size)))]


def linear_rows(shapes: list[tuple[int, int]], rows: list[int], dtypes: list[torch.dtype],
                stream_bytes: int, reps: int) -> list[dict]:
    out = []
    for dtype in dtypes:
        for n, k in shapes:
            weights = copies((n, k), dtype, stream_bytes)
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                torch_ms = best_ms([lambda w=w, x=x: F.linear(x, w) for w in weights], reps)
                ours_ms = best_ms([lambda w=w, x=x: dense_linear(x, w) for w in weights],
                                  reps)
                out.append({"what": "linear", "dtype": str(dtype).removeprefix("torch."),
                            "shape": [n, k], "rows": m, "torch_ms": torch_ms,
                            "ours_ms": ours_ms, "speedup": torch_ms / ours_ms})
    return out


def gather_rows(slots: int, pool: int, heads: int, dim: int, layers: int,
                reps: int) -> list[dict]:
    """One decode step's K gathers: `slots` positions of a pool of `pool` slots, a pool per
    layer (so that each gather reads memory, as a step through the layers does)."""
    caches = [torch.randn(pool, heads, dim) for _ in range(layers)]
    index = torch.randint(0, pool, (slots,))
    torch_ms = best_ms([lambda c=c: c[index] for c in caches], reps)
    ours_ms = best_ms([lambda c=c: gather_slots(c, index) for c in caches], reps)
    return [{"what": "gather", "dtype": "float32", "shape": [pool, heads, dim], "rows": slots,
             "torch_ms": torch_ms, "ours_ms": ours_ms, "speedup": torch_ms / ours_ms}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 64, 256])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"])
    ap.add_argument("--shapes", default="smollm2", choices=["smollm2", "tiny"],
                    help="tiny: two small shapes (a check that the script runs)")
    ap.add_argument("--stream-mb", type=int, default=256,
                    help="bytes of weight copies per shape (above the last-level cache)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = SMOLLM2 if args.shapes == "smollm2" else [(64, 32), (32, 64)]
    gather = ((4096, 3632, 3, 64, 30) if args.shapes == "smollm2" else (64, 128, 2, 8, 2))
    rows = linear_rows(shapes, args.rows, [getattr(torch, d) for d in args.dtypes],
                       args.stream_mb << 20, args.reps)
    rows += gather_rows(*gather, reps=args.reps)
    for r in rows:
        print(f"{r['what']:7} {r['dtype']:9} {str(tuple(r['shape'])):18} rows {r['rows']:5}  "
              f"torch {r['torch_ms']:8.3f} ms  ours {r['ours_ms']:8.3f} ms  "
              f"x{r['speedup']:.2f}")
    if args.out:
        args.out.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
