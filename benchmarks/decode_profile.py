"""Where a real decode's device time goes: the kernels of one `LLM.generate` of a workload
(the embedded SmolLM2 by default), per kernel name, with the prefill taken out.

Runs the same prompts twice under torch.profiler, to 1 new token (the prefill and the first
token) and to `--max-tokens`, and reports the difference per kernel name: total time, calls
and time per call. `verify_passes` counts the full-attention passes of the decode (the calls
of the paged split kernel over the layers): with γ+1 rows per pass, the rounds the batch ran,
whatever its rows' own rounds. Compare with `step_profile.py`'s round at the same shape,
whose batch runs every row in every round.

    python benchmarks/decode_profile.py --workload essays --context 7500 --batch 64 \
        --max-tokens 256 --out decode_profile.json

On a CPU (the torch backend, no CUDA graphs) the table holds the CPU operators instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler_util import _filter_name, _rewrite_name
from torch.profiler import ProfilerActivity, profile

from vegas_spec.bench.workloads import essay_prompts
from vegas_spec.config import SamplingParams, SpecConfig
from vegas_spec.engine import LLM

PAGED_KERNEL = "_paged_split_kernel"


def kernel_times(llm: LLM, ids: list[list[int]], spec: SpecConfig, max_tokens: int,
                 ) -> tuple[dict[str, tuple[float, int]], dict[str, Any]]:
    """name -> (µs, calls) of one generate, and its statistics."""
    cuda = torch.cuda.is_available() and llm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        outs = llm.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                            speculative=spec)
        if cuda:
            torch.cuda.synchronize()
    return event_totals(prof, cuda), outs[0].stats


def event_totals(prof: profile, cuda: bool) -> dict[str, tuple[float, int]]:
    """name -> (µs, calls) of the profile's CUDA events (their device time) or, without CUDA,
    of its CPU operators (their self time)."""
    totals: dict[str, tuple[float, int]] = {}
    for span in spans(prof, "CUDA" if cuda else "CPU"):
        t, c = totals.get(span.name, (0.0, 0))
        totals[span.name] = (t + (span.elapsed() if cuda else span.self_time()), c + 1)
    return totals


@dataclass(eq=False)
class Span:
    """One profiled event as torch.profiler's FunctionEvent has it: its name, start and end
    (µs from the trace's start) and thread; an async one (begun and ended on different
    threads) nests nowhere and its time counts 0."""

    name: str
    start: float
    end: float
    thread: int
    sync: bool
    parent: Span | None = None
    children: list[Span] = field(default_factory=list)

    def elapsed(self) -> float:
        return self.end - self.start if self.sync else 0.0

    def self_time(self) -> float:
        """Its time less its children's (FunctionEvent.self_cpu_time_total)."""
        if not self.sync:
            return 0.0
        return self.elapsed() - sum(child.elapsed() for child in self.children)


def spans(prof: profile, kind: str) -> list[Span]:
    """The profile's events on the `kind` device (CPU or CUDA) as `prof.events()` lists them:
    the same names, times and order, host events nested by thread, a child that repeats
    its only-child parent's name folded into it. Read from the raw events: prof.events()
    builds a FunctionEvent with every field of each, slow for a CPU's many operators."""
    result = prof.profiler.kineto_results
    origin = result.trace_start_ns()
    names: dict[str, str] = {}  # raw -> as FunctionEvent names it (demangled)
    out = []
    for e in result.events():
        raw = e.name()
        if e.device_type().name != kind or _filter_name(raw) \
                or getattr(e, "is_hidden_event", lambda: False)():
            continue
        if raw not in names:
            names[raw] = _rewrite_name(raw, with_wildcard=True)
        thread = e.start_thread_id()
        out.append(Span(names[raw], (e.start_ns() - origin) / 1000, (e.end_ns() - origin) / 1000,
                        thread, not e.is_async() and thread == e.end_thread_id()))
    out.sort(key=lambda s: (s.start, -s.end))
    if kind == "CPU":
        nest([s for s in out if s.sync])
        out = fold_repeats(out)
    return out


def nest(events: list[Span]) -> None:
    """Each event's parent: the innermost earlier event of its thread that contains it
    (EventList._populate_cpu_children)."""
    for _, mine in itertools.groupby(sorted(events, key=lambda s: s.thread),
                                     key=lambda s: s.thread):
        stack: list[Span] = []
        for event in sorted(mine, key=lambda s: (s.start, -s.end)):
            while stack:
                parent = stack[-1]
                if event.start >= parent.end or event.end > parent.end:
                    stack.pop()
                else:
                    parent.children.append(event)
                    event.parent = parent
                    break
            stack.append(event)


def fold_repeats(events: list[Span]) -> list[Span]:
    """Without the events that repeat the name of a parent they are the only child of, their
    children lifted to that parent (EventList._remove_dup_nodes)."""
    while True:
        folded: set[int] = set()
        for i, event in enumerate(events):
            parent = event.parent
            if parent is not None and parent.name == event.name and len(parent.children) == 1:
                parent.children = event.children
                for child in event.children:
                    child.parent = parent
                folded.add(i)
        if not folded:
            return events
        events = [e for i, e in enumerate(events) if i not in folded]


def decode_only(full: dict[str, tuple[float, int]],
                base: dict[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
    """The run to max_tokens minus the run to one token, per name (names only in the first)."""
    return {k: (t - base.get(k, (0.0, 0))[0], c - base.get(k, (0.0, 0))[1])
            for k, (t, c) in full.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--workload", choices=["essays", "code"], default="essays")
    ap.add_argument("--context", type=int, default=7500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--method", default="vegas")
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rows", type=int, default=30, help="kernels to list")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="the KV pool (default: the engine's)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    kv = None if args.kv_cache_gb is None else int(args.kv_cache_gb * (1 << 30))
    llm = LLM(args.model, device="cuda" if cuda else "cpu",
              dtype="bfloat16" if cuda else "float32", kv_cache_bytes=kv)
    ids = [p.ids for p in essay_prompts(llm.tokenizer, args.context, args.batch, args.workload)]
    spec = SpecConfig(method=args.method, gamma=args.gamma, ratio=args.ratio, adaptive=False)
    warm = min(args.max_tokens, 2 * args.gamma + 3)  # the graphs of every kind are captured
    llm.generate(ids, SamplingParams(max_tokens=warm, ignore_eos=True), speculative=spec)
    base, _ = kernel_times(llm, ids, spec, 1)
    full, stats = kernel_times(llm, ids, spec, args.max_tokens)
    diff = decode_only(full, base)
    layers = llm.model_config.num_layers
    table = [{"name": name, "ms": t / 1e3, "calls": c, "us_per_call": t / max(c, 1)}
             for name, (t, c) in sorted(diff.items(), key=lambda kv: -kv[1][0])[:args.rows]]
    summary = {"iterations": stats.get("iterations"), "phase_s": stats.get("phase_s"),
               "decode_s": stats.get("decode_s"),
               "tokens_per_iteration": stats.get("tokens_per_iteration"),
               "decode_kernel_ms": sum(t for t, _ in diff.values()) / 1e3,
               "decode_kernels": sum(c for _, c in diff.values()),
               "verify_passes": diff.get(PAGED_KERNEL, (0.0, 0))[1] / layers}
    print(json.dumps(summary), flush=True)
    for row in table:
        print(f"{row['ms']:9.2f} ms {row['calls']:8d} x {row['us_per_call']:8.2f} us  "
              f"{row['name'][:100]}", flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"),
            "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "summary": summary, "kernels": table},
                                   indent=1))


if __name__ == "__main__":
    main()
