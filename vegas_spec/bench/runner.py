"""Cells (workload, context, batch, method, γ, ratio) run one after another on one engine, and
`results.json`, rewritten after every cell so that `--resume` skips what is already there.

A cell runs its batch of prompts once to warm up (kernels compile; on CUDA the batch's graphs
are captured), then `repeats` times timed: the row keeps the run of median decode throughput,
and every run's throughput and request time, whose spread says how far a speedup can be
trusted. vanilla runs first in each group (workload, context, batch),
so that every speedup and every identity check is against plain decoding of the same
prompts in the same engine."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vegas_spec.bench import analysis
from vegas_spec.bench.workloads import Prompt, found
from vegas_spec.config import ConfigError, SamplingParams, SpecConfig

RESULTS = "results.json"
# Run statistics a cell keeps (the engine's summary, minus what is per sequence).
KEPT_STATS = ("decode_tokens_per_s", "decode_s", "prefill_s", "ttft_s", "total_s",
              "generated_tokens", "prompt_tokens", "tokens_per_iteration",
              "tokens_per_iteration_histogram", "acceptance_rate_per_position", "budget_mean",
              "iterations", "phase_s", "draft_length_histogram", "plain_steps",
              "speculative_share")
# Figures kept for every timed run of a cell: their spread bounds its speedups.
RUN_STATS = ("decode_tokens_per_s", "total_s")


@dataclass(frozen=True)
class Cell:
    workload: str
    context: int | None  # prompt tokens; None: the workload's own prompt lengths
    batch: int
    method: str
    gamma: int
    ratio: float
    max_tokens: int

    @property
    def group(self) -> str:
        """Cells of one group decode the same prompts; vanilla's is their baseline."""
        return f"{self.workload}|{self.context or '-'}|{self.batch}"

    @property
    def key(self) -> str:
        if self.method == "vanilla":
            return f"{self.group}|vanilla"
        return f"{self.group}|{self.method}|g{self.gamma}|r{self.ratio:g}"

    @property
    def label(self) -> str:
        ctx = "" if self.context is None else f" {self.context} tok"
        spec = "" if self.method == "vanilla" else f" γ{self.gamma} r{self.ratio:g}"
        return f"{self.workload}{ctx} ×{self.batch} {self.method}{spec}"

    def work(self) -> float:
        """A rough cost for the progress bar's time left: decode steps of the batch, each
        dearer with a longer context."""
        return self.batch * self.max_tokens * (1.0 + (self.context or 0) / 4096)

    def baseline(self) -> Cell:
        return dataclasses.replace(self, method="vanilla")


@dataclass(frozen=True)
class RunSettings:
    spec: SpecConfig  # every setting but method, γ and ratio, which each cell sets
    temperature: float = 0.0
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    top_p: float = 1.0  # 1: no nucleus filter
    top_k: int = 0  # 0: no top-k filter
    repeats: int = 1  # timed runs of each cell

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Store:
    """The rows of `DIR/results.json` by cell key; `setting` must match on --resume."""

    def __init__(self, folder: Path, meta: dict[str, Any], resume: bool) -> None:
        self.path, self.meta, self.rows = folder / RESULTS, meta, {}
        if resume and self.path.exists():
            old = _load(self.path)
            if old.get("meta", {}).get("setting") != meta["setting"]:
                raise ConfigError(f"--resume: {self.path} was measured with other settings "
                                  f"({_difference(old.get('meta', {}).get('setting'), meta)});"
                                  " choose another --out or drop --resume")
            self.rows = {row["key"]: row for row in old.get("cells", [])}

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def get(self, key: str) -> dict[str, Any] | None:
        return self.rows.get(key)

    def add(self, row: dict[str, Any]) -> None:
        self.rows[row["key"]] = row
        self.save()

    def save(self) -> None:
        """Written to a temporary file, then renamed: a run cut short keeps a whole file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows = list(self.rows.values())
        data = {"meta": self.meta, "cells": rows,
                "summary": analysis.summary(rows, self.meta["setting"]["dtype"],
                                            self.meta["setting"].get("exact", False))}
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, self.path)


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"--resume: cannot read {path} ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise ConfigError(f"--resume: {path} is not a results file of vegas bench/tune")
    return data


def _difference(old: Any, meta: dict[str, Any]) -> str:
    if not isinstance(old, dict):
        return "no settings recorded"
    new = meta["setting"]
    diff = [f"{k} {old.get(k)!r} vs {new.get(k)!r}" for k in sorted(new) if old.get(k) != new[k]]
    return ", ".join(diff[:3]) or "unknown"


def ordered(cells: Iterable[Cell]) -> list[Cell]:
    """Each group's vanilla cell first, then the rest in the order given; duplicates once."""
    out: list[Cell] = []
    seen: set[str] = set()
    for cell in cells:
        for c in ((cell.baseline(), cell) if cell.method != "vanilla" else (cell,)):
            if c.key not in seen:
                seen.add(c.key)
                out.append(c)
    return out


