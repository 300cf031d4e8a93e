"""Adaptive speculation against fixed draft lengths on a GPU, side by side in one process, on
every workload of `vegas bench` (essays, code and needle at each context, `--max-tokens` new
tokens; generation: as many chat questions as the batch, their own length,
`--generation-tokens` new tokens), at each batch, greedy (or sampled at the reference setting:
temperature 0.6, top-p 0.95, top-k 20).

A cell (workload, context, batch) decodes the same prompts in every run: vanilla, then the
method with adaptive speculation at γ `--gamma`, then the method with each fixed γ of
`--fixed` (`adaptive: False`: a round every iteration). Each run follows a `--warmup`-token
warm-up of the same batch with the same settings (graphs captured there; the adaptive
controller is made anew when the method's settings change, which they do before every
adaptive run, so its counts run from the warm-up on). `--repeats N` runs the cell's whole
list N times, interleaved, every second
time in reverse order (`order`), so that no run always comes first or last: in one process
the runs of a cell are not alike in where they fall (the first after a cell's prompts
change ran slower in the generation cells), and over an even number of repeats every run
takes every place on average.

Per cell, a row (printed as a JSON line as it ends; `--out` rewritten after each cell): per
run, decode tokens/s (the median over the repeats, every repeat kept), tokens per iteration
(of a round, per row; 1 for vanilla), the batch's decode iterations of each repeat (until
its last row was done: with rows of unlike acceptance, more than the tokens over tokens per
iteration), the speedup over vanilla, and for the adaptive run the
controller's summary (`controller.summary()`, whole, of the repeat of median throughput); the
fastest fixed γ (`best_fixed`), `adaptive_vs_best_fixed` (adaptive tok/s over the best fixed
γ's) and `adaptive_vs_vanilla`. The goal it checks: adaptive never below 0.98× vanilla, and
within 5% of the best fixed γ of the sweep (`adaptive_vs_best_fixed` >= 0.95), in every cell.

    python benchmarks/adaptive_sweep.py --out adaptive_sweep.json
    python benchmarks/adaptive_sweep.py --sampled --out adaptive_sweep_sampled.json

`--tiny` runs the same on CPU on a 2-layer random model that speaks SmolLM2's tokenizer (a
check that the script runs, not a measurement; its context is 2,048 tokens: give small
`--contexts`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import tiny_model

from vegas_spec import LLM, SamplingParams
from vegas_spec.bench.workloads import build

SAMPLED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
DEPTHS = [0.1, 0.5, 0.9]  # needle depths, `vegas bench`'s default


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-layer random model on CPU (a check that the script runs)")
    ap.add_argument("--workloads", nargs="+", default=["essays", "code", "needle", "generation"],
                    choices=["essays", "code", "needle", "generation"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[2048, 7500],
                    help="prompt tokens (not for generation, whose prompts have their own)")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--generation-tokens", type=int, default=1024,
                    help="new tokens of the generation workload")
    ap.add_argument("--warmup", type=int, default=16, help="tokens of each warm-up run")
    ap.add_argument("--method", default="vegas")
    ap.add_argument("--gamma", type=int, default=6, help="the adaptive run's γ")
    ap.add_argument("--fixed", nargs="+", type=int, default=[2, 4, 6], help="fixed γ's")
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--sampled", action="store_true",
                    help="temperature 0.6, top-p 0.95, top-k 20, seed 1 (default: greedy)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--trace", action="store_true",
                    help="keep the adaptive runs' iterations (`traced`) in --out")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", nargs="+", type=Path, metavar="RESULTS",
                    help="print the markdown table of these result files (BENCHMARKS.md "
                         "§1.5's) and exit")
    args = ap.parse_args(argv)
    if args.table:
        print("\n".join(table(args.table)))
        return
    if args.out is None:
        ap.error("--out is required (or --table)")
    if min(args.max_tokens, args.generation_tokens) < 2 or args.repeats < 1:
        ap.error("--max-tokens and --generation-tokens must be >= 2 (a decode rate needs two "
                 "decoded tokens), --repeats >= 1")
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("adaptive_sweep.py times the decode loop on a GPU: it needs CUDA "
                 "(--tiny runs it on CPU on a tiny random model)")
    meta = {"date": time.strftime("%Y-%m-%d"),
            "gpu": "cpu" if args.tiny else torch.cuda.get_device_name(),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            llm = LLM(str(tiny_model(Path(tmp))), load_format="dummy", device="cpu",
                      max_num_seqs=max(args.batches), kv_cache_bytes=1 << 26)
        else:
            llm = LLM(args.model, device="cuda", dtype="bfloat16",
                      max_num_seqs=max(args.batches))
        rows: list[dict[str, Any]] = []
        for workload in args.workloads:
            for context in [None] if workload == "generation" else args.contexts:
                for batch in args.batches:
                    rows.append(cell(llm, args, workload, context, batch))
                    print(json.dumps(rows[-1]), flush=True)
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def runs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(label, speculative settings) of a cell's runs, in order."""
    spec = {"method": args.method, "ratio": args.ratio}
    return [("vanilla", {"method": "vanilla"}),
            ("adaptive", {**spec, "gamma": args.gamma, "adaptive": True}),
            *((f"fixed {g}", {**spec, "gamma": g, "adaptive": False}) for g in args.fixed)]


