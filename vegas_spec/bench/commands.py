"""`vegas bench` and `vegas tune`: their options, the checks before a model loads, and the
flow from a plan of cells to results.json, report.md and the plots."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from vegas_spec.bench import analysis, options, plots, report, tune, workloads
from vegas_spec.bench.runner import Bar, Cell, RunSettings, Store, run_cells
from vegas_spec.bench.workloads import PROMPT_ROOM
from vegas_spec.config import DTYPES, ConfigError, SamplingParams, SpecConfig

DEFAULT_METHODS = "vanilla,vegas,stream,quest,lastq,specextend"
# `max`: each sequence as long as the context allows after its batch's longest prompt.
GENERATION_TOKENS = "max"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# What each call of vegas tune's steps runs, as its progress bar names it.
TUNE_STEPS = ("vanilla", "reference", "step 1/3 (ratio)", "step 2/3 (γ)", "step 3/3 (ratio)")


def add_shared(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="essays",
                   help="essays (long-document questions and summaries), code (the same "
                        "over Python's standard-library source), "
                        "needle (needle-in-a-haystack retrieval at --depths), generation "
                        "(a long output from a short prompt), prompts (your own, --prompts); "
                        "bench takes a comma-separated list, tune one")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help='JSONL file of your prompts, one a line: "text" or {"prompt": "text"}')
    p.add_argument("--depths", default="0.1,0.5,0.9",
                   help="needle: depths (share of the prompt before the needle), cycled over "
                        "the prompts of a batch")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="new tokens per prompt (every sequence decodes all of them)")
    p.add_argument("--generation-tokens", default=GENERATION_TOKENS,
                   help="new tokens per prompt of the generation workload: an integer, or max "
                        "(the context, --max-model-len or the model's, minus the batch's "
                        "longest prompt)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="output directory (created when missing)")
    p.add_argument("--resume", action="store_true",
                   help="keep the cells of an existing DIR/results.json and run only the rest")
    p.add_argument("--repeats", type=int,
                   help="timed runs of each cell (sampled run i draws with seed + i); a "
                        "cell reports its median run, and a speedup the range its runs allow, "
                        "marked ~ (noise) where that range holds 1.0 "
                        "(default: 3 on cuda, 1 on cpu, where a run takes long)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it shows only where stderr is a terminal)")


def add_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated methods; vanilla always runs (speedups are over it)")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--context", default="2k",
                   help="comma-separated prompt lengths in tokens of the essays and needle "
                        "workloads: 7500, 2k (2,000), 7.5k")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy, outputs compared token for token with vanilla's")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the likeliest tokens whose probabilities add up to p "
                        "(1: no limit; reference setting: --temperature 0.6 --top-p 0.95 "
                        "--top-k 20)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k likeliest tokens only (0: no limit)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    add_shared(p)


def add_tune(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="vegas", help="the speculative method to tune")
    p.add_argument("--batch", default="1", help="the batch size to tune for")
    p.add_argument("--context", default="2k", help="the prompt length to tune for: 7500, 7.5k")
    p.add_argument("--ratios", default="0.01,0.02,0.03,0.05,0.07,0.1,0.15",
                   help="step 1: ratios swept at --gamma for tokens per iteration")
    p.add_argument("--gammas", default="2,3,4,5,6,7,8,10",
                   help="step 2: γ values swept for throughput at the plateau's ratio")
    p.add_argument("--fine", default="0.6,0.8,1.25,1.5",
                   help="step 3: factors of that ratio tried at the best γ")
    p.add_argument("--plateau", type=float, default=0.03,
                   help="step 1: the plateau starts where tokens per iteration reach (1 - "
                        "this) of the best")
    add_shared(p)


# --- checks and plan --------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
    cells: list[Cell]
    depths: list[float]
    texts: list[str]  # the --prompts file's prompts
    settings: RunSettings
    meta: dict[str, Any]
    kv_cache_bytes: int | None
    own_tokenizer: bool  # False: the model has none (dummy timing): the embedded default's
    # The prompts' tokenizer, loaded with the plan when the generation workload counts its
    # prompts' tokens (for --generation-tokens), else by the first cell that builds prompts.
    tokenizer: Any | None = None


def _one(option: str, text: str, parse: Any) -> Any:
    values = options.split_list(option, text, parse)
    if len(values) != 1:
        raise ConfigError(f"{option} takes one value in vegas tune, got {text!r}")
    return values[0]


def _counts(args: argparse.Namespace) -> None:
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.repeats is not None and args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")


def repeats(args: argparse.Namespace) -> int:
    """--repeats, by default 3 on CUDA (a spread to judge a speedup by) and 1 on a CPU."""
    return args.repeats or (3 if args.device == "cuda" else 1)


def sampling(args: argparse.Namespace) -> SamplingParams:
    """The sampling options checked by SamplingParams itself (one set of rules for the
    engine and the command), its message naming the option. vegas tune has none: greedy."""
    try:
        return SamplingParams(temperature=getattr(args, "temperature", 0.0),
                              top_p=getattr(args, "top_p", 1.0), top_k=getattr(args, "top_k", 0),
                              seed=getattr(args, "seed", 0))
    except ConfigError as err:
        # "top_p must be ..." -> "--top-p must be ..."
        raise ConfigError(re.sub(r"^(\w+)", lambda m: "--" + m.group(1).replace("_", "-"),
                                 str(err))) from None


def _prompt_tokenizer(model: str | None, own: bool, vocab: int) -> Any:
    """The tokenizer the prompts are built with: the model's, or for a model without one
    (random weights for timing) the embedded default's, whose ids must fit its vocabulary."""
    from vegas_spec.models.loader import resolve
    from vegas_spec.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve(model if own else None))
    if not own and len(tok) > vocab:
        raise ConfigError(f"the model has no tokenizer and its vocabulary ({vocab}) is "
                          f"smaller than the default tokenizer's ({len(tok)}); add a "
                          "tokenizer to the model folder")
    return tok


