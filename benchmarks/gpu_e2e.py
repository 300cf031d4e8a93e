"""End-to-end decode throughput on a GPU: every method side by side in one process, plus
transformers `generate` with a static cache on the same prompts, and the bf16 agreement of
each speculative method with plain decoding.

    python benchmarks/gpu_e2e.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --contexts 2000 7500 --batches 1 16 64 --max-tokens 64 --out results.json

All prompts of a batch have exactly `context` tokens (essays at different offsets), so
transformers needs no padding. Decode tokens/s = generated tokens / decode wall time
(prefill excluded; the prefix cache makes the prompt KV identical for every method).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import TEXTS

from vegas_spec import LLM, SamplingParams, SpecConfig

METHODS = ["vanilla", "vegas", "stream", "quest", "lastq", "specextend"]


def make_prompts(tokenizer, texts: list[str], tokens: int, count: int) -> list[list[int]]:  # noqa: ANN001
    """`count` distinct windows of `tokens` tokens, evenly spread over all texts (the essays:
    ~200K tokens): neighbouring prompts overlap when count * tokens exceeds the text."""
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    stride = (len(ids) - tokens) // max(count - 1, 1)
    assert stride > 0, "not enough text for prompts this long"
    return [ids[i * stride : i * stride + tokens] for i in range(count)]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def margin_at(llm: LLM, prompt: list[int], generated: list[int], index: int) -> float:
    """Top-2 logit margin of the plain run at generated position `index`."""
    logits = llm.logits(prompt + generated[:index])[-1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def run_method(llm: LLM, prompts: list[list[int]], method: str, args: argparse.Namespace,
               gamma: int | None = None, ratio: float | None = None,
               ) -> tuple[dict, list[list[int]]]:
    spec = SpecConfig(method=method, gamma=gamma or args.gamma, ratio=ratio or args.ratio,
                      min_tokens=args.min_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), speculative=spec)
    torch.cuda.synchronize()
    outs = llm.generate(prompts, params, speculative=spec)
    stats = dict(outs[0].stats)
    stats.pop("sequence", None)
    return stats, [o.token_ids for o in outs]


def run_hf(model, prompts: list[list[int]], max_tokens: int) -> float:  # noqa: ANN001
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2000, 7500])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--sweep-gammas", type=int, nargs="*", default=[],
                    help="also run vegas at every (gamma, ratio) of these lists")
    ap.add_argument("--sweep-ratios", type=float, nargs="*", default=[])
    ap.add_argument("--text", choices=sorted(TEXTS), default="essays",
                    help="prompt source: essays (prose) or code (the Python standard library)")
    ap.add_argument("--hf", action="store_true", help="also time transformers generate")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    kw = {} if not args.eager else {"cuda_graphs": False}
    llm = LLM(args.model, device="cuda", dtype="bfloat16", kv_cache_fraction=0.5,
              prefix_cache_bytes=24 << 30, **kw)
    texts = TEXTS[args.text]()
    hf = None
    if args.hf:
        from transformers import AutoModelForCausalLM

        path = Path(args.model)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.bfloat16).cuda().eval()
    rows = []
    for ctx in args.contexts:
        for bsz in args.batches:
            prompts = make_prompts(llm.tokenizer, texts, ctx, bsz)
            base_tokens = None
            for method in args.methods:
                stats, tokens = run_method(llm, prompts, method, args)
                row = {"context": ctx, "batch": bsz, "method": method, **stats}
                if method == "vanilla":
                    base_tokens = tokens
                elif base_tokens is not None:
                    row["divergences"] = divergences(llm, prompts, base_tokens, tokens)
                rows.append(row)
                save(args, rows)
                print(json.dumps({k: row.get(k) for k in (
                    "context", "batch", "method", "decode_tokens_per_s", "tokens_per_iteration",
                    "phase_fraction", "divergences")}), flush=True)
            for gamma in args.sweep_gammas:
                for ratio in args.sweep_ratios or [args.ratio]:
                    stats, tokens = run_method(llm, prompts, "vegas", args, gamma, ratio)
                    row = {"context": ctx, "batch": bsz, "method": f"vegas g{gamma} r{ratio}",
                           "gamma": gamma, "ratio": ratio, **stats}
                    if base_tokens is not None:
                        row["divergences"] = divergences(llm, prompts, base_tokens, tokens)
                    rows.append(row)
                    save(args, rows)
                    print(json.dumps({k: row.get(k) for k in (
                        "method", "decode_tokens_per_s", "tokens_per_iteration")}), flush=True)
            if hf is not None:
                rows.append({"context": ctx, "batch": bsz, "method": "transformers-static",
                             "decode_tokens_per_s": run_hf(hf, prompts, args.max_tokens)})
                print(json.dumps(rows[-1]), flush=True)
            save(args, rows)


def save(args: argparse.Namespace, rows: list[dict]) -> None:
    """Rewritten after every row so a run cut short keeps what it measured."""
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def divergences(llm: LLM, prompts: list[list[int]], base: list[list[int]],
                spec: list[list[int]]) -> list[dict]:
    """Where a speculative run parts from plain bf16 decoding, and the plain top-2 margin
    there (a near-tie explains a parting; a large margin would be a bug)."""
    out = []
    for i, (a, b) in enumerate(zip(base, spec)):
        at = first_divergence(a, b)
        if at is not None:
            out.append({"prompt": i, "position": at, "margin": margin_at(llm, prompts[i], a, at)})
    return out


if __name__ == "__main__":
    main()