def run_cells(cells: list[Cell], store: Store, settings: RunSettings,
              engine: Callable[[], Any], prompts: Callable[[Any, Cell], list[Prompt]],
              progress: bool = True, bar: Bar | None = None,
              step: str = "") -> list[dict[str, Any]]:
    """Run every cell that `store` does not hold yet (vanilla of each group first), saving
    after each; returns the rows of `cells` in order. `engine()` gives the LLM, loaded on
    the first cell that runs; `prompts(llm, cell)` the cell's prompts. bar: the progress bar
    of a longer run (vegas tune's steps), else one of these cells; step: what the cells are
    in that run."""
    todo = [c for c in ordered(cells) if c.key not in store]
    own = bar is None
    bar = bar or Bar(sum(c.work() for c in todo), progress)
    try:
        for cell in todo:
            bar.show(f"{step}: {cell.label}" if step else cell.label)
            llm = engine()
            store.add(run_cell(llm, cell, prompts(llm, cell), settings, store))
            bar.advance(cell.work())
    finally:
        if own:
            bar.close()
    return [store.rows[c.key] for c in cells]


class Bar:
    """A progress bar of cells (the cell, the share of the work done, the time left) on
    stderr, where it is a terminal: elsewhere (a log, CI) it would fill it with updates.
    tqdm is the `bench` extra: without it there is no bar."""

    def __init__(self, total: float, enabled: bool) -> None:
        shown = enabled and total > 0 and sys.stderr is not None and sys.stderr.isatty()
        self.tqdm = None
        if shown and importlib.util.find_spec("tqdm") is not None:
            from tqdm.auto import tqdm

            self.tqdm = tqdm(total=total, dynamic_ncols=True, file=sys.stderr,
                             bar_format="{desc} |{bar}| {percentage:3.0f}% [{elapsed} "
                                        "elapsed, {remaining} left]")

    def show(self, label: str) -> None:
        if self.tqdm is not None:
            self.tqdm.set_description_str(label)

    def advance(self, work: float) -> None:
        if self.tqdm is not None:
            self.tqdm.update(work)

    def finish(self) -> None:
        """The whole run is done (some cells it counted were measured already)."""
        if self.tqdm is not None:
            self.tqdm.update(self.tqdm.total - self.tqdm.n)

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()