def generation_lengths(tokenizer: Any, batches: list[int], requested: int | None,
                       max_len: int, where: str) -> dict[int, int]:
    """New tokens per batch size of the generation workload: what was asked (checked to
    fit), or with `max` (None) the context less the batch's longest templated prompt."""
    return {b: options.fit_generation(
        requested, max(len(p.ids) for p in workloads.generation_prompts(tokenizer, b)),
        max_len, where) for b in batches}


def _own_tokenizer(args: argparse.Namespace) -> bool:
    """Whether the model brings a tokenizer. A config folder without one (random weights for
    timing) gets its prompts from the embedded default's tokenizer."""
    from vegas_spec.models.loader import resolve

    source = resolve(args.model)
    if source.is_gguf or any((source.path / n).exists() for n in TOKENIZER_FILES):
        return True
    if args.load_format != "dummy":
        raise ConfigError(f"{source.path} has no tokenizer files; the workloads' prompts are "
                          "built with the model's tokenizer")
    return False


def _model_len(args: argparse.Namespace) -> tuple[Any, int, str]:
    """The model's config (read without loading weights) and the usable context."""
    from vegas_spec.models.loader import load_config, resolve

    cfg = load_config(resolve(args.model))
    if args.max_model_len is not None:
        if args.max_model_len > cfg.max_position_embeddings:
            raise ConfigError(f"--max-model-len {args.max_model_len} exceeds the model's "
                              f"{cfg.max_position_embeddings} positions")
        return cfg, args.max_model_len, "--max-model-len"
    return cfg, cfg.max_position_embeddings, "the model's context"


def plan(args: argparse.Namespace, spec: SpecConfig, argv: list[str], kind: str) -> Plan:
    """Every check of the command's values, the model's context included, before loading."""
    _counts(args)
    names = options.workloads(args.workload, args.prompts)
    if kind == "tune" and len(names) != 1:
        raise ConfigError(f"--workload takes one workload in vegas tune, got {args.workload!r}")
    depths = options.split_list("--depths", args.depths, options.fraction("--depths", False))
    texts = workloads.read_prompt_file(args.prompts) if args.prompts else []
    if options.sized(names):
        workloads.essays_folder()  # the essays are installed
    out = options.out_dir(args.out)
    sample = sampling(args)
    requested = options.generation_tokens(args.generation_tokens)
    if kind == "bench":
        methods = options.methods(args.methods)
        batches = options.split_list("--batch", args.batch, options.positive_int("--batch"))
        contexts = options.split_list("--context", args.context, options.context)
    else:
        _tune_method(args.method)
        batches = [_one("--batch", args.batch, options.positive_int("--batch"))]
        contexts = [_one("--context", args.context, options.context)] \
            if names[0] in workloads.SIZED else []
    cfg, max_len, where = _model_len(args)
    own = _own_tokenizer(args)
    if options.sized(names):
        options.check_lengths(contexts, args.max_tokens, max_len, where)
    tokenizer, generation = None, {}
    if "generation" in names:  # its lengths come from its templated prompts
        tokenizer = _prompt_tokenizer(args.model, own, cfg.vocab_size)
        generation = generation_lengths(tokenizer, batches, requested, max_len, where)
    if kind == "bench":
        cells = bench_cells(names, contexts, batches, methods, spec, args.max_tokens,
                            generation)
    else:
        cells = [tune_base(args, spec, names[0], contexts, batches[0], generation)]
    settings = RunSettings(spec, sample.temperature, sample.seed or 0, args.dtype,
                           args.device, top_p=sample.top_p, top_k=sample.top_k,
                           repeats=repeats(args))
    meta = {"command": "vegas " + shlex.join(argv), "date": time.strftime("%Y-%m-%d %H:%M"),
            "kind": kind, "device_name": _device_name(args.device), "torch": _torch_version(),
            "repeats": settings.repeats,
            "setting": {"model": str(args.model or "embedded SmolLM2-135M-Instruct"),
                        "dtype": args.dtype, "device": args.device, "backend": args.backend,
                        "load_format": args.load_format, "eager": args.eager,
                        "exact": getattr(args, "exact", False),
                        "draft_weights": getattr(args, "draft_weights", "auto"),
                        "narrowest_span": engine_span(args),
                        "temperature": settings.temperature, "top_p": settings.top_p,
                        "top_k": settings.top_k, "seed": settings.seed,
                        "tokenizer": "the model's" if own else "the embedded default's",
                        "spec": {k: v for k, v in spec.as_dict().items()
                                 if k not in ("method", "gamma", "ratio")}}}
    kv = None if args.kv_cache_gb is not None else kv_bytes(cfg, cells, texts, args.dtype,
                                                            max_len)
    del out
    return Plan(cells, depths, texts, settings, meta, kv, own, tokenizer)


