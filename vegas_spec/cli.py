"""`vegas generate`, `vegas compare`, `vegas bench` and `vegas tune`: the command line over
`LLM.generate` (bench and tune live in `vegas_spec.bench`).

Every input the engine refuses ends in one line `vegas: error: ...` and exit code 2, as does
every argument argparse refuses (`vegas generate: error: ... (see vegas generate --help)`);
Ctrl-C in one line `vegas: interrupted` and exit code 130. `vegas --help` and the argument
errors answer without importing torch."""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, NoReturn

# Only the standard library at import time: the rest (torch first) is imported inside main,
# where Ctrl-C is caught.
EXIT_ERROR, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 2, 130, 141  # 128 + SIGINT, SIGPIPE
RANDOM_SEED = -1  # --seed -1: a random seed, as llama.cpp's


class _Parser(argparse.ArgumentParser):
    """argparse's own errors as one line, as every other refusal: no usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {' '.join(message.split())} "
                              f"(see {self.prog} --help)\n")


class _Formatter(argparse.HelpFormatter):
    """Each option's help ends with its default, unless it has none (None, False, [])."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        if (action.option_strings and "%(default)" not in text and default is not None
                and default is not False and default != [] and default is not argparse.SUPPRESS):
            shown = " ".join(default) if isinstance(default, list) else str(default)
            text += f" (default: {shown.replace('%', '%%')})"
        return text


def _parser(settings=None) -> argparse.ArgumentParser:  # noqa: ANN001 - SpecConfig | None
    """The command line; `settings` (a SpecConfig read from --config FILE) replaces the
    defaults of the speculative options, so that options given explicitly still win."""
    from vegas_spec.bench.commands import add_bench, add_tune
    from vegas_spec.config import METHODS

    parser = _Parser(
        prog="vegas", formatter_class=_Formatter,
        description="Lossless self-speculative decoding: generate text, compare methods side "
                    "by side, benchmark them, or tune gamma and the ratio. A bad input ends in "
                    "one line `vegas: error: ...` and exit code 2; Ctrl-C in `vegas: "
                    "interrupted` and exit code 130.")
    sub = parser.add_subparsers(dest="command", required=True)
    common = _common(settings)
    g = sub.add_parser("generate", parents=[common], formatter_class=_Formatter,
                       help="generate text (plain or self-speculative)",
                       description="Generate text for each prompt, plainly (--method vanilla) "
                                   "or self-speculatively; greedy output is identical either "
                                   "way.")
    g.add_argument("--method", default=settings.method if settings else "vanilla",
                   choices=METHODS,
                   help="vanilla: plain decoding; vegas: self-speculative decoding whose verify "
                        "pass selects the KV positions the next drafts read; stream, quest, "
                        "lastq, specextend: the same loop with other selections (baselines); "
                        "full: dense drafts (an oracle)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 decodes greedily")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample among the k likeliest tokens only (0: no limit)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the likeliest tokens whose probabilities add up to p "
                        "(1: no limit)")
    g.add_argument("--seed", type=int, default=RANDOM_SEED,
                   help="seed of the sampling: a seeded run samples the same tokens again "
                        "(with --fixed-gamma: see README, What is promised); -1 draws a random "
                        "one, given with the statistics (--stats, --json) so that the run can "
                        "be repeated; greedy decoding (--temperature 0) uses none")
    g.add_argument("--stop", action="append", default=[],
                   help="stop string: the text ends before it (repeatable)")
    out = g.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true",
                     help="one JSON object per prompt: text, token_ids, finish_reason, stats")
    out.add_argument("--stats", action="store_true",
                     help="after each text, its statistics in a few readable lines")
    c = sub.add_parser("compare", parents=[common], formatter_class=_Formatter,
                       help="greedy decoding with plain and speculative methods side by side: "
                            "decode speed, tokens per iteration, identical output",
                       description="Greedy decoding with vanilla, then each method, on the same "
                                   "prompts in one engine: decode speed, tokens per iteration "
                                   "and whether every output equals vanilla's. Where one parts "
                                   "from vanilla's: the position and vanilla's top-2 logit "
                                   "margin there; a margin within the dtype's rounding is a "
                                   "near-tie, anything else (any parting with --exact) a "
                                   "mismatch (exit code 1).")
    c.add_argument("--methods", nargs="+",
                   default=[settings.method] if settings and settings.speculative else ["vegas"],
                   choices=[m for m in METHODS if m != "vanilla"],
                   help="speculative methods to run after vanilla")
    c.add_argument("--json", action="store_true", help="one JSON object per method")
    engine = _engine_options(settings)
    b = sub.add_parser("bench", parents=[engine], formatter_class=_Formatter,
                       help="measure methods side by side: results.json, report.md, plots",
                       description="Run every method on the same prompts in one engine for "
                                   "each workload, context and batch; write DIR/results.json, "
                                   "DIR/report.md and PNG plots (exit code 1 if a greedy output "
                                   "differs from vanilla's beyond a near-tie).")
    add_bench(b)
    t = sub.add_parser("tune", parents=[engine], formatter_class=_Formatter,
                       help="tune gamma and the ratio in three steps; save the setting",
                       description="Sweep the ratio until tokens per iteration plateau, sweep "
                                   "gamma for throughput at that ratio, fine-tune the ratio "
                                   "at the best gamma; print the fastest setting and save it "
                                   "as DIR/config.json for --config. --gamma and --ratio are "
                                   "the reference setting and step 1's gamma.")
    add_tune(t)
    _serve_parser(sub, METHODS, settings)
    return parser


