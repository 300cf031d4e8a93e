"""Many requests behind one long shared prefix (a system prompt, a document), with the prefix
cache off and on: time to first token and the KV pages held. With the cache on, the first
request computes the prefix and the others take its full pages by reference and prefill only
their own tokens, so the prefix's pages are held once.

    python benchmarks/prefix_share.py                      # 64 requests, ~7K-token prefix
    python benchmarks/prefix_share.py --device cpu --dtype float32 --requests 8 \
        --prefix-tokens 1500 --out prefix_share_cpu.json   # the CPU size

Each setting runs in an engine of its own, after a warm-up request of other text; all
requests are added at once and stepped until they finish. TTFT counts from when they were
added; `peak_pages` is the most pages held at once since the engine was made
(`PageAllocator.peak`: the warm-up's few pages are far below the run's), `computed_tokens`
the prompt positions prefilled (the rest, each sequence's `cached` positions, were pages
taken from the prefix cache)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import TEXTS

from vegas_spec import SamplingParams
from vegas_spec.engine import LLMEngine
from vegas_spec.sequence import Sequence


def token_ids(engine: LLMEngine, text: str, n: int) -> list[int]:
    """The first n tokens of text."""
    ids = engine.tokenizer(text[: n * 8])["input_ids"][:n]
    assert len(ids) == n, f"the text gives only {len(ids)} tokens, {n} asked"
    return ids


def prompts(engine: LLMEngine, text: str, requests: int, prefix: int, own: int,
            ) -> list[list[int]]:
    """`requests` prompts: the same `prefix` tokens, then `own` tokens of each one's own."""
    shared = token_ids(engine, text, prefix)
    tails = token_ids(engine, text[-(requests * own * 8) :], requests * own)
    return [shared + tails[i * own : (i + 1) * own] for i in range(requests)]


def run(engine: LLMEngine, batch: list[list[int]], max_tokens: int) -> dict:
    """Every prompt added at once, stepped until all finish -> the figures."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    pool = engine.scheduler.pool
    seqs: list[Sequence] = [engine.sequence(p, params, text=False) for p in batch]
    start = time.perf_counter()
    for seq in seqs:
        engine.add_request(seq)
    while engine.has_unfinished():
        engine.step(collect=False)
    total = time.perf_counter() - start
    ttft = [s.first_token_time - start for s in seqs if s.first_token_time is not None]
    computed = sum(len(s.prompt_ids) - s.cached for s in seqs)
    return {"ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "total_s": total, "peak_pages": pool.peak,
            "peak_kv_bytes": pool.peak * pool.bytes_per_page,
            "computed_tokens": computed, "prompt_tokens": sum(map(len, batch))}


def measure(args: argparse.Namespace, cache: bool) -> dict:
    engine = LLMEngine(args.model, dtype=args.dtype, device=args.device,
                       kv_cache_bytes=args.kv_bytes,
                       prefix_cache_bytes=args.kv_bytes if cache else 0)
    text = "\n\n".join(TEXTS[args.text]())
    batch = prompts(engine, text, args.requests, args.prefix_tokens, args.own_tokens)
    run(engine, [token_ids(engine, text[-20000:], 64)], 2)  # warm-up: other tokens
    return run(engine, batch, args.max_tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=7000)
    p.add_argument("--own-tokens", type=int, default=32, help="each request's tokens after it")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--text", choices=sorted(TEXTS), default="essays")
    p.add_argument("--kv-gb", type=float, default=None,
                   help="KV pool (default: every request's whole prompt and output, unshared)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    tokens = args.prefix_tokens + args.own_tokens + args.max_tokens + 64
    per_token = 30 * 2 * 3 * 64 * (4 if args.dtype == "float32" else 2)  # SmolLM2-135M
    args.kv_bytes = int(args.kv_gb * 2**30) if args.kv_gb else \
        (args.requests + 1) * tokens * per_token
    rows = {name: measure(args, cache) for name, cache in (("off", False), ("on", True))}
    for name, row in rows.items():
        print(f"cache {name:3}  TTFT median {row['ttft_median_s']:.3f} s, max "
              f"{row['ttft_max_s']:.3f} s, total {row['total_s']:.2f} s, peak "
              f"{row['peak_pages']} pages ({row['peak_kv_bytes'] / 2**20:.1f} MiB), prefilled "
              f"{row['computed_tokens']} of {row['prompt_tokens']} prompt tokens")
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                 if k != "out"}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
