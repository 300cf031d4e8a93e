"""Long text for the benchmarks: the Paul Graham essays and, as a second kind that is not
prose, the Python standard library's own source code; the same texts `vegas bench` reads
(its essays and code workloads)."""

from __future__ import annotations

from vegas_spec.bench.workloads import TEXTS, essays, source_code

__all__ = ["TEXTS", "essays", "source_code"]
