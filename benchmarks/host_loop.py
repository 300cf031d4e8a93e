"""Host work per iteration of the engine's own decode loop, from the engine's own timings.

On a GPU the decode loop replays CUDA graphs and everything else an iteration does is Python on
the host: scheduling, the step's tensor bookkeeping, the one device-to-host read, appending
tokens (incremental detokenisation, stop checks), statistics, finished rows leaving and the
step's outputs. This script runs `LLM.generate` on a tiny random model that speaks SmolLM2's
vocabulary and tokenizer (so detokenisation is real), with static shapes (the buffers and code
path the CUDA graphs replay, run eagerly on CPU), greedy and ignore_eos, every prompt
prefilled before the rows decode (as `generate` does), and measures only through public
reports:

- `LLM.generate(on_step=...)` is called after every step: the wall time from the end of one
  call to the start of the next is one step of the loop (the callback's own time left out;
  the `Progress` that `generate` makes for it, four sums over the batch, stays in);
- `engine.last_step` says what the step did: the steps kept are those that only decoded, all
  `--batch` rows (rows the random model drafts badly for decode longer, alone, and are not
  counted);
- the runner's phase timer (`engine.runner.timer.totals`, new for every `generate`, the
  figures behind a run's `phase_s`) gives the time of the step's timed phases, read as a
  difference before and after the step: `forward_ms` the plain step with its sampling or the
  round (`decode`, `speculate`, or `draft` + `verify` + `accept` when eager), `select_ms` the
  selection of the next draft positions when the round did not make it (`select`). On a GPU
  both are device work (CUDA events, the graphs' replays); here the tiny model's forward,
  computed on CPU.

`host_ms` = `iteration_ms` - `forward_ms` - `select_ms` per iteration: the host's share. Each
figure is the median over `--repeats` timed runs after one warm-up run (`runs` lists each).

`generate` steps without making per-step outputs, and a request without stop strings is
detokenized only when its text is read (after the loop, outside the steps timed);
`--stream` makes every step's outputs and text deltas, as the server's loop does.

    python benchmarks/host_loop.py --batch 64 --max-tokens 256 --repeats 3 --out host_loop.json
    python benchmarks/host_loop.py --batch 64 --methods vegas --cprofile 25
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
from pathlib import Path
from typing import Any

import torch
from common import StepWatch, tiny_model

from vegas_spec import LLM, SamplingParams, SpecConfig

FIGURES = ("iteration_ms", "forward_ms", "select_ms", "host_ms", "tokens_per_iteration")


class StepClock(StepWatch):
    """Per kept step (decode only, every one of `rows` rows) its wall time and the phase
    timer's seconds it added, summed."""

    def __init__(self, llm: LLM, rows: int) -> None:
        super().__init__(llm)
        self.rows = rows
        self.wall = self.forward = self.select = 0.0
        self.iterations = self.tokens = 0

    def step(self, wall: float, added: dict[str, float], info: Any) -> None:
        if len(info.emitted) == self.rows and not info.prefill_tokens and not info.first_tokens:
            select = added.pop("select", 0.0)
            self.wall += wall
            self.forward += sum(added.values())
            self.select += select
            self.iterations += 1
            self.tokens += sum(info.emitted)

    def row(self) -> dict[str, Any]:
        n = max(self.iterations, 1)
        out = {"iterations": self.iterations,
               "iteration_ms": 1e3 * self.wall / n, "forward_ms": 1e3 * self.forward / n,
               "select_ms": 1e3 * self.select / n,
               "tokens_per_iteration": self.tokens / (n * self.rows)}
        out["host_ms"] = out["iteration_ms"] - out["forward_ms"] - out["select_ms"]
        return out


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams, spec: SpecConfig,
            repeats: int, stream: bool = False) -> dict[str, Any]:
    """Median per-iteration figures over `repeats` timed runs (after a warm-up)."""
    llm.generate(prompts, params, speculative=spec, stream=stream)
    runs = []
    for _ in range(repeats):
        clock = StepClock(llm, len(prompts))
        llm.generate(prompts, params, speculative=spec, stream=stream, on_step=clock)
        runs.append(clock.row())
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in FIGURES}
    out["iterations"] = min(r["iterations"] for r in runs)
    out["runs"] = runs
    return out


def profile_table(llm: LLM, prompts: list[list[int]], params: SamplingParams,
                  spec: SpecConfig, rows: int, stream: bool = False) -> str:
    """cProfile of one whole generate() by own time (the prefill and the tiny model's
    forwards included: their torch operators are rows of their own)."""
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, params, speculative=spec, stream=stream)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=["vanilla", "vegas"])
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: host work only)")
    ap.add_argument("--cprofile", type=int, default=0, help="also print the top N functions")
    ap.add_argument("--stream", nargs="?", const="yes", default="no",
                    choices=["no", "yes", "both"],
                    help="every step makes its outputs and text deltas, as the server does "
                         "(both: each method without, then with)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(tiny_model(Path(tmp))), load_format="dummy", static_shapes=True,
                  device=args.device, max_num_seqs=args.batch, kv_cache_bytes=1 << 26,
                  max_model_len=512)
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
                              for k, v in row.items() if k != "runs"}), flush=True)
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
