"""What a step that admits a prompt costs besides its prompt tokens, from the engine's own timings.

A server step that prefills prompt tokens while rows decode takes the decode iteration's time
plus the prefill's; the prefill pacer (`scheduler.PrefillPacer`) models the latter as a fixed
cost plus a cost per token, and the fixed cost decides how small a chunk can usefully be. This
script measures both on one engine: `--rows` requests decode (prompts of `--base-context`
tokens, ignore_eos), and new requests of `--context`-token prompts arrive one at a time and are
prefilled at each per-step budget of `--chunks` (the scheduler's `prefill_budget`, the pacer
off), then decode a few tokens and leave. After each arrival's first token the engine takes
`--gap` decode-only steps.

Every step is timed as it runs (no added waits), through public reports only: its wall time
around `LLMEngine.step`, what it did (`engine.last_step`: prompt tokens, rows decoded, and
`prefill_seconds`, its admission and prefill part), and the seconds the runner's phase timer
(`engine.runner.timer.totals`) added in it, by phase (`prefill`: the packed prefill forwards;
`decode` or `speculate`: the decode iteration; `select`: the selections; CUDA events on a GPU).
Per method: the median of the decode-only steps of every row, and per budget the median
excess of the steps that prefilled over it, a least-squares line of the excess over the
step's prompt tokens (the pacer's model), and the medians of the parts above.

    python benchmarks/step_parts.py --model SmolLM2-135M-Instruct.Q4_1.gguf --device cuda \\
        --dtype bfloat16 --methods vanilla vegas --out step_parts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import tiny_model
from serve_load import prompts

from vegas_spec.config import SamplingParams, spec_config
from vegas_spec.engine import LLMEngine
from vegas_spec.models.loader import resolve
from vegas_spec.tokenizer import load_tokenizer


def line(points: list[tuple[int, float]]) -> dict[str, float | None]:
    """Least squares seconds ~ fixed + per_token x tokens."""
    if len({t for t, _ in points}) < 2:
        return {"fixed_s": None, "per_token_s": None}
    n = len(points)
    mt = sum(t for t, _ in points) / n
    ms = sum(s for _, s in points) / n
    slope = sum((t - mt) * (s - ms) for t, s in points) / sum((t - mt) ** 2 for t, _ in points)
    return {"fixed_s": ms - slope * mt, "per_token_s": slope}


def run_pass(engine: LLMEngine, arrivals: list[list[int]], chunks: list[int], gap: int,
             ) -> list[dict[str, Any]]:
    """Per budget, each arrival prefilled in chunks of that budget, then `gap` decode-only
    steps -> one record per step: budget, prompt tokens, rows decoded, seconds, the engine's
    prefill part and the phase timer's seconds by phase."""
    timer = engine.runner.timer
    steps: list[dict[str, Any]] = []
    leave = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for chunk in chunks:
        engine.scheduler.prefill_budget = chunk
        for prompt in arrivals:
            engine.add_request(list(prompt), leave)
            after = 0  # steps since the arrival's first token (its prompt all prefilled)
            while after <= gap:
                before = dict(timer.totals)
                t0 = time.perf_counter()
                engine.step(collect=False)
                seconds = time.perf_counter() - t0
                info = engine.last_step
                phases = {k: v - before.get(k, 0.0) for k, v in timer.totals.items()}
                steps.append({"chunk": chunk, "tokens": info.prefill_tokens,
                              "rows": len(info.emitted), "seconds": seconds,
                              "prefill_part_s": info.prefill_seconds,
                              "phases": {k: v for k, v in phases.items() if v > 0}})
                if after or info.first_tokens:
                    after += 1
    return steps


