"""Long text for the benchmarks: the Paul Graham essays and, as a second kind that is not
prose, the Python standard library's own source code; the same texts `vegas bench` reads
(its essays and code workloads), loaded from there on first use."""

from __future__ import annotations


def essays() -> list[str]:
    from vegas_spec.bench.workloads import essays as read

    return read()


def source_code() -> list[str]:
    from vegas_spec.bench.workloads import source_code as read

    return read()


TEXTS = {"essays": essays, "code": source_code}
