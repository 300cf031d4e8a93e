"""Local context in vegas's selection: tokens per iteration over a (window, pool) grid.

vegas's and lastq's `window` always selects the positions just before the selection row (inside the
budget k), and `pool` max-pools the aggregated scores over neighbouring positions before the
top-k (SnapKV's trick); window 0 and pool 1 are the paper's pure top-k. This script runs, per
workload (essays and code at --context tokens, generation: a chat question and a long
answer) and sampling (greedy; temperature 0.6, top-p 0.95, top-k 20), every cell of the grid
with vegas (and lastq with --methods vegas lastq) at γ 6 and --ratio, plus stream at the same
budget for reference and, under greedy decoding, vanilla to count the outputs that equal it.
It prints one table per workload and sampling and rewrites --out (JSON) after every cell, so
that a run cut short keeps what it measured.

    python benchmarks/selection_sweep.py --device cuda --dtype bfloat16 --batch 16 \\
        --context 4096 --max-tokens 1024 --out selection.json

Tokens per iteration is pooled over every iteration of the batch; per-prompt values are kept
too (a cell moves by ±0.5 from one prompt to the next: compare over many prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from vegas_spec import LLM, SamplingParams, SpecConfig
from vegas_spec.bench import workloads

WORKLOADS = ("essays", "code", "generation")
SAMPLINGS = ("greedy", "sampled")
# The reference workload's sampling (METHOD.md): temperature 0.6, top-p 0.95, top-k 20.
SAMPLED = dict(temperature=0.6, top_p=0.95, top_k=20)


def prompts_of(llm: LLM, workload: str, args: argparse.Namespace) -> list[list[int]]:
    """`--batch` prompts of the workload: essays and code cut to --context tokens;
    generation, the bench's chat questions at their own length."""
    context = args.context if workload in workloads.SIZED else None
    return [p.ids for p in workloads.build(workload, llm.tokenizer, context, args.batch, [], [])]


def params_of(sampling: str, args: argparse.Namespace) -> list[SamplingParams]:
    """One per prompt: greedy, or sampled with a seed of its own (the same in every cell)."""
    extra = {} if sampling == "greedy" else SAMPLED
    return [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=args.seed + i,
                           **extra) for i in range(args.batch)]


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
        spec: SpecConfig) -> dict[str, Any]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, speculative=spec)
    stats = outs[0].stats
    row = {k: stats.get(k) for k in ("tokens_per_iteration", "acceptance_rate_per_position",
                                     "budget_mean", "iterations", "decode_tokens_per_s")}
    row["per_prompt"] = [o.stats["sequence"].get("tokens_per_iteration") for o in outs]
    row["wall_s"] = round(time.perf_counter() - t0, 3)
    row["token_ids"] = [o.token_ids for o in outs]
    return row


def _f(value: float | None) -> str:
    """A tokens-per-iteration figure (None: no speculative iteration ran)."""
    return "-" if value is None else f"{value:.2f}"


