"""The least time one kernel costs inside a CUDA graph on this GPU: a graph of n launches of
a kernel that does almost nothing (each program adds 1 to one float32 that the previous
launch wrote, so the launches stay in order), replayed; µs per launch, for several program
counts (1 program: launch latency alone; a few per SM: the block scheduling too).

    python benchmarks/launch_floor.py --launches 100 400 --programs 1 132 528 --out floor.json

A decode step of k kernels costs at least k times this on top of its bytes' time, whatever
the kernels do (BENCHMARKS.md §2.1)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import graph_us  # noqa: E402


@triton.jit
def _bump_kernel(x_ptr):
    """x[p] += 1 for program p."""
    p = tl.program_id(0)
    tl.store(x_ptr + p, tl.load(x_ptr + p) + 1.0)


def launch_us(launches: int, programs: int, reps: int) -> float:
    """Median µs per launch over `reps` replays of a graph of `launches` dependent launches."""
    x = torch.zeros(programs, device="cuda")
    return graph_us(lambda: _bump_kernel[(programs,)](x), calls=launches, reps=reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, nargs="+", default=[100, 400])
    ap.add_argument("--programs", type=int, nargs="+", default=[1, 132, 528])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("launch_floor: needs a CUDA GPU (it times CUDA graphs)", file=sys.stderr)
        return 2
    rows = []
    for launches in args.launches:
        for programs in args.programs:
            row = {"launches": launches, "programs": programs,
                   "us_per_launch": launch_us(launches, programs, args.reps)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