def engine_span(args: argparse.Namespace) -> int:
    """The engine's narrowest key width of the decode graphs (`EngineConfig.narrowest_span`)."""
    from vegas_spec.config import EngineConfig

    given = getattr(args, "narrowest_span", None)
    return EngineConfig.narrowest_span if given is None else given


def _device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
        f"{torch.get_num_threads()} threads)"


def _torch_version() -> str:
    import torch

    return torch.__version__


def bench_cells(names: list[str], contexts: list[int], batches: list[int], methods: list[str],
                spec: SpecConfig, max_tokens: int, generation: dict[int, int]) -> list[Cell]:
    """Every (workload, context, batch, method) cell; `generation`: the generation
    workload's new tokens per batch size, the others decode `max_tokens`."""
    cells = []
    for name in names:
        sized = name in workloads.SIZED
        for ctx in (contexts if sized else [None]):
            for batch in batches:
                tokens = generation[batch] if name == "generation" else max_tokens
                cells += [Cell(name, ctx, batch, m, spec.gamma, spec.ratio, tokens)
                          for m in methods]
    return cells


def _tune_method(method: str) -> None:
    if method not in options.METHODS or method == "vanilla":
        speculative = ", ".join(m for m in options.METHODS if m != "vanilla")
        raise ConfigError(f"--method must be a speculative method ({speculative}), got "
                          f"{method!r}")


def tune_base(args: argparse.Namespace, spec: SpecConfig, name: str, contexts: list[int],
              batch: int, generation: dict[int, int]) -> Cell:
    """The reference cell tune's steps vary: --method at --gamma and --ratio."""
    tokens = generation[batch] if name == "generation" else args.max_tokens
    return Cell(name, contexts[0] if contexts else None, batch, args.method, spec.gamma,
                spec.ratio, tokens)


def kv_bytes(cfg: Any, cells: list[Cell], texts: list[str], dtype: str, max_len: int) -> int:
    """A KV pool just large enough for the largest cell (pages of 16, the drafts past the
    last kept token, a scratch page), so that a CPU run does not reserve more than it uses.
    A sequence stops at the context (`max_len`), whatever its prompt's bound says."""
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * DTYPES[dtype].itemsize
    own = max([len(t.encode("utf-8")) + 16 for t in texts] + [PROMPT_ROOM])
    tokens = 0
    for c in cells:
        extra = 2 * max(c.gamma, 10) + 2  # tune's γ sweep, and each verify's γ+1 rows
        kept = min((c.context or own) + c.max_tokens, max_len)
        per_seq = math.ceil((kept + extra) / 16) * 16
        tokens = max(tokens, c.batch * per_seq)
    return int(per_token * (tokens + 64) * 1.05) + (1 << 20)


# --- running ----------------------------------------------------------------------------

class Engine:
    """The LLM, loaded on first use (a --resume with nothing left to run loads nothing)."""

    def __init__(self, model: str | None, kwargs: dict[str, Any]) -> None:
        self.model, self.kwargs, self.llm = model, kwargs, None

    def __call__(self) -> Any:
        if self.llm is None:
            from vegas_spec.engine import LLM

            self.llm = LLM(self.model, **self.kwargs)
        return self.llm


