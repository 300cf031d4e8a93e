"""Host work per iteration of the engine's own decode loop, split by phase, on CPU.

On a GPU the decode loop replays CUDA graphs and everything else an iteration does is Python on
the host: scheduling, building the step's inputs, the one device-to-host read, appending tokens
(incremental detokenisation, stop checks), statistics, the next selection when the round's
graph did not make it, and the step's outputs. This script runs `LLMEngine` on a tiny random
model that speaks SmolLM2's vocabulary and tokenizer (so detokenisation is real), with static
shapes (the buffers and code path the CUDA graphs replay, run eagerly on CPU), all prompts
prefilled in the first step, and times each phase of every step that only decodes, with all
`--batch` rows, by wall-clock timers around the engine's methods (greedy, ignore_eos: rows
that the random model drafts badly for decode longer, alone, and are not counted):

    schedule  the step's plan: admission, pieces (none), pages       LLMEngine._plan
    inputs    the step's tensor bookkeeping around the iteration     ModelRunner.execute, decode
    commit    the one device-to-host read and its unpacking         ModelRunner._commit
    rows      per row: tokens appended, stops, statistics            LLMEngine._decoded
    select    finished rows dropped, the next plan (unless made)     ModelRunner._leave, _select
    outputs   finished requests released (and, with --stream, the    LLMEngine.step
              step's RequestOutputs and their text deltas)

`generate` steps without making per-step outputs, and a request without stop strings is
detokenized only when its text is read: after the loop (not timed here: one decode per
request), or, with `--stream`, by every step's text delta, as the server's loop reads it.

Each figure is that method's own time (its timed callees excluded). Not host work, reported
apart: `graph`, the fixed-shape steps the GPU replays as graphs (GraphRunner._replay: here the
tiny model's forward, computed on CPU), and `sample`, vanilla's argmax over the vocabulary
(one kernel on a GPU). `host_ms` is the sum of the six host phases per iteration; the median
over `--repeats` timed runs after one warm-up run.

    python benchmarks/host_loop.py --batch 64 --max-tokens 128 --out host_loop.json
    python benchmarks/host_loop.py --batch 64 --methods vegas --cprofile 25
    python benchmarks/host_loop.py --batch 64 --stream
    python benchmarks/host_loop.py --batch 64 --stream both     # each method both ways
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import platform
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vegas_spec import model_runner
from vegas_spec.config import SamplingParams, SpecConfig
from vegas_spec.engine import LLM, LLMEngine
from vegas_spec.graphs import GraphRunner
from vegas_spec.model_runner import ModelRunner

HOST = ("schedule", "inputs", "commit", "rows", "select", "outputs")
DEVICE = ("graph", "sample")
# (owner, method, phase) of every timed method
TIMED: list[tuple[Any, str, str]] = [
    (LLMEngine, "step", "outputs"), (LLMEngine, "_plan", "schedule"),
    (LLMEngine, "_decoded", "rows"), (ModelRunner, "execute", "inputs"),
    (ModelRunner, "decode", "inputs"), (ModelRunner, "_commit", "commit"),
    (ModelRunner, "_leave", "select"), (ModelRunner, "_select", "select"),
    (GraphRunner, "_replay", "graph"), (model_runner, "next_tokens", "sample"),
]


class PhaseClock:
    """Exclusive wall time per phase of the current step, kept only for decode-only steps;
    `sync`, if given, runs at every timed method's entry and exit (a device drain)."""

    def __init__(self, rows: int, sync: Callable[[], None] | None = None) -> None:
        self.rows = rows  # steps with fewer decoding rows are not kept
        self.sync: Callable[[], None] = sync or (lambda: None)
        self.step: dict[str, float] = defaultdict(float)
        self.totals: dict[str, float] = defaultdict(float)
        self.iterations = 0
        self._stack: list[list[float]] = []  # [start, time of timed callees]

    def wrap(self, fn: Callable, phase: str) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            self._stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                start, inner = self._stack.pop()
                elapsed = time.perf_counter() - start
                self.step[phase] += elapsed - inner
                if self._stack:
                    self._stack[-1][1] += elapsed
        return timed

    def end_step(self, engine: LLMEngine) -> None:
        """Keep the step's times if it only decoded (no prompt tokens, no first tokens), every
        one of the batch's rows."""
        info = engine.last_step
        if len(info.emitted) == self.rows and not info.prefill_tokens and not info.first_tokens:
            for phase, seconds in self.step.items():
                self.totals[phase] += seconds
            self.iterations += 1
        self.step.clear()

    def per_iteration_ms(self) -> dict[str, float]:
        n = max(self.iterations, 1)
        return {p: 1e3 * self.totals.get(p, 0.0) / n for p in HOST + DEVICE}


