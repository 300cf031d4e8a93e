"""How often Python's cyclic garbage collector runs, and for how long, during a command of
the CLI: a `gc.callbacks` probe around `vegas ARGS...` in this process. Prints the number of
tracked objects at the end and, per generation, the collections, their total and their
longest pause (ms); `--out` writes the same as JSON.

    python benchmarks/gc_probe.py --out gc.json -- bench --methods vanilla,vegas,stream \
        --workload essays --context 1k --batch 4 --max-tokens 48 --out gc_bench --no-progress
"""

from __future__ import annotations

import argparse
import gc
import json
import runpy
import sys
import time
from pathlib import Path


def probe(cli_args: list[str]) -> dict:
    """Run `vegas CLI_ARGS` here with every collection timed."""
    pauses: list[tuple[int, float]] = []
    started: list[float] = []

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((info["generation"], time.perf_counter() - started.pop()))

    gc.callbacks.append(on_collection)
    argv, sys.argv = sys.argv, ["vegas", *cli_args]
    began = time.perf_counter()
    try:
        runpy.run_module("vegas_spec.cli", run_name="__main__")
    except SystemExit as stop:
        if stop.code:
            raise
    finally:
        sys.argv = argv
        gc.callbacks.remove(on_collection)
    generations = {}
    for gen in sorted({g for g, _ in pauses}):
        times = [t * 1e3 for g, t in pauses if g == gen]
        generations[gen] = {"collections": len(times), "total_ms": sum(times),
                            "longest_ms": max(times)}
    return {"seconds": time.perf_counter() - began, "tracked_objects": len(gc.get_objects()),
            "generations": generations}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("cli", nargs=argparse.REMAINDER, help="-- then the vegas command's arguments")
    args = ap.parse_args()
    cli = args.cli[1:] if args.cli[:1] == ["--"] else args.cli
    result = probe(cli)
    print(f"tracked objects {result['tracked_objects']}, {result['seconds']:.1f} s")
    for gen, row in result["generations"].items():
        print(f"generation {gen}: {row['collections']} collections, {row['total_ms']:.1f} ms, "
              f"longest {row['longest_ms']:.2f} ms")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