def _serve_parser(sub: argparse._SubParsersAction, methods: tuple[str, ...],
                  settings=None) -> None:  # noqa: ANN001 - SpecConfig | None
    s = sub.add_parser("serve", parents=[_engine_options(settings)], formatter_class=_Formatter,
                       help="an OpenAI-compatible HTTP server",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, "
                                   "/health and /metrics over HTTP, batching requests "
                                   "continuously.")
    s.add_argument("--method", default=settings.method if settings else "vegas",
                   choices=methods,
                   help="the decoding method of every request (as for generate)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (0.0.0.0 serves other machines too)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--max-num-seqs", type=int, default=64,
                   help="requests decoding at once (rows of the batch)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a row; past it the server answers 429")
    s.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route but "
                   "/health and /metrics (also from --api-key-file or $VEGAS_API_KEY, which "
                   "keep it out of the process list)")
    s.add_argument("--api-key-file", type=Path,
                   help="a file whose first line is the API key")
    s.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds the requests in flight get to finish after SIGINT or SIGTERM "
                        "before each ends with finish reason abort; a second signal ends "
                        "them at once")
    s.add_argument("--prefill-pacing", type=float, default=2.0,
                   help="while requests decode, prefill about this many decode iterations' "
                        "time of prompt tokens per step, so arriving prompts stretch "
                        "inter-token latency by at most ~1+this (0: no pacing)")
    s.add_argument("--served-model-name",
                   help="the model's name in the API (default: the model file or folder name)")


def _common(settings=None) -> argparse.ArgumentParser:  # noqa: ANN001 - SpecConfig | None
    """Options of generate and compare: prompts, then the engine and speculative settings."""
    g = argparse.ArgumentParser(add_help=False, parents=[_engine_options(settings)])
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompt-file", action="append", type=Path,
                     help="UTF-8 text file whose whole text is one prompt (repeat for a batch)")
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the model's chat template as a user turn")
    g.add_argument("--max-tokens", type=int, default=64,
                   help="most tokens to generate per prompt; where the model's context leaves "
                        "less room after a prompt, capped to that room, with a warning")
    g.add_argument("--ignore-eos", action="store_true",
                   help="go on past the end-of-sequence token, up to --max-tokens")
    return g


