"""Tokens per iteration of every method, and ms per token of vegas vs vanilla, side by side.

SmolLM2-135M-Instruct (embedded), float32, torch backend, Paul Graham essays as context,
greedy. For each context length all methods run on the same prompts in one process; every
speculative output is checked token for token against vanilla.

    python benchmarks/cpu_methods.py --contexts 2000 7500 --prompts 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from common import essays

from vegas_spec import LLM, SamplingParams, SpecConfig

METHODS = ["vanilla", "vegas", "lastq", "stream", "quest", "specextend", "full"]


def prompts(tokenizer, texts: list[str], tokens: int, count: int) -> list[list[int]]:  # noqa: ANN001
    """`count` prompts of `tokens` tokens, each starting at a different essay."""
    out = []
    cue = tokenizer("\n\nIn summary, the main point of the essay above is",
                    add_special_tokens=False)["input_ids"]
    for i in range(count):
        offset = (i * 7) % len(texts)
        text = "\n\n".join(texts[offset:] + texts[:offset])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: tokens - len(cue)]
        out.append(ids + cue)
    return out


def run(llm: LLM, batch: list[list[int]], method: str, args: argparse.Namespace) -> dict:
    spec = SpecConfig(method=method, gamma=args.gamma, ratio=args.ratio,
                      min_tokens=args.min_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, speculative=spec)
    stats = dict(outs[0].stats)
    stats.pop("sequence", None)
    stats["wall_s"] = time.perf_counter() - t0
    stats["ms_per_token"] = 1000 * stats["decode_s"] / stats["generated_tokens"]
    stats["token_ids"] = [o.token_ids for o in outs]
    return stats


def table(results: dict[int, dict[str, dict]]) -> str:
    lines = ["| context | method | tokens/iter | accept@1 | accept@6 | budget | ms/token | "
             "vs vanilla | select % | lossless |", "|" + "---|" * 10]
    for ctx, rows in results.items():
        base = rows["vanilla"]
        for method, r in rows.items():
            acc = r.get("acceptance_rate_per_position") or [None] * 6
            frac = r.get("phase_fraction", {}).get("select")
            lines.append("| {} | {} | {} | {} | {} | {} | {:.1f} | {:.2f}x | {} | {} |".format(
                ctx, method, _f(r.get("tokens_per_iteration")), _f(acc[0]), _f(acc[-1]),
                _f(r.get("budget_mean"), 0), r["ms_per_token"],
                base["ms_per_token"] / r["ms_per_token"], _f(frac and 100 * frac, 1),
                "yes" if r["token_ids"] == base["token_ids"] else "NO"))
    return "\n".join(lines)


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[2000, 7500])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_methods.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kv_bytes = args.prompts * (max(args.contexts) + args.max_tokens + 64) * 46080 + (64 << 20)
    llm = LLM(kv_cache_bytes=kv_bytes, prefix_cache_bytes=2 * kv_bytes)
    texts = essays()
    results: dict[int, dict[str, dict]] = {}
    for ctx in args.contexts:
        batch = prompts(llm.tokenizer, texts, ctx, args.prompts)
        results[ctx] = {}
        for method in args.methods:
            results[ctx][method] = run(llm, batch, method, args)
            r = results[ctx][method]
            print(f"{ctx} {method}: tpi={r.get('tokens_per_iteration')} "
                  f"ms/token={r['ms_per_token']:.1f}", flush=True)
            save(args, results)
    print(table(results))


def save(args: argparse.Namespace, results: dict) -> None:
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "args": vars(args) | {"out": str(args.out)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