def install(clock: PhaseClock, timed: list[tuple[Any, str, str]] | None = None,
            ) -> Callable[[], None]:
    """Wrap the timed methods (default TIMED) -> a function that puts the originals back."""
    timed = TIMED if timed is None else timed
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in timed]
    for owner, name, phase in timed:
        setattr(owner, name, clock.wrap(getattr(owner, name), phase))

    def restore() -> None:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return restore


def tiny_model(folder: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's vocabulary and tokenizer files."""
    from vegas_spec.models.loader import resolve
    from vegas_spec.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve(None))
    tok.save_pretrained(str(folder))
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": len(tok),
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1,
              "eos_token_id": 2, "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run_once(llm: LLM, prompts: list[list[int]], params: SamplingParams,
             spec: SpecConfig, clock: PhaseClock | None, stream: bool = False) -> None:
    """One generate() of every prompt; with a clock, each step's phases go to it; stream:
    every step makes its RequestOutputs (text deltas included) and decodes while prompts are
    prefilled, as the server's loop does, where generate makes none and prefills first."""
    engine = llm.engine
    step = engine.step

    def each_step(collect: bool = True, prefill_first: bool = False) -> list:
        outs = step(collect or stream, prefill_first=prefill_first and not stream)
        if clock is not None:
            clock.end_step(engine)
        return outs

    engine.step = each_step  # type: ignore[method-assign]
    try:
        llm.generate(prompts, params, speculative=spec)
    finally:
        del engine.step  # the class's method again


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams, spec: SpecConfig,
            repeats: int, stream: bool = False) -> dict[str, Any]:
    """Median per-iteration ms of every phase over `repeats` timed runs (after a warm-up)."""
    run_once(llm, prompts, params, spec, None, stream)
    runs = []
    for _ in range(repeats):
        clock = PhaseClock(len(prompts))
        restore = install(clock)
        try:
            run_once(llm, prompts, params, spec, clock, stream)
        finally:
            restore()
        row = clock.per_iteration_ms()
        row["host_ms"] = sum(row[p] for p in HOST)
        row["iterations"] = clock.iterations
        runs.append(row)
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def profile_table(llm: LLM, prompts: list[list[int]], params: SamplingParams,
                  spec: SpecConfig, rows: int, stream: bool = False) -> str:
    """cProfile of one whole generate() by own time, paused inside the device phases and the
    prefill's forwards: what remains is host work (the prefill's included)."""
    from vegas_spec.prefill_graphs import PrefillGraphs

    prof = cProfile.Profile()
    paused = [(GraphRunner, "_replay"), (model_runner, "next_tokens"), (PrefillGraphs, "run")]
    originals = [(owner, name, getattr(owner, name)) for owner, name in paused]
    for owner, name, fn in originals:
        setattr(owner, name, pausing(prof, fn))
    try:
        prof.enable()
        run_once(llm, prompts, params, spec, None, stream)
        prof.disable()
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def pausing(prof: cProfile.Profile, fn: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        prof.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            prof.enable()
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=["vanilla", "vegas"])
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: host work only)")
    ap.add_argument("--cprofile", type=int, default=0, help="also print the top N functions")
    ap.add_argument("--stream", nargs="?", const="yes", default="no",
                    choices=["no", "yes", "both"],
                    help="every step makes its outputs and text deltas, as the server does "
                         "(both: each method without, then with)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(tiny_model(Path(tmp))), load_format="dummy", static_shapes=True,
                  max_num_seqs=args.batch, kv_cache_bytes=1 << 26, max_model_len=512)
        vocab = llm.model_config.vocab_size
        prompts = [[(i * 7919 + j * 31) % (vocab - 3) + 3 for j in range(args.prompt_tokens)]
                   for i in range(args.batch)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        rows = []
        streams = {"no": [False], "yes": [True], "both": [False, True]}[args.stream]
        for method, stream in itertools.product(args.methods, streams):
            spec = SpecConfig(method=method, gamma=args.gamma, ratio=0.1, min_tokens=16,
                              adaptive=False)
            row = {"method": method, "stream": stream,
                   **measure(llm, prompts, params, spec, args.repeats, stream)}
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
            if args.cprofile:
                print(profile_table(llm, prompts, params, spec, args.cprofile, stream),
                      flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or "cpu",
            "cpus": torch.get_num_threads(), "torch": torch.__version__,
            "args": {k: str(v) for k, v in vars(args).items()}}
    if args.out is not None:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
