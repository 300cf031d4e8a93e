"""A bounded load generator for `vegas serve`, on loopback: throughput and latency per method,
with one engine (the same model, KV pool and requests) serving each method in turn.

Requests are prompts of --context tokens (windows of the essays, or with --text code of
Python source code, each ending in a cue to summarise) with output lengths drawn uniformly from
[--min-tokens, --max-tokens] (ignore_eos, greedy), sent by --concurrency streaming clients
until --requests have completed, after an untimed warm-up (--warmup-requests, by default one
per client; every decode and prefill graph is captured before it, as `vegas serve` does at
start-up). The clients run in a child process, so that reading
their streams does not compete with the server's engine thread for the interpreter. Per
method:

- requests/s and output tokens/s (the tokens each response's usage chunk counts), and the
  latter's ratio to vanilla's (`vs_vanilla`, when vanilla runs) and to the first method's;
- time to first token (TTFT), p50 and p99;
- inter-token latency (ITL): the gaps between a response's streamed chunks (each carries the
  1 to γ+1 tokens of one iteration: the latency a reader sees), p50 and p99, and its mean per
  token;
- the ITL of running requests while new prompts are admitted: the gaps in which a server step
  that prefilled prompt tokens ended (another request's prompt: a request's own prefill ends
  before its first chunk), p50 and p99, and that p99 over the median of all gaps
  (`itl_admitting_p99_over_itl_p50`). The server records each step's end and prefill tokens;
  both processes read the same monotonic clock;
- the server's steps: how many, how many prefilled, and their durations; the prompt tokens
  of the steps that prefilled while rows decoded and the medians of their two parts, up to
  the end of the prefill and after it (`paced_*`), and the prefill pacer's
  estimates after the last step (`pacer`: decode seconds, the prompt tokens a step can
  take, the budget they give);
- the decode iterations by kind, plain steps and rounds, in the steps that prefilled
  (`paced_plain_steps`, `paced_rounds`) and in the others (`decode_only_...`): what adaptive
  speculation chose (`--fixed-gamma`: a round every iteration), their mean decode seconds
  (`*_plain_step_mean_s`, `*_round_mean_s`; a paced step's after its prefill), and the
  controller's estimates per batch bucket after the last step (`controller`);
- the share of decode time spent outside the device's work (`decode_host_share`): over the
  steps that prefilled nothing, 1 - the device time of their decode phases (CUDA events
  around the graph replays) over their wall time: the host work of the loop. On CPU the
  phases are timed on the host.

    python benchmarks/serve_load.py --device cuda --dtype bfloat16 --kv-cache-gb 40 \\
        --context 7500 --requests 256 --min-tokens 64 --max-tokens 512 --concurrency 64 \\
        --methods vanilla vegas stream --warmup-requests 256 --out serve_load.json

--prefill-chunk sets the engine's per-step prefill budget and --prefill-pacing (default 2, as
`vegas serve`) how much of it a step may use while requests decode: the ITL while admitting
depends on both. The server half (torch, the engine, uvicorn) is imported in `main` only: the client
process is spawned and imports this module again, and needs no more than httpx.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import multiprocessing
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import TEXTS

MODEL = "model"
CUES = {"essays": "\n\nIn summary, the main point of the essay above is",
        "code": "\n\n# In summary, the code above"}
STRIDE = 997  # tokens between the starts of consecutive requests' windows of the text
# The phases of a decode iteration (vegas_spec.stats), each timed on the device on CUDA.
DECODE_PHASES = ("decode", "draft", "verify", "speculate", "select", "accept")

# --- the requests ---------------------------------------------------------------------------


def prompts(tokenizer: Any, count: int, tokens: int, text: str = "essays") -> list[list[int]]:
    """count prompts of `tokens` ids: windows of the essays (or the source code) at different
    offsets, each ending in a cue to summarise. The text is tokenized once, only as far as
    needed."""
    cue = tokenizer(CUES[text], add_special_tokens=False)["input_ids"]
    body = tokens - len(cue)
    if body < 1:
        raise SystemExit(f"serve_load.py: --context must exceed the cue's {len(cue)} tokens")
    ids: list[int] = []
    for doc in TEXTS[text]():
        ids += tokenizer(doc + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= body + STRIDE * (count - 1):
            break
    if len(ids) < body:
        raise SystemExit(f"serve_load.py: --context {tokens} is longer than the {text} "
                         f"({len(ids) + len(cue)} tokens)")
    starts = [(i * STRIDE) % (len(ids) - body + 1) for i in range(count)]
    return [ids[s : s + body] + cue for s in starts]


def workload(tokenizer: Any, args: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [(p, rng.randint(args.min_tokens, args.max_tokens))
            for p in prompts(tokenizer, args.requests, args.context, args.text)]


# --- the clients (in the child process) -----------------------------------------------------


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], n: int) -> dict:
    """A streamed request -> its start, the arrival of each chunk with text, the completion
    tokens its usage chunk counts."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start, chunks, tokens = time.perf_counter(), [], None
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now, chunk = time.perf_counter(), json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                chunks.append(now)
    return {"start": start, "chunks": chunks, "tokens": tokens, "asked": n}


