"""Command-line values of `vegas bench` and `vegas tune` turned into checked lists, and every
check that can run before a model loads (each failure a ConfigError: one line, exit code 2)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from vegas_spec.bench.workloads import MIN_CONTEXT, SIZED, WORKLOADS
from vegas_spec.config import METHODS, ConfigError

T = TypeVar("T")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kK]?)$")


def split_list(option: str, text: str, parse: Callable[[str], T]) -> list[T]:
    """`a,b,c` (spaces allowed) parsed item by item; an empty list or item is an error."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ConfigError(f"{option} needs a comma-separated list without empty items, "
                          f"got {text!r}")
    out = [parse(item) for item in items]
    if len(set(out)) != len(out):
        raise ConfigError(f"{option} lists a value twice: {text!r}")
    return out


def _one_of(option: str, what: str, allowed: tuple[str, ...] | list[str]):  # noqa: ANN202
    """A checker of one list item: a name among `allowed`, else a ConfigError naming it."""
    def one(name: str) -> str:
        if name not in allowed:
            raise ConfigError(f"{option}: unknown {what} {name!r}; choose from "
                              f"{', '.join(allowed)}")
        return name

    return one


def methods(text: str) -> list[str]:
    """The methods to run, vanilla first (added when missing: speedups are over it)."""
    listed = split_list("--methods", text, _one_of("--methods", "method", METHODS))
    return ["vanilla", *[m for m in listed if m != "vanilla"]]


def positive_int(option: str) -> Callable[[str], int]:
    def parse(item: str) -> int:
        if not re.fullmatch(r"\d+", item) or int(item) < 1:
            raise ConfigError(f"{option} values must be integers >= 1, got {item!r}")
        return int(item)
    return parse


def context(item: str) -> int:
    """A prompt length in tokens: `7500`, `2k` (2,000) or `7.5k` (7,500)."""
    match = _SIZE.match(item)
    if match is None:
        raise ConfigError(f"--context values are token counts like 7500, 2k or 7.5k, got "
                          f"{item!r}")
    value = float(match.group(1)) * (1000 if match.group(2) else 1)
    if value != int(value) or value < MIN_CONTEXT:
        raise ConfigError(f"--context values must be whole token counts >= {MIN_CONTEXT}, "
                          f"got {item!r}")
    return int(value)


def fraction(option: str, low_open: bool = True) -> Callable[[str], float]:
    def parse(item: str) -> float:
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(f"{option} values must be numbers, got {item!r}") from None
        if not math.isfinite(value) or not (0 < value <= 1 if low_open else 0 <= value <= 1):
            interval = "(0, 1]" if low_open else "[0, 1]"
            raise ConfigError(f"{option} values must lie in {interval}, got {item!r}")
        return value
    return parse


def workloads(text: str, prompts_file: Path | None) -> list[str]:
    chosen = split_list("--workload", text, _one_of("--workload", "workload", WORKLOADS))
    if "prompts" in chosen and prompts_file is None:
        raise ConfigError("--workload prompts needs --prompts FILE (JSONL)")
    if prompts_file is not None and "prompts" not in chosen:
        raise ConfigError("--prompts FILE is read by the prompts workload: add it to "
                          "--workload (e.g. --workload prompts)")
    return chosen


def out_dir(path: Path) -> Path:
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path} is a file; it must be a directory (it is created "
                          "when missing)")
    parent = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    if not parent.is_dir():
        raise ConfigError(f"--out {path}: {parent} is not a directory")
    return path


def check_lengths(contexts: list[int], new_tokens: int, max_len: int, where: str) -> None:
    """Every sized prompt and its new tokens fit the model's context."""
    for ctx in contexts:
        if ctx + new_tokens > max_len:
            need = ctx + new_tokens
            raise ConfigError(f"--context {ctx} with {new_tokens} new tokens needs {need} "
                              f"positions but {where} is {max_len}")


def generation_tokens(text: str) -> int | None:
    """`--generation-tokens`: an integer >= 1, or `max` (None): as many as the context
    leaves after the batch's longest prompt."""
    if text.strip().lower() == "max":
        return None
    if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
        raise ConfigError(f"--generation-tokens must be an integer >= 1 or max, got {text!r}")
    return int(text)


def fit_generation(requested: int | None, longest: int, max_len: int, where: str) -> int:
    """The generation workload's new tokens for a batch whose longest prompt has `longest`
    tokens: `requested`, refused when the context cannot hold it, or (None, `max`) all the
    context leaves."""
    room = max_len - longest
    if room < 1:
        raise ConfigError(f"the generation workload's longest prompt has {longest} tokens: "
                          f"nothing is left to generate in {where} of {max_len}")
    if requested is None:
        return room
    if requested > room:
        raise ConfigError(f"--generation-tokens {requested} does not fit {where} of {max_len} "
                          f"after the longest prompt of {longest} tokens (at most {room}, or "
                          "max)")
    return requested


def sized(names: list[str]) -> bool:
    return any(w in SIZED for w in names)
