"""Long text for the benchmarks: the Paul Graham essays that `vegas bench` also reads."""

from __future__ import annotations

from vegas_spec.bench.workloads import essays

__all__ = ["essays"]
