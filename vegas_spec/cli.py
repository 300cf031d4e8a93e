"""`vegas generate ...` and `vegas compare ...`: the command line over `LLM.generate`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vegas_spec.config import DTYPES, METHODS, ConfigError, SamplingParams, SpecConfig
from vegas_spec.models.loader import WeightError

DEFAULT_SPEC = SpecConfig()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vegas", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    common = _common()
    g = sub.add_parser("generate", parents=[common],
                       help="generate text (plain or self-speculative)")
    g.add_argument("--method", default="vanilla", choices=METHODS)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    c = sub.add_parser("compare", parents=[common],
                       help="greedy decoding with plain and speculative methods side by side: "
                            "decode speed, tokens per iteration, identical output")
    c.add_argument("--methods", nargs="+", default=["vegas"],
                   choices=[m for m in METHODS if m != "vanilla"],
                   help="speculative methods to run after vanilla (default: vegas)")
    c.add_argument("--json", action="store_true", help="one JSON object per method")
    return parser


def _common() -> argparse.ArgumentParser:
    """Options shared by every command: model, prompts, engine and speculative settings."""
    g = argparse.ArgumentParser(add_help=False)
    g.add_argument("--model", help="HF folder (config.json + safetensors) or .gguf file; "
                   "default: the embedded SmolLM2-135M-Instruct")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompt-file", action="append", type=Path,
                     help="file whose whole text is one prompt (repeat for a batch)")
    g.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    g.add_argument("--dtype", default="float32", choices=list(DTYPES))
    g.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from the model's config.json (timing only)")
    g.add_argument("--kv-cache-gb", type=float, help="KV page pool size in GiB")
    g.add_argument("--eager", action="store_true",
                   help="no CUDA graphs: run the decode loop eagerly with dynamic shapes")
    g.add_argument("--max-model-len", type=int,
                   help="longest sequence (default: the model's); bounds the static buffers")
    g.add_argument("--gamma", type=int, default=DEFAULT_SPEC.gamma)
    g.add_argument("--ratio", type=float, default=DEFAULT_SPEC.ratio)
    g.add_argument("--min-tokens", type=int, default=DEFAULT_SPEC.min_tokens)
    g.add_argument("--score", default=DEFAULT_SPEC.score, choices=["weight", "logit"])
    g.add_argument("--collect", default=DEFAULT_SPEC.collect, choices=["2", "all"])
    g.add_argument("--granularity", default=DEFAULT_SPEC.granularity,
                   choices=["layer", "kv_head"])
    g.add_argument("--sink", type=int, default=DEFAULT_SPEC.sink, help="stream: sink tokens")
    return g


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {"device": args.device, "dtype": args.dtype, "backend": args.backend,
              "load_format": args.load_format}
    if args.kv_cache_gb is not None:
        kwargs["kv_cache_bytes"] = int(args.kv_cache_gb * (1 << 30))
    if args.eager:
        kwargs["cuda_graphs"] = False
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    return kwargs


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return args.prompt
    missing = [str(p) for p in args.prompt_file if not p.is_file()]
    if missing:
        raise ConfigError(f"prompt file not found: {', '.join(missing)}")
    return [p.read_text(encoding="utf-8") for p in args.prompt_file]


def _spec(args: argparse.Namespace, method: str) -> SpecConfig:
    return SpecConfig(method=method, gamma=args.gamma, ratio=args.ratio,
                      min_tokens=args.min_tokens, score=args.score, collect=args.collect,
                      granularity=args.granularity, sink=args.sink)


def generate(args: argparse.Namespace) -> int:
    from vegas_spec.engine import LLM

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop),
                            ignore_eos=args.ignore_eos)
    prompts = _prompts(args)
    llm = LLM(args.model, speculative=_spec(args, args.method), **_engine_kwargs(args))
    for out in llm.generate(prompts, params, chat=args.chat):
        if args.json:
            print(json.dumps({"text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "stats": out.stats}))
        else:
            print(out.text)
    return 0


def compare(args: argparse.Namespace) -> int:
    """vanilla, then each method, on the same prompts in one engine; each first warmed up on
    the first prompt (kernels compile, graphs are captured), then timed."""
    from vegas_spec.engine import LLM

    prompts = _prompts(args)
    llm = LLM(args.model, **_engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    rows, base = [], None
    for method in ["vanilla", *args.methods]:
        spec = _spec(args, method)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), chat=args.chat, speculative=spec)
        outs = llm.generate(prompts, params, chat=args.chat, speculative=spec)
        tokens = [o.token_ids for o in outs]
        base = tokens if base is None else base
        rows.append(_comparison(method, outs[0].stats, tokens, base, rows))
    for row in rows:
        print(json.dumps(row) if args.json else _line(row))
    return 0 if all(r["identical"] == r["prompts"] for r in rows) else 1


def _comparison(method: str, stats: dict, tokens: list[list[int]], base: list[list[int]],
                rows: list[dict]) -> dict:
    speed = stats["decode_tokens_per_s"]
    return {"method": method, "decode_tokens_per_s": speed,
            "vs_vanilla": speed / rows[0]["decode_tokens_per_s"] if rows else 1.0,
            "ttft_s": stats["ttft_s"], "total_s": stats["total_s"],
            "tokens_per_iteration": stats.get("tokens_per_iteration"),
            "identical": sum(a == b for a, b in zip(tokens, base)), "prompts": len(base)}


def _line(row: dict) -> str:
    tpi = row["tokens_per_iteration"]
    return (f"{row['method']:<11} {row['decode_tokens_per_s']:10.1f} tok/s  "
            f"{row['vs_vanilla']:5.2f}x vanilla  "
            f"first token {1e3 * row['ttft_s']:8.1f} ms  total {row['total_s']:7.2f} s  "
            f"tokens/iter {'-' if tpi is None else f'{tpi:.2f}':>5}  "
            f"identical to vanilla: {row['identical']}/{row['prompts']}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return compare(args) if args.command == "compare" else generate(args)
    except (ConfigError, WeightError) as err:
        print(f"vegas: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