def _engine_options(settings=None) -> argparse.ArgumentParser:  # noqa: ANN001
    """Options of every command: model, engine and speculative settings."""
    from vegas_spec.config import (
        DEFAULT_WINDOW,
        DRAFT_WEIGHTS,
        DTYPES,
        VEGAS_WINDOW,
        SpecConfig,
    )

    DEFAULT_SPEC = settings or SpecConfig()  # noqa: N806
    g = argparse.ArgumentParser(add_help=False)
    g.set_defaults(settings=settings)  # its method's own settings: the defaults of _spec
    g.add_argument("--model", help="HF folder (config.json + *.safetensors) or .gguf file "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--config", type=Path, metavar="FILE",
                   help="settings file written by `vegas tune` (DIR/config.json): its method, "
                        "gamma, ratio and other speculative settings become the defaults; "
                        "options given here still win")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model runs")
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split attention heads and MLP columns over N ranks, one process "
                        "each (started here; under torchrun, its ranks); on cuda one GPU "
                        "each")
    g.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="type of the weights, activations and KV cache")
    g.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"],
                   help="kernels: torch (plain PyTorch) or triton (GPU; on CPU only under "
                        "TRITON_INTERPRET=1); auto: triton on cuda, torch on cpu")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from the model's config.json (timing only)")
    g.add_argument("--kv-cache-gb", type=float,
                   help="KV page pool size in GiB (default: half the free GPU memory on cuda; "
                        "on cpu 2 GiB, or half the available memory if that is less)")
    g.add_argument("--eager", action="store_true",
                   help="no CUDA graphs: run the decode loop eagerly with dynamic shapes")
    g.add_argument("--max-model-len", type=int,
                   help="longest sequence (default: the model's); bounds the static buffers")
    g.add_argument("--narrowest-span", type=int,
                   help="CUDA graphs: the decode graphs are also captured at key widths "
                        "narrower than --max-model-len's, halved down to this many tokens "
                        "(at most three), and a batch runs the narrowest that holds its "
                        "longest row (default 2048; 0: the whole width alone)")
    g.add_argument("--exact", action="store_true",
                   help="every kernel computes each row the same way whatever the batch and "
                        "the number of rows in a step: greedy output of every method is plain "
                        "decoding's token for token in bfloat16 too, and a prompt gives the "
                        "same tokens alone or in a batch (slower)")
    g.add_argument("--draft-weights", default="auto", choices=DRAFT_WEIGHTS,
                   help="the draft steps' copy of the projection weights: fp8 (e4m3, one "
                        "scale per output row: half the bytes a draft step streams; a GPU of "
                        "compute capability 8.9+, or the CPU's reference path), int8 (8-bit "
                        "integers, one scale per row and group of 128 (or 64, 32) input "
                        "channels: 3%% more bytes, any GPU, drafts closer to the model's), "
                        "int4 (4-bit integers, the same groups: about a quarter of the "
                        "bytes), model (none); lossless, "
                        "drafts are verified by the model's own weights; auto: fp8 for dense "
                        "models of at least 64 MB of projections a layer (8B-class, where "
                        "FP8 drafts measure faster) on a GPU with FP8 whose memory holds "
                        "the copies 4 times over, else model")
    g.add_argument("--gamma", type=int, default=DEFAULT_SPEC.gamma,
                   help="draft tokens per speculative iteration (1 to 32)")
    g.add_argument("--ratio", type=float, default=DEFAULT_SPEC.ratio,
                   help="share of the context each draft step attends to: the selection "
                        "budget is ratio x context length, at least --min-tokens")
    g.add_argument("--min-tokens", type=int, default=DEFAULT_SPEC.min_tokens,
                   help="smallest selection budget in tokens; shorter contexts draft with "
                        "full attention")
    g.add_argument("--score", choices=["weight", "logit"],
                   help="vegas: how the verify pass ranks cached positions: weight = softmax "
                        "probability per head (heads comparable; the default), logit = raw q.k")
    g.add_argument("--collect", choices=["2", "all"],
                   help="vegas: verify rows whose scores select: 2 = the first and the last "
                        "row (the default), all = all gamma+1 rows")
    g.add_argument("--granularity", choices=["layer", "kv_head"],
                   help="vegas: layer = one selection per layer shared by all heads (the "
                        "default), kv_head = one per KV head")
    g.add_argument("--fixed-gamma", dest="adaptive", action="store_false",
                   default=DEFAULT_SPEC.adaptive,
                   help="draft --gamma tokens every iteration; by default the engine's own "
                        "timings choose each iteration's draft length (gamma, 2/3 or 1/3 of "
                        "it) or a plain step, whichever decodes fastest")
    g.add_argument("--adaptive", dest="adaptive", action="store_true",
                   help="the default: speculate only where it pays (overrides a settings "
                        "file's fixed gamma)")
    g.add_argument("--sink", type=int,
                   help="stream, vegas, lastq, specextend: first tokens always attended to "
                        "(attention sink; default 4)")
    g.add_argument("--window", type=int,
                   help="vegas, lastq, specextend: positions just before the selection row "
                        f"always selected, at most 3/4 of the budget (0: pure top-k; "
                        f"default {VEGAS_WINDOW} for vegas, {DEFAULT_WINDOW} for the others)")
    g.add_argument("--pool", type=int,
                   help="vegas, lastq: odd width of a max-pool of the scores over "
                        "neighbouring positions before the top-k (1: none, the default)")
    g.add_argument("--page", type=int,
                   help="quest: tokens per page whose min and max keys are scored (default 16)")
    g.add_argument("--chunk", type=int,
                   help="specextend: tokens per scored chunk (default 32)")
    return g


def _draft_weights_text(kind: str, nbytes: int) -> str:
    from vegas_spec.cache import fmt_bytes

    return f"draft weights: {kind}, {fmt_bytes(nbytes)} beside the model's" if nbytes \
        else "draft weights: the model's"


def _engine_kwargs(args: argparse.Namespace) -> dict:
    from vegas_spec.config import ConfigError

    kwargs = {"device": args.device, "dtype": args.dtype, "backend": args.backend,
              "load_format": args.load_format, "draft_weights": args.draft_weights}
    if args.kv_cache_gb is not None:
        if not math.isfinite(args.kv_cache_gb) or args.kv_cache_gb <= 0:
            raise ConfigError(f"--kv-cache-gb must be a positive number of GiB, got "
                              f"{args.kv_cache_gb:g}")
        kwargs["kv_cache_bytes"] = int(args.kv_cache_gb * (1 << 30))
    if args.eager:
        kwargs["cuda_graphs"] = False
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if args.exact:
        kwargs["exact"] = True
    if args.narrowest_span is not None:
        kwargs["narrowest_span"] = args.narrowest_span
    return kwargs