async def load(url: str, work: list[tuple[list[int], int]], concurrency: int) -> list[dict]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    results: list[dict] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt, n = queue.get_nowait()
            results.append(await one(client, url, prompt, n))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return results


def run_load(url: str, work: list[tuple[list[int], int]], concurrency: int) -> list[dict]:
    return asyncio.run(load(url, work, concurrency))


# --- the server (in this process) -----------------------------------------------------------


def decode_device_s(engine: Any) -> float:
    """Seconds so far of the decode phases, timed on the device (CUDA events)."""
    totals = engine.runner.timer.totals
    return sum(totals.get(k, 0.0) for k in DECODE_PHASES)


@dataclass
class StepLog:
    """Appended by the engine thread after each step: the end (perf_counter) of each step
    that prefilled prompt tokens, the seconds of each step, and over the steps that prefilled
    nothing, their wall time and the device time of their decode phases. (A step's events are
    read in its own decode; a prefill's device work can spill into the next step's wall
    time, so steps that prefilled are left out of the host share.)"""

    prefill_ends: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    decode_device: float = 0.0
    device_mark: float = 0.0  # decode_device_s after the last step
    # steps that prefilled while rows decoded: their prompt tokens, and their two parts
    paced_tokens: list[int] = field(default_factory=list)
    paced_parts: list[tuple[float, float]] = field(default_factory=list)  # prefill, decode s
    ceiling: int = 0  # the engine's prefill budget: a paced step that took all of it
    # decode iterations by kind: [plain steps, rounds] in paced steps and in decode-only ones
    kinds: dict[str, list[int]] = field(default_factory=lambda: {"paced": [0, 0],
                                                                 "decode_only": [0, 0]})
    # and their decode seconds (a paced step's: its time after the prefill), summed
    kind_s: dict[str, list[float]] = field(default_factory=lambda: {"paced": [0.0, 0.0],
                                                                    "decode_only": [0.0, 0.0]})

    def after(self, then: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        """An on_step hook that records the step, then calls `then` (the server's metrics)."""
        def hook(engine: Any, outs: Any) -> None:
            info, device = engine.last_step, decode_device_s(engine)
            if info.emitted:
                kind = "paced" if info.prefill_tokens else "decode_only"
                self.kinds[kind][int(bool(info.drafted))] += 1
                spent = info.seconds - info.prefill_seconds
                self.kind_s[kind][int(bool(info.drafted))] += spent
            if info.prefill_tokens:
                self.prefill_ends.append(time.perf_counter())
                self.prefill_s.append(info.seconds)
                if info.emitted:
                    self.paced_tokens.append(info.prefill_tokens)
                    self.paced_parts.append((info.prefill_seconds,
                                             info.seconds - info.prefill_seconds))
            else:
                self.decode_s.append(info.seconds)
                self.decode_device += device - self.device_mark
            self.device_mark = device
            then(engine, outs)
        return hook

    def clear(self, engine: Any) -> None:
        for values in (self.prefill_ends, self.prefill_s, self.decode_s, self.paced_tokens,
                       self.paced_parts):
            values.clear()
        self.kinds = {kind: [0, 0] for kind in self.kinds}
        self.kind_s = {kind: [0.0, 0.0] for kind in self.kinds}
        self.decode_device, self.device_mark = 0.0, decode_device_s(engine)

    def summary(self) -> dict:
        wall = sum(self.decode_s)
        return {"steps": len(self.prefill_s) + len(self.decode_s),
                "prefill_steps": len(self.prefill_s),
                "prefill_step_p50_s": pct(self.prefill_s, 50),
                "prefill_step_max_s": max(self.prefill_s, default=None),
                "decode_step_p50_s": pct(self.decode_s, 50),
                "decode_step_p99_s": pct(self.decode_s, 99),
                "decode_wall_s": wall, "decode_device_s": self.decode_device,
                "decode_host_share": 1 - self.decode_device / wall if wall > 0 else None,
                "paced_steps": len(self.paced_tokens),
                "paced_tokens_p50": pct(self.paced_tokens, 50),
                "paced_tokens_max": max(self.paced_tokens, default=None),
                "paced_whole": sum(t >= self.ceiling for t in self.paced_tokens),
                "paced_prefill_part_p50_s": pct([p for p, _ in self.paced_parts], 50),
                "paced_decode_part_p50_s": pct([d for _, d in self.paced_parts], 50),
                **{f"{kind}_{name}": counts[i] for kind, counts in self.kinds.items()
                   for i, name in enumerate(("plain_steps", "rounds"))},
                **{f"{kind}_{name}_mean_s": self.kind_s[kind][i] / counts[i] if counts[i]
                   else None for kind, counts in self.kinds.items()
                   for i, name in enumerate(("plain_step", "round"))}}


def pacer_estimates(engine: Any) -> dict[str, float | None]:
    """The prefill pacer's current estimates ({} when pacing is off): read once the engine
    thread has stopped, they are the ones after the last step."""
    pacer = engine.pacer
    if pacer is None:
        return {}
    return {"decode_s": pacer.decode_s, "tokens": pacer.tokens,
            "budget": pacer.budget(decoding=True)}


def controller_estimates(engine: Any) -> dict[str, dict[str, float | None]]:
    """Adaptive speculation's estimates per batch bucket after the last step ({} when it
    is off): the plain step's seconds, and each draft length's round seconds and τ, as it
    weighs them."""
    controller = engine.controller
    if controller is None:
        return {}
    return {str(bucket): {"plain_s": b.costs[0].value,
                          **{f"round_{g}_s": b.costs[g].value for g in controller.lengths},
                          **{f"tau_{g}": b.acceptance.tokens(g) for g in controller.lengths}}
            for bucket, b in controller.buckets.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(engine: Any, concurrency: int, log: StepLog) -> tuple[Any, threading.Thread, str]:
    """The app of `vegas serve` on a free loopback port, in a thread -> the uvicorn server,
    its thread and the completions URL."""
    import uvicorn

    from vegas_spec.serve.app import Server, build_app

    server = Server(engine, MODEL, 4 * concurrency)
    server.engine.on_step = log.after(server.engine.on_step)
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port,
                                         log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        if not thread.is_alive():
            raise SystemExit("serve_load.py: the server did not start")
        time.sleep(0.05)
    return http, thread, f"http://127.0.0.1:{port}/v1/completions"


def measure(engine: Any, spec: Any, args: argparse.Namespace,
            work: list[tuple[list[int], int]], clients: Executor) -> dict:
    engine.set_spec(spec)
    from vegas_spec.cli import freeze_heap

    engine.warm_up(args.concurrency)  # every bucket's graphs, as `vegas serve` does
    freeze_heap()  # as `vegas serve` does after its warm-up
    log = StepLog(ceiling=engine.scheduler.prefill_budget)
    http, thread, url = start(engine, args.concurrency, log)
    try:
        warmup = [work[i % len(work)] for i in range(args.warmup_requests or args.concurrency)]
        clients.submit(run_load, url, warmup, args.concurrency).result()
        log.clear(engine)
        t0 = time.perf_counter()
        results = clients.submit(run_load, url, work, args.concurrency).result()
        wall = time.perf_counter() - t0
    finally:
        http.should_exit = True
        thread.join(timeout=120)
    return {"method": spec.method, **throughput(results, wall), **latency(results, log),
            **log.summary(), "pacer": pacer_estimates(engine),
            "controller": controller_estimates(engine)}


# --- the figures ----------------------------------------------------------------------------


def pct(values: list[float], q: int) -> float | None:
    """The q-th percentile (between the smallest and largest value; None: no values)."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def throughput(results: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] or 0 for r in results)
    return {"requests": len(results), "wall_s": wall, "requests_per_s": len(results) / wall,
            "output_tokens": tokens, "asked_tokens": sum(r["asked"] for r in results),
            "output_tokens_per_s": tokens / wall}


def gaps(results: list[dict]) -> list[tuple[float, float]]:
    """(previous chunk, chunk) arrival times of every gap between two chunks of a response."""
    return [(a, b) for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]


def admitting(spans: list[tuple[float, float]], ends: list[float]) -> list[float]:
    """The lengths of the gaps in which one of `ends` (sorted) falls."""
    out = []
    for a, b in spans:
        i = bisect.bisect_right(ends, a)
        if i < len(ends) and ends[i] < b:
            out.append(b - a)
    return out


def latency(results: list[dict], log: StepLog) -> dict:
    spans = gaps(results)
    itl = [b - a for a, b in spans]
    during = admitting(spans, sorted(log.prefill_ends))
    ttft = [r["chunks"][0] - r["start"] for r in results if r["chunks"]]
    decoded = sum(r["chunks"][-1] - r["chunks"][0] for r in results if r["chunks"])
    median, tail = pct(itl, 50), pct(during, 99)
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_gaps": len(itl), "itl_p50_s": median, "itl_p99_s": pct(itl, 99),
            "itl_per_token_s": decoded / max(sum((r["tokens"] or 1) - 1 for r in results), 1),
            "itl_admitting_gaps": len(during), "itl_admitting_p50_s": pct(during, 50),
            "itl_admitting_p99_s": tail,
            "itl_admitting_p99_over_itl_p50": tail / median if tail and median else None}


def compare(rows: list[dict]) -> None:
    """Each method's output tokens/s over the first method's and over vanilla's."""
    rates = {r["method"]: r["output_tokens_per_s"] for r in rows}
    for row in rows:
        row["vs_first"] = row["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]
        if "vanilla" in rates:
            row["vs_vanilla"] = row["output_tokens_per_s"] / rates["vanilla"]


# --- the command ----------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model path (default: the embedded SmolLM2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--context", type=int, default=1000, help="prompt tokens")
    p.add_argument("--text", choices=sorted(CUES), default="essays",
                   help="what the prompts are windows of: the essays or source code")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--ratio", type=float, default=0.05)
    p.add_argument("--fixed-gamma", action="store_true",
                   help="speculate every iteration (adaptive speculation off)")
    p.add_argument("--methods", nargs="+", default=["vanilla", "vegas", "stream"])
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens prefilled per step (default: the engine's)")
    p.add_argument("--prefill-pacing", type=float, default=2.0,
                   help="the engine's prefill pacing, as `vegas serve --prefill-pacing` (0: off)")
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="requests of the untimed warm-up (0: one per client)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="also write the report here (JSON)")
    args = p.parse_args(argv)
    check(p, args)
    return args


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("context", "requests", "min_tokens", "max_tokens", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.min_tokens > args.max_tokens:
        p.error("--min-tokens must not exceed --max-tokens")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        p.error("--prefill-chunk must be at least 1")
    if args.prefill_pacing < 0:
        p.error("--prefill-pacing must be at least 0")
    if args.warmup_requests < 0:
        p.error("--warmup-requests must be at least 0")
    if args.kv_cache_gb <= 0:
        p.error("--kv-cache-gb must be positive")
    if len(set(args.methods)) != len(args.methods):
        p.error("--methods names a method twice")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    from vegas_spec.config import ConfigError, spec_config
    from vegas_spec.engine import LLMEngine
    from vegas_spec.models.loader import resolve
    from vegas_spec.tokenizer import load_tokenizer

    try:  # every method checked before the model loads
        specs = [spec_config({"method": m, "gamma": args.gamma, "ratio": args.ratio,
                              "adaptive": not args.fixed_gamma}) for m in args.methods]
        engine = LLMEngine(args.model, speculative=specs[0], device=args.device,
                           dtype=args.dtype, max_num_seqs=args.concurrency,
                           kv_cache_bytes=int(args.kv_cache_gb * 2**30),
                           prefill_chunk=args.prefill_chunk,
                           prefill_pacing=args.prefill_pacing or None)
    except ConfigError as e:
        raise SystemExit(f"serve_load.py: {e}") from None
    work = workload(load_tokenizer(resolve(args.model)), args)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as clients:
        rows = [measure(engine, spec, args, work, clients) for spec in specs]
    compare(rows)
    for row in rows:
        print(json.dumps(row))
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                 for k, v in vars(args).items()},
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
