"""Two ways to start a projection of few rows before the small kernel ahead of it has finished,
timed on a decode layer: L2 warmed with the head of its weights, and programmatic dependent
launch with its first weight tiles loaded before it waits.

`fused`, `separate`: Hopper's bulk prefetch (`cp.async.bulk.prefetch.L2.global`, fire and
forget) lets a program of a small kernel ask L2 for the first bytes of each weight row, the
bytes every program of the next projection reads first, while the small kernel leaves the
memory idle. A layer here is the draft step's sequence without its attention: norm -> qkv
-> small kernel -> o_proj -> norm -> gate_up -> small kernel -> down, at M rows, each small
kernel an RMSNorm of M rows (the stand-in for the norm, the merge and SiLU · up). With
`--row-bytes B` the small kernel before each projection gets extra programs that ask L2 for
the first B bytes of every row of that projection's weight (`fused`), or a prefetch kernel
of its own runs before it (`separate`); the projections run cuBLAS and the skinny kernel
(`--linears`).

`pdl0`, `pdl1`, `pdl2`: every kernel of the layer is launched with programmatic dependent
launch (sm_90): a kernel waits (`griddepcontrol.wait`) for the one before and then lets the
next one be scheduled (`launch_dependents`), so the next kernel's programs sit on the free SMs
while this one runs. The projection (the skinny kernel's loop without split K,
`pdl_linear`) loads its first 0, 1 or 2 weight tiles before it waits: the weight does not
depend on the kernel before, only x does. `plain` is the same kernels without PDL.

Several layers of weight copies rotate so that nothing stays in L2 between uses.

    python benchmarks/layer_overlap.py --config benchmarks/configs/llama-3.1-8b --rows 16 \
        --row-bytes 0 1024 2048 --modes fused separate plain pdl0 pdl1 pdl2 --out overlap.json

µs per layer (median of CUDA-graph replays), beside the layer's byte floor at the measured
copy bandwidth."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import copy_bandwidth, graph_us  # noqa: E402

from vegas_spec.kernels.skinny_matmul import skinny_linear  # noqa: E402

PREFETCH_PROGRAMS = 32


@triton.jit
def prefetch_rows(base_ptr, rows, row_stride, row_bytes, program, programs,
                  BLOCK: tl.constexpr, ENABLED: tl.constexpr):
    """Program `program` of `programs` asks L2 for bytes [0, row_bytes) of its share of the
    `rows` rows starting at base_ptr (`row_stride` elements apart; row_bytes a multiple of 16,
    rows 16-byte aligned)."""
    if ENABLED:
        per = tl.cdiv(rows, programs)
        lo = program * per
        hi = tl.minimum(lo + per, rows)
        size = tl.full([BLOCK], row_bytes, tl.int32)
        for r0 in range(lo, hi, BLOCK):
            r = r0 + tl.arange(0, BLOCK)
            ptrs = base_ptr + tl.minimum(r, hi - 1).to(tl.int64) * row_stride
            tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(w_ptr, rows, row_stride, row_bytes, BLOCK: tl.constexpr,
                     ENABLED: tl.constexpr):
    prefetch_rows(w_ptr, rows, row_stride, row_bytes, tl.program_id(0), tl.num_programs(0),
                  BLOCK=BLOCK, ENABLED=ENABLED)


def prefetch_l2(weight: torch.Tensor, row_bytes: int, programs: int = 32) -> None:
    """Ask L2 for the first row_bytes of every row of weight [N, K] (row-major, on CUDA), as a
    kernel of its own (`prefetch_rows` is the same inside another kernel)."""
    assert weight.dim() == 2 and weight.stride(-1) == 1 and row_bytes % 16 == 0
    row_bytes = min(row_bytes, weight.shape[1] * weight.element_size())
    _prefetch_kernel[(programs,)](weight, weight.shape[0], weight.stride(0), row_bytes,
                                  BLOCK=128, ENABLED=True, num_warps=4)


@triton.jit
def _norm_prefetch_kernel(x_ptr, w_ptr, out_ptr, N, eps, pf_ptr, pf_rows, pf_stride,
                          pf_bytes, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                          PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """Programs 0..ROWS-1: RMSNorm of one row; the rest: L2 prefetch of pf's rows."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    p = tl.program_id(0)
    if p < ROWS:
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + p * N + cols, mask=ok, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + p * N + cols, (x * r * w).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        prefetch_rows(pf_ptr, pf_rows, pf_stride, pf_bytes, p - ROWS,
                      tl.num_programs(0) - ROWS, BLOCK=128, ENABLED=PREFETCH)


