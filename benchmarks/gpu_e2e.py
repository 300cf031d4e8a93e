"""End-to-end decode throughput on a GPU: every method side by side through `vegas bench`
(bf16, Triton backend, CUDA graphs unless --eager; the bf16 partings from plain decoding and
their top-2 margins are in its report), plus what users do not run: transformers `generate`
with a static cache on the same prompts (`--hf`), written to DIR/transformers.json.

    python benchmarks/gpu_e2e.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --contexts 2000 7500 --batches 1 16 64 --max-tokens 64 --hf --out gpu_e2e

γ/ratio sweeps are `vegas tune`'s job. All prompts of a batch have exactly `context` tokens
(the essays workload, or `--text code`: the Python standard library's source), so
transformers needs no padding.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vegas_spec import cli

METHODS = ["vanilla", "vegas", "stream", "quest", "lastq", "specextend"]


def run_hf(model, prompts: list[list[int]], max_tokens: int) -> float:  # noqa: ANN001
    """Decode tokens/s of transformers' generate (static cache), prefill excluded."""
    ids = torch.tensor(prompts, device="cuda")
    kwargs = dict(do_sample=False, cache_implementation="static", pad_token_id=0,
                  eos_token_id=None)
    # Same shapes as the timed calls: a static cache compiles its step on first use.
    model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
    model.generate(ids, max_new_tokens=1, **kwargs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kwargs)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
    torch.cuda.synchronize()
    decode = time.perf_counter() - t0 - prefill
    return len(prompts) * (max_tokens - 1) / decode


def transformers_rows(args: argparse.Namespace) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from vegas_spec.bench.workloads import essay_prompts
    from vegas_spec.models.loader import resolve
    from vegas_spec.tokenizer import load_tokenizer

    path = Path(args.model)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.bfloat16).cuda().eval()
    tokenizer = load_tokenizer(resolve(args.model))
    rows = []
    for ctx in args.contexts:
        for bsz in args.batches:
            prompts = [p.ids for p in essay_prompts(tokenizer, ctx, bsz, args.text)]
            rows.append({"context": ctx, "batch": bsz, "method": "transformers-static",
                         "decode_tokens_per_s": run_hf(hf, prompts, args.max_tokens)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2000, 7500])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--text", choices=["essays", "code"], default="essays",
                    help="prompt source: essays (prose) or code (the Python standard library)")
    ap.add_argument("--hf", action="store_true", help="also time transformers generate")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    args = ap.parse_args()
    argv = ["bench", "--model", args.model, "--device", "cuda", "--dtype", "bfloat16",
            "--workload", args.text, "--context", ",".join(map(str, args.contexts)),
            "--batch", ",".join(map(str, args.batches)), "--max-tokens", str(args.max_tokens),
            "--gamma", str(args.gamma), "--ratio", str(args.ratio), "--min-tokens",
            str(args.min_tokens), "--methods", ",".join(args.methods), "--out", str(args.out)]
    code = cli.main(argv + ["--eager"] * args.eager + ["--resume"] * args.resume)
    if code in (0, 1) and args.hf:
        rows = transformers_rows(args)
        (args.out / "transformers.json").write_text(json.dumps(rows, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