class Prompts:
    """Each group's prompts, built once (all cells of a group decode the same ones)."""

    def __init__(self, plan: Plan) -> None:
        self.plan, self.cache = plan, {}

    def __call__(self, llm: Any, cell: Cell) -> list[workloads.Prompt]:
        if cell.group not in self.cache:
            self.cache[cell.group] = workloads.build(cell.workload, self.tokenizer(llm),
                                                     cell.context, cell.batch,
                                                     self.plan.depths, self.plan.texts)
        return self.cache[cell.group]

    def tokenizer(self, llm: Any) -> Any:
        """The plan's (the generation workload's lengths were counted with it), else the
        model's, else the embedded default's."""
        if self.plan.tokenizer is None:
            self.plan.tokenizer = llm.tokenizer if self.plan.own_tokenizer else \
                _prompt_tokenizer(None, False, llm.model_config.vocab_size)
        return self.plan.tokenizer


def _engine(args: argparse.Namespace, kwargs: dict[str, Any], p: Plan) -> Engine:
    kwargs = dict(kwargs)
    if p.kv_cache_bytes is not None:
        kwargs["kv_cache_bytes"] = p.kv_cache_bytes
    return Engine(args.model, kwargs)


def bench(args: argparse.Namespace, engine_kwargs: dict[str, Any], spec: SpecConfig,
          argv: list[str]) -> int:
    """Exit code 0, or 1 when a greedy output differs from vanilla's beyond a near-tie."""
    p = plan(args, spec, argv, "bench")
    store = Store(args.out, p.meta, args.resume)
    rows = run_cells(p.cells, store, p.settings, _engine(args, engine_kwargs, p), Prompts(p),
                     progress=not args.no_progress)
    rows = list({r["key"]: r for r in rows}.values())
    lines = analysis.summary(rows, args.dtype, getattr(args, "exact", False))
    made = plots.bench_plots(lines, rows, args.out) if _plots() else []
    (args.out / "report.md").write_text(report.bench_report(p.meta, lines, made),
                                        encoding="utf-8")
    verdicts = analysis.method_verdicts(lines)
    for method, v in verdicts.items():
        if method != "vanilla":
            print(f"{method:<11} {v['verdict']:<10} identical {v['identical']}/{v['prompts']}")
    print(f"wrote {args.out / 'results.json'}, {args.out / 'report.md'} and "
          f"{len(made)} plots")
    return 1 if any(v["verdict"] == "DIFFERS" for v in verdicts.values()) else 0


def tune_command(args: argparse.Namespace, engine_kwargs: dict[str, Any], spec: SpecConfig,
                 argv: list[str]) -> int:
    from vegas_spec.config_file import write_config

    ratios = options.split_list("--ratios", args.ratios, options.fraction("--ratios"))
    gammas = options.split_list("--gammas", args.gammas, _gamma)
    factors = options.split_list("--fine", args.fine, _factor)
    if not 0 <= args.plateau < 1:
        raise ConfigError(f"--plateau must lie in [0, 1), got {args.plateau}")
    p = plan(args, spec, argv, "tune")
    store = Store(args.out, p.meta, args.resume)
    engine, prompts = _engine(args, engine_kwargs, p), Prompts(p)
    # one bar over the steps, as vegas bench's over its cells (each cell costs the same)
    cells = 2 + len(ratios) + len(gammas) + len(factors) + 1
    bar, steps = Bar(cells * p.cells[0].work(), not args.no_progress), iter(TUNE_STEPS)

    def run(cells: list[Cell]) -> list[dict[str, Any]]:
        return run_cells(cells, store, p.settings, engine, prompts, bar=bar, step=next(steps))

    try:
        result = tune.three_steps(p.cells[0], ratios, gammas, factors, args.plateau, run)
        bar.finish()
    finally:
        bar.close()
    rec = result.recommended
    chosen = dataclasses.replace(spec, method=rec["method"], gamma=rec["gamma"],
                                 ratio=rec["ratio"])
    base = result.vanilla["decode_tokens_per_s"]
    measured = {"model": p.meta["setting"]["model"], "device": args.device, "dtype": args.dtype,
                "workload": rec["workload"], "context": rec["context"], "batch": rec["batch"],
                "max_tokens": rec["max_tokens"], "decode_tokens_per_s":
                    rec["decode_tokens_per_s"], "vanilla_tokens_per_s": base,
                "reference": {"gamma": result.reference["gamma"],
                              "ratio": result.reference["ratio"], "decode_tokens_per_s":
                                  result.reference["decode_tokens_per_s"]},
                "date": p.meta["date"], "command": p.meta["command"]}
    write_config(args.out / "config.json", chosen, measured)
    made = tune_plots(result, args.out) if _plots() else []
    (args.out / "tune.md").write_text(tune_report(p.meta, result, made, args.dtype),
                                      encoding="utf-8")
    print(recommendation_line(result, args.out / "config.json"))
    return 0


