"""Drafting accuracy of every method and vegas variant over many prompts, paired per prompt.

Tokens per iteration moves by ±0.5 from one prompt to the next, so comparing methods on a
handful of prompts says little. This script runs every variant on the same N prompts of spread
lengths (essays at distinct offsets, in two formats) and reports, per variant, the pooled mean
over all iterations, the mean over prompts with its standard error, and the paired difference
to `vegas` per prompt (mean ± standard error): a difference is real when it is several
standard errors away from 0.

    python benchmarks/method_sweep.py --prompts 24 --min-context 1000 --max-context 7500 \
        --max-tokens 96 --formats raw chat --out sweep.json

Variants are `method[:key=value,...]` over SpecConfig fields (e.g. `vegas:collect=all`), plus
ablations of vegas defined here, each registered as a method of its own name
(`policies.register_method`, with vegas's settings) and run as `SpecConfig(method=name)`:
  vegas-acc   collect rows x0 and the last accepted row (not dγ, which may be rejected)
  vegas-x0    collect row x0 only
Every output is compared token for token with vanilla's.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from common import essays

from vegas_spec import LLM, SamplingParams, SpecConfig
from vegas_spec.speculative.policies import SelectionInput, Vegas, register_method, topk_positions

VARIANTS = ["vanilla", "vegas", "vegas:collect=all", "vegas:score=logit",
            "vegas:granularity=kv_head", "vegas-acc", "vegas-x0", "lastq", "stream", "quest",
            "specextend", "full"]
CUE = "\n\nIn summary, the main point of the essay above is"
ASK = "\n\nSummarize the essay above in a few paragraphs."


def accepted_row(scores: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """scores [layers, B, R, G, W], row [B] -> each sequence's row `row[b]`: [layers, B, G, W]
    (R == 1: row ignored)."""
    if scores.shape[2] == 1:
        return scores[:, :, 0]
    index = row.view(1, -1, 1, 1, 1).expand(scores.shape[0], -1, 1, *scores.shape[3:])
    return scores.gather(2, index)[:, :, 0]


@register_method
class VegasAcc(Vegas):
    """Ablation: rows x0 and the last accepted token instead of x0 and dγ."""

    name = "vegas-acc"

    def score_rows(self, n: int, prefill: bool) -> list[int]:
        return [n - 1] if prefill else list(range(n))

    def indices(self, inp: SelectionInput, rankable: torch.Tensor,
                k: torch.Tensor) -> torch.Tensor:
        assert inp.scores is not None
        first = inp.scores[:, :, 0]
        both = first if inp.scores.shape[2] == 1 else first + accepted_row(inp.scores, inp.accepted)
        return topk_positions(both, rankable, k, inp.kmax)


@register_method
class VegasX0(Vegas):
    """Ablation: row x0 only."""

    name = "vegas-x0"

    def score_rows(self, n: int, prefill: bool) -> list[int]:
        return [n - 1] if prefill else [0]



def spec_of(variant: str, args: argparse.Namespace) -> SpecConfig:
    method, _, rest = variant.partition(":")
    kw = dict(item.split("=", 1) for item in rest.split(",") if item)
    return SpecConfig(method=method, gamma=args.gamma, ratio=args.ratio,
                      min_tokens=args.min_tokens, adaptive=False, **kw)


def make_prompts(tok, texts: list[str], lengths: list[int], fmt: str) -> list[list[int]]:  # noqa: ANN001
    """Prompt i: the essays from offset 2i on, cut to lengths[i] tokens with the cue/question."""
    out = []
    for i, n in enumerate(lengths):
        offset = (2 * i) % len(texts)
        body = tok(leading_text(texts[offset:] + texts[:offset], 8 * n),
                   add_special_tokens=False)["input_ids"]
        if fmt == "raw":
            cue = tok(CUE, add_special_tokens=False)["input_ids"]
            out.append(body[: n - len(cue)] + cue)
        else:
            overhead = len(chat(tok, ASK))
            text = tok.decode(body[: n - overhead]) + ASK
            out.append(chat(tok, text))
    return out


def leading_text(texts: list[str], chars: int) -> str:
    """The first essays joined, at least `chars` characters when there is that much: ample
    for n tokens at 8 characters each, so the first n tokens are those of the whole text."""
    out: list[str] = []
    for text in texts:
        out.append(text)
        if sum(map(len, out)) >= chars:
            break
    return "\n\n".join(out)


def chat(tok, text: str) -> list[int]:  # noqa: ANN001
    ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                  add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def run(llm: LLM, prompts: list[list[int]], variant: str, args: argparse.Namespace) -> dict:
    spec = spec_of(variant, args)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, speculative=spec)
    stats = {k: v for k, v in outs[0].stats.items() if k != "sequence"}
    stats["per_prompt"] = [o.stats["sequence"].get("tokens_per_iteration") for o in outs]
    stats["token_ids"] = [o.token_ids for o in outs]
    stats["wall_s"] = time.perf_counter() - t0
    return stats


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    var = sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)
    return m, math.sqrt(var / len(xs))


def equal_count(outputs: list[list[int]], base: list[list[int]]) -> str:
    return f"{sum(a == b for a, b in zip(outputs, base))}/{len(base)}"


def table(results: dict[str, dict[str, dict]]) -> str:
    lines = ["| format | variant | tokens/iter (pooled) | per prompt mean ± se | vs vegas, paired "
             "| accept@1 | accept@γ | = vanilla |", "|" + "---|" * 8]
    for fmt, rows in results.items():
        base, ref = rows.get("vanilla"), rows.get("vegas")
        for name, r in rows.items():
            if name == "vanilla":
                continue
            m, se = mean_se(r["per_prompt"])
            diff = "-"
            if ref is not None and name != "vegas":
                dm, dse = mean_se([a - b for a, b in zip(r["per_prompt"], ref["per_prompt"])])
                diff = f"{dm:+.2f} ± {dse:.2f}"
            acc = r["acceptance_rate_per_position"]
            same = "-" if base is None else equal_count(r["token_ids"], base["token_ids"])
            lines.append(f"| {fmt} | {name} | {r['tokens_per_iteration']:.2f} | {m:.2f} ± {se:.2f}"
                         f" | {diff} | {acc[0]:.2f} | {acc[-1]:.2f} | {same} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF or HF folder (default: the embedded one)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--min-context", type=int, default=1000)
    ap.add_argument("--max-context", type=int, default=7500)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--formats", nargs="+", default=["raw", "chat"], choices=["raw", "chat"])
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kv = args.prompts * (args.max_context + args.max_tokens + 64) * 46080 * 2 + (256 << 20)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, backend=args.backend,
              kv_cache_bytes=kv, prefix_cache_bytes=2 * kv)
    n = args.prompts
    lengths = [round(args.min_context + (args.max_context - args.min_context) * i / max(n - 1, 1))
               for i in range(n)]
    texts = essays()
    results: dict[str, dict[str, dict]] = {}
    for fmt in args.formats:
        prompts = make_prompts(llm.tokenizer, texts, lengths, fmt)
        results[fmt] = {}
        for variant in args.variants:
            r = results[fmt][variant] = run(llm, prompts, variant, args)
            print(f"{fmt} {variant}: tpi={r.get('tokens_per_iteration')} "
                  f"wall={r['wall_s']:.1f}s", flush=True)
            save(args, lengths, results)
    print(table(results))


def save(args: argparse.Namespace, lengths: list[int], results: dict) -> None:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = {"date": time.strftime("%Y-%m-%d"), "device": device, "lengths": lengths,
            "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
