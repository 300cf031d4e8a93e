"""BENCHMARKS.md's tables name the raw files they come from: every one of them is in the
checkout, so a reader can check a figure against its run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def expand(path: str) -> list[str]:
    """'a/{b,c}.json' -> ['a/b.json', 'a/c.json'], nested braces in turn."""
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    return [name for choice in match.group(1).split(",")
            for name in expand(path[:match.start()] + choice + path[match.end():])]


def cited_paths(text: str) -> list[str]:
    """The raw files a report cites: each `benchmarks/results/...` in backquotes, braces
    expanded."""
    return [name for cited in re.findall(r"`(benchmarks/results/[^`\s]+)`", text)
            for name in expand(cited)]


def test_expand_and_cite_read_braces() -> None:
    text = "raw `benchmarks/results/x/{a,b}_{1,2}.json`, and `benchmarks/results/y.json`"
    assert cited_paths(text) == ["benchmarks/results/x/a_1.json", "benchmarks/results/x/a_2.json",
                                 "benchmarks/results/x/b_1.json", "benchmarks/results/x/b_2.json",
                                 "benchmarks/results/y.json"]


def test_every_raw_file_the_report_cites_exists() -> None:
    cited = cited_paths((ROOT / "BENCHMARKS.md").read_text())
    assert len(cited) > 20
    missing = [name for name in cited if not (ROOT / name).exists()]
    assert not missing, f"BENCHMARKS.md cites files that are not in the checkout: {missing}"