def order(cell_runs: list[tuple[str, dict[str, Any]]],
          repeat: int) -> list[tuple[str, dict[str, Any]]]:
    """The runs of a cell's `repeat`-th pass: in order, every second pass reversed."""
    return cell_runs[::-1] if repeat % 2 else cell_runs


def measure(llm: LLM, ids: list[list[int]], params: SamplingParams, warmup: int,
            spec: dict[str, Any], trace: bool = False) -> dict[str, Any]:
    """One warm-up, then one timed run of the batch -> its figures (trace: with the adaptive
    controller's iterations of the timed run, `traced`)."""
    llm.generate(ids, dataclasses.replace(params, max_tokens=min(warmup, params.max_tokens)),
                 speculative=spec)
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    iterations = traced(llm.engine.controller) if trace and spec.get("adaptive") else None
    start = llm.engine.iterations
    stats = llm.generate(ids, params, speculative=spec)[0].stats
    out = {"decode_tokens_per_s": stats["decode_tokens_per_s"],
           "batch_iterations": llm.engine.iterations - start,
           "tokens_per_iteration": stats.get("tokens_per_iteration",
                                             1.0 if spec["method"] == "vanilla" else None)}
    if spec.get("adaptive"):
        controller = llm.engine.controller
        out["controller"] = controller.summary() if controller is not None else None
    if iterations is not None:
        out["trace"] = iterations
    return out


def traced(controller: Any) -> list[list[Any]] | None:
    """The controller's iterations from now on, as they are observed: [bucket, draft length
    (0: a plain step), ms, mean tokens a row emitted, its cost estimate in ms of each choice
    after the iteration (None: not measured yet)] (None: no controller)."""
    if controller is None:
        return None
    iterations: list[list[Any]] = []
    observe = controller.observe

    def record(bucket: int, drafted: int, seconds: float, emitted: Any = ()) -> None:
        observe(bucket, drafted, seconds, emitted)
        costs = controller.buckets[bucket].costs
        iterations.append([bucket, drafted, round(seconds * 1e3, 3),
                           round(statistics.fmean(emitted), 2) if emitted else None,
                           {g: None if e.value is None else round(e.value * 1e3, 3)
                            for g, e in costs.items()}])

    controller.observe = record
    return iterations


