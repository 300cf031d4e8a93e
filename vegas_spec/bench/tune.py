"""The paper's three tuning steps as code: sweep the ratio until tokens per iteration stop
improving, sweep γ for throughput at that ratio, then fine-tune the ratio around the best γ.
The recommendation is the fastest cell of all that was measured (the reference setting, e.g.
γ 6 / ratio 0.05, included), so it is never slower than the reference on the same run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from vegas_spec.bench.runner import Cell

Run = Callable[[list[Cell]], list[dict[str, Any]]]  # cells in, their rows out (in order)


def plateau(points: list[tuple[float, float]], tolerance: float) -> float:
    """The smallest ratio whose tokens per iteration reach (1 - tolerance) of the best."""
    best = max(tpi for _, tpi in points)
    return min(ratio for ratio, tpi in points if tpi >= (1.0 - tolerance) * best)


def fine_ratios(ratio: float, factors: list[float]) -> list[float]:
    """Ratios around `ratio` (rounded to 4 decimals, kept in (0, 1]), itself included."""
    out = {ratio}
    for f in factors:
        r = round(ratio * f, 4)
        if 0 < r <= 1:
            out.add(r)
    return sorted(out)


def best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of the highest decode throughput."""
    timed = [r for r in rows if r.get("decode_tokens_per_s")]
    if not timed:
        raise ValueError("no cell of the sweep has a decode throughput (too few new tokens?)")
    return max(timed, key=lambda r: r["decode_tokens_per_s"])


@dataclasses.dataclass
class TuneResult:
    reference: dict[str, Any]
    ratio_sweep: list[dict[str, Any]]
    plateau_ratio: float
    gamma_sweep: list[dict[str, Any]]
    best_gamma: int
    fine_sweep: list[dict[str, Any]]
    recommended: dict[str, Any]
    vanilla: dict[str, Any]


def three_steps(base: Cell, ratios: list[float], gammas: list[int], factors: list[float],
                tolerance: float, run: Run) -> TuneResult:
    """`base` is the reference cell (its γ and ratio); every step runs through `run`, which
    skips cells already measured, so a cell shared by two steps runs once."""
    vanilla = run([base.baseline()])[0]
    reference = run([base])[0]
    step1 = run([dataclasses.replace(base, ratio=r) for r in ratios])
    tpi = [(r["ratio"], r.get("tokens_per_iteration") or 0.0) for r in step1]
    ratio = plateau(tpi, tolerance)
    step2 = run([dataclasses.replace(base, gamma=g, ratio=ratio) for g in gammas])
    gamma = best(step2)["gamma"]
    step3 = run([dataclasses.replace(base, gamma=gamma, ratio=r)
                 for r in fine_ratios(ratio, factors)])
    recommended = best([reference, *step1, *step2, *step3])
    return TuneResult(reference, step1, ratio, step2, gamma, step3, recommended, vanilla)
