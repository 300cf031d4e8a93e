"""What an iteration costs, by kind, in the engine's own decode loop on a GPU: vanilla, and
each speculative method with adaptive speculation and with a fixed γ, side by side in one
process on the long-generation workload (32 distinct chat questions), greedy and sampled at
the reference setting (temperature 0.6, top-p 0.95, top-k 20).

For each run: decode tokens/s, tokens per iteration, the controller's rounds and plain steps
(counted from the warm-up on) and, per kind, what the engine itself reports, read by the
`on_step` callback of `LLM.generate` after every step:

- `plain_ms`, `round_ms` (and `plain_n`, `round_n`, by `engine.last_step.drafted`): the mean
  time per plain step or round of its phases in the runner's phase timer
  (`engine.runner.timer.totals`, the figures behind a run's `phase_s`; the difference before
  and after the step): `decode` for a plain step, `speculate` for a round's graph (or
  `draft` + `verify` + `accept` when eager). On a GPU that is the device's time between the
  phase's CUDA events: unlike the earlier figures, timed around `ModelRunner.decode`, it
  leaves out the host's share of the call (its launches, the iteration's one host read and
  the bookkeeping around them);
- `select_ms`: the phase timer's `select` (the next round's draft positions where the round's
  graph did not choose them, and the first plan of a joining prompt) over the run, per round;
  a new figure (the earlier ones left it out of `round_ms`, or, after a plain step, had it
  inside);
- `step_ms` (and `step_n`): the mean wall time of a step, from the end of one `on_step` call
  to the start of the next (the callback's own time left out): the whole iteration, its host
  work included, as `LLMEngine.step` was timed before, with the loop's check for unfinished
  requests and the `Progress` that `generate` makes for the callback (four sums over the
  batch) in; every step of the run, the prefilling ones included.

Each run follows a `--warmup`-token warm-up of the same batch (graphs captured there). Plain
steps and rounds are also counted by batch bucket (`engine.last_step.bucket`, steps that
emitted tokens; rows leave as they finish: the last buckets are the batch's tail).

    python benchmarks/adaptive_costs.py --max-tokens 2048 --batch 32 --out adaptive_costs.json

`--tiny` runs the same on CPU on a 2-layer random model that speaks SmolLM2's tokenizer (a
check that the script runs, not a measurement).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import StepWatch, tiny_model

from vegas_spec import LLM, SamplingParams
from vegas_spec.bench.workloads import generation_prompts

SAMPLED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
RUNS = [("vanilla", {}), ("vegas", {}), ("vegas", {"adaptive": False}), ("stream", {}),
        ("stream", {"adaptive": False})]
ROUND_PHASES = ("speculate", "draft", "verify", "accept")


class StepClock(StepWatch):
    """Every step's wall time, and per decode iteration its kind, batch bucket and the phase
    timer's seconds it added."""

    def __init__(self, llm: LLM) -> None:
        super().__init__(llm)
        self.times: dict[str, list[float]] = {"plain": [], "round": [], "step": []}
        self.select = 0.0
        # bucket -> [plain steps, rounds]
        self.kinds: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])

    def step(self, wall: float, added: dict[str, float], info: Any) -> None:
        self.times["step"].append(wall)
        self.select += added.get("select", 0.0)
        if info.bucket:  # the step decoded
            if info.drafted:
                self.times["round"].append(sum(added.get(k, 0.0) for k in ROUND_PHASES))
            else:
                self.times["plain"].append(added.get("decode", 0.0))
            if info.emitted:
                self.kinds[info.bucket][int(bool(info.drafted))] += 1

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind, values in self.times.items():
            out[f"{kind}_n"] = len(values)
            out[f"{kind}_ms"] = 1e3 * sum(values) / max(len(values), 1)
        out["select_ms"] = 1e3 * self.select / max(len(self.times["round"]), 1)
        out["plain_and_rounds_by_bucket"] = dict(sorted(self.kinds.items()))
        return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-layer random model on CPU (a check that the script runs)")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=64, help="tokens of the warm-up run")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.07)
    ap.add_argument("--min-tokens", type=int, default=256, help="the budget's floor")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("adaptive_costs.py times the decode loop on a GPU: it needs CUDA "
                 "(--tiny runs it on CPU on a tiny random model)")
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            llm = LLM(str(tiny_model(Path(tmp))), load_format="dummy", device="cpu",
                      max_num_seqs=args.batch, kv_cache_bytes=1 << 26)
        else:
            llm = LLM(args.model, device="cuda", dtype="bfloat16")
        rows = measure(llm, args)
    meta = {"date": time.strftime("%Y-%m-%d"),
            "gpu": "cpu" if args.tiny else torch.cuda.get_device_name(),
            "batch": args.batch, "max_tokens": args.max_tokens}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def measure(llm: LLM, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run of RUNS, greedy then sampled -> a row each (printed as it ends)."""
    ids = [p.ids for p in generation_prompts(llm.tokenizer, args.batch)]
    rows = []
    for sampled in (False, True):
        sampling = SAMPLED if sampled else {}
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=1, **sampling)
        warm = SamplingParams(max_tokens=args.warmup, ignore_eos=True, seed=1, **sampling)
        for method, extra in RUNS:
            spec = {"method": method, "gamma": args.gamma, "ratio": args.ratio,
                    "min_tokens": args.min_tokens, **extra}
            llm.generate(ids, warm, speculative=spec)
            label = f"{'sampled' if sampled else 'greedy'} {method}" + (" fixed" if extra else "")
            if llm.device.type == "cuda":
                torch.cuda.synchronize()
            clock = StepClock(llm)
            outs = llm.generate(ids, params, speculative=spec, on_step=clock)
            stats = outs[0].stats
            controller = llm.engine.controller
            row = {"label": label, "decode_tokens_per_s": stats.get("decode_tokens_per_s"),
                   "tokens_per_iteration": stats.get("tokens_per_iteration"),
                   **(controller.summary() if controller is not None else {}),
                   **clock.summary()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