def run_cell(llm: Any, cell: Cell, batch: list[Prompt], settings: RunSettings,
             store: Store) -> dict[str, Any]:
    spec = dataclasses.replace(settings.spec, method=cell.method, gamma=cell.gamma,
                               ratio=cell.ratio)
    ids = [p.ids for p in batch]
    params = SamplingParams(temperature=settings.temperature, top_p=settings.top_p,
                            top_k=settings.top_k, seed=settings.seed,
                            max_tokens=cell.max_tokens, ignore_eos=True)
    warm_up(llm, ids, params, spec)
    runs = [_timed(llm, ids, repeat_params(params, i), spec) for i in range(settings.repeats)]
    wall, outs = _median(runs)
    stats = outs[0].stats
    row: dict[str, Any] = {"key": cell.key, "group": cell.group,
                           **dataclasses.asdict(cell), "wall_s": wall,
                           **{k: stats[k] for k in KEPT_STATS if k in stats},
                           "repeats": len(runs),
                           **{f"{k}_runs": [o[0].stats[k] for _, o in runs] for k in RUN_STATS},
                           "per_prompt_tokens_per_iteration":
                               [o.stats["sequence"].get("tokens_per_iteration") for o in outs],
                           "prompt_lengths": [len(p.ids) for p in batch],
                           "token_ids": [o.token_ids for o in outs],
                           "texts": [o.text for o in outs]}
    if any(p.answer is not None for p in batch):
        row["needle"] = [{"depth": p.depth, "found": found(p, o.text)}
                         for p, o in zip(batch, outs)]
    base = store.get(cell.baseline().key)
    if cell.method != "vanilla" and settings.greedy and base is not None:
        row["partings"] = partings(llm, batch, base["token_ids"], row["token_ids"])
    return row


def repeat_params(params: SamplingParams, repeat: int) -> SamplingParams:
    """The sampling of a cell's `repeat`-th timed run (0-based): greedy runs repeat the same
    text; sampled run i draws with seed + i, the same seeds for every method, so a cell's
    repeats span as many sampled texts (and slowest rows) as runs instead of timing one text
    again (an unseeded run draws afresh anyway)."""
    if params.temperature == 0.0 or repeat == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + repeat)


def warm_up(llm: Any, prompts: list[Any], params: SamplingParams, spec: SpecConfig,
            chat: bool = False) -> None:
    """Before a timed run: on CUDA the whole batch, long enough for two speculative rounds,
    so that the timed run replays graphs captured here; on CPU one short prompt (kernels and
    caches warm). It samples as the timed run does: greedy and sampled rounds are captured
    apart."""
    cuda = llm.device.type == "cuda"
    tokens = min(params.max_tokens, 2 * spec.gamma + 3) if cuda else 2
    llm.generate(prompts if cuda else prompts[:1], dataclasses.replace(params, max_tokens=tokens),
                 chat=chat, speculative=spec)


def _timed(llm: Any, ids: list[list[int]], params: SamplingParams,
           spec: SpecConfig) -> tuple[float, list[Any]]:
    started = time.perf_counter()
    outs = llm.generate(ids, params, speculative=spec)
    return time.perf_counter() - started, outs


def _median(runs: list[tuple[float, list[Any]]]) -> tuple[float, list[Any]]:
    """The run of median decode throughput (of the slower middle one for an even count;
    by request time where a run decoded too few tokens to time)."""
    def key(run: tuple[float, list[Any]]) -> float:
        stats = run[1][0].stats
        speed = stats["decode_tokens_per_s"]
        return speed if speed is not None else -stats["total_s"]

    return sorted(runs, key=key)[(len(runs) - 1) // 2]


def partings(llm: Any, batch: list[Prompt], base: list[list[int]],
             other: list[list[int]]) -> list[dict[str, Any]]:
    """Where each output first parts from vanilla's, with the plain run's top-2 logit margin
    at that position (a near-tie explains a parting under bf16 rounding; a wide margin is a
    bug)."""
    return parting_margins(llm, [p.ids for p in batch], base, other)


def parting_margins(llm: Any, prompts: list[list[int]], base: list[list[int]],
                    other: list[list[int]]) -> list[dict[str, Any]]:
    """`partings` of prompts given as token ids: [{prompt, position, margin}] for every
    output of `other` that is not its `base` output."""
    out = []
    for i, (ids, a, b) in enumerate(zip(prompts, base, other)):
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None and len(a) != len(b):
            at = min(len(a), len(b))
        if at is not None:
            out.append({"prompt": i, "position": at, "margin": margin(llm, ids + a[:at])})
    return out


def margin(llm: Any, ids: list[int]) -> float:
    """Top-2 logit margin of the token after `ids` (plain prefill)."""
    top = llm.logits(ids)[-1].float().topk(2).values
    return float(top[0] - top[1])
