"""Few-row projections of 8B models: cuBLAS (`F.linear`) against `skinny_linear` over a grid
of tile settings, as weight-streaming bandwidth.

At M <= 64 rows a projection is 2·M flops per weight element, so its floor is the weight
bytes over the copy bandwidth. For the projections of every model config given (by default
Llama-3.1-8B and Qwen3-8B: qkv, o_proj, gate_up, down, LM head; shapes two models share are
timed once) and every row count M (1, 4, 16, 32, 64, 112), this script times

  cublas    F.linear, at every M;
  default   skinny_linear with `skinny_tiles`' choice, at M <= 64 (the kernel's limit);
  tiles     skinny_linear over block_n x block_k (4 stages, 4 warps, no split);
  pipeline  the best of those over num_stages x num_warps;
  split     the best so far with each split of K,

(`--exhaustive`: every combination instead of the three stages), skipping settings that
cannot apply: shared memory over an H200's 227 KB, fewer 16-byte W vectors per K step than
threads, a split of K where the column blocks alone give two programs per SM or a split
shorter than the pipeline. Every setting is first checked against F.linear (relative error;
a failed check is not timed). Each time is the median over replays of a CUDA graph whose calls
rotate among copies of the weight (at least --rotate-mb of them, so no call finds its weight
in the 50 MB L2), per call. Every cell reports µs, GB/s of weight bytes and % of the copy
bandwidth (a 1 GiB device-to-device copy, bytes read + written over time); the last table
is the best setting per shape and M against cuBLAS. Everything goes to --out (JSON).

    python benchmarks/skinny_gemm.py --out skinny_gemm.json           # CUDA (~2 min)
    python benchmarks/skinny_gemm.py --dry-run --out /tmp/plan.json   # the plan, no device
    python benchmarks/skinny_gemm.py --device cpu --out /tmp/sg.json  # tiny, interpreter
    python benchmarks/skinny_gemm.py --compile-sm90 --out /tmp/c.json # sm_90 builds, no GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks" / "configs"
DEFAULT_CONFIGS = [CONFIGS / "llama-3.1-8b", CONFIGS / "qwen3-8b"]
# Small enough for Triton's interpreter (the CPU run checks that the script works).
TINY_HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 200, "hidden_size": 128,
           "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
           "rms_norm_eps": 1e-6, "eos_token_id": 2}
SMEM_BYTES = 232448  # an H100/H200 block's shared memory (227 KB)
SMS = 132  # an H200's SMs
PROJECTIONS = ["qkv", "o_proj", "gate_up", "down", "lm_head"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="write the full results (JSON) here")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda where there is one; cpu runs tiny shapes under Triton's "
                        "interpreter (checks the script; its timings mean nothing)")
    p.add_argument("--dry-run", action="store_true",
                   help="print and write the plan (shapes, settings, counts); touch no device")
    p.add_argument("--compile-sm90", action="store_true",
                   help="compile every setting of the grid for sm_90 (no GPU needed) and "
                        "report its shared memory; time nothing")
    p.add_argument("--configs", nargs="+", type=Path, default=None,
                   help="HF config folders or files (default: Llama-3.1-8B and Qwen3-8B; on "
                        "cpu a tiny Llama)")
    p.add_argument("--projections", nargs="+", default=None,
                   choices=PROJECTIONS)
    p.add_argument("--rows", nargs="+", type=int, default=None,
                   help="M values (default 1 4 16 32 64 112; on cpu 1 16 112)")
    p.add_argument("--block-n", nargs="+", type=int, default=None)
    p.add_argument("--block-k", nargs="+", type=int, default=None)
    p.add_argument("--stages", nargs="+", type=int, default=None)
    p.add_argument("--warps", nargs="+", type=int, default=None)
    p.add_argument("--split-k", nargs="+", type=int, default=None)
    p.add_argument("--exhaustive", action="store_true",
                   help="every combination of the grid instead of the staged search")
    p.add_argument("--rotate-mb", type=float, default=256.0,
                   help="weight copies per shape: at least this many MB of them")
    p.add_argument("--graph-mb", type=float, default=1024.0,
                   help="calls per timed graph: at least this many MB of weights")
    p.add_argument("--reps", type=int, default=20, help="graph replays per timing (median)")
    p.add_argument("--time-budget-s", type=float, default=180.0,
                   help="timings not started by then are marked skipped")
    return p.parse_args(argv)


def _interpreter_wanted(argv: list[str]) -> bool:
    """Triton's interpreter must be chosen before triton is first imported: for a CPU run
    (asked for, or no CUDA), never for the sm_90 builds."""
    known = argparse.ArgumentParser(add_help=False)
    known.add_argument("--device")
    known.add_argument("--compile-sm90", action="store_true")
    args, _ = known.parse_known_args(argv)
    if args.compile_sm90:
        return False
    return args.device == "cpu" or not torch.cuda.is_available()


if __name__ == "__main__" and _interpreter_wanted(sys.argv[1:]):
    assert "triton" not in sys.modules, "triton imported before TRITON_INTERPRET was set"
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import vegas_spec.kernels  # noqa: F401  (interpreter patches, before any kernel runs)
except ImportError:
    sys.path.insert(0, str(ROOT))
    import vegas_spec.kernels  # noqa: F401

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from vegas_spec.config import ModelConfig  # noqa: E402
from vegas_spec.kernels import interpreting  # noqa: E402
from vegas_spec.kernels.skinny_matmul import (  # noqa: E402
    MAX_ROWS,
    SkinnyTiles,
    block_rows,
    skinny_linear,
    skinny_tiles,
)

# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Shape:
    name: str  # qkv, o_proj, gate_up, down, lm_head
    n: int
    k: int
    models: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.name} {self.n}x{self.k}"


@dataclass
class Grid:
    block_n: list[int]
    block_k: list[int]
    stages: list[int]
    warps: list[int]
    split_k: list[int]

    def base(self) -> tuple[int, int]:
        """(stages, warps) of the first stage: 4 and 4 where the grid has them."""
        return (4 if 4 in self.stages else self.stages[0],
                4 if 4 in self.warps else self.warps[0])


def model_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of the engine's projections: q/k/v and gate/up are fused at load time."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "gate_up": (2 * inter, h),
              "down": (h, inter), "lm_head": (cfg.vocab_size, h)}
    assert list(shapes) == PROJECTIONS
    return shapes


def load_config(path: Path) -> tuple[str, ModelConfig]:
    file = path / "config.json" if path.is_dir() else path
    name = file.parent.name if file.name == "config.json" else file.stem
    return name, ModelConfig.from_hf(json.loads(file.read_text()))


def collect_shapes(models: list[tuple[str, ModelConfig]], names: list[str] | None,
                   ) -> list[Shape]:
    """Every projection of every model, once per (name, N, K)."""
    seen: dict[tuple[str, int, int], list[str]] = {}
    for model, cfg in models:
        for name, (n, k) in model_shapes(cfg).items():
            if names is None or name in names:
                seen.setdefault((name, n, k), []).append(model)
    order = list(PROJECTIONS)
    return sorted((Shape(name, n, k, tuple(ms)) for (name, n, k), ms in seen.items()),
                  key=lambda s: (order.index(s.name), s.n, s.k))


def pruned(t: SkinnyTiles, block_m: int, n: int, k: int, itemsize: int) -> str | None:
    """Why a setting cannot apply to this shape (None: it can). Shared memory: Triton keeps
    num_stages - 1 x and W tiles in flight for the Ampere-style MMA (BLOCK_M < 64), num_stages
    for Hopper's (an estimate; a launch that still runs out is recorded as an error)."""
    buffers = t.num_stages if block_m >= 64 else t.num_stages - 1
    if (block_m + t.block_n) * t.block_k * itemsize * max(buffers, 1) > SMEM_BYTES:
        return "shared memory"
    if t.num_warps * 32 > t.block_n * t.block_k * itemsize // 16:
        return "fewer 16-byte W vectors per K step than threads"
    if t.split_k > 1:
        if triton.cdiv(n, t.block_n) >= 2 * SMS:
            return "column blocks alone give two programs per SM"
        if triton.cdiv(k, t.split_k) < t.num_stages * t.block_k:
            return "split shorter than the pipeline"
    return None


