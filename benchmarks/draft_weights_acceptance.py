"""Tokens per iteration with FP8 and INT4 draft weights against drafts on the model's own
weights, for every sparse policy, greedy and sampled (temperature 0.6, top-p 0.95, top-k 20),
on the workloads of `vegas bench`: essays and source code (prompts of about --tokens tokens,
each from another text onwards) and long generation (chat questions, --generation-tokens new
tokens), on the embedded model (or --model), each kind of draft weights in an engine of its
own. With --keep, each setting in turn reads some of the copy's projections from the model's
weights instead (a projection kind in every layer, or every projection of the first and last
N layers): where a copy's acceptance goes.

    python benchmarks/draft_weights_acceptance.py --device cpu --out acceptance.json
    python benchmarks/draft_weights_acceptance.py --device cuda --dtype bfloat16 \\
        --prompts 16 --max-tokens 256 --out acceptance.json
    python benchmarks/draft_weights_acceptance.py --draft-weights model fp8 --methods vegas \\
        --keep none qkv o_proj down edges:2 --out keep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

from common import TEXTS, rotated_prompts

from vegas_spec import LLM, SamplingParams, SpecConfig
from vegas_spec.bench.workloads import generation_prompts

METHODS = ("vegas", "lastq", "stream", "quest", "specextend")
SAMPLED = dict(temperature=0.6, top_p=0.95, top_k=20)


def keep_arg(text: str) -> str:
    """--keep: none, a projection's name (every layer's read from the model's weights), or
    edges:N (every projection of the first and last N layers)."""
    if text == "none" or (text.startswith("edges:") and text[6:].isdigit()) or \
            text.replace("_", "").isalpha():
        return text
    raise argparse.ArgumentTypeError(f"none, a projection's name or edges:N, not {text!r}")


def keep_model_weights(llm: LLM, copies: list[dict], setting: str) -> float:
    """The copies (`copies`: each layer's own, as made) with those of `setting` replaced by
    the model's weights (a projection of the model read as a draft step's weight) -> the
    share of the projections' parameters kept in the model's dtype (1.0: no copies, the
    drafts read the model's weights already)."""
    if not any(copies):
        return 1.0
    edges = int(setting[6:]) if setting.startswith("edges:") else None
    if edges is None and setting != "none" and any(setting not in own for own in copies):
        raise SystemExit(f"--keep {setting}: the copies hold {', '.join(copies[0])}")
    layers = llm.engine.runner.model.layers
    kept = total = 0
    for i, (layer, own) in enumerate(zip(layers, copies, strict=True)):
        layer.drafts = dict(own)
        for name in own:
            size = getattr(layer, name).weight.numel()
            total += size
            if name == setting or (edges is not None and (i < edges or i >= len(layers) - edges)):
                layer.drafts[name] = getattr(layer, name).weight
                kept += size
    return kept / total


def workload_prompts(llm: LLM, workload: str, args: argparse.Namespace,
                     ) -> tuple[list[list[int]], int]:
    """A workload's prompts and the new tokens each decodes."""
    if workload == "generation":
        return ([p.ids for p in generation_prompts(llm.tokenizer, args.prompts)],
                args.generation_tokens)
    return (rotated_prompts(llm.tokenizer, TEXTS[workload](), args.prompts, args.tokens, 100),
            args.max_tokens)


def run(llm: LLM, prompts: list[list[int]], tokens: int, method: str,
        sampled: bool, draws: int = 1) -> dict[str, object]:
    """One cell: every prompt decoded at γ 6 (fixed), each with its own seed; sampled,
    `draws` times, draw r with seeds r·len(prompts) + i (as many sampled texts a prompt), the
    figures averaged over the draws (each decodes the same prompts and tokens)."""
    spec = SpecConfig(method=method, gamma=6, ratio=0.05, min_tokens=128, adaptive=False)
    taus, rates = [], []
    for r in range(draws if sampled else 1):
        params = [SamplingParams(max_tokens=tokens, ignore_eos=True, seed=r * len(prompts) + i,
                                 **(SAMPLED if sampled else {})) for i in range(len(prompts))]
        stats = llm.generate(prompts, params, speculative=spec)[0].stats
        taus.append(stats["tokens_per_iteration"])
        rates.append(stats["acceptance_rate_per_position"])
    return {"tokens_per_iteration": sum(taus) / len(taus),
            "acceptance_rate_per_position": [sum(col) / len(col) for col in zip(*rates)],
            **({"tokens_per_iteration_draws": taus} if len(taus) > 1 else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1500, help="prompt tokens (+100 per prompt)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--generation-tokens", type=int, default=128)
    ap.add_argument("--workloads", nargs="+", default=["essays", "code", "generation"],
                    choices=["essays", "code", "generation"])
    ap.add_argument("--draft-weights", nargs="+", default=["model", "fp8", "int8", "int4"],
                    choices=["model", "fp8", "int8", "int4"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--keep", nargs="+", type=keep_arg, default=["none"],
                    help="the copy's projections read from the model's weights instead, each "
                         "setting in turn: none, a projection's name (qkv, o_proj, gate_up, "
                         "down) or edges:N (the first and last N layers)")
    ap.add_argument("--kv-cache-gb", type=float, default=0.25)
    ap.add_argument("--draws", type=int, default=1,
                    help="sampled cells: texts drawn per prompt (other seeds), averaged")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.draws < 1:
        raise SystemExit(f"--draws must be at least 1, got {args.draws}")
    cells = []
    for drafts in args.draft_weights:
        llm = LLM(args.model, device=args.device, dtype=args.dtype, draft_weights=drafts,
                  kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)))
        copies = [dict(layer.drafts or {}) for layer in llm.engine.runner.model.layers]
        work = {workload: workload_prompts(llm, workload, args) for workload in args.workloads}
        for keep in args.keep if drafts != "model" else ["none"]:
            kept = keep_model_weights(llm, copies, keep)
            for (workload, (prompts, tokens)), method, sampling in itertools.product(
                    work.items(), args.methods, ("greedy", "sampled")):
                cell = {"draft_weights": drafts, "keep": keep, "kept_share": kept,
                        "workload": workload, "method": method, "sampling": sampling,
                        **run(llm, prompts, tokens, method, sampling == "sampled",
                              args.draws)}
                cells.append(cell)
                print(json.dumps(cell), flush=True)
        del llm
    meta = {"date": time.strftime("%Y-%m-%d"), "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
