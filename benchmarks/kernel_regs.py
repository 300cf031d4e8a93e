"""Registers and spills per thread of the paged attention split kernel, compiled for a GPU
target without a device (ptxas from the Triton wheel), at one verify shape.

Default: the Llama-3.1-8B verify step (H 32, Hkv 8, D 128, bf16, n = 7 rows, 2 weight-score
rows) with the score pass's tiles at that head dim on the target arch (`paged_attention.TUNING`,
`PagedTuning.score_tiles_at`: keys per block, stages, register cap; 4 warps). Prints one line
per variant: no scores, and a weight-mode pass with each of `SCORE_STORES`.

    python benchmarks/kernel_regs.py [--arch 90] [--block-k 64 --stages 2 --maxnreg 128]

`--maxnreg` compiles with that cap on the registers per thread (0: ptxas's choice), to see
which cap a tile fits without spills and how many programs an SM holds. `--sinks` and
`--window W` compile gpt-oss's variants (attention sinks, a sliding window of W keys), e.g.
gpt-oss-20b's verify step: `--heads 64 --kv-heads 8 --head-dim 64 --sinks --window 128`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vegas_spec.kernels.paged_attention as pa  # noqa: E402
from vegas_spec.kernels import split_merge  # noqa: E402
from vegas_spec.kernels.split_merge import MIN_DOT  # noqa: E402

# argument -> type of the split kernel's runtime arguments (pointers 16-byte aligned)
POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "table_ptr": "*i32",
            "pos_ptr": "*i64", "out_ptr": "*bf16", "lse_ptr": "*fp32", "acc_ptr": "*fp32",
            "m_ptr": "*fp32", "l_ptr": "*fp32", "rows_ptr": "*i64", "sc_ptr": "*fp32",
            "sinks_ptr": "*bf16"}
SCALARS = {"scale": "fp32"}


def compile_split(constexprs: dict, arch: int, warps: int, stages: int,
                  desc: str | None = None, scratch: str = "*fp32", maxnreg: int | None = None):
    """The split kernel compiled for sm_<arch> with these constexprs; every integer argument
    a runtime i32 (divisible by 16 where the JIT would see it so: strides, sizes). desc: the
    score scratch's descriptor type (e.g. "tensordesc<fp32[8, 128]>") when USE_DESC; scratch:
    the score scratch's pointer type; maxnreg: the registers per thread ptxas may use."""
    fn = pa._paged_split_kernel
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name == "sc_desc" and desc is not None:
            signature[name] = desc
        elif name in constexprs or name == "sc_desc":
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = scratch if name == "sc_ptr" else POINTERS[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = SCALARS.get(name, "i32")
            if name.startswith("stride") or name in ("split_size", "width", "sc_width"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    fixed = constexprs if desc is not None else {**constexprs, "sc_desc": None}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=fixed, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 64),
                          options={"num_warps": warps, "num_stages": stages,
                                   **({} if maxnreg is None else {"maxnreg": maxnreg})})


def resources(kern, arch: int) -> dict[str, int]:
    """Registers per thread of a compiled kernel's cubin (cuobjdump), and the spill bytes and
    stack frame ptxas -v reports for its PTX (the launcher's n_regs / n_spills need a
    device)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = Path(tmp) / "k.cubin", Path(tmp) / "k.ptx"
        cubin.write_bytes(kern.asm["cubin"])
        ptx.write_text(kern.asm["ptx"])
        dump = subprocess.run([str(bin_dir / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
        log = subprocess.run([str(bin_dir / "ptxas"), "-v", f"-arch=sm_{arch}a", str(ptx),
                              "-o", str(Path(tmp) / "v.cubin")],
                             capture_output=True, text=True, check=True).stderr
    frame, stores, loads = re.search(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
        log).groups()
    return {"registers": int(re.search(r"REG:(\d+)", dump).group(1)),
            "ptxas_registers": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_store_bytes": int(stores), "spill_load_bytes": int(loads),
            "stack_frame_bytes": int(frame)}


def programs_per_sm(registers: int, shared: int, warps: int, regs_per_sm: int = 65536,
                    smem_per_sm: int = 228 * 1024) -> int:
    """Programs one SM holds (Hopper: 64K registers, 228 KB of shared memory with 1 KB
    reserved per program); registers are allocated per warp in units of 8 per thread."""
    by_regs = regs_per_sm // (-(-registers // 8) * 8 * 32) // warps
    by_smem = smem_per_sm // (shared + 1024) if shared else by_regs
    return min(by_regs, by_smem)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--n", type=int, default=7)
    ap.add_argument("--score-rows", type=int, default=2)
    ap.add_argument("--block-k", type=int, help="default: the library's at this head dim")
    ap.add_argument("--stages", type=int, help="default: the library's at this head dim")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--maxnreg", type=int,
                    help="registers per thread ptxas may use (0: its own choice; default: "
                         "the library's at this head dim)")
    ap.add_argument("--sinks", action="store_true", help="a sink logit per query head")
    ap.add_argument("--window", type=int, default=0, help="a sliding window of W keys")
    args = ap.parse_args()
    arch = f"sm{args.arch}"  # the target's tuning, no device needed
    library = pa.TUNING.get(arch, pa.TUNING["default"]).score_tiles_at(args.head_dim)
    max_lanes = split_merge.TUNING.get(arch, split_merge.TUNING["default"]).max_lanes
    args.block_k = args.block_k or library.block_k
    args.stages = args.stages or library.stages
    args.maxnreg = library.maxnreg if args.maxnreg is None else args.maxnreg or None
    group = args.heads // args.kv_heads
    group_pad = triton.next_power_of_2(group)
    block_n = max(min(triton.next_power_of_2(args.n), max(1, max_lanes // group_pad)),
                  MIN_DOT // group_pad, 1)
    base = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_N=block_n, BLOCK_K=args.block_k,
                BLOCK_D=max(triton.next_power_of_2(args.head_dim), 16),
                HEAD_DIM=args.head_dim, SINGLE=False, DOT_PRECISION="tf32", SINKS=args.sinks,
                WINDOW=args.window)
    r_pad = pa._rows_pad(args.score_rows, group_pad, gpu=True)
    variants = [("no scores", dict(MODE=0, R_PAD=1, WRITE_LSE=False, USE_DESC=False,
                                   WHOLE_BLOCKS=False))]
    variants += [(f"weight scores, {name}",
                  dict(MODE=1, R_PAD=r_pad, WRITE_LSE=True, USE_DESC=kind.descriptor,
                       WHOLE_BLOCKS=kind.whole_blocks))
                 for name, kind in pa.SCORE_STORES.items()]
    for label, extra in variants:
        lanes = extra["R_PAD"] * group_pad
        desc = f"tensordesc<fp32[{lanes}, {args.block_k}]>" if extra["USE_DESC"] else None
        kern = compile_split({**base, **extra}, args.arch, args.warps, args.stages, desc,
                             "*fp32", args.maxnreg)
        found = resources(kern, args.arch)
        print(json.dumps({"variant": label, **found, "shared_bytes": kern.metadata.shared,
                          "programs_per_sm": programs_per_sm(found["registers"],
                                                             kern.metadata.shared, args.warps),
                          "block_k": args.block_k, "stages": args.stages,
                          "warps": args.warps, "maxnreg": args.maxnreg, "sinks": args.sinks,
                          "window": args.window}), flush=True)


if __name__ == "__main__":
    main()