def stage_settings(grid: Grid, stage: str, best: SkinnyTiles | None) -> list[SkinnyTiles]:
    """The settings a stage times: `best` is the fastest of the earlier stages (None: the
    pipeline and split stages have nothing to start from)."""
    stages, warps = grid.base()
    if stage == "exhaustive":
        return [SkinnyTiles(bn, bk, w, s, sk) for bn, bk, s, w, sk in itertools.product(
            grid.block_n, grid.block_k, grid.stages, grid.warps, grid.split_k)]
    if stage == "tiles":
        return [SkinnyTiles(bn, bk, warps, stages) for bn in grid.block_n for bk in grid.block_k]
    if best is None:
        return []
    if stage == "pipeline":
        return [replace(best, num_stages=s, num_warps=w)
                for s in grid.stages for w in grid.warps]
    assert stage == "split"
    return [replace(best, split_k=s) for s in grid.split_k if s > 1]


# ---------------------------------------------------------------- timing


@dataclass
class Bench:
    device: torch.device
    dtype: torch.dtype
    grid: Grid
    exhaustive: bool
    rotate_bytes: float
    graph_bytes: float
    reps: int
    deadline: float
    copy_bw: float = float("nan")  # bytes / s
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def itemsize(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def error_text(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return " ".join(line.strip() for line in lines)[-500:]


def per_call_us(bench: Bench, call: Callable[[int], Any], copies: int,
                weight_bytes: int) -> float:
    """Median µs of one call over graph replays; call(i) uses weight copy i. On CPU (the
    interpreter): one run of each copy, timed on the host."""
    if bench.device.type != "cuda":
        start = time.perf_counter()
        for i in range(copies):
            call(i)
        return (time.perf_counter() - start) * 1e6 / copies
    from vegas_spec.graphs import capture

    calls = max(copies, math.ceil(bench.graph_bytes / weight_bytes))
    graph, _ = capture(lambda: [call(i % copies) for i in range(calls)], None)
    graph.replay()
    times = []
    for _ in range(bench.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) * 1e3 / calls


def copy_bandwidth(bench: Bench) -> dict[str, float]:
    """Bytes read + written per second by a large device-to-device copy (1 GiB on CUDA),
    alternating its direction so that neither buffer stays warm."""
    size = (1 << 30) if bench.device.type == "cuda" else (16 << 20)
    # 16-bit elements: torch's copy of bytes runs at two thirds of the rate (2.76 against
    # 4.16 TB/s on an H200), which would flatter every kernel compared with it
    pair = [torch.full((size // 2,), 1, dtype=torch.int16, device=bench.device),
            torch.full((size // 2,), 2, dtype=torch.int16, device=bench.device)]
    us = per_call_us(bench, lambda i: pair[1 - i].copy_(pair[i]), 2, size)
    return {"buffer_bytes": size, "copy_us": us, "copy_bytes_per_s": 2 * size / us * 1e6}


@dataclass
class Case:
    """One shape at one M: the weight copies, the input and the cuBLAS output to check with."""
    shape: Shape
    m: int
    copies: list[torch.Tensor]
    x: torch.Tensor
    ref: torch.Tensor

    @property
    def weight_bytes(self) -> int:
        return self.copies[0].numel() * self.copies[0].element_size()


def new_row(case: Case, impl: str, stage: str, tiles: SkinnyTiles | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "shape": case.shape.name, "n": case.shape.n, "k": case.shape.k,
        "models": list(case.shape.models), "m": case.m, "impl": impl, "stage": stage,
        "tiles": None if tiles is None else asdict(tiles), "weight_bytes": case.weight_bytes,
        "copies": len(case.copies), "status": "pending"}
    if tiles is not None:
        row["block_m"] = block_rows(case.m)
        row["programs"] = triton.cdiv(case.shape.n, tiles.block_n) * tiles.split_k
    return row


def timed(bench: Bench, case: Case, row: dict[str, Any],
          fn: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """Check fn against cuBLAS's output, then time it; the row records either."""
    bench.rows.append(row)
    if bench.out_of_time():
        row["status"] = "skipped (time)"
        return row
    try:
        got = fn(case.copies[0]).float()
        row["rel_err"] = float((got - case.ref).norm() / case.ref.norm())
        limit = 1e-4 if bench.dtype == torch.float32 else 2e-2
        if not row["rel_err"] < limit:
            row["status"] = "FAIL"
            log(f"FAIL {case.shape.label} M {case.m} {row['tiles']}: rel err {row['rel_err']}")
            return row
        us = per_call_us(bench, lambda i: fn(case.copies[i]), len(case.copies),
                         case.weight_bytes)
    except Exception as exc:
        row["status"] = "error"
        row["error"] = error_text(exc)
        log(f"ERROR {case.shape.label} M {case.m} {row['tiles']}: {row['error']}")
        return row
    per_s = case.weight_bytes / us * 1e6
    row.update(status="ok", us=us, weight_gb_per_s=per_s / 1e9,
               pct_copy=100 * per_s / bench.copy_bw)
    log(f"{case.shape.label:22} M {case.m:3} {row['impl']:6} {row['stage']:8} "
        f"{tiles_text(row['tiles']):24} {us:9.2f} us {per_s / 1e9:7.0f} GB/s "
        f"{row['pct_copy']:5.1f}% of copy")
    return row


def tiles_text(tiles: dict[str, int] | None) -> str:
    if tiles is None:
        return "-"
    return (f"n{tiles['block_n']} k{tiles['block_k']} s{tiles['num_stages']} "
            f"w{tiles['num_warps']} split{tiles['split_k']}")


def skinny_rows(bench: Bench, case: Case) -> None:
    """The default tiles, then the staged search (or the whole grid), each setting once; each
    stage starts from the fastest grid setting so far (not from the default tiles)."""
    shape, block_m = case.shape, block_rows(case.m)
    tried: set[SkinnyTiles] = set()
    best: list[tuple[float, SkinnyTiles]] = []

    def run(stage: str, tiles: SkinnyTiles) -> None:
        if tiles in tried:
            return
        tried.add(tiles)
        row = new_row(case, "skinny", stage, tiles)
        reason = pruned(tiles, block_m, shape.n, shape.k, bench.itemsize)
        if reason is not None and stage != "default":
            bench.rows.append({**row, "status": f"pruned: {reason}"})
            return
        timed(bench, case, row, lambda w: skinny_linear(case.x, w, tiles=tiles))
        if row["status"] == "ok" and stage != "default":
            best.append((row["us"], tiles))
            best.sort(key=lambda pair: pair[0])

    run("default", skinny_tiles(case.m, shape.n, shape.k))
    for stage in ["exhaustive"] if bench.exhaustive else ["tiles", "pipeline", "split"]:
        for tiles in stage_settings(bench.grid, stage, best[0][1] if best else None):
            run(stage, tiles)


def shape_rows(bench: Bench, shape: Shape, rows: list[int]) -> None:
    weight = torch.randn(shape.n, shape.k, device=bench.device).to(bench.dtype) / shape.k ** 0.5
    nbytes = weight.numel() * weight.element_size()
    count = 1 if bench.device.type != "cuda" else max(1, math.ceil(bench.rotate_bytes / nbytes))
    copies = [weight] + [weight.clone() for _ in range(count - 1)]
    for m in rows:
        x = torch.randn(m, shape.k, device=bench.device).to(bench.dtype)
        case = Case(shape, m, copies, x, F.linear(x, weight).float())
        timed(bench, case, new_row(case, "cublas", "-", None), lambda w, x=x: F.linear(x, w))
        if m <= MAX_ROWS:
            skinny_rows(bench, case)
    del copies, weight
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- reports


def best_table(bench: Bench) -> tuple[list[dict[str, Any]], str]:
    """Per (shape, M): cuBLAS, the default tiles and the fastest skinny setting."""
    cells: dict[tuple[str, int, int, int], dict[str, Any]] = {}
    for r in bench.rows:
        if r.get("status") != "ok":
            continue
        cell = cells.setdefault((r["shape"], r["n"], r["k"], r["m"]), {
            "shape": r["shape"], "n": r["n"], "k": r["k"], "m": r["m"]})
        if r["impl"] == "cublas":
            cell.update(cublas_us=r["us"], cublas_pct=r["pct_copy"])
            continue
        if r["stage"] == "default":
            cell.update(default_us=r["us"], default_pct=r["pct_copy"])
        if "skinny_us" not in cell or r["us"] < cell["skinny_us"]:
            cell.update(skinny_us=r["us"], skinny_pct=r["pct_copy"], tiles=r["tiles"])
    best = list(cells.values())
    for cell in best:
        if "skinny_us" in cell and "cublas_us" in cell:
            cell["speedup"] = cell["cublas_us"] / cell["skinny_us"]
    lines = ["| shape | N x K | M | cuBLAS µs | % copy | skinny µs | % copy | best setting "
             "| speedup | default tiles % copy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in best:
        def fmt(key: str, spec: str, c: dict[str, Any] = c) -> str:
            return format(c[key], spec) if key in c else "-"

        lines.append(f"| {c['shape']} | {c['n']}x{c['k']} | {c['m']} | {fmt('cublas_us', '.2f')}"
                     f" | {fmt('cublas_pct', '.1f')} | {fmt('skinny_us', '.2f')}"
                     f" | {fmt('skinny_pct', '.1f')} | {tiles_text(c.get('tiles'))}"
                     f" | {fmt('speedup', '.2f')} | {fmt('default_pct', '.1f')} |")
    return best, "\n".join(lines)


# ---------------------------------------------------------------- sm_90 builds


def compile_sm90(bench: Bench, shapes: list[Shape], rows: list[int]) -> list[dict[str, Any]]:
    """Build every setting the grid could time (pruning as the timed run does, for the
    block_m of the given rows) for sm_90 without a GPU, recording the shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vegas_spec.kernels.skinny_matmul import _skinny_kernel, _sum_splits_kernel

    assert not interpreting(), "unset TRITON_INTERPRET for --compile-sm90"
    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[bench.dtype]
    types = {"x_ptr": ptr, "w_ptr": ptr, "b_ptr": ptr, "y_ptr": ptr}
    # what a launch specialises: 16-byte aligned pointers, sizes and strides divisible by 16
    aligned = ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "N", "K", "k_split", "stride_xm",
               "stride_wn", "stride_ym"]
    target = GPUTarget("cuda", 90, 32)

    def build(fn: Any, types: dict[str, str], consts: dict[str, Any], warps: int,
              stages: int) -> Any:
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned
                 if a in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=target,
                              options={"num_warps": warps, "num_stages": stages})

    out: list[dict[str, Any]] = []
    wanted: dict[tuple[SkinnyTiles, int], str | None] = {}
    for shape in shapes:
        for m in (m for m in rows if m <= MAX_ROWS):
            bm = block_rows(m)
            wanted.setdefault((skinny_tiles(m, shape.n, shape.k), bm), None)
            for tiles in stage_settings(bench.grid, "exhaustive", None):
                reason = pruned(tiles, bm, shape.n, shape.k, bench.itemsize)
                if wanted.get((tiles, bm), "x") is not None:  # buildable for some shape wins
                    wanted[(tiles, bm)] = reason
    for (tiles, bm), reason in wanted.items():
        row: dict[str, Any] = {"tiles": asdict(tiles), "block_m": bm, "pruned": reason}
        out.append(row)
        if reason is not None:
            continue
        consts = {"HAS_BIAS": False, "BLOCK_M": bm, "BLOCK_N": tiles.block_n,
                  "BLOCK_K": tiles.block_k, "SPLIT_K": tiles.split_k, "EVEN_K": True,
                  "DOT_PRECISION": "tf32"}
        try:
            start = time.perf_counter()
            kernel = build(_skinny_kernel, types, consts, tiles.num_warps, tiles.num_stages)
            ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
            row.update(status="ok", compile_s=time.perf_counter() - start,
                       shared=kernel.metadata.shared,
                       fits=kernel.metadata.shared <= SMEM_BYTES,
                       pipelined="async_copy_global_to_local" in ttgir,
                       mma="wgmma" if "wgmma.mma_async" in ptx else "mma.sync")
        except Exception as exc:
            row.update(status="error", error=error_text(exc))
        log(f"sm_90 block_m {bm:2} {tiles_text(row['tiles']):26} {row.get('status')} "
            f"shared {row.get('shared')} {row.get('mma', '')} {row.get('error', '')}")
    for split in sorted({t.split_k for t, _ in wanted if t.split_k > 1}):
        row = {"kernel": "sum_splits", "split_k": split}
        try:
            build(_sum_splits_kernel, {"p_ptr": "*fp32", "b_ptr": ptr, "y_ptr": ptr},
                  {"HAS_BIAS": False, "SPLIT_K": split, "BLOCK": 1024}, 4, 1)
            row["status"] = "ok"
        except Exception as exc:
            row.update(status="error", error=error_text(exc))
        out.append(row)
    return out


# ---------------------------------------------------------------- main


def build_bench(args: argparse.Namespace, cuda: bool) -> tuple[Bench, list[Shape], list[int]]:
    tiny = not cuda and not (args.dry_run or args.compile_sm90)
    if args.configs:
        models = [load_config(p) for p in args.configs]
    elif tiny:
        models = [("tiny-llama", ModelConfig.from_hf(TINY_HF))]
    else:
        models = [load_config(p) for p in DEFAULT_CONFIGS]
    shapes = collect_shapes(models, args.projections)
    rows = args.rows or ([1, 16, 112] if tiny else [1, 4, 16, 32, 64, 112])
    if tiny:  # few settings: the interpreter's cost is per program and K step
        grid = Grid([16, 32], [64], [1], [4], [1, 2])
    else:
        grid = Grid([16, 32, 64], [64, 128, 256], [3, 4, 5], [4, 8], [1, 2, 4])
    grid = Grid(args.block_n or grid.block_n, args.block_k or grid.block_k,
                args.stages or grid.stages, args.warps or grid.warps,
                args.split_k or grid.split_k)
    dtype = torch.bfloat16 if cuda or args.compile_sm90 or args.dry_run else torch.float16
    bench = Bench(torch.device("cuda" if cuda else "cpu"), dtype, grid, args.exhaustive,
                  args.rotate_mb * 1e6, args.graph_mb * 1e6, args.reps,
                  time.monotonic() + args.time_budget_s)
    return bench, shapes, rows


def plan(bench: Bench, shapes: list[Shape], rows: list[int]) -> dict[str, Any]:
    """Counts for the dry run: cells, and the settings the first stage (or the whole grid)
    would time after pruning; later stages add at most |stages x warps| + |split_k| - 2."""
    stage = "exhaustive" if bench.exhaustive else "tiles"
    first = stage_settings(bench.grid, stage, None)
    cells, timings, builds = [], 0, set()
    for shape in shapes:
        for m in rows:
            kept = [] if m > MAX_ROWS else [
                t for t in first
                if pruned(t, block_rows(m), shape.n, shape.k, bench.itemsize) is None]
            builds.update((t, block_rows(m)) for t in kept)
            timings += 1 + len(kept) + (m <= MAX_ROWS)
            cells.append({"shape": shape.label, "models": list(shape.models), "m": m,
                          "skinny_settings": len(kept)})
    later = 0 if bench.exhaustive else len(bench.grid.stages) * len(bench.grid.warps) + len(
        bench.grid.split_k) - 2
    skinny_cells = sum(m <= MAX_ROWS for m in rows) * len(shapes)
    return {"cells": cells, "first_stage_settings": [asdict(t) for t in first],
            "timings_first_stage": timings, "builds_first_stage": len(builds),
            "timings_later_stages_at_most": later * skinny_cells}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = (args.device != "cpu" and torch.cuda.is_available() and not interpreting()
            and not args.dry_run and not args.compile_sm90)
    if args.device == "cuda" and not cuda and not (args.dry_run or args.compile_sm90):
        raise SystemExit("--device cuda: no CUDA device here")
    bench, shapes, rows = build_bench(args, cuda)
    started = time.monotonic()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "dtype": str(bench.dtype),
        "args": vars(args),
        "grid": asdict(bench.grid), "shapes": [asdict(s) for s in shapes], "rows_m": rows,
        "timer": "median of CUDA graph replays, weights rotated" if cuda else
                 "one host-timed run (interpreter: the figures mean nothing)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.dry_run or args.compile_sm90:
        result["plan"] = plan(bench, shapes, rows)
        if args.compile_sm90:
            result["sm90"] = compile_sm90(bench, shapes, rows)
            bad = [r for r in result["sm90"] if r.get("status") == "error"
                   or r.get("fits") is False]
            print(f"sm_90 builds: {sum(r.get('status') == 'ok' for r in result['sm90'])} ok, "
                  f"{len(bad)} failed or over shared memory")
        args.out.write_text(json.dumps(result, indent=1, default=str))
        p = result["plan"]
        print(f"{len(shapes)} shapes x {len(rows)} M; first stage: {p['timings_first_stage']} "
              f"timings, {p['builds_first_stage']} builds; later stages at most "
              f"{p['timings_later_stages_at_most']} timings. JSON: {args.out}")
        return
    copy: dict[str, float] = {}
    try:
        copy = copy_bandwidth(bench)
        bench.copy_bw = copy["copy_bytes_per_s"]
        log(f"copy {bench.copy_bw / 1e12:.3f} TB/s (read + written)")
        for shape in shapes:
            shape_rows(bench, shape, rows)
            result.update(copy=copy, rows=bench.rows)
            args.out.write_text(json.dumps(result, indent=1, default=str))
    finally:
        best, table = best_table(bench)
        result.update(copy=copy, rows=bench.rows, best=best,
                      elapsed_s=time.monotonic() - started)
        args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"copy bandwidth {bench.copy_bw / 1e12:.3f} TB/s; {bench.dtype}; % copy = weight "
          f"bytes / time / copy bandwidth\n")
    print(table)
    print(f"\n{len(bench.rows)} rows in {time.monotonic() - started:.0f} s; JSON: {args.out}")


if __name__ == "__main__":
    main()
