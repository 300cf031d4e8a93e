"""What an iteration costs, by kind, in the engine's own decode loop on a GPU: vanilla, and
each speculative method with adaptive speculation and with a fixed γ, side by side in one
process on the long-generation workload (32 distinct chat questions), greedy and sampled at
the reference setting (temperature 0.6, top-p 0.95, top-k 20).

For each run: decode tokens/s, tokens per iteration, the controller's rounds and plain steps
(counted from the warm-up on) and per kind the mean wall time of `ModelRunner.decode` (a
plain step or a round: the device's time up to the iteration's one host read) and of
`LLMEngine.step` (the whole iteration, its host work included), timed by wrapping those two
methods. Each run follows a 64-token warm-up
of the same batch (graphs captured there). Plain steps and rounds are also counted by batch
bucket (rows leave as they finish: the last buckets are the batch's tail).

    python benchmarks/adaptive_costs.py --max-tokens 2048 --batch 32 --out adaptive_costs.json
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path
from typing import Any

import torch

from vegas_spec import LLM, SamplingParams
from vegas_spec.bench.workloads import generation_prompts
from vegas_spec.engine import LLMEngine
from vegas_spec.model_runner import ModelRunner

SAMPLED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
RUNS = [("vanilla", {}), ("vegas", {}), ("vegas", {"adaptive": False}), ("stream", {}),
        ("stream", {"adaptive": False})]


class Clock:
    """Wall times of runner.decode (by kind) and engine.step under the current label."""

    def __init__(self) -> None:
        self.label = ""
        self.times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        # (label, bucket) -> [plain steps, rounds]
        self.kinds: dict[tuple[str, int], list[int]] = collections.defaultdict(lambda: [0, 0])
        decode, step = ModelRunner.decode, LLMEngine.step

        def timed_decode(runner: ModelRunner, draft: bool = True) -> Any:
            t = time.perf_counter()
            out = decode(runner, draft)
            self.add("round" if out.drafted else "plain", time.perf_counter() - t)
            return out

        def timed_step(engine: LLMEngine, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = step(engine, *args, **kwargs)
            self.add("step", time.perf_counter() - t)
            info = engine.last_step
            if self.label and info.emitted:
                self.kinds[(self.label, info.bucket)][int(info.drafted)] += 1
            return out

        ModelRunner.decode, LLMEngine.step = timed_decode, timed_step

    def add(self, kind: str, seconds: float) -> None:
        if self.label:
            self.times[(self.label, kind)].append(seconds)

    def summary(self, label: str) -> dict[str, float | int]:
        out: dict[str, float | int] = {}
        for kind in ("plain", "round", "step"):
            values = self.times[(label, kind)]
            out[f"{kind}_n"] = len(values)
            out[f"{kind}_ms"] = 1e3 * sum(values) / max(len(values), 1)
        out["plain_and_rounds_by_bucket"] = {
            bucket: counts for (at, bucket), counts in sorted(self.kinds.items()) if at == label}
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.07)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    llm = LLM(args.model, device="cuda", dtype="bfloat16")
    ids = [p.ids for p in generation_prompts(llm.tokenizer, args.batch)]
    clock, rows = Clock(), []
    for sampled in (False, True):
        sampling = SAMPLED if sampled else {}
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=1, **sampling)
        warm = SamplingParams(max_tokens=64, ignore_eos=True, seed=1, **sampling)
        for method, extra in RUNS:
            spec = {"method": method, "gamma": args.gamma, "ratio": args.ratio, **extra}
            clock.label = ""
            llm.generate(ids, warm, speculative=spec)
            label = f"{'sampled' if sampled else 'greedy'} {method}" + (" fixed" if extra else "")
            clock.label = label
            torch.cuda.synchronize()
            outs = llm.generate(ids, params, speculative=spec)
            stats = outs[0].stats
            controller = llm.engine.controller
            row = {"label": label, "decode_tokens_per_s": stats.get("decode_tokens_per_s"),
                   "tokens_per_iteration": stats.get("tokens_per_iteration"),
                   **(controller.summary() if controller is not None else {}),
                   **clock.summary(label)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
            "batch": args.batch, "max_tokens": args.max_tokens}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