def _gamma(item: str) -> int:
    from vegas_spec.config import MAX_GAMMA

    value = options.positive_int("--gammas")(item)
    if value > MAX_GAMMA:
        raise ConfigError(f"--gammas values must be at most {MAX_GAMMA}, got {value}")
    return value


def _factor(item: str) -> float:
    try:
        value = float(item)
    except ValueError:
        raise ConfigError(f"--fine values must be positive numbers, got {item!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"--fine values must be positive numbers, got {item!r}")
    return value


def _speed(row: dict[str, Any], base: float | None) -> str:
    speed = row.get("decode_tokens_per_s")
    if speed is None:
        return "-"
    return f"{speed:.1f} tok/s" + (f" ({speed / base:.2f}x vanilla)" if base else "")


def _plots() -> bool:
    """Whether figures can be drawn; if not, says so once on stderr."""
    if plots.available():
        return True
    print(plots.MISSING, file=sys.stderr)
    return False


def recommendation_line(result: tune.TuneResult, path: Path) -> str:
    rec, ref, base = result.recommended, result.reference, \
        result.vanilla.get("decode_tokens_per_s")
    return (f"recommended: --method {rec['method']} --gamma {rec['gamma']} --ratio "
            f"{rec['ratio']:g}: {_speed(rec, base)}; reference γ {ref['gamma']} ratio "
            f"{ref['ratio']:g}: {_speed(ref, base)}. Saved to {path}: use it with "
            f"--config {path}")


def tune_plots(result: tune.TuneResult, folder: Path) -> list[str]:
    tpi = [(r["ratio"], r.get("tokens_per_iteration") or 0.0) for r in result.ratio_sweep]
    speed = lambda rows, key: [(r[key], r.get("decode_tokens_per_s") or 0.0) for r in rows]
    return [
        plots.sweep(tpi, folder, "tune_ratio.png", "ratio", "tokens per iteration",
                    f"1. ratio at γ {result.reference['gamma']}", result.plateau_ratio),
        plots.sweep(speed(result.gamma_sweep, "gamma"), folder, "tune_gamma.png", "γ",
                    "decode tokens/s", f"2. γ at ratio {result.plateau_ratio:g}",
                    result.best_gamma),
        plots.sweep(speed(result.fine_sweep, "ratio"), folder, "tune_fine.png", "ratio",
                    "decode tokens/s", f"3. ratio at γ {result.best_gamma}",
                    result.recommended["ratio"]
                    if result.recommended["gamma"] == result.best_gamma else None)]


def tune_report(meta: dict[str, Any], result: tune.TuneResult, made: list[str],
                dtype: str) -> str:
    base = result.vanilla.get("decode_tokens_per_s")
    steps = [("1. ratio sweep at γ " + str(result.reference["gamma"]) + ", plateau at ratio "
              f"{result.plateau_ratio:g}", result.ratio_sweep),
             (f"2. γ sweep at ratio {result.plateau_ratio:g}, best γ {result.best_gamma}",
              result.gamma_sweep),
             (f"3. ratio around {result.plateau_ratio:g} at γ {result.best_gamma}",
              result.fine_sweep)]
    lines = [*report.header(meta, "vegas tune"), "## Recommendation", "",
             recommendation_line(result, Path("config.json")), "",
             f"vanilla: {_speed(result.vanilla, None)}.", ""]
    for title, rows in steps:
        lines += [f"## {title}", "", "| γ | ratio | tokens/iter | decode tok/s | speedup | "
                  "= vanilla |", "|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            loss = analysis.lossless(r, result.vanilla, dtype)
            speed = r.get("decode_tokens_per_s")
            lines.append(f"| {r['gamma']} | {r['ratio']:g} | "
                         f"{report._f(r.get('tokens_per_iteration'))} | "
                         f"{report._f(speed, 1)} | "
                         f"{report._f(speed / base if speed and base else None, 2, 'x')} | "
                         f"{loss['verdict']} |")
        lines.append("")
    lines += ["## Plots", ""] + [f"![{m[:-4]}]({m})" for m in made] + [""]
    return "\n".join(lines)