def norm(x: torch.Tensor, w: torch.Tensor, weight: torch.Tensor | None,
         row_bytes: int, pdl: bool = False) -> torch.Tensor:
    """RMSNorm of x [M, N]; with weight and row_bytes, extra programs prefetch it."""
    m, n = x.shape
    out = torch.empty_like(x)
    pf = weight is not None and row_bytes > 0
    target = weight if pf else x
    _norm_prefetch_kernel[(m + (PREFETCH_PROGRAMS if pf else 0),)](
        x, w, out, n, 1e-5, target, target.shape[0], target.stride(0),
        min(row_bytes, target.shape[1] * target.element_size()) if pf else 16, ROWS=m,
        BLOCK=triton.next_power_of_2(n), PREFETCH=pf, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


@triton.jit
def _pdl_linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr,
                       PDL: tl.constexpr):
    """y = x W^T for columns pid*BLOCK_N.. (K a multiple of BLOCK_K, at least PRELOAD steps):
    the first PRELOAD weight tiles are loaded before the wait for the kernel before."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_row = x_ptr + rm[:, None] * K
    w_row = w_ptr + rn.to(tl.int64)[:, None] * K
    if PRELOAD >= 1:
        w0 = tl.load(w_row + rk[None, :], mask=n_ok[:, None], other=0.0)
    if PRELOAD >= 2:
        w1 = tl.load(w_row + BLOCK_K + rk[None, :], mask=n_ok[:, None], other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PRELOAD >= 1:
        x0 = tl.load(x_row + rk[None, :], mask=m_ok[:, None], other=0.0)
        acc = tl.dot(x0, tl.trans(w0), acc)
    if PRELOAD >= 2:
        x1 = tl.load(x_row + BLOCK_K + rk[None, :], mask=m_ok[:, None], other=0.0)
        acc = tl.dot(x1, tl.trans(w1), acc)
    for k0 in range(PRELOAD * BLOCK_K, K, BLOCK_K):
        x = tl.load(x_row + k0 + rk[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_row + k0 + rk[None, :], mask=n_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# pdl_linear's tiles: 32 columns a program, 256-element K steps, four stages (at most 32 rows
# fit the shared memory).
PDL_BLOCK_K, PDL_MAX_ROWS = 256, 32


def pdl_fits(rows: int, ks: list[int]) -> bool:
    """Whether pdl_linear takes `rows` rows of projections of these reduction sizes."""
    return rows <= PDL_MAX_ROWS and all(k % PDL_BLOCK_K == 0 and k >= 2 * PDL_BLOCK_K
                                        for k in ks)


def pdl_linear(x: torch.Tensor, weight: torch.Tensor, preload: int, pdl: bool) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (`pdl_fits`)."""
    (m, k), n = x.shape, weight.shape[0]
    block_k = PDL_BLOCK_K
    assert pdl_fits(m, [k])
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _pdl_linear_kernel[(triton.cdiv(n, 32),)](
        x, weight, y, m, n, k, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=32,
        BLOCK_K=block_k, PRELOAD=preload, PDL=pdl, num_warps=4, num_stages=4, launch_pdl=pdl)
    return y


PDL_MODES = {"plain": (False, 1), "pdl0": (True, 0), "pdl1": (True, 1), "pdl2": (True, 2)}


