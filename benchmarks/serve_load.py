"""A bounded load generator for `vegas serve`, on loopback: requests/s, output tokens/s, time
to first token and inter-token latency (p50, p99) per method, each method's server started
in this process on the same model and the same requests.

Requests are essay prompts of --context tokens with output lengths drawn uniformly from
[--min-tokens, --max-tokens] (ignore_eos, greedy), sent by --concurrency clients until
--requests have completed; every response streams. Inter-token latency: the gaps between a
response's streamed chunks (each carries the 1 to γ+1 tokens of one iteration: the latency a
reader sees), p50 and p99, and its mean per token.

    python benchmarks/serve_load.py --device cuda --dtype bfloat16 --context 7500 \\
        --requests 256 --min-tokens 64 --max-tokens 512 --concurrency 64 \\
        --methods vanilla vegas stream
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import threading
import time
from typing import Any

import httpx
import uvicorn
from common import essays

from vegas_spec.engine import LLMEngine
from vegas_spec.models.loader import resolve
from vegas_spec.serve.app import Server, build_app
from vegas_spec.tokenizer import load_tokenizer

MODEL = "model"


def prompts(tokenizer: Any, count: int, tokens: int) -> list[list[int]]:
    texts = essays()
    cue = tokenizer("\n\nIn summary, the main point of the essay above is",
                    add_special_tokens=False)["input_ids"]
    out = []
    for i in range(count):
        offset = (i * 7) % len(texts)
        text = "\n\n".join(texts[offset:] + texts[:offset])
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"][: tokens - len(cue)]
                   + cue)
    return out


def start(engine: LLMEngine, concurrency: int) -> tuple[uvicorn.Server, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(Server(engine, MODEL, 4 * concurrency)),
                                           host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}/v1/completions"


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], n: int) -> dict:
    """A streamed request -> time to first token, the gaps between its chunks."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first, last, gaps = None, t0, []
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if not chunk["choices"][0]["text"] and chunk["choices"][0]["finish_reason"]:
                continue
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
    return {"ttft": (first or last) - t0, "gaps": gaps, "decode_s": last - (first or last)}


async def load(url: str, work: list[tuple[list[int], int]], concurrency: int) -> list[dict]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    results: list[dict] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt, n = queue.get_nowait()
            results.append({**await one(client, url, prompt, n), "tokens": n})

    async with httpx.AsyncClient(timeout=3600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return results


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def measure(method: str, args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict:
    spec = {"method": method, "gamma": args.gamma, "ratio": args.ratio}
    engine = LLMEngine(args.model, speculative=spec, device=args.device, dtype=args.dtype,
                       max_num_seqs=args.concurrency,
                       kv_cache_bytes=int(args.kv_cache_gb * 2**30))
    engine.runner.reserve(args.concurrency)
    server, url = start(engine, args.concurrency)
    try:
        asyncio.run(load(url, work[: args.concurrency], args.concurrency))  # warm-up
        t0 = time.perf_counter()
        results = asyncio.run(load(url, work, args.concurrency))
        wall = time.perf_counter() - t0
    finally:
        server.should_exit = True
    gaps = [g for r in results for g in r["gaps"]]
    ttft = [r["ttft"] for r in results]
    return {"method": method, "requests": len(results), "wall_s": wall,
            "requests_per_s": len(results) / wall,
            "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(gaps, 50) if gaps else None,
            "itl_p99_s": pct(gaps, 99) if gaps else None,
            "itl_per_token_s": sum(r["decode_s"] for r in results)
            / max(sum(r["tokens"] - 1 for r in results), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--ratio", type=float, default=0.05)
    p.add_argument("--methods", nargs="+", default=["vanilla", "vegas", "stream"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    tokenizer = load_tokenizer(resolve(args.model))
    rng = random.Random(args.seed)
    texts = prompts(tokenizer, args.requests, args.context)
    work = [(t, rng.randint(args.min_tokens, args.max_tokens)) for t in texts]
    rows = [measure(m, args, work) for m in args.methods]
    base = rows[0]["output_tokens_per_s"]
    for row in rows:
        row["vs_first"] = row["output_tokens_per_s"] / base
        print(json.dumps(row))


if __name__ == "__main__":
    main()
