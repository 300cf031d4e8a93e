"""What several benchmarks share: long text (the Paul Graham essays and, as a second kind
that is not prose, the Python standard library's own source code; the same texts `vegas
bench` reads, its essays and code workloads, loaded from there on first use) and the timer
of calls captured in one CUDA graph."""

from __future__ import annotations

from collections.abc import Callable


def essays() -> list[str]:
    from vegas_spec.bench.workloads import essays as read

    return read()


def source_code() -> list[str]:
    from vegas_spec.bench.workloads import source_code as read

    return read()


TEXTS = {"essays": essays, "code": source_code}


def graph_us(fn: Callable[[], object], calls: int = 30, reps: int = 20) -> float:
    """Median µs per call of `calls` calls captured in one CUDA graph (after a warm-up run
    outside the capture), over `reps` replays."""
    import torch

    from vegas_spec.graphs import capture

    graph, _ = capture(lambda: [fn() for _ in range(calls)], None)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, read + write."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 2 / sorted(times)[len(times) // 2]