def layer_fn(ws: list[dict[str, torch.Tensor]], rows: int, hidden: int, inter: int,
             mode: str, linear_name: str, row_bytes: int) -> Callable[[], None]:
    """One replay: every layer of ws as the draft step's projections and small kernels."""
    dev = ws[0]["qkv"].device
    x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
    xi = torch.randn(rows, inter, device=dev, dtype=torch.bfloat16)
    nh, ni = torch.ones(hidden, device=dev, dtype=x.dtype), torch.ones(inter, device=dev,
                                                                       dtype=x.dtype)
    if mode in PDL_MODES:
        pdl, preload = PDL_MODES[mode]

        def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return pdl_linear(a, w, preload, pdl)

        def small(a: torch.Tensor, nw: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return norm(a, nw, None, 0, pdl=pdl)
    else:
        linear = {"cublas": F.linear, "skinny": skinny_linear}[linear_name]

        def small(a: torch.Tensor, nw: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            if mode == "separate":
                prefetch_l2(weight, row_bytes, PREFETCH_PROGRAMS)
                return norm(a, nw, None, 0)
            return norm(a, nw, weight, row_bytes)

    def run() -> None:
        for w in ws:
            linear(small(x, nh, w["qkv"]), w["qkv"])
            linear(small(x, nh, w["o"]), w["o"])
            linear(small(x, nh, w["gate_up"]), w["gate_up"])
            linear(small(xi, ni, w["down"]), w["down"])

    return run


def cases(modes: list[str], linears: list[str], row_bytes: list[int]) -> list[tuple]:
    """(mode, linear, row bytes) to time: each prefetch mode per projection and size (the
    size 0, no prefetch, once per projection), each PDL mode once."""
    out, baseline = [], set()
    for mode in modes:
        if mode in PDL_MODES:
            out.append((mode, "pdl_linear", 0))
            continue
        for name in linears:
            for size in row_bytes:
                if size == 0 and name in baseline:
                    continue
                baseline.update([name] if size == 0 else [])
                out.append((mode, name, size))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True, help="folder with a config.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[16])
    ap.add_argument("--row-bytes", type=int, nargs="+", default=[0, 1024, 2048, 4096])
    ap.add_argument("--modes", nargs="+", default=["fused", "separate"],
                    choices=["fused", "separate", "plain", "pdl0", "pdl1", "pdl2"])
    ap.add_argument("--linears", nargs="+", default=["cublas", "skinny"],
                    choices=["cublas", "skinny"], help="projections of the prefetch modes")
    ap.add_argument("--layers", type=int, default=6, help="weight copies that rotate")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("layer_overlap: needs a CUDA GPU (sm_90 prefetch and launches)", file=sys.stderr)
        return 2
    cfg = json.loads((args.config / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    o_in = cfg["num_attention_heads"] * d

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02

    ws = [{"qkv": weight(qkv, h), "o": weight(h, o_in), "gate_up": weight(2 * inter, h),
           "down": weight(h, inter)} for _ in range(args.layers)]
    layer_bytes = sum(w.numel() * w.element_size() for w in ws[0].values())
    bandwidth = copy_bandwidth()
    results = []
    for rows in args.rows:
        for mode, name, row_bytes in cases(args.modes, args.linears, args.row_bytes):
            if mode in PDL_MODES and not pdl_fits(rows, [h, o_in, inter]):
                print(f"{mode} skipped at {rows} rows: pdl_linear takes at most "
                      f"{PDL_MAX_ROWS} rows and K a multiple of {PDL_BLOCK_K}", flush=True)
                continue
            fn = layer_fn(ws, rows, h, inter, mode, name, row_bytes)
            us = graph_us(fn, calls=2, reps=args.reps) / args.layers
            row = {"rows": rows, "linear": name, "mode": mode, "row_bytes": row_bytes,
                   "us_per_layer": us, "floor_us": layer_bytes / bandwidth * 1e6}
            print(json.dumps(row), flush=True)
            results.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "copy_bandwidth_bytes_per_s": bandwidth,
            "config": str(args.config), "layer_bytes": layer_bytes}
    args.out.write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