STDIN = Path("-")  # --prompt-file -: the prompt is standard input
# Bytes of a prompt read without more ado; a larger one is first held against the most bytes
# the model's context can take (which loads the model's config and tokenizer).
READ_FREELY = 1 << 20
UTF8_BYTES = 4  # the most bytes of one character


def _prompts(args: argparse.Namespace) -> list[str]:
    from vegas_spec.config import ConfigError

    if args.prompt:
        return args.prompt
    files = args.prompt_file
    if files.count(STDIN) > 1:
        raise ConfigError("--prompt-file - (standard input) can be given once")
    for p in files:
        if p != STDIN and p.is_dir():
            raise ConfigError(f"prompt file {p} is a directory, not a file")
    missing = [str(p) for p in files if p != STDIN and not p.exists()]
    if missing:
        raise ConfigError(f"prompt file not found: {', '.join(missing)}")
    limit = functools.cache(lambda: _byte_limit(args.model, args.max_model_len))
    return [_read_prompt(p, limit) for p in files]


def _file_name(path: Path) -> str:
    return "standard input" if path == STDIN else f"prompt file {path}"


def _byte_limit(model: str | None, max_model_len: int | None) -> tuple[int, int]:
    """(the context in tokens, the most bytes a prompt can have and still fit it): a token
    spans at most the vocabulary's longest token in characters, a character at most
    UTF8_BYTES bytes."""
    from vegas_spec.models.loader import load_config, resolve
    from vegas_spec.tokenizer import load_tokenizer, longest_token

    source = resolve(model)
    context = max_model_len or load_config(source).max_position_embeddings
    return context, context * longest_token(load_tokenizer(source)) * UTF8_BYTES


def _read_prompt(path: Path, limit: Callable[[], tuple[int, int]]) -> str:
    """The text of a prompt file (or standard input), refused unread where its size alone
    says that it cannot fit the context, else refused once it is read past that size."""
    from vegas_spec.config import ConfigError

    try:
        with _open_prompt(path) as f:
            size = None if path == STDIN else os.fstat(f.fileno()).st_size
            if size is not None and size > READ_FREELY and size > limit()[1]:
                raise _too_large(path, limit(), size)
            data = f.read(READ_FREELY + 1)
            if len(data) > READ_FREELY:  # standard input, or a file that grew
                data += f.read(limit()[1] + 1 - len(data))
                if len(data) > limit()[1]:
                    raise _too_large(path, limit())
    except OSError as err:
        raise ConfigError(f"cannot read {_file_name(path)}: {err.strerror or err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{_file_name(path)} is not UTF-8 text (byte 0x{data[err.start]:02x} "
                          f"at offset {err.start}); convert it, e.g. with iconv") from None


def _open_prompt(path: Path) -> contextlib.AbstractContextManager[BinaryIO]:
    if path == STDIN:  # standard input stays open: a context that closes nothing
        return contextlib.nullcontext(sys.stdin.buffer)
    return path.open("rb")


def _too_large(path: Path, limit: tuple[int, int], size: int | None = None):  # noqa: ANN202
    """The ConfigError of a prompt of `size` bytes (None: more than the limit, read so far)
    that no context of the model can hold."""
    from vegas_spec.config import ConfigError

    context, most = limit
    held = f"{size:,} bytes" if size is not None else f"more than {most:,} bytes"
    return ConfigError(f"{_file_name(path)} has {held}, more than any {context}-token context "
                       f"holds (at most {most:,} bytes)")


OPTION_FLAGS = ("score", "collect", "granularity", "sink", "window", "pool", "page", "chunk")


def _spec(args: argparse.Namespace, method: str, strict: bool = True):  # noqa: ANN202
    """The SpecConfig of `method` from the flags, over a settings file's (`--config`): its
    method's own settings carry over where `method` has them. A method's setting flag given
    for a method without it is an error (strict), or left to the methods that have it."""
    import dataclasses

    from vegas_spec.config import SpecConfig, option_names

    given = {name: getattr(args, name) for name in OPTION_FLAGS
             if getattr(args, name, None) is not None}
    mine = set(option_names(method))
    if strict and set(given) - mine:
        SpecConfig(method=method, **given)  # raises: the error names the method's own
    base = getattr(args, "settings", None) or SpecConfig(method=method)
    return dataclasses.replace(base, method=method, gamma=args.gamma, ratio=args.ratio,
                               min_tokens=args.min_tokens, adaptive=args.adaptive,
                               **{k: v for k, v in given.items() if k in mine})