def table(cells: list[dict[str, Any]], windows: list[int], pools: list[int]) -> str:
    """Tokens per iteration per (window, pool) of each workload, sampling and method, with
    stream's beside it."""
    lines = []
    groups = dict.fromkeys((c["workload"], c["sampling"]) for c in cells)
    for workload, sampling in groups:
        rows = [c for c in cells if (c["workload"], c["sampling"]) == (workload, sampling)]
        stream = next((c for c in rows if c["method"] == "stream"), None)
        ref = "-" if stream is None else _f(stream["tokens_per_iteration"])
        for method in dict.fromkeys(c["method"] for c in rows if c["method"] != "stream"):
            lines += [f"{workload}, {sampling}, {method} (stream: {ref})",
                      "| window | " + " | ".join(f"pool {p}" for p in pools) + " |",
                      "|---|" + "---|" * len(pools)]
            for w in windows:
                got = {c["pool"]: c for c in rows
                       if c["method"] == method and c["window"] == w}
                lines.append(f"| {w} | " + " | ".join(
                    _f(got[p]["tokens_per_iteration"]) if p in got else "-"
                    for p in pools) + " |")
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF folder or .gguf file (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None,
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--kv-cache-gb", type=float, help="KV pool (default: the engine's)")
    ap.add_argument("--max-model-len", type=int, help="default: the model's")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--batch", type=int, default=8, help="prompts a cell runs together")
    ap.add_argument("--context", type=int, default=4096,
                    help="prompt tokens of essays and code")
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens generated a prompt")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--samplings", nargs="+", default=list(SAMPLINGS), choices=SAMPLINGS)
    ap.add_argument("--methods", nargs="+", default=["vegas"], choices=["vegas", "lastq"])
    ap.add_argument("--windows", nargs="+", type=int, default=[0, 32, 64, 128])
    ap.add_argument("--pools", nargs="+", type=int, default=[1, 3, 7])
    ap.add_argument("--collects", nargs="+", default=["2"], choices=["2", "all"],
                    help="vegas's verify rows scored: the first and last, or all")
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0, help="sampled: prompt i's seed is seed + i")
    ap.add_argument("--no-stream", action="store_true", help="skip stream's reference runs")
    ap.add_argument("--out", type=Path, help="JSON of every cell (rewritten after each)")
    args = ap.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    kwargs: dict[str, Any] = {"device": args.device, "dtype": dtype, "backend": args.backend}
    if args.kv_cache_gb is not None:
        kwargs["kv_cache_bytes"] = int(args.kv_cache_gb * (1 << 30))
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if args.eager:
        kwargs["cuda_graphs"] = False
    base = SpecConfig(gamma=args.gamma, ratio=args.ratio, min_tokens=args.min_tokens,
                      adaptive=False)  # a round every iteration: tau of every cell
    specs = [dataclasses.replace(base, method=m, window=w, pool=p,  # checked before loading
                                 **({"collect": c} if m == "vegas" else {}))
             for m in args.methods for c in (args.collects if m == "vegas" else ["2"])
             for w in args.windows for p in args.pools]
    llm = LLM(args.model, **kwargs)
    meta = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "dtype": dtype, "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    cells: list[dict[str, Any]] = []

    def save() -> None:
        if args.out is not None:
            rows = [{k: v for k, v in c.items() if k != "token_ids"} for c in cells]
            args.out.write_text(json.dumps({"meta": meta, "cells": rows}, indent=1) + "\n")

    for workload in args.workloads:
        prompts = prompts_of(llm, workload, args)
        for sampling in args.samplings:
            params = params_of(sampling, args)
            plain = None
            if sampling == "greedy":
                plain = run(llm, prompts, params, SpecConfig(method="vanilla"))["token_ids"]
            # stream reads neither setting: recorded as the pure top-k's
            todo = ([] if args.no_stream else
                    [dataclasses.replace(base, method="stream")])
            for spec in todo + specs:
                window = getattr(spec.options, "window", 0)  # stream: the pure top-k's
                pool = getattr(spec.options, "pool", 1)
                collect = getattr(spec.options, "collect", None)
                method = (spec.method if collect in (None, "2")
                          else f"{spec.method}, collect {collect}")
                row = run(llm, prompts, params, spec)
                if plain is not None:
                    row["same_as_vanilla"] = sum(a == b for a, b in
                                                 zip(row["token_ids"], plain))
                cells.append({"workload": workload, "sampling": sampling,
                              "method": method, "window": window, "pool": pool, **row})
                print(f"{workload} {sampling} {method} window {window} pool "
                      f"{pool}: {_f(row['tokens_per_iteration'])} tokens/iteration"
                      + ("" if plain is None else
                         f", {row['same_as_vanilla']}/{len(plain)} = vanilla"), flush=True)
                save()
    print()
    print(table(cells, args.windows, args.pools))


if __name__ == "__main__":
    main()
