"""What a step that admits a prompt costs besides its prompt tokens, part by part.

A server step that prefills prompt tokens while rows decode takes the decode iteration's time
plus the prefill's; the prefill pacer (`scheduler.PrefillPacer`) models the latter as a fixed
cost plus a cost per token, and the fixed cost decides how small a chunk can usefully be. This
script measures both on one engine: `--rows` requests decode (prompts of `--base-context`
tokens, ignore_eos), and new requests of `--context`-token prompts arrive one at a time and are
prefilled at each per-step budget of `--chunks`, then decode a few tokens and leave. Between
arrivals the engine takes `--gap` decode-only steps.

Two passes per method:

- **wall**: the engine as it runs (no added waits): each step's wall time, the median of the
  decode-only steps, and per budget the median excess of the steps that prefilled over it,
  and a least-squares line of the excess over the step's prompt tokens (the pacer's model).
- **parts**: the same steps with the device drained at each part's edge, so that each part's
  device work is its own; the median seconds per part of the steps that prefilled, and of the
  decode-only steps:

      admit    admission, prefix lookup, buffer reservation   Scheduler.admit, ModelRunner.reserve
      forward  the packed prefill forward(s) of the step's pieces   Prefiller.step
      first    the first tokens of the prompts that end here        ModelRunner._prefill (the rest)
      join     their rows: page table, first selection (eager)      ModelRunner._join
      decode   the decode iteration of every row                    ModelRunner.decode
      select   finished rows out, the next plan if not made         ModelRunner._leave, _select
      engine   the rest of LLMEngine.step (planning, bookkeeping, outputs)

  (Drained parts add each part's launch latency to its time, so their sum exceeds the wall
  pass's step; they say where the time goes, the wall pass how much there is.)

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
from host_loop import PhaseClock, install, tiny_model
from serve_load import prompts

from vegas_spec.config import SamplingParams, spec_config
from vegas_spec.engine import LLMEngine
from vegas_spec.model_runner import ModelRunner
from vegas_spec.models.loader import resolve
from vegas_spec.prefill import Prefiller
from vegas_spec.scheduler import Scheduler
from vegas_spec.tokenizer import load_tokenizer

PARTS = ("admit", "forward", "first", "join", "decode", "select", "engine")
# (owner, method, part) of every timed method; LLMEngine.step's own time is "engine"
TIMED: list[tuple[Any, str, str]] = [
    (LLMEngine, "step", "engine"), (Scheduler, "admit", "admit"),
    (ModelRunner, "reserve", "admit"), (ModelRunner, "_prefill", "first"),
    (Prefiller, "step", "forward"), (ModelRunner, "_join", "join"),
    (ModelRunner, "decode", "decode"), (ModelRunner, "_leave", "select"),
    (ModelRunner, "_select", "select"),
]


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
             drain: bool) -> list[dict[str, Any]]:
    """Per budget, each arrival prefilled in chunks of that budget, then `gap` decode-only
    steps -> one record per step: budget, prompt tokens, rows decoded, seconds, parts."""
    device = engine.runner.device
    clock = PhaseClock(0, (lambda: torch.cuda.synchronize(device))
                       if drain and device.type == "cuda" else None)
    restore = install(clock, TIMED)
    steps: list[dict[str, Any]] = []
    leave = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        for chunk in chunks:
            engine.scheduler.prefill_budget = chunk
            for prompt in arrivals:
                engine.add_request(list(prompt), leave)
                after = 0  # steps since the arrival's prompt was all prefilled
                while after <= gap:
                    t0 = time.perf_counter()
                    engine.step(collect=False)
                    seconds = time.perf_counter() - t0
                    info = engine.last_step
                    steps.append({"chunk": chunk, "tokens": info.prefill_tokens,
                                  "rows": len(info.emitted), "seconds": seconds,
                                  "parts": dict(clock.step)})
                    clock.step.clear()
                    if not engine.scheduler.waiting and all(
                            s.prefilled == len(s.prompt_ids) for s in engine.scheduler.running):
                        after += 1
    finally:
        restore()
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
                           "decode_parts_s": medians([s["parts"] for s in plain])}
    paced = [s for s in steps if s["tokens"] and s["rows"] >= rows]
    out["excess_line"] = line([(s["tokens"], s["seconds"] - base) for s in paced])
    per: dict[int, Any] = {}
    for chunk in sorted({s["chunk"] for s in paced}):
        mine = [s for s in paced if s["chunk"] == chunk]
        per[chunk] = {"steps": len(mine),
                      "tokens_p50": statistics.median(s["tokens"] for s in mine),
                      "step_s": statistics.median(s["seconds"] for s in mine),
                      "excess_s": statistics.median(s["seconds"] - base for s in mine),
                      "parts_s": medians([s["parts"] for s in mine])}
    out["per_chunk"] = per
    return out


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {p: statistics.median(r.get(p, 0.0) for r in rows) for p in PARTS} if rows else {}


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
    while any(s.prefilled < len(s.prompt_ids) for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step(collect=False)
    run_pass(engine, arrivals[:1], args.chunks, args.gap, drain=False)  # warm
    out: dict[str, Any] = {"method": method}
    for name, drain in (("wall", False), ("parts", True)):
        steps = run_pass(engine, arrivals, args.chunks, args.gap, drain)
        out[name] = summarize(steps, args.rows)
        print(json.dumps({"method": method, "pass": name, **out[name]}), flush=True)
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
        run_pass(engine, arrivals, [chunk], gap, drain=False)
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