def summarize(steps: list[dict[str, Any]], rows: int) -> dict[str, Any]:
    """Medians per budget of the steps that prefilled while rows decoded, against the
    decode-only steps of all rows."""
    plain = [s for s in steps if not s["tokens"] and s["rows"] >= rows]
    if not plain:
        raise SystemExit("step_parts.py: no decode-only step of every row was timed; raise "
                         "--gap or --arrivals")
    base = statistics.median(s["seconds"] for s in plain)
    out: dict[str, Any] = {"decode_step_s": base, "decode_steps": len(plain),
                           "decode_phase_s": medians([s["phases"] for s in plain])}
    paced = [s for s in steps if s["tokens"] and s["rows"] >= rows]
    out["excess_line"] = line([(s["tokens"], s["seconds"] - base) for s in paced])
    per: dict[int, Any] = {}
    for chunk in sorted({s["chunk"] for s in paced}):
        mine = [s for s in paced if s["chunk"] == chunk]
        per[chunk] = {"steps": len(mine),
                      "tokens_p50": statistics.median(s["tokens"] for s in mine),
                      "step_s": statistics.median(s["seconds"] for s in mine),
                      "excess_s": statistics.median(s["seconds"] - base for s in mine),
                      "prefill_part_s": statistics.median(s["prefill_part_s"] for s in mine),
                      "phase_s": medians([s["phases"] for s in mine])}
    out["per_chunk"] = per
    return out


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per phase timed in any of rows, its median (0 where a row did not time it)."""
    names = sorted({k for r in rows for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in names}


def measure(args: argparse.Namespace, method: str, base: list[list[int]],
            arrivals: list[list[int]]) -> dict[str, Any]:
    spec = spec_config({"method": method, "gamma": args.gamma, "ratio": args.ratio})
    engine = LLMEngine(args.model, speculative=spec, device=args.device, dtype=args.dtype,
                       load_format="dummy" if args.tiny else "auto",
                       max_num_seqs=args.rows + 1, kv_cache_bytes=int(args.kv_cache_gb * 2**30),
                       prefill_chunk=max(args.chunks), prefill_pacing=None)
    engine.warm_up(args.rows + 1)
    stay = SamplingParams(max_tokens=engine.max_model_len, temperature=0.0, ignore_eos=True)
    seqs = [engine.sequence(list(prompt), stay) for prompt in base]
    if engine.scheduler.max_resident(seqs) < len(seqs):
        raise SystemExit(f"step_parts.py: {len(seqs)} decoding rows do not fit "
                         "the KV pool at the model's context: raise --kv-cache-gb")
    for seq in seqs:
        engine.add_request(seq)
    while len(engine.last_step.emitted) < len(seqs):
        engine.step(collect=False)  # until every prompt is in and its row decodes
    run_pass(engine, arrivals[:1], args.chunks, args.gap)  # warm
    out: dict[str, Any] = {"method": method,
                           **summarize(run_pass(engine, arrivals, args.chunks, args.gap),
                                       args.rows)}
    print(json.dumps(out), flush=True)
    if args.profile is not None:
        profile(engine, arrivals[:1], args.profile_chunk, args.gap,
                args.profile.with_name(f"{args.profile.stem}_{method}{args.profile.suffix}"))
    engine.abort_all()
    return out


def profile(engine: LLMEngine, arrivals: list[list[int]], chunk: int, gap: int,
            path: Path) -> None:
    """torch.profiler over one arrival at `chunk` tokens per step (and `gap` decode-only
    steps) -> `path`: the operators and kernels by device time and by host time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + \
        ([ProfilerActivity.CUDA] if engine.runner.device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        run_pass(engine, arrivals, [chunk], gap)
    table = prof.key_averages()
    sort = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
    path.write_text(table.table(sort_by=sort, row_limit=50) + "\n\n"
                    + table.table(sort_by="cpu_time_total", row_limit=50))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model path (default: the embedded SmolLM2)")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer random model with SmolLM2's tokenizer (checks the script)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--rows", type=int, default=63, help="requests that keep decoding")
    p.add_argument("--base-context", type=int, default=3500,
                   help="their prompt tokens (their outputs grow to the model's context)")
    p.add_argument("--context", type=int, default=7500, help="prompt tokens of an arrival")
    p.add_argument("--arrivals", type=int, default=2, help="arrivals per chunk budget")
    p.add_argument("--chunks", type=int, nargs="+",
                   default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--gap", type=int, default=3, help="decode-only steps after an arrival")
    p.add_argument("--methods", nargs="+", default=["vanilla", "vegas"])
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--ratio", type=float, default=0.05)
    p.add_argument("--profile", type=Path,
                   help="also profile one arrival per method (torch.profiler tables to "
                        "PROFILE with the method's name added)")
    p.add_argument("--profile-chunk", type=int, default=4096)
    p.add_argument("--out", type=Path, help="also write the report here (JSON)")
    args = p.parse_args(argv)
    for name in ("rows", "base_context", "context", "arrivals", "gap"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.chunks) < 1:
        p.error("--chunks must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.tiny:
        with tempfile.TemporaryDirectory() as tmp:
            args.model = str(tiny_model(Path(tmp)))
            report(args)
    else:
        report(args)


def report(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(resolve(args.model))
    base = prompts(tokenizer, args.rows, args.base_context)
    arrivals = prompts(tokenizer, args.arrivals + 1, args.context)
    rows = [measure(args, m, base, arrivals) for m in args.methods]
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                 for k, v in vars(args).items()},
                                        "device": torch.cuda.get_device_name()
                                        if args.device == "cuda" else "cpu",
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
