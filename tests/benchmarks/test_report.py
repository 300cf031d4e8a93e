"""BENCHMARKS.md's tables name the raw files they come from: every one of them is in the
checkout, so a reader can check a figure against its run, and git keeps no raw result that
no table cites (the history keeps the others)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

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


def test_every_raw_file_in_git_is_cited() -> None:
    """Only the raw files a table cites stay in git (cited in BENCHMARKS.md or the kernel
    notes)."""
    listed = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    text = (ROOT / "BENCHMARKS.md").read_text() + (ROOT / "docs" / "kernel-notes.md").read_text()
    cited = set(cited_paths(text))
    uncited = [name for name in listed.stdout.split() if name not in cited]
    assert not uncited, f"raw results in git that no table cites: {uncited}"
