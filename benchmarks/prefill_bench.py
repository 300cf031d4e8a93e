"""Prefill: the engine against transformers' forward pass on the same token ids, the 8B shapes
against the card's matrix throughput, peak memory of a 128K prompt, the GPU's busy fraction,
and end-to-end time (prefill + decode) per method. One process, side by side.

    python benchmarks/prefill_bench.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --sections kernel smollm shapes memory profile e2e --out prefill.json
    python benchmarks/prefill_bench.py --device cpu --dtype float32 --sections smollm \
        --context 2750 --batches 1 --out prefill_cpu.json       # the CPU path

Sections:
  kernel   the prefill attention kernel alone over tile configurations (SmolLM2 and 8B head
           shapes), TFLOP/s against torch's SDPA (flash) on the same contiguous tensors.
  smollm   `LLM.generate(prompts, max_tokens=1)` (prefill and the first token, warmed up on the
           same batch) against transformers' forward (SDPA) on the same ids, with the full
           logits and with `logits_to_keep=1`; two kinds of prompt: essay windows and random
           token ids.
  shapes   the Llama-3.1-8B and Qwen3-8B shapes (`--shapes`: any folder of configs/, e.g.
           qwen3-30b-a3b, gpt-oss-20b) with dummy weights: 16 x 8K and 1 x 32K;
           FLOPs = 2 x (weights a token multiplies by: in a mixture of experts the router and
           its routed experts) x tokens + attention (pairs of visible keys x 4·H·D per layer,
           a sliding-window layer's within its window) + the LM head of the last tokens, over
           the time, against a measured 8192^3 bf16 matmul.
  memory   a 128K-token prompt at the Llama-3.1-8B shape: peak allocation beyond the weights
           and the KV pool.
  profile  torch.profiler over one prefill of each SmolLM2 batch: GPU kernel time (union of
           kernel intervals) over the wall time of generate(max_tokens=1) and over its time
           to first token, the top kernels, and a host profile (cProfile).
  e2e      the largest batch (16) x 7.5K, 256 new tokens, greedy: prefill, decode and total
           time of vanilla, vegas and stream, on both kinds of prompt.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import time
from pathlib import Path

import torch
from common import essays

from vegas_spec import LLM, SamplingParams, SpecConfig
from vegas_spec.kernels.prefill_attention import (
    PrefillConfig,
    prefill_attention,
    prefill_flops,
    prefill_tiles,
)

CONFIGS = Path(__file__).resolve().parent / "configs"
TILES = [PrefillConfig(128, 64, 8, 3), PrefillConfig(128, 64, 4, 3), PrefillConfig(128, 128, 8, 3),
         PrefillConfig(128, 32, 4, 4), PrefillConfig(64, 64, 4, 3), PrefillConfig(64, 128, 4, 3),
         PrefillConfig(128, 64, 8, 4), PrefillConfig(128, 128, 8, 2)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, reps: int) -> float:  # noqa: ANN001
    """Median wall seconds of fn() after one warm-up call (device synchronised around)."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda: a @ b, torch.device("cuda"), 20)
    return 2 * 8192 ** 3 / t / 1e12


def essay_prompts(tokenizer, tokens: int, count: int) -> list[list[int]]:  # noqa: ANN001
    ids = tokenizer("\n\n".join(essays()), add_special_tokens=False)["input_ids"]
    stride = (len(ids) - tokens) // max(count - 1, 1)
    return [ids[i * stride : i * stride + tokens] for i in range(count)]


def random_prompts(vocab: int, tokens: int, count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, tokens), generator=gen).tolist()


# --- kernel ------------------------------------------------------------------------------------

