"""PNG figures of a bench or tune run (matplotlib, no display needed). Each function takes the
summary lines (`analysis.summary`) or the cells and writes one file, returning its name, or
None when the run has nothing to show in it. matplotlib is the `bench` extra
(`pip install 'vegas-spec[bench]'`); without it a run writes its results and report, no
figures (`available`)."""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from pathlib import Path
from typing import Any

COLORS = {"vanilla": "#777777", "vegas": "#d62728", "stream": "#1f77b4", "quest": "#2ca02c",
          "lastq": "#ff7f0e", "specextend": "#9467bd", "full": "#8c564b"}
SPLIT_COLORS = {"decode": "#777777", "draft": "#1f77b4", "verify": "#ff7f0e",
                "round": "#9467bd", "selection": "#d62728", "acceptance": "#2ca02c",
                "other": "#cccccc"}


MISSING = "no plots: matplotlib is not installed (pip install 'vegas-spec[bench]')"


def available() -> bool:
    """Whether matplotlib can be imported (the `bench` extra)."""
    return importlib.util.find_spec("matplotlib") is not None


def _plt():  # noqa: ANN202 - matplotlib.pyplot
    import matplotlib

    matplotlib.use("Agg")  # files only, whatever the display
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, folder: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(folder / name, dpi=110)
    _plt().close(fig)
    return name


def _ctx(context: int | None) -> str:
    return "own length" if context is None else f"{context} tok"


def throughput(lines: list[dict[str, Any]], folder: Path) -> str | None:
    """Decode tokens/s per method and batch, one panel per (workload, context)."""
    panels: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        if line["decode_tokens_per_s"]:
            panels[(line["workload"], _ctx(line["context"]))].append(line)
    if not panels:
        return None
    plt = _plt()
    cols = min(3, len(panels))
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 4 * rows_n), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, ((workload, ctx), rows) in zip(axes.flat, panels.items()):
        batches = sorted({r["batch"] for r in rows})
        methods = list(dict.fromkeys(r["method"] for r in rows))
        width = 0.8 / len(methods)
        for j, method in enumerate(methods):
            speed = {r["batch"]: r["decode_tokens_per_s"] for r in rows if r["method"] == method}
            xs = [i + j * width for i, b in enumerate(batches) if b in speed]
            ax.bar(xs, [speed[b] for b in batches if b in speed], width, label=method,
                   color=COLORS.get(method))
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))],
                      [str(b) for b in batches])
        ax.set(title=f"{workload}, {ctx}", xlabel="batch", ylabel="decode tokens/s")
        ax.legend(fontsize=7)
    return _save(fig, folder, "throughput.png")


def speedup_vs_context(lines: list[dict[str, Any]], folder: Path) -> str | None:
    """Speedup over vanilla against context length, a line per method, a panel per batch."""
    rows = [r for r in lines if r["context"] is not None and r["speedup"] is not None]
    if not rows:
        return None
    plt = _plt()
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        series: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in rows:
            if r["batch"] == batch:
                series[r["method"]][r["context"]].append(r["speedup"])
        for method, points in series.items():
            xs = sorted(points)  # mean over workloads at one context
            ax.plot(xs, [sum(points[x]) / len(points[x]) for x in xs], marker="o",
                    label=method, color=COLORS.get(method))
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set(title=f"batch {batch}", xlabel="context (tokens)", ylabel="speedup over vanilla")
        ax.legend(fontsize=7)
    return _save(fig, folder, "speedup_vs_context.png")


def tokens_per_iteration(lines: list[dict[str, Any]], folder: Path) -> str | None:
    """Mean tokens per iteration per method (over every cell of the method)."""
    per: dict[str, list[float]] = defaultdict(list)
    for r in lines:
        if r["tokens_per_iteration"] is not None:
            per[r["method"]].append(r["tokens_per_iteration"])
    if not per:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(per)
    ax.bar(names, [sum(v) / len(v) for v in per.values()],
           color=[COLORS.get(m) for m in names])
    ax.set(ylabel="tokens per iteration (mean over cells)", title="tokens per iteration")
    return _save(fig, folder, "tokens_per_iteration.png")


def acceptance(cells: list[dict[str, Any]], folder: Path) -> str | None:
    """Acceptance rate by draft position per method, weighted by each cell's iterations."""
    per: dict[str, list[tuple[list[float], int]]] = defaultdict(list)
    for c in cells:
        if c.get("acceptance_rate_per_position"):
            per[c["method"]].append((c["acceptance_rate_per_position"], c["iterations"]))
    if not per:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, items in per.items():
        n = min(len(a) for a, _ in items)  # cells of another γ: the common positions
        total = sum(w for _, w in items) or 1
        rate = [sum(a[j] * w for a, w in items) / total for j in range(n)]
        ax.plot(range(1, n + 1), rate, marker="o", label=method, color=COLORS.get(method))
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.02),
           title="acceptance by draft position")
    ax.legend(fontsize=7)
    return _save(fig, folder, "acceptance.png")


def time_split(lines: list[dict[str, Any]], folder: Path) -> str | None:
    """Stacked share of the decode loop per phase, one bar per cell of the largest context
    of the first workload."""
    rows = [r for r in lines if r["time_split"]]
    if not rows:
        return None
    first = rows[0]["workload"]
    rows = [r for r in rows if r["workload"] == first]
    top = max((r["context"] or 0) for r in rows)
    rows = [r for r in rows if (r["context"] or 0) == top]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4.5))
    labels = [f"{r['method']}\n×{r['batch']}" for r in rows]
    bottom = [0.0] * len(rows)
    for phase, color in SPLIT_COLORS.items():
        values = [r["time_split"].get(phase, 0.0) for r in rows]
        if any(values):
            ax.bar(labels, values, bottom=bottom, label=phase, color=color)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel="share of decode time", ylim=(0, 1.05),
           title=f"time split, {first}, {_ctx(rows[0]['context'])}")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    return _save(fig, folder, "time_split.png")


def bench_plots(lines: list[dict[str, Any]], cells: list[dict[str, Any]],
                folder: Path) -> list[str]:
    made = [throughput(lines, folder), speedup_vs_context(lines, folder),
            tokens_per_iteration(lines, folder), acceptance(cells, folder),
            time_split(lines, folder)]
    return [name for name in made if name is not None]


def sweep(points: list[tuple[float, float]], folder: Path, name: str, xlabel: str,
          ylabel: str, title: str, mark: float | None = None) -> str:
    """One tuning step: y against x, the chosen x marked."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = sorted(points)
    ax.plot([x for x, _ in xs], [y for _, y in xs], marker="o", color=COLORS["vegas"])
    if mark is not None:
        ax.axvline(mark, color="black", linestyle="--", linewidth=0.8, label=f"chosen {mark:g}")
        ax.legend(fontsize=8)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return _save(fig, folder, name)