def _check_options(args: argparse.Namespace, methods: list[str]) -> None:
    """A method's setting flag that none of `methods` has is an error."""
    from vegas_spec.config import ConfigError, option_names

    for name in OPTION_FLAGS:
        if getattr(args, name, None) is not None and \
                not any(name in option_names(m) for m in methods):
            raise ConfigError(f"--{name} is a setting of none of the methods compared "
                              f"({', '.join(methods)})")


def generate(args: argparse.Namespace) -> int:
    """Each prompt's text (a single prompt's streamed as it is decoded), its statistics with
    --stats, or one JSON object a prompt with --json."""
    from vegas_spec.config import SamplingParams
    from vegas_spec.engine import LLM

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=_seed(args.seed),
                            stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    spec, kwargs, prompts = _spec(args, args.method), _engine_kwargs(args), _prompts(args)
    llm = LLM(args.model, speculative=spec, **kwargs)
    display = _display(args, stream=len(prompts) == 1)
    try:
        outs = llm.generate(prompts, params, chat=args.chat,
                            on_step=display if display.active else None,
                            stream=display.out is not None)
    finally:
        display.clear()
    for i, out in enumerate(outs):
        stats = _with_settings(out, params, spec)
        if args.json:
            print(json.dumps({"text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "stats": stats}))
            continue
        print(out.text[display.written:] if display.out is not None else out.text)
        if args.stats:
            print(_stats_text(out, i, len(outs), stats, spec.min_tokens))
    return 0


def _display(args: argparse.Namespace, stream: bool, label: str = ""):  # noqa: ANN202
    """What the run shows as it goes: a single prompt's text on stdout (not with --json), and
    the progress line on stderr where it is a terminal (not with --json)."""
    from vegas_spec.terminal import Display

    quiet = getattr(args, "json", False)
    line = sys.stderr if not quiet and sys.stderr is not None and sys.stderr.isatty() else None
    return Display(sys.stdout if stream and not quiet else None, line, label)


def _seed(seed: int) -> int | None:
    """--seed: -1 draws a random seed (in the command, so that the statistics can give it)."""
    import secrets

    from vegas_spec.config import ConfigError

    if seed == RANDOM_SEED:
        return secrets.randbelow(1 << 63)
    if seed < 0:
        raise ConfigError(f"--seed must be an integer >= 0, or -1 for a random seed; got {seed}")
    return seed


def _with_settings(out, params, spec) -> dict:  # noqa: ANN001 - RequestOutput, ...
    """The run's statistics, with the seed of a sampled run and, for a method that drafts
    from a selection, the new tokens whose drafts read the whole context because it was no
    longer than min_tokens (the budget's floor)."""
    stats = dict(out.stats)
    if not params.greedy:
        stats["seed"] = params.seed
    if spec.speculative and spec.method != "full":
        stats["dense_draft_tokens"] = _dense_tokens(len(out.prompt_token_ids),
                                                    len(out.token_ids), spec.min_tokens)
    return stats


def _dense_tokens(prompt: int, generated: int, min_tokens: int) -> int:
    """Tokens decoded (after the prefill's first) while the context was at most min_tokens
    long: a budget of max(ratio x context, min_tokens) then covers all of it, and the drafts
    are dense. The k-th new token is decoded with a context of prompt + k - 1."""
    return max(0, min(generated, min_tokens - prompt + 1) - 1)


def _stats_text(out, index: int, n: int, stats: dict | None = None,  # noqa: ANN001
                min_tokens: int = 0) -> str:
    """A few readable lines about a RequestOutput: what was generated, how fast, how well the
    drafts did; `stats`: its statistics with the command's additions (`_with_settings`)."""
    s = out.stats if stats is None else stats
    seq = s["sequence"]
    which = f" (prompt {index + 1} of {n})" if n > 1 else ""
    speed = s["decode_tokens_per_s"]
    lines = [
        f"--- {s['method']}{which}: {len(out.prompt_token_ids)} prompt tokens, "
        f"{len(out.token_ids)} generated (finish: {out.finish_reason})",
        f"    batch: prefill {s['prefill_s']:.3f} s, decode {s['decode_s']:.3f} s"
        + ("" if speed is None else f" ({speed:.1f} tokens/s)"),
    ]
    if "tokens_per_iteration" in seq:
        acc = " ".join(f"{a:.2f}" for a in seq["acceptance_rate_per_position"])
        n = seq["iterations"]
        line = (f"    {n} iteration{'s' * (n != 1)}, {seq['tokens_per_iteration']:.2f} tokens "
                f"per iteration; acceptance per draft position: {acc}")
        if "budget_mean" in seq:
            line += f"; mean budget {seq['budget_mean']:.0f} tokens"
        lines.append(line)
        lengths = seq.get("draft_length_histogram") or []
        if sum(1 for c in lengths if c) > 1:  # adaptive speculation drafted fewer than γ
            drafts = ", ".join(f"{c} of {g}" for g, c in enumerate(lengths, 1) if c)
            lines.append(f"    rounds by draft length: {drafts}")
        if s.get("plain_steps"):
            lines.append(f"    plain steps where a round would not pay: "
                         f"{1 - s['speculative_share']:.0%} of the batch's row iterations")
    else:
        n = seq["iterations"]
        lines.append(f"    {n} decode step{'s' * (n != 1)}")
    return "\n".join(lines + _notes(out, s, min_tokens))


def _notes(out, s: dict, min_tokens: int) -> list[str]:  # noqa: ANN001 - a RequestOutput
    """The seed of a sampled run; where drafts read the whole context (a short one), why."""
    lines = []
    if s.get("seed") is not None:
        lines.append(f"    sampled with seed {s['seed']}")
    dense, decoded = s.get("dense_draft_tokens", 0), max(len(out.token_ids) - 1, 0)
    if dense and "tokens_per_iteration" in s["sequence"]:
        what = "every decoded token" if dense >= decoded else f"{dense} of {decoded} tokens"
        lines.append(f"    dense drafts for {what}: drafts read the whole context while it "
                     f"is at most --min-tokens ({min_tokens}) tokens long, so nearly all are "
                     "accepted; a longer prompt drafts from a selection")
    return lines


def compare(args: argparse.Namespace) -> int:
    """vanilla, then each method, on the same prompts in one engine; each first warmed up
    (`bench.runner.warm_up`: on CUDA the whole batch, so that the timed run captures no
    graphs and its first-token and total times are the engine's), then timed."""
    from vegas_spec.bench.runner import warm_up
    from vegas_spec.config import SamplingParams
    from vegas_spec.engine import LLM

    specs = [_spec(args, method, strict=False) for method in ["vanilla", *args.methods]]
    _check_options(args, args.methods)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    kwargs, prompts = _engine_kwargs(args), _prompts(args)
    llm = LLM(args.model, **kwargs)
    rows, base, ids = [], [], []
    for spec in specs:
        warm_up(llm, prompts, params, spec, chat=args.chat)
        display = _display(args, stream=False, label=spec.method)
        try:
            outs = llm.generate(prompts, params, chat=args.chat, speculative=spec,
                                on_step=display if display.active else None)
        finally:
            display.clear()
        tokens = [o.token_ids for o in outs]
        if not rows:
            base, ids = tokens, [list(o.prompt_token_ids) for o in outs]
        row = _comparison(spec.method, outs[0].stats, tokens, base, rows)
        if rows:
            row.update(_partings(llm, ids, base, tokens, args))
        rows.append(row)
    for row in rows:
        print(json.dumps(row) if args.json else _line(row, args))
    return _verdict(rows, args)


def _partings(llm, ids: list[list[int]], base: list[list[int]],  # noqa: ANN001 - an LLM
              tokens: list[list[int]], args: argparse.Namespace) -> dict:
    """Where each output parts from vanilla's, vanilla's top-2 margin there, and how many of
    those partings are near-ties (rounding) and how many mismatches."""
    from vegas_spec.bench.analysis import count_partings, near_tie
    from vegas_spec.bench.runner import parting_margins

    found = parting_margins(llm, ids, base, tokens)
    for p in found:
        p["near_tie"] = near_tie(p["margin"], args.dtype, args.exact)
    return {"partings": found, **count_partings(found, args.dtype, args.exact)}


def _verdict(rows: list[dict], args: argparse.Namespace) -> int:
    """Exit code 1 for a mismatch; a note suggesting --exact when every parting is a
    near-tie."""
    mismatches = sum(r.get("mismatches", 0) for r in rows)
    near = sum(r.get("near_ties", 0) for r in rows)
    if near and not mismatches:
        print(f"vegas: note: every output that parts from vanilla's does so at a near-tie "
              f"(vanilla's top-2 logit margin within {args.dtype} rounding): the multi-row "
              f"verify step rounds differently from a one-row step; --exact makes every "
              f"output vanilla's token for token", file=sys.stderr)
    return 1 if mismatches else 0


def freeze_heap() -> None:
    """Move every object made so far (model, tokenizer, graphs, buffers) into the garbage
    collector's permanent generation: its full collections, which otherwise walk them all
    and pause the engine thread for tens of milliseconds between steps, then see only what
    requests create."""
    gc.collect()
    gc.freeze()


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted."""
    from vegas_spec.config import ConfigError
    from vegas_spec.engine import LLMEngine

    try:
        from vegas_spec.serve.app import serve as run
    except ModuleNotFoundError as e:
        raise ConfigError(f"vegas serve needs the serve extra ({e.name} is not installed): "
                          "pip install 'vegas-spec[serve]'") from None

    key = _api_key(args)  # before loading anything
    if not 0 <= args.port <= 65535:  # else uvicorn's OverflowError, after the model loaded
        raise ConfigError(f"--port must be a TCP port in [0, 65535], got {args.port}")
    if not math.isfinite(args.shutdown_timeout) or args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be a number of seconds >= 0, got "
                          f"{args.shutdown_timeout:g}")
    _check_bind(args.host, args.port)
    # a --config settings file has set the speculative options' defaults
    pacing = args.prefill_pacing or None  # 0: off
    engine = LLMEngine(args.model, speculative=_spec(args, args.method),
                       max_num_seqs=args.max_num_seqs, prefill_pacing=pacing,
                       **_engine_kwargs(args))
    started = time.perf_counter()
    made = engine.warm_up(args.max_num_seqs)  # every bucket's graphs, before the first request
    if args.device == "cuda" and not args.eager:  # graphs (on a CPU there are none to speak of)
        print(f"vegas: graphs ready in {time.perf_counter() - started:.1f} s "
              f"({made} prefill shapes)", file=sys.stderr)
    drafts = _draft_weights_text(engine.draft_weight_kind, engine.draft_weight_bytes)
    print(f"vegas: {drafts}", file=sys.stderr)
    freeze_heap()
    name = args.served_model_name or engine.source.path.name
    ended = run(engine, name, args.host, args.port, args.max_queue, key, args.shutdown_timeout)
    print(f"vegas: {ended}", file=sys.stderr)
    return 0


def _check_bind(host: str, port: int) -> None:
    """Refuse an address the server could not listen on (in use, not this machine's, not an
    address), before the model loads rather than after."""
    import socket

    from vegas_spec.config import ConfigError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise ConfigError(f"--host {host} is not an address to listen on: {err.strerror}") \
            from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as err:
            raise ConfigError(f"cannot listen on {host} port {port}: "
                              f"{err.strerror or err}") from None


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else $VEGAS_API_KEY (None: no key);
    two of them given is an error, as is an empty key."""
    from vegas_spec.config import ConfigError

    given = [name for name, value in (("--api-key", args.api_key),
                                      ("--api-key-file", args.api_key_file)) if value]
    if len(given) > 1:
        raise ConfigError("give the API key once: --api-key or --api-key-file")
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise ConfigError(f"cannot read --api-key-file {args.api_key_file}: "
                              f"{e.strerror or e}") from None
        key = lines[0].strip() if lines else ""
    else:
        key = args.api_key if args.api_key is not None else os.environ.get("VEGAS_API_KEY")
    if key is not None and not key:
        raise ConfigError("the API key is empty")
    return key


def _comparison(method: str, stats: dict, tokens: list[list[int]], base: list[list[int]],
                rows: list[dict]) -> dict:
    speed = stats["decode_tokens_per_s"]  # None: too few decoded tokens to time
    plain = rows[0]["decode_tokens_per_s"] if rows else speed
    return {"method": method, "decode_tokens_per_s": speed,
            "vs_vanilla": speed / plain if speed is not None and plain else None,
            "ttft_s": stats["ttft_s"], "total_s": stats["total_s"],
            "tokens_per_iteration": stats.get("tokens_per_iteration"),
            "identical": sum(a == b for a, b in zip(tokens, base)), "prompts": len(base)}


def _line(row: dict, args: argparse.Namespace) -> str:
    tpi, speed, ratio = row["tokens_per_iteration"], row["decode_tokens_per_s"], row["vs_vanilla"]
    text = (f"{row['method']:<11} {'-' if speed is None else f'{speed:.1f}':>10} tok/s  "
            f"{'-' if ratio is None else f'{ratio:.2f}':>5}x vanilla  "
            f"first token {1e3 * row['ttft_s']:8.1f} ms  total {row['total_s']:7.2f} s  "
            f"tokens/iter {'-' if tpi is None else f'{tpi:.2f}':>5}  "
            f"identical to vanilla: {row['identical']}/{row['prompts']}")
    if row.get("partings"):
        text += f" ({row['near_ties']} near-ties, {row['mismatches']} mismatches)"
    for p in row.get("partings", []):
        kind = "near-tie" if p["near_tie"] else "MISMATCH"
        text += (f"\n    {_prompt_name(args, p['prompt'])}: parts from vanilla at generated "
                 f"token {p['position']}, vanilla's top-2 margin {p['margin']:.4g} ({kind})")
    return text


def _prompt_name(args: argparse.Namespace, index: int | None) -> str:
    """How the command line names prompt `index` (0-based; None: the first)."""
    files = args.prompt_file or []
    n, index = len(args.prompt or files), index or 0
    if n == 1:
        return f"prompt file {files[0]}" if files else "prompt"
    name = f"prompt {index + 1} of {n}"
    return f"{name} ({files[index]})" if files else name


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C, while importing, loading or decoding
        print("vegas: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _settings_file(argv: list[str]):  # noqa: ANN202 - SpecConfig | None
    """The settings of `--config FILE`, read before the real parse (they set its defaults)."""
    from vegas_spec.config_file import read_config

    pre = _Parser(prog="vegas", add_help=False)
    pre.add_argument("--config", type=Path)
    known, _ = pre.parse_known_args(argv)
    return None if known.config is None else read_config(known.config)


def _main(argv: list[str] | None) -> int:
    from vegas_spec.config import ConfigError, LengthCapWarning, PromptError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parser(_settings_file(argv)).parse_args(argv)
    except ConfigError as err:
        return _fail(str(err))
    except SystemExit as done:  # --help (0), or argparse's error in one line (2)
        return done.code if isinstance(done.code, int) else EXIT_ERROR
    if sys.stdout is None and args.command != "serve":  # `vegas generate ... >&-`
        return _fail("standard output is closed: there is nowhere to write the output")

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
        if isinstance(message, LengthCapWarning):
            print(f"vegas: warning: {_prompt_name(args, message.index)} {message.problem}",
                  file=sys.stderr)
        else:
            default_show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        default_show, warnings.showwarning = warnings.showwarning, show
        try:
            return _run_command(args, argv)
        except PromptError as err:
            return _fail(f"{_prompt_name(args, err.index)} {err.problem}")
        except ConfigError as err:
            return _fail(str(err))
        except BrokenPipeError:  # the reader of stdout left (`vegas ... | head`)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_BROKEN_PIPE
        except Exception as err:
            message = _failure(err)
            if message is None:
                raise
            return _fail(message)


def _failure(err: Exception) -> str | None:
    """The line that reports an error of the model files, the ranks or the GPU's memory
    (None: any other, a bug). Their classes are looked up where they were imported: an
    error of a module not imported yet cannot have been raised, and `vegas --help` and the
    argument errors never import torch."""
    loader, executor, torch = (sys.modules.get(name) for name in (
        "vegas_spec.models.loader", "vegas_spec.executor", "torch"))
    if loader is not None and isinstance(err, loader.WeightError) or \
            executor is not None and isinstance(err, executor.ExecutorError):
        return str(err)
    if torch is not None and isinstance(err, torch.cuda.OutOfMemoryError):
        return (f"out of GPU memory ({str(err).splitlines()[0]}); lower --kv-cache-gb, the "
                "batch, --max-tokens or --max-model-len")
    return None


def _run_command(args: argparse.Namespace, argv: list[str]) -> int:
    """The command, on rank 0 of --tensor-parallel ranks (their workers started here, or
    torchrun's); a torchrun rank other than 0 makes rank 0's model calls instead."""
    from vegas_spec.executor import launch, under_torchrun

    tp = getattr(args, "tensor_parallel", 1)
    executor = launch(tp, args.device) if tp != 1 or under_torchrun() else None
    if executor is None and under_torchrun() and os.environ["RANK"] != "0":
        return 0  # a torchrun worker rank: its loop has ended
    try:
        code = _COMMANDS[args.command](args, argv)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    finally:
        if executor is not None:
            executor.shutdown()


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    from vegas_spec.bench.commands import bench

    return bench(args, _engine_kwargs(args), _spec(args, "vegas"), argv)


def _tune(args: argparse.Namespace, argv: list[str]) -> int:
    from vegas_spec.bench.commands import tune_command

    return tune_command(args, _engine_kwargs(args), _spec(args, "vegas"), argv)


_COMMANDS = {"generate": lambda args, argv: generate(args),
             "compare": lambda args, argv: compare(args),
             "serve": lambda args, argv: serve(args), "bench": _bench, "tune": _tune}


def _fail(message: str) -> int:
    print(f"vegas: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def console() -> None:
    """The `vegas` command: main's exit code. After Ctrl-C the process ends at once
    (`os._exit`, output flushed), so that nothing left in interpreter shutdown (threads or
    exit hooks of the libraries that were interrupted) can turn status 130 into a death by
    the signal."""
    _hold_standard_fds()
    code = main()
    if code == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _hold_standard_fds() -> None:
    """Put /dev/null on a standard descriptor that was closed (`vegas ... >&-`), so that no
    file the command opens takes its number, where a library's writes to it would land.
    Python has already made the stream None, which main reports."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one


if __name__ == "__main__":
    console()