def kernel_section(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    for name, heads, hkv, dim, lengths in [("smollm2", 9, 3, 64, [7500] * 16),
                                           ("smollm2", 9, 3, 64, [7500]),
                                           ("8b", 32, 8, 128, [8192] * 4),
                                           ("8b", 32, 8, 128, [32768])]:
        rows += kernel_shape(name, heads, hkv, dim, lengths, args.reps)
        torch.cuda.empty_cache()
    return rows


def kernel_shape(name: str, heads: int, hkv: int, dim: int, lengths: list[int],
                 reps: int) -> list[dict]:
    """Packed pieces in a shuffled paged cache; each tile configuration is checked against
    SDPA on the first piece's values before it is timed."""
    dev, dt, page = torch.device("cuda"), torch.bfloat16, 16
    total = sum(lengths)
    pages = torch.randperm(total // page + len(lengths)).to(dev, torch.int32)
    k = torch.randn(pages.numel() * page, hkv, dim, device=dev, dtype=dt)
    v = torch.randn_like(k)
    q = torch.randn(total, heads, dim, device=dev, dtype=dt)
    per = -(-max(lengths) // page)
    table = torch.stack([pages[i * per : (i + 1) * per] for i in range(len(lengths))])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=dev)
    starts = torch.zeros(len(lengths), dtype=torch.int32, device=dev)
    flops = prefill_flops(lengths, [0] * len(lengths), heads, dim)
    # SDPA on the first piece's contiguous K/V: the correctness and the speed yardstick
    slots = (table[0].long()[:, None] * page + torch.arange(page, device=dev)).flatten()
    n0 = lengths[0]
    qs = q[:n0].transpose(0, 1)[None]
    ks, vs = (x[slots[:n0]].transpose(0, 1)[None].repeat_interleave(heads // hkv, 1)
              for x in (k, v))
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, qs, ks, vs,
                             is_causal=True)
    want = sdpa()[0].transpose(0, 1).float()
    sdpa_tflops = prefill_flops([n0], [0], heads, dim) / timed(sdpa, dev, reps) / 1e12
    rows = []
    for cfg in TILES:
        tiles = prefill_tiles(lengths, [0] * len(lengths), cfg.block_m, dev)
        run = functools.partial(prefill_attention, q, k, v, table, cu, starts, tiles, page,
                                dim ** -0.5, config=cfg)
        row = {"shape": name, "lengths": f"{len(lengths)}x{lengths[0]}",
               "config": [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages]}
        try:
            out = run()
            t = timed(run, dev, reps)
        except Exception as exc:  # noqa: BLE001  (a configuration that does not compile)
            rows.append({**row, "error": str(exc)[:200]})
            continue
        err = ((out[:n0].float() - want).norm() / want.norm()).item()
        rows.append({**row, "ms": 1e3 * t, "tflops": flops / t / 1e12, "rel_err": err,
                     "sdpa_tflops_one_seq": sdpa_tflops})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# --- SmolLM2 against transformers -------------------------------------------------------------

def hf_model(model: str, dtype: torch.dtype, device: torch.device):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    path = Path(model)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=dtype, attn_implementation="sdpa")
    return hf.to(device).eval()


def engine_prefill_s(llm: LLM, prompts: list[list[int]], reps: int) -> tuple[float, float]:
    """Median wall seconds of generate(max_tokens=1) and of its prefill_s statistic."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    stats = []

    def run() -> None:
        stats.append(llm.generate(prompts, params)[0].stats["prefill_s"])

    wall = timed(run, llm.device, reps)
    return wall, sorted(stats)[len(stats) // 2]


def smollm_section(args: argparse.Namespace) -> list[dict]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_bytes=int(8 << 30),
              backend=args.backend)
    hf = hf_model(args.model or str(llm.engine.source.path), dtype, device)
    rows = []
    for kind in args.kinds:
        for batch in args.batches:
            prompts = essay_prompts(llm.tokenizer, args.context, batch) if kind == "essays" \
                else random_prompts(llm.model_config.vocab_size, args.context, batch)
            ids = torch.tensor(prompts, device=device)
            with torch.inference_mode():
                full = timed(lambda: hf(ids, use_cache=False), device, args.reps)  # noqa: B023
                last = timed(lambda: hf(ids, use_cache=False, logits_to_keep=1),  # noqa: B023
                             device, args.reps)
                ours, prefill = engine_prefill_s(llm, prompts, args.reps)
                a = llm.next_token_logits(prompts[:1])[0]
                b = hf(ids[:1], use_cache=False, logits_to_keep=1).logits[0, -1].float()
            rows.append({"kind": kind, "batch": batch, "context": args.context,
                         "engine_generate_1_ms": 1e3 * ours, "engine_prefill_ms": 1e3 * prefill,
                         "hf_forward_ms": 1e3 * full, "hf_forward_last_logits_ms": 1e3 * last,
                         "speedup_vs_hf": full / ours, "speedup_vs_hf_last_logits": last / ours,
                         "tokens_per_s": batch * args.context / ours,
                         "same_next_token_as_hf": bool(a.argmax() == b.argmax()),
                         "max_abs_logit_diff": float((a - b).abs().max())})
            print(json.dumps(rows[-1]), flush=True)
    return rows


# --- 8B shapes -------------------------------------------------------------------------------

def matmul_params(cfg) -> int:  # noqa: ANN001
    """Weights a token multiplies by: q/k/v and o, then the dense MLP, or in a mixture of
    experts the router and the experts_per_token experts a token is routed to (the active
    ones: an expert's gate/up and down)."""
    d, h = cfg.head_dim, cfg.hidden_size
    attention = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    return cfg.num_layers * (attention + mlp_params(cfg))


def mlp_params(cfg) -> int:  # noqa: ANN001
    """Weights a token multiplies by in one layer's MLP (the active experts and the router
    in a mixture of experts)."""
    if not cfg.num_experts:
        return 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.hidden_size * (cfg.num_experts
                              + 3 * cfg.experts_per_token * cfg.moe_intermediate_size)


def window_pairs(n: int, window: int) -> float:
    """Causal (query, key) pairs of an n-token prompt when each query sees at most `window`
    keys (itself included); 0: no window."""
    if not window or window >= n:
        return n * (n + 1) / 2
    return window * (window + 1) / 2 + (n - window) * window


def attention_flops(cfg, context: int, batch: int) -> float:  # noqa: ANN001
    """QK^T and PV of every layer over its visible keys: sliding-window layers (gpt-oss's
    every other layer) over their window, the rest causally over the whole prompt."""
    per_pair = 4.0 * cfg.num_heads * cfg.head_dim
    return batch * per_pair * sum(window_pairs(context, cfg.window(i))
                                  for i in range(cfg.num_layers))


def shapes_section(args: argparse.Namespace) -> list[dict]:
    peak = matmul_tflops()
    rows = []
    for name in args.shapes:
        llm = LLM(str(CONFIGS / name), device="cuda", dtype="bfloat16", load_format="dummy",
                  kv_cache_bytes=int(args.kv_gb * (1 << 30)))
        cfg = llm.model_config
        for batch, context in ((16, 8192), (1, 32768)):
            prompts = random_prompts(cfg.vocab_size, context, batch)
            wall, prefill = engine_prefill_s(llm, prompts, max(2, args.reps // 2))
            tokens = batch * context
            experts = 2.0 * cfg.num_layers * mlp_params(cfg) * tokens if cfg.num_experts else 0.0
            flops = 2.0 * matmul_params(cfg) * tokens + attention_flops(cfg, context, batch) \
                + 2.0 * cfg.hidden_size * cfg.vocab_size * batch
            rows.append({"shape": name, "batch": batch, "context": context,
                         "engine_generate_1_ms": 1e3 * wall, "engine_prefill_ms": 1e3 * prefill,
                         "tflop": flops / 1e12, "active_expert_tflop": experts / 1e12,
                         "tflops": flops / wall / 1e12, "matmul_tflops_8192": peak,
                         "fraction_of_matmul": flops / wall / 1e12 / peak})
            print(json.dumps(rows[-1]), flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def memory_section(args: argparse.Namespace) -> list[dict]:
    context = 131072 - 64
    llm = LLM(str(CONFIGS / "llama-3.1-8b"), device="cuda", dtype="bfloat16",
              load_format="dummy", kv_cache_bytes=int(24 << 30))
    prompt = random_prompts(llm.model_config.vocab_size, context, 1)
    sync(llm.device)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    sync(llm.device)
    wall = time.perf_counter() - t0
    row = {"shape": "llama-3.1-8b", "context": context, "prefill_chunk": llm.config.prefill_chunk,
           "weights_and_kv_gib": base / 2 ** 30,
           "peak_beyond_weights_and_kv_gib": (torch.cuda.max_memory_allocated() - base) / 2 ** 30,
           "n_by_n_bf16_gib_if_materialised": context ** 2 * 2 / 2 ** 30,
           "first_call_s": wall}
    print(json.dumps(row), flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [row]


# --- profile ---------------------------------------------------------------------------------

def busy_fraction(prof, wall_us: float) -> tuple[float, list[dict]]:  # noqa: ANN001
    spans, per_kernel = [], {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((ev.time_range.start, ev.time_range.end))
            key = ev.name[:60]
            per_kernel[key] = per_kernel.get(key, 0.0) + ev.time_range.elapsed_us()
    spans.sort()
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:8]
    return busy / wall_us, [{"kernel": k, "ms": v / 1e3} for k, v in top]


def profile_section(args: argparse.Namespace) -> list[dict]:
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              kv_cache_bytes=int(args.profile_kv_gb * (1 << 30)), load_format=args.load_format)
    rows = []
    for batch in args.batches:
        prompts = random_prompts(llm.model_config.vocab_size, args.context, batch) \
            if args.load_format == "dummy" else essay_prompts(llm.tokenizer, args.context, batch)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        llm.generate(prompts, params)
        sync(llm.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                               if llm.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            ttft = llm.generate(prompts, params)[0].stats["ttft_s"]
            sync(llm.device)
            wall = time.perf_counter() - t0
        busy, top = busy_fraction(prof, wall * 1e6)
        # nearly every kernel of a one-token generate() is the prefill's
        busy_ttft = busy * wall / ttft
        host = cProfile.Profile()
        host.enable()
        llm.generate(prompts, params)
        sync(llm.device)
        host.disable()
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(25)
        rows.append({"batch": batch, "context": args.context, "wall_ms": 1e3 * wall,
                     "ttft_ms": 1e3 * ttft, "gpu_busy_fraction": busy,
                     "gpu_busy_fraction_of_ttft": busy_ttft, "top_kernels": top,
                     "host_profile": text.getvalue().splitlines()[-40:]})
        print(json.dumps(rows[-1]), flush=True)
    del llm
    gc.collect()
    return rows


# --- end to end ------------------------------------------------------------------------------

def e2e_section(args: argparse.Namespace) -> list[dict]:
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_bytes=int(8 << 30))
    rows, batch = [], max(args.batches)
    for kind in args.kinds:
        prompts = essay_prompts(llm.tokenizer, args.context, batch) if kind == "essays" \
            else random_prompts(llm.model_config.vocab_size, args.context, batch)
        base = None
        for method in ("vanilla", "vegas", "stream"):
            spec = SpecConfig(method=method)
            params = SamplingParams(max_tokens=args.e2e_tokens, ignore_eos=True)
            llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True),
                         speculative=spec)
            llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True),
                         speculative=spec)
            sync(llm.device)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, speculative=spec)
            wall = time.perf_counter() - t0
            stats = outs[0].stats
            tokens = [o.token_ids for o in outs]
            base = tokens if base is None else base
            rows.append({"kind": kind, "method": method, "batch": batch, "context": args.context,
                         "new_tokens": args.e2e_tokens, "total_s": wall,
                         "ttft_s": stats["ttft_s"], "prefill_s": stats["prefill_s"],
                         "decode_s": stats["decode_s"],
                         "prefill_fraction": stats["prefill_s"] / wall,
                         "tokens_per_iteration": stats.get("tokens_per_iteration"),
                         "identical_to_vanilla": sum(a == b for a, b in zip(tokens, base))})
            print(json.dumps(rows[-1]), flush=True)
    return rows


SECTIONS = {"kernel": kernel_section, "smollm": smollm_section, "shapes": shapes_section,
            "memory": memory_section, "profile": profile_section, "e2e": e2e_section}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="SmolLM2 GGUF (default: the embedded one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="auto")
    p.add_argument("--load-format", default="auto", help="dummy: random weights (profile)")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    p.add_argument("--context", type=int, default=7500)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--kinds", nargs="+", default=["essays", "random"])
    p.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "qwen3-8b"])
    p.add_argument("--kv-gb", type=float, default=40.0)
    p.add_argument("--profile-kv-gb", type=float, default=8.0,
                   help="the KV pool of the profile section's engine (GB)")
    p.add_argument("--e2e-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict = {"meta": {"torch": torch.__version__, "device": args.device,
                             "card": torch.cuda.get_device_name() if args.device == "cuda"
                             else "cpu", "date": time.strftime("%Y-%m-%d")}}
    for name in args.sections:
        result[name] = SECTIONS[name](args)
        args.out.write_text(json.dumps(result, indent=1))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