def cell(llm: LLM, args: argparse.Namespace, workload: str, context: int | None,
         batch: int) -> dict[str, Any]:
    """Every run of the cell, `--repeats` times interleaved -> the cell's row."""
    tokens = args.generation_tokens if workload == "generation" else args.max_tokens
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=1,
                            **(SAMPLED if args.sampled else {}))
    ids = [p.ids for p in build(workload, llm.tokenizer, context, batch, DEPTHS, [])]
    measured: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in runs(args)}
    for repeat in range(args.repeats):
        for label, spec in order(runs(args), repeat):
            measured[label].append(measure(llm, ids, params, args.warmup, spec, args.trace))
    out: dict[str, dict[str, Any]] = {}
    for label, reps in measured.items():
        speeds = [r["decode_tokens_per_s"] for r in reps]
        tpi = [r["tokens_per_iteration"] for r in reps if r["tokens_per_iteration"] is not None]
        out[label] = {"decode_tokens_per_s": statistics.median(speeds),
                      "tokens_per_iteration": statistics.median(tpi) if tpi else None,
                      "decode_tokens_per_s_runs": speeds,
                      "batch_iterations_runs": [r["batch_iterations"] for r in reps]}
        if "controller" in reps[0]:  # the repeat of median throughput (the slower middle one)
            middle = sorted(reps, key=lambda r: r["decode_tokens_per_s"])[(len(reps) - 1) // 2]
            out[label]["controller"] = middle["controller"]
        if any("trace" in r for r in reps):  # --trace: every repeat's, in run order
            out[label]["traces"] = [r.get("trace") for r in reps]
    vanilla = out["vanilla"]["decode_tokens_per_s"]
    for figures in out.values():
        figures["vs_vanilla"] = figures["decode_tokens_per_s"] / vanilla
    best = max((label for label in out if label.startswith("fixed")),
               key=lambda label: out[label]["decode_tokens_per_s"])
    adaptive = out["adaptive"]["decode_tokens_per_s"]
    return {"workload": workload, "context": context, "batch": batch, "max_tokens": tokens,
            "prompt_tokens": sum(map(len, ids)), "runs": out,
            "best_fixed": {"label": best, "decode_tokens_per_s": out[best]["decode_tokens_per_s"]},
            "adaptive_vs_best_fixed": adaptive / out[best]["decode_tokens_per_s"],
            "adaptive_vs_vanilla": adaptive / vanilla}


def table(paths: list[Path]) -> list[str]:
    """The rows of result files as one markdown table: per cell vanilla's tok/s, adaptive
    and each fixed γ over vanilla (the best fixed γ in bold), adaptive over the best fixed γ
    (✗: below the goals, 0.98× vanilla and 0.95× the best fixed γ) and the adaptive run's
    iterations by draft length (0: plain steps)."""
    files = [json.loads(p.read_text()) for p in paths]
    rows = [(data, r) for data in files for r in data["rows"]]
    fixed = sorted({int(label.split()[1]) for _, r in rows for label in r["runs"]
                    if label.startswith("fixed")})
    lengths = sorted({0, *fixed})
    out = ["| workload, decoding | context | batch | vanilla tok/s | adaptive × vanilla | "
           "fixed γ " + " / ".join(map(str, fixed)) + " × vanilla | adaptive / best fixed | "
           "iterations: plain / γ " + " / ".join(map(str, lengths[1:])) + " |",
           "|---|---:|---:|---:|---:|---|---:|---|"]
    for data, r in rows:
        runs, best = r["runs"], r["best_fixed"]["label"]
        mode = "sampled" if data["meta"]["args"].get("sampled") else "greedy"
        name = r["workload"] if mode == "greedy" and r["workload"] != "generation" \
            else f"{r['workload']}, {mode}"
        each = " / ".join((f"**{runs[f'fixed {g}']['vs_vanilla']:.2f}**" if f"fixed {g}" == best
                           else f"{runs[f'fixed {g}']['vs_vanilla']:.2f}") for g in fixed)
        chosen = (runs["adaptive"].get("controller") or {}).get("draft_lengths") or {}
        counts = " / ".join(str(chosen.get(str(g), chosen.get(g, 0))) for g in lengths)
        adaptive, versus = runs["adaptive"]["vs_vanilla"], r["adaptive_vs_best_fixed"]
        out.append(f"| {name} | {r['context'] or '-'} | {r['batch']} | "
                   f"{runs['vanilla']['decode_tokens_per_s']:,.0f} | "
                   f"{adaptive:.2f}{' ✗' if adaptive < 0.98 else ''} | {each} | "
                   f"{versus:.2f}{' ✗' if versus < 0.95 else ''} | {counts} |")
    return out


if __name__ == "__main__":
    main()
