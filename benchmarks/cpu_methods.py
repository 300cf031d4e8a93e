"""Tokens per iteration of every method, and decode speed against vanilla, side by side on CPU:
a thin caller of `vegas bench` (SmolLM2-135M-Instruct, float32, torch backend, essay prompts,
greedy; every speculative output checked token for token against vanilla).

    python benchmarks/cpu_methods.py --contexts 2000 7500 --prompts 4 --max-tokens 64 \
        --out benchmarks/results/cpu_methods

is the same as

    vegas bench --device cpu --workload essays --context 2000,7500 --batch 4 --max-tokens 64 \
        --methods vanilla,vegas,lastq,stream,quest,specextend,full \
        --out benchmarks/results/cpu_methods

Figures recorded before `vegas bench` existed came from this script's own prompt builder
(windows starting at every seventh essay); `vegas bench` spreads its windows evenly.
"""

from __future__ import annotations

import argparse
import sys

import torch

from vegas_spec import cli

METHODS = ["vanilla", "vegas", "lastq", "stream", "quest", "specextend", "full"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[2000, 7500])
    ap.add_argument("--prompts", type=int, default=4, help="prompts decoded together")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--out", default="benchmarks/results/cpu_methods", help="output directory")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return cli.main(["bench", "--device", "cpu", "--dtype", "float32", "--workload", "essays",
                     "--context", ",".join(map(str, args.contexts)), "--batch",
                     str(args.prompts), "--max-tokens", str(args.max_tokens), "--gamma",
                     str(args.gamma), "--ratio", str(args.ratio), "--min-tokens",
                     str(args.min_tokens), "--methods", ",".join(args.methods), "--out",
                     args.out])


if __name__ == "__main__":
    sys.exit(main())
