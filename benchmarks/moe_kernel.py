"""The fused MoE kernel (`kernels.fused_moe`) alone at the real expert shapes of Qwen3-30B-A3B
and gpt-oss-20b, bf16: µs per layer call and the bytes it reads against the copy bandwidth.

A call routes T tokens to their top-k experts (uniformly at random, distinct per token: the
routing a step profile of dummy weights sees) and streams the weights of the experts hit,
so the floor is (distinct experts hit) × (one expert's gate/up, down and biases) plus the
activations it moves (x, the [P, 2I] and [P, I] intermediates, the [P, H] outputs, P = T·k),
over the copy bandwidth. Each cell cycles through `--layers` layers' weights of its own in a
CUDA graph of one call per layer, so that no call finds its experts in L2 (every expert of one
layer is 1.2 GB at Qwen3-30B-A3B, 0.5 GB at gpt-oss-20b); median over replays. T: 1, 16 and
64 (a plain step at those batches) and 112 (a verify step of 16 sequences at γ 6).
`--formats bf16 mxfp4` times the experts kept in MXFP4 as well (`quant.Mxfp4`, random codes
and scales near 2^-6, read as stored: 17 bytes a 32 values against bf16's 64).

    python benchmarks/moe_kernel.py --out moe_kernel.json
    python benchmarks/moe_kernel.py --tokens 16 --tiles 16:64:128:4:4 32:64:64:4:3 --out t.json
    python benchmarks/moe_kernel.py --formats bf16 mxfp4 --out mxfp4.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from common import copy_bandwidth, graph_us

from vegas_spec.config import ModelConfig
from vegas_spec.kernels.exact_matmul import MatmulTiles
from vegas_spec.kernels.fused_moe import fused_moe, moe_tiles
from vegas_spec.quant import random_mxfp4

CONFIGS = Path(__file__).resolve().parent / "configs"


def tiles_arg(text: str) -> MatmulTiles:
    """BLOCK_M:BLOCK_N:BLOCK_K:WARPS:STAGES."""
    return MatmulTiles(*(int(v) for v in text.split(":")))


def routing(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """[T, k] distinct expert ids a token, uniformly at random (int64, on the GPU)."""
    scores = torch.rand(tokens, experts, generator=gen, device="cuda")
    return scores.topk(top_k, dim=-1).indices


def read_bytes(cfg: ModelConfig, ids: torch.Tensor, itemsize: int, fmt: str = "bf16") -> int:
    """The floor's bytes of one call: the experts hit (their matrices in `fmt`: MXFP4 half a
    byte a value and a byte a 32), and the activations moved."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    matrices = 3 * h * i * (17 / 32 if fmt == "mxfp4" else itemsize)
    expert = int(matrices) + itemsize * (2 * i + h if cfg.expert_bias else 0)
    pairs = ids.numel()
    moved = itemsize * (ids.shape[0] * h * 2 + pairs * (2 * i * 2 + i * 2 + h * 2))
    return int(ids.unique().numel()) * expert + moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 112])
    ap.add_argument("--tiles", type=tiles_arg, nargs="*", default=[],
                    help="BLOCK_M:BLOCK_N:BLOCK_K:WARPS:STAGES settings beside the default")
    ap.add_argument("--layers", type=int, default=4, help="layers' weights a cell cycles through")
    ap.add_argument("--formats", nargs="+", choices=["bf16", "mxfp4"], default=["bf16"],
                    help="how the experts' matrices are kept")
    ap.add_argument("--fp4-dots", type=int, nargs="+", choices=[0, 1, 2], default=None,
                    help="MXFP4: the kernel's FP4_DOT forms to time (default: the library's)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    rows = []
    for name in args.models:
        cfg = ModelConfig.from_hf(json.loads((CONFIGS / name / "config.json").read_text()))
        e, h, i, k = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                      cfg.experts_per_token)
        gen = torch.Generator(device="cuda").manual_seed(e + h)
        bf16 = torch.bfloat16
        layers = []
        for _ in range(args.layers):
            layer = {"gate_up": torch.randn(e, 2 * i, h, generator=gen, device="cuda").to(bf16)
                     / h ** 0.5,
                     "down": torch.randn(e, h, i, generator=gen, device="cuda").to(bf16)
                     / i ** 0.5}
            if "mxfp4" in args.formats:
                layer["gate_up_mxfp4"] = random_mxfp4(e, 2 * i, h, gen.device, gen)
                layer["down_mxfp4"] = random_mxfp4(e, h, i, gen.device, gen)
            if cfg.expert_bias:
                layer["gate_up_bias"] = torch.zeros(e, 2 * i, dtype=bf16, device="cuda")
                layer["down_bias"] = torch.zeros(e, h, dtype=bf16, device="cuda")
            layers.append(layer)
        for t, fmt in itertools.product(args.tokens, args.formats):
            x = torch.randn(t, h, generator=gen, device="cuda").to(bf16)
            ids = [routing(t, e, k, gen) for _ in layers]
            weights = torch.full((t, k), 1.0 / k, dtype=bf16, device="cuda")
            nbytes = sum(read_bytes(cfg, d, 2, fmt) for d in ids) / len(ids)
            hit = sum(int(d.unique().numel()) for d in ids) / len(ids)
            default = moe_tiles(x.device, t * k, e, False, fmt == "mxfp4")
            suffix = "" if fmt == "bf16" else "_" + fmt
            forms = args.fp4_dots if fmt == "mxfp4" and args.fp4_dots else [None]
            for tiles, form in itertools.product([None, *args.tiles], forms):
                state = {"i": 0}

                def one(tiles=tiles, form=form, state=state, x=x, ids=ids, weights=weights,
                        layers=layers, limit=cfg.swiglu_limit, suffix=suffix) -> None:
                    n = state["i"] % len(layers)
                    lay = layers[n]
                    fused_moe(x, lay["gate_up" + suffix], lay["down" + suffix], weights,
                              ids[n], tiles=tiles, fp4_dot=form,
                              gate_up_bias=lay.get("gate_up_bias"),
                              down_bias=lay.get("down_bias"), limit=limit)
                    state["i"] += 1

                us = graph_us(one, calls=len(layers), reps=20)
                cfg_used = tiles or default
                rows.append({"model": name, "tokens": t, "format": fmt, "experts_hit": hit,
                             "tiles": f"{cfg_used.block_m}:{cfg_used.block_n}:"
                                      f"{cfg_used.block_k}:{cfg_used.num_warps}:"
                                      f"{cfg_used.num_stages}", "default": tiles is None,
                             "fp4_dot": form,
                             "us": us, "bytes": nbytes,
                             "share_of_copy_bandwidth": nbytes / (us * 1e-6) / bandwidth})
                print(json.dumps(rows[-1]), flush=True)
    args.out.write_text(json.dumps({"copy_bandwidth": bandwidth, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
