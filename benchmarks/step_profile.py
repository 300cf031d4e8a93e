"""Time of one plain step, one verify step, one draft step and one selection, each against its
memory-bandwidth floor, on a dummy-weights model (timing only: the weights and the KV cache are
random, so no token means anything).

    python benchmarks/step_profile.py --config benchmarks/configs/llama-3.1-8b \
        --contexts 32768 65536 131072 --batches 1 4 --out scaling.json
    python benchmarks/step_profile.py --config benchmarks/configs/smollm2-135m \
        --contexts 7500 --batches 64 --profile --out smollm2_steps.json

Every step is the engine's own CUDA graph (the GraphRunner of the method, batch bucket =
batch), replayed `--reps` times after a warm-up; the figure is the median of CUDA-event times.
The selection is the vegas policy turning the verify step's scores into the next plan,
including the copy of the plan into the graph buffers, with the attention backend's top-k
(`select_reference_ms`: with the PyTorch reference's). A round is what a greedy iteration
replays: the γ draft steps, the verify step, acceptance and the next selection captured as
one graph (also timed without the selection: the difference is the selection's cost inside
the graph, `select_in_round_ms`). Floors:
bytes the step must move (weights once, K and V of every position it attends to; for the
verify step with scores also its score rows' logits, written and read back as
`score_bytes_per_key` counts them) over the measured copy bandwidth;
`floor_verify_over_plain` is that floor over the measured plain step: the least verify / plain
any kernel of this design can reach.
A mixture of experts' step streams only the experts its tokens hit, so its weight bytes
(`weight_bytes_plain`, `_verify`, `_draft`) count in every layer the distinct experts its
router picked, counted from one eager forward of the step's inputs (`experts_hit_<step>`,
the mean over the layers), and beside them under uniform routing, E·(1 - (1 - k/E)^n) for
n = batch x rows tokens (`..._expected`, and `byte_ideal_speedup_expected`): a verify step's
γ+1 rows a sequence hit more experts than a plain step's one, which eats into the speedup at
a small batch (`--batches 1 16 64`; a closing table lists each step's experts and weight
bytes and the projected and byte-ideal speedups). The dummy weights' biases, ones, are drawn
as their weights for a mixture of experts (`spread_biases`), else gpt-oss's route every token
alike. Both families' experts run the fused MoE kernel (`kernels.fused_moe`, gpt-oss's biases
and clamped SwiGLU included), which reads the experts hit and no others:

    python benchmarks/step_profile.py --config benchmarks/configs/qwen3-30b-a3b \
        --contexts 4096 --batches 1 16 64 --brief --out qwen3_moe_steps.json

`--modes default exact` runs every (context, batch) in both modes, each in an engine of its
own, and ends with exact mode's cost: plain steps per second and vegas's projected tokens
per second (τ · batch / (round + host work)) in exact mode against the default mode
(`--brief` skips the extra steps below to keep such a run short):

    python benchmarks/step_profile.py --config benchmarks/configs/smollm2-135m \
        --contexts 7500 --batches 64 --modes default exact --brief --out exact_smollm2.json

`--profile` adds a per-kernel table (torch.profiler) of one replay of each step (quest's
draft step too); `--launches` counts the kernels of one replay of each step, the greedy and
the sampled round included (`launches_<step>`, and by kernel under `launches`: on CUDA the
profiler's, a graph's kernels included; on CPU what the CPU path runs, Triton launches
under the interpreter and PyTorch operators that would launch a kernel, the sampling
references included, for the script's own tests);
`--score-tiles` times scored passes with other tiles than the library's for the model's head
dim (`paged_attention.PagedTuning.score_tiles`), each in graphs of its own; `--sparse-splits
paged` the draft steps with the sparse attention split by the paged kernel's rule, likewise
(a number N: the one-wave split with N programs per SM at the model's head dim);
`--topk-min-warps 1 2 4` the resident top-k (quest's pages, vegas's ranking) with at least
that many warps, likewise;
`--projections` the weight-streaming rate of every projection at the plain and the verify
step's row counts. Also reported: the verify step without scores (stream's), quest's draft
step, the host work between rounds of the engine's own loop and the projected speedup
τ · plain / (round + host work) for `--tokens-per-iteration` τ, beside the byte-ideal one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import time
import unittest.mock
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from common import copy_bandwidth, cuda_median_ms

from vegas_spec import LLM, SamplingParams, SpecConfig, quant, runner_setup
from vegas_spec.config import ModelConfig
from vegas_spec.graphs import GraphRunner
from vegas_spec.kernels import paged_attention as pa
from vegas_spec.kernels import sparse_attention as sa
from vegas_spec.kernels import split_merge, tuned
from vegas_spec.kernels import topk as tk
from vegas_spec.models.loader import load_config, resolve
from vegas_spec.ops import route
from vegas_spec.sampling import BatchSampling
from vegas_spec.speculative.policies import SelectionInput, make_policy


def median_ms(fn, reps: int) -> float:  # noqa: ANN001
    fn()
    if not torch.cuda.is_available():  # CPU smoke runs: wall time
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    return cuda_median_ms(fn, reps)


def kernel_table(fn, rows: int = 25) -> str:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return "(no CUDA: no kernel table)"
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total = sum(e.device_time for e in events)
    head = f"{len(events)} kernels, {total / 1e3:.3f} ms of kernel time\n"
    return head + prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


# PyTorch operators that launch no kernel on a GPU (views, allocations, metadata)
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "expand", "select", "slice", "t", "transpose", "permute",
    "unsqueeze", "squeeze", "as_strided", "detach", "alias", "reshape", "split",
    "split_with_sizes", "unbind", "lift_fresh", "view_as", "narrow", "unflatten", "flatten",
    "diagonal", "empty", "empty_like", "empty_strided", "sym_size", "sym_stride",
    "is_same_size", "_local_scalar_dense"})


def launches(fn) -> dict[str, int]:  # noqa: ANN001
    """The kernels one call of fn launches, by name: on CUDA the profiler's (a graph
    replay's included); elsewhere the Triton launches (under the interpreter) and the
    PyTorch operators that launch a kernel on a GPU, counted as fn runs them."""
    import collections

    fn()
    counts: collections.Counter[str] = collections.Counter()
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        counts.update(e.name for e in prof.events() if e.device_type.name == "CUDA")
        return dict(counts)
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    inside = [0]

    class Operators(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            name = func.overloadpacket.__name__
            if not inside[0] and name not in NO_KERNEL:
                counts["torch." + name] += 1
            return func(*args, **(kwargs or {}))

    launch = interpreter.GridExecutor.__call__

    def counted(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        counts["triton." + self.fn.__name__] += 1
        inside[0] += 1
        try:
            return launch(self, *a, **k)
        finally:
            inside[0] -= 1

    interpreter.GridExecutor.__call__ = counted
    try:
        with Operators():
            fn()
    finally:
        interpreter.GridExecutor.__call__ = launch
    return dict(counts)


def graph_runner(llm: LLM, spec: SpecConfig, policy: Any, bsz: int) -> GraphRunner:
    """The engine's decode buffers (and graphs) for `spec` and bsz rows, as `reserve` makes
    them."""
    runner = llm.engine.runner
    runner_setup.reserve(runner.input, runner.parts, runner.config, spec, policy, bsz)
    assert runner.graphs is not None
    return runner.graphs


def held_graph_runner(llm: LLM, shapes: Any, capacity: int, policy: Any) -> GraphRunner:
    """Buffers (and graphs) of `shapes` for `capacity` rows, held by the engine's runner."""
    r = llm.engine.runner
    graphs = GraphRunner(r.model, r.cache.layers, r.ops, r.attn, shapes, capacity,
                         llm.config.page_size, r.scratch_page, llm.config.graphs, policy)
    r.use_graphs(graphs)
    return graphs


def weight_bytes(llm: LLM) -> int:
    """Bytes of weights a step reads: every parameter once, and experts kept in MXFP4 as
    stored, but of an untied input embedding only the looked-up rows (ignored)."""
    model = llm.engine.runner.model
    params = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    total += sum(w.blocks.nbytes + w.scales.nbytes for layer in model.layers
                 for w in (getattr(layer, "packed", None) or ()))
    embed, head = llm.engine.runner.model.embed.weight, llm.engine.runner.model.lm_head.weight
    untied = embed.data_ptr() != head.data_ptr()
    return total - (embed.numel() * embed.element_size() if untied else 0)


def draft_weight_bytes(llm: LLM) -> int:
    """Bytes of weights a draft step reads: `weight_bytes`, with the projections' FP8 copies
    in place of the model's projections where the engine made them."""
    total = weight_bytes(llm)
    for layer in llm.engine.runner.model.layers:
        if layer.drafts is not None:
            for name, copy in layer.drafts.items():
                w = getattr(layer, name).weight
                total += copy.nbytes - w.numel() * w.element_size()
    return total


def expected_experts_hit(experts: int, top_k: int, tokens: int) -> float:
    """The expected number of distinct experts that `tokens` routed tokens hit in one layer,
    assuming each token picks its top_k of the `experts` experts uniformly at random and
    independently of the other tokens (the dummy router's case, roughly: random weights on
    random tokens; a trained router's skewed load hits fewer). One token misses a given
    expert with probability 1 - k/E, so E·(1 - (1 - k/E)^n) are hit. 0 without experts."""
    if experts == 0:
        return 0.0
    return experts * (1 - (1 - top_k / experts) ** tokens)


def expert_bytes(cfg: ModelConfig, itemsize: float) -> float:
    """One expert's weights in one layer: gate/up [2I, H] and down [H, I], and where
    cfg.expert_bias (gpt-oss) their biases [2I] and [H], at itemsize bytes a value (17/32
    in MXFP4: its biases are then undercounted by 0.1% of the expert); 0 for a dense
    model."""
    if not cfg.num_experts:
        return 0
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return itemsize * (3 * h * i + (2 * i + h if cfg.expert_bias else 0))


def routed_weight_bytes(cfg: ModelConfig, all_bytes: int, itemsize: float,
                        hits: Sequence[float]) -> float:
    """`all_bytes` (every weight read once: `weight_bytes` or `draft_weight_bytes`, i.e.
    attention projections, norms, routers, LM head and every expert) with each layer's
    experts counted only for those its tokens hit: hits[l] distinct experts in layer l. A
    dense config's: all_bytes as it is."""
    if not cfg.num_experts:
        return all_bytes
    assert len(hits) == cfg.num_layers, f"{len(hits)} layers' hits, {cfg.num_layers} layers"
    per = expert_bytes(cfg, itemsize)
    return all_bytes - cfg.num_layers * cfg.num_experts * per + per * sum(hits)


def expected_weight_bytes(cfg: ModelConfig, all_bytes: int, itemsize: float, rows: int,
                          batch: int) -> float:
    """The weight bytes a step of `batch` sequences of `rows` rows each (1: a plain or draft
    step; γ+1: a verify step) is expected to stream: `routed_weight_bytes` with
    `expected_experts_hit` of rows × batch tokens in every layer (uniform routing). A dense
    config's: all_bytes, whatever rows and batch."""
    hit = expected_experts_hit(cfg.num_experts, cfg.experts_per_token, rows * batch)
    return routed_weight_bytes(cfg, all_bytes, itemsize, [hit] * cfg.num_layers)


def spread_biases(model: torch.nn.Module, seed: int = 0) -> None:
    """Every bias of dummy weights drawn as the loader draws weights, N(0, 0.02), in place of
    its ones: a constant o_proj bias (gpt-oss's) swamps the residual stream of random
    weights, and every token then routes to the same experts."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                gen = torch.Generator(p.device).manual_seed(seed)
                p.normal_(0.0, 0.02, generator=gen)
                seed += 1


@contextlib.contextmanager
def routing_recorded(ops: Any) -> Iterator[list[torch.Tensor]]:
    """While open, every `moe` call of `ops` (the ops seam) also appends the expert ids
    [T, k] its router logits pick (`ops.route`, as `moe` routes them), one entry a layer."""
    ids: list[torch.Tensor] = []
    moe = ops.moe

    def recording(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, top_k: int, renormalize: bool,
                  *rest: Any) -> torch.Tensor:
        ids.append(route(logits.reshape(-1, logits.shape[-1]), top_k, renormalize)[1])
        return moe(x, logits, gate_up, down, top_k, renormalize, *rest)

    ops.moe = recording
    try:
        yield ids
    finally:
        del ops.moe


def experts_hit(runner: GraphRunner, kind: str) -> list[int]:
    """Distinct experts each layer routes the tokens of `runner`'s last `kind` step to: one
    eager forward of the inputs in its buffers (tokens, positions, plan) with the routing
    recorded, since a replayed graph's routing stays inside it. The forward rewrites the K
    and V the step wrote, the same values."""
    with routing_recorded(runner.ops) as ids:
        runner._forward(kind, runner.rows)
    return [int(i.unique().numel()) for i in ids]


def expert_itemsize(llm: LLM) -> float:
    """Bytes a value of the experts' matrices: their dtype's, 17/32 kept in MXFP4 (half a
    byte, and a scale byte a 32); 0 for a dense model."""
    layer = llm.engine.runner.model.layers[0]
    if getattr(layer, "packed", None) is not None:
        return 17 / 32
    weights = getattr(layer, "experts_gate_up", None)
    return 0 if weights is None else weights.element_size()


def step_weights(cfg: ModelConfig, bsz: int, gamma: int, all_bytes: dict[str, int],
                 itemsize: float, hits: dict[str, list[int]]) -> dict:
    """Each step's weight bytes (`weight_bytes_plain`, `_verify`, `_draft`): of a dense
    model all_bytes[step]; of a mixture of experts only the experts hit, counted (`hits`,
    `experts_hit_<step>`: their mean over the layers) and expected under uniform routing
    (`..._expected`)."""
    out: dict = {}
    for step, base in all_bytes.items():
        rows = gamma + 1 if step == "verify" else 1
        if not cfg.num_experts:
            out[f"weight_bytes_{step}"] = base
            continue
        out[f"experts_hit_{step}"] = sum(hits[step]) / len(hits[step])
        out[f"experts_hit_{step}_expected"] = expected_experts_hit(
            cfg.num_experts, cfg.experts_per_token, rows * bsz)
        out[f"weight_bytes_{step}"] = routed_weight_bytes(cfg, base, itemsize, hits[step])
        out[f"weight_bytes_{step}_expected"] = expected_weight_bytes(cfg, base, itemsize,
                                                                     rows, bsz)
    return out


def set_floors(row: dict, moved: dict[str, int], bandwidth: float, suffix: str = "") -> None:
    """row["floor_<step><suffix>_ms"]: the step's weight bytes (row["weight_bytes_<step>
    <suffix>"]) and the other bytes it moves (`moved`: K/V, scores) over the bandwidth."""
    for step, other in moved.items():
        row[f"floor_{step}{suffix}_ms"] = 1e3 * (row[f"weight_bytes_{step}{suffix}"]
                                                 + other) / bandwidth


def measure(llm: LLM, spec: SpecConfig, context: int, bsz: int, args: argparse.Namespace,
            bandwidth: float, rank_width: str = "library") -> dict:
    cfg, dev = llm.model_config, llm.device
    gamma = spec.gamma
    pages = [llm.engine.runner.cache.allocate(context + gamma + 1) for _ in range(bsz)]
    try:
        table = torch.tensor(pages, dtype=torch.int32, device=dev)
        lengths = torch.full((bsz,), context, dtype=torch.long, device=dev)
        tokens = torch.randint(0, cfg.vocab_size, (bsz, gamma + 1), device=dev)
        positions = lengths[:, None] + torch.arange(gamma + 1, device=dev)
        out: dict = {"context": context, "batch": bsz}
        kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim \
            * llm.engine.runner.cache.layers[0][0].element_size()
        wbytes = weight_bytes(llm)
        profiles: dict[str, str] = {}
        counted: dict[str, dict[str, int]] = {}  # each step's launches by kernel
        hits: dict[str, list[int]] = {}  # each step's experts hit, layer by layer (MoE)

        plain = graph_runner(llm, SpecConfig(method="vanilla"), None, bsz)
        plain.set_rows(0, table)
        step = lambda: plain.run("plain", tokens[:, :1], positions[:, :1])  # noqa: E731
        out["plain_ms"] = median_ms(step, args.reps)
        if args.profile:
            profiles["plain"] = kernel_table(step)
        if args.launches:
            counted["plain"] = launches(step)
        if cfg.num_experts:
            hits["plain"] = experts_hit(plain, "plain")
        llm.engine.runner.use_graphs(None)

        if not args.brief:
            # The same verify step without scores (stream's runner: no score request).
            stream = dataclasses.replace(spec, method="stream")
            unscored = graph_runner(llm, stream, make_policy(stream), bsz)
            unscored.set_rows(0, table)
            out["verify_noscores_ms"] = median_ms(
                lambda: unscored.run("verify", tokens, positions), args.reps)
            llm.engine.runner.use_graphs(None)
            out["quest_draft_ms"] = quest_draft_ms(llm, spec, bsz, table, lengths, tokens,
                                                   positions, context, args.reps,
                                                   profiles if args.profile else None)

        policy = make_policy(spec)
        runner = graph_runner(llm, spec, policy, bsz)
        runner.set_rows(0, table)
        verify = lambda: runner.run("verify", tokens, positions)  # noqa: E731
        out["verify_ms"] = median_ms(verify, args.reps)
        if args.profile:
            profiles["verify"] = kernel_table(verify)
        if args.launches:
            counted["verify"] = launches(verify)
        verify()
        if cfg.num_experts:
            hits["verify"] = experts_hit(runner, "verify")
        # the host bounds of the runner's shapes, as the engine's selection has them
        inp = runner.bound(SelectionInput(
            runner.scores(), lengths, torch.zeros_like(lengths), lengths + 1, gamma,
            llm.engine.runner.cache.layers, table, llm.config.page_size, max_len=context + 1,
            topk=runner.attn.topk, topk_sum=runner.attn.topk_sum))
        if rank_width == "whole":  # the top-k ranks the whole static key width
            inp.rank_width = None

        def select() -> None:
            plan = policy.plan(inp)
            runner.set_plan_rows(plan, 0)

        out["select_ms"] = median_ms(select, args.reps)
        # the same plan ranked by the PyTorch reference (torch.topk and a sort), side by side
        reference = dataclasses.replace(inp, topk=None, topk_sum=None)
        out["select_reference_ms"] = median_ms(
            lambda: runner.set_plan_rows(policy.plan(reference), 0), args.reps)
        select()
        budget = int(runner.buf.budget[:bsz].max())  # the plan select() left in the buffers
        draft = lambda: runner.run("draft", tokens[:, :1], positions[:, :1])  # noqa: E731
        out["draft_ms"] = median_ms(draft, args.reps)
        if args.launches:
            counted["draft"] = launches(draft)
        if args.profile:
            profiles["draft"] = kernel_table(draft)
            profiles["select"] = kernel_table(select)
        if cfg.num_experts:
            hits["draft"] = experts_hit(runner, "draft")
        plan = policy.plan(inp)
        llm.engine.runner.use_graphs(None)

        # A greedy round as the engine runs it: γ drafts, verify, acceptance and the next
        # selection in one graph; and the same round without the selection.
        last = tokens[:, 0].contiguous()
        shapes = runner_setup.static_shapes(llm.engine.runner.parts, spec, policy,
                                            args.narrowest_span)
        longest = context if args.narrowest_span else None  # the width the engine would run
        if rank_width == "whole":
            shapes = dataclasses.replace(shapes, rank_width=0)
        for key, plans in (("round_ms", True), ("round_unplanned_ms", False)):
            greedy = held_graph_runner(llm, dataclasses.replace(shapes, plans=plans), bsz,
                                       policy)
            greedy.set_rows(0, table)
            greedy.set_plan_rows(plan, 0)
            round_ = functools.partial(greedy.run_spec, last, lengths, None, None, longest)
            out[key] = median_ms(round_, args.reps)
            if args.profile and plans:
                profiles["round"] = kernel_table(round_)
            if args.launches and plans:
                counted["round"] = launches(round_)
            llm.engine.runner.use_graphs(None)
        out["round_sampled_ms"] = sampled_round_ms(llm, shapes, policy, table, plan, last,
                                                   lengths, args.reps,
                                                   counted if args.launches else None, longest)
        out["select_in_round_ms"] = out["round_ms"] - out["round_unplanned_ms"]
        out["budget"] = budget
        full_kv = kv_read_bytes(cfg, bsz, context, 1, kv_token)
        sparse_kv = kv_read_bytes(cfg, bsz, budget + 2 * gamma + 1, 1, kv_token, context)
        scored = runner.shapes
        score_bytes = bsz * context * cfg.num_layers * score_bytes_per_key(
            scored.score_mode, cfg.num_heads, cfg.num_kv_heads, len(scored.score_rows),
            scored.score_groups) if scored.score_rows else 0
        out.update(step_weights(cfg, bsz, gamma, {
            "plain": wbytes, "verify": wbytes, "draft": draft_weight_bytes(llm)},
            expert_itemsize(llm), hits))
        # the verify step with scores also writes and reads back its rows' logits
        verify_kv = kv_read_bytes(cfg, bsz, context, gamma + 1, kv_token)
        moved = {"plain": full_kv, "verify": verify_kv + score_bytes, "draft": sparse_kv}
        set_floors(out, moved, bandwidth)
        if cfg.num_experts:
            set_floors(out, moved, bandwidth, "_expected")
        out["score_bytes"] = score_bytes
        out["weight_bytes"], out["kv_bytes"] = wbytes, full_kv
        for k in ("plain", "verify", "draft"):
            out[f"{k}_vs_floor"] = out[f"{k}_ms"] / out[f"floor_{k}_ms"]
        out["draft_over_plain"] = out["draft_ms"] / out["plain_ms"]
        out["ideal_speedup_at_7_tokens"] = (gamma + 1) * out["plain_ms"] / (
            gamma * out["draft_ms"] + out["verify_ms"] + out["select_ms"])
        out["round_over_steps"] = out["round_unplanned_ms"] / (
            gamma * out["draft_ms"] + out["verify_ms"])
        out["ideal_speedup_at_7_tokens_round"] = (gamma + 1) * out["plain_ms"] / out["round_ms"]
        out["verify_over_plain"] = out["verify_ms"] / out["plain_ms"]
        # the least verify / plain a kernel of this design can reach (at its byte floor)
        out["floor_verify_over_plain"] = out["floor_verify_ms"] / out["plain_ms"]
        if not args.brief:
            out["verify_noscores_over_plain"] = out["verify_noscores_ms"] / out["plain_ms"]
            out["quest_draft_over_draft"] = out["quest_draft_ms"] / out["draft_ms"]
        if profiles:
            out["profiles"] = profiles
        for name, kernels in counted.items():
            out[f"launches_{name}"] = sum(kernels.values())
        if counted:
            out["launches"] = counted
        return out
    finally:
        for p in pages:
            llm.engine.runner.cache.release(p)


def projection_bandwidth(llm: LLM, rows: int, bandwidth: float, reps: int) -> dict:
    """Each projection (and the LM head) at M = rows: µs per call and the weight bytes it
    streams per second as a fraction of the copy bandwidth. Every call of the timed graph
    uses the next layer's weight, so that no weight is read from L2. A mixture of experts'
    layers: the attention's projections only (the experts are no nn.Linear)."""
    from vegas_spec.graphs import capture

    model, linear, out = llm.engine.runner.model, llm.engine.runner.ops.linear, {}
    names = [n for n in ("qkv", "o_proj", "gate_up", "down") if hasattr(model.layers[0], n)]
    groups = {n: [getattr(layer, n) for layer in model.layers] for n in names}
    groups["lm_head"] = [model.lm_head]
    for name, mods in groups.items():
        x = torch.randn(rows, mods[0].in_features, device=llm.device,
                        dtype=mods[0].weight.dtype)
        graph, _ = capture(lambda mods=mods, x=x: [linear(x, m.weight, m.bias) for m in mods],
                           None)
        ms = median_ms(graph.replay, reps) / len(mods)
        weight = mods[0].weight
        per_s = weight.numel() * weight.element_size() / (ms / 1e3)
        out[name] = {"us": 1e3 * ms, "fraction_of_copy": per_s / bandwidth}
    return out


def sampled_round_ms(llm: LLM, shapes: Any, policy: Any, table: torch.Tensor, plan: Any,
                     last: torch.Tensor, lengths: torch.Tensor, reps: int,
                     counted: dict[str, dict[str, int]] | None = None,
                     longest: int | None = None) -> float:
    """A sampled round as the engine runs it, every row at the reference's setting:
    temperature 0.6, top-k 20, top-p 0.95 (the `topk` graph), at the key width that holds
    `longest` (None: the whole); with `counted`, its launches go there as "round_sampled"."""
    runner = held_graph_runner(llm, shapes, len(last), policy)
    runner.set_rows(0, table)
    runner.set_plan_rows(plan, 0)
    rows = len(last)
    runner.buf.temperature[:rows], runner.buf.top_k[:rows] = 0.6, 20
    runner.buf.top_p[:rows] = 0.95
    runner.buf.seeds[:rows] = torch.arange(rows, device=last.device)
    setting = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
    sampling = BatchSampling.build([setting] * rows, last.device)
    round_ = functools.partial(runner.run_spec, last, lengths, sampling, None, longest)
    ms = median_ms(round_, reps)
    if counted is not None:
        counted["round_sampled"] = launches(round_)
    llm.engine.runner.use_graphs(None)
    return ms


def project(row: dict, gamma: int, tau: float) -> None:
    """The speedup a round of τ tokens gives over plain steps, from the captured round graph
    plus the host work between rounds; beside it the byte-ideal one (every step at its floor)."""
    row["tokens_per_iteration"] = tau
    row["projected_speedup"] = tau * row["plain_ms"] / (row["round_ms"] + row["host_gap_ms"])
    # a sampled plain step costs about a greedy one plus its sampling (~2-5% at these shapes)
    row["projected_sampled_speedup"] = tau * row["plain_ms"] / (
        row["round_sampled_ms"] + row["host_gap_ms"])
    row["sampled_vs_greedy_round"] = row["round_sampled_ms"] / row["round_ms"]
    for suffix in ("", "_expected") if "floor_plain_expected_ms" in row else ("",):
        row[f"byte_ideal_speedup{suffix}"] = tau * row[f"floor_plain{suffix}_ms"] / (
            gamma * row[f"floor_draft{suffix}_ms"] + row[f"floor_verify{suffix}_ms"])


def quest_draft_ms(llm: LLM, spec: SpecConfig, bsz: int, table: torch.Tensor,
                   lengths: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                   context: int, reps: int, profiles: dict[str, str] | None = None) -> float:
    """quest's draft step (page scoring and top-k inside every layer) at the same budget;
    with `profiles`, its kernel table goes there as "quest_draft"."""
    quest = dataclasses.replace(spec, method="quest")
    policy = make_policy(quest)
    runner = graph_runner(llm, quest, policy, bsz)
    runner.set_rows(0, table)
    inp = SelectionInput(None, lengths, torch.zeros_like(lengths), lengths + 1, spec.gamma,
                         llm.engine.runner.cache.layers, table, llm.config.page_size,
                         max_len=context + 1)
    runner.set_plan_rows(policy.plan(runner.bound(inp)), 0)
    draft = lambda: runner.run("draft", tokens[:, :1], positions[:, :1])  # noqa: E731
    ms = median_ms(draft, reps)
    if profiles is not None:
        profiles["quest_draft"] = kernel_table(draft)
    llm.engine.runner.use_graphs(None)
    return ms


def host_gap_ms(llm: LLM, spec: SpecConfig, bsz: int, new_tokens: int = 64,
                prompt_tokens: int = 256) -> float:
    """Wall time per iteration of the engine's own greedy decode loop (short prompts, every
    sequence decoding `new_tokens`) that is not the round graph's GPU time: the host work
    between rounds (reading the accepted counts, bookkeeping, the next replay's copies)."""
    vocab = llm.model_config.vocab_size
    prompts = [[(i * 7919 + j * 31) % vocab for j in range(prompt_tokens)] for i in range(bsz)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, speculative=spec)  # captures this bucket's graphs
    stats = llm.generate(prompts, params, speculative=spec)[0].stats
    llm.engine.runner.use_graphs(None)
    iterations = max(stats["iterations"], 1)
    gpu = sum(stats["phase_s"].get(k, 0.0) for k in ("speculate", "select"))
    return 1e3 * (stats["decode_s"] - gpu) / iterations


def exact_cost(rows: list[dict]) -> list[dict]:
    """Per (context, batch) measured in both modes: plain steps' and vegas's projected
    tokens per second in each, and exact mode's slowdown (1 - exact / default)."""
    out = []
    for ex in (r for r in rows if r["mode"] == "exact"):
        key = ("context", "batch", "rank_width")
        base = next((r for r in rows if r["mode"] == "default"
                     and all(r.get(k) == ex.get(k) for k in key)), None)
        if base is None:
            continue
        line = {"context": ex["context"], "batch": ex["batch"], "rank_width": ex["rank_width"]}
        for name, row in (("default", base), ("exact", ex)):
            line[f"plain_tok_s_{name}"] = 1e3 * row["batch"] / row["plain_ms"]
            line[f"vegas_tok_s_{name}"] = 1e3 * row["batch"] * row["tokens_per_iteration"] / (
                row["round_ms"] + row["host_gap_ms"])
        for kind in ("plain", "vegas"):
            line[f"{kind}_slowdown"] = 1 - line[f"{kind}_tok_s_exact"] / line[
                f"{kind}_tok_s_default"]
        out.append(line)
    return out


def cost_table(lines: list[dict]) -> str:
    head = ("| context | batch | plain tok/s default | exact | slower | vegas tok/s default "
            "| exact | slower |\n|---|---|---|---|---|---|---|---|")
    body = [f"| {c['context']} | {c['batch']} | {c['plain_tok_s_default']:.0f} | "
            f"{c['plain_tok_s_exact']:.0f} | {100 * c['plain_slowdown']:.1f}% | "
            f"{c['vegas_tok_s_default']:.0f} | {c['vegas_tok_s_exact']:.0f} | "
            f"{100 * c['vegas_slowdown']:.1f}% |" for c in lines]
    return "\n".join([head, *body])


def moe_table(rows: list[dict], experts: int) -> str:
    """Per row: each step's experts hit (mean over the layers, of `experts`; counted, and in
    brackets expected under uniform routing), its weight bytes, and the projected and
    byte-ideal speedups (counted; uniform)."""
    head = (f"| context | batch | experts hit of {experts}: plain | verify | draft "
            "| weight GB: plain | verify | draft | projected | byte-ideal | uniform |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    body = []
    for r in rows:
        hit = " | ".join(f"{r[f'experts_hit_{k}']:.1f} ({r[f'experts_hit_{k}_expected']:.1f})"
                         for k in ("plain", "verify", "draft"))
        gb = " | ".join(f"{r[f'weight_bytes_{k}'] / 1e9:.2f}"
                        for k in ("plain", "verify", "draft"))
        body.append(f"| {r['context']} | {r['batch']} | {hit} | {gb} | "
                    f"{r['projected_speedup']:.2f} | {r['byte_ideal_speedup']:.2f} | "
                    f"{r['byte_ideal_speedup_expected']:.2f} |")
    return "\n".join([head, *body])


def score_bytes_per_key(mode: str, heads: int, kv_heads: int, rows: int, groups: int) -> int:
    """Bytes a scored pass moves per key, sequence and layer beyond its K and V: the R rows'
    float32 logits written by the split kernel and read back by the finalise kernel, one per
    query head ("weight") or per kv head ("logit"), plus the float32 scores [R, G] the
    finalise kernel writes (padding lanes left out)."""
    lanes = heads if mode == "weight" else kv_heads
    return 2 * 4 * lanes * rows + 4 * groups * rows


def score_tiles_arg(text: str) -> str:
    """Checks a `--score-tiles` entry: 'library' or BLOCK_K:STAGES[:STORE[:SPLIT_MAX[:MAXNREG]]]."""
    if text != "library":
        parse_score_tiles(text, pa.TUNING["default"].score_tiles_other)
    return text


def parse_score_tiles(text: str, library: pa.ScoreTiles) -> pa.ScoreTiles:
    """'library' -> the library's tiles; '64:2' -> 64-key blocks, 2 stages, the library's
    store, split cap and register cap; '128:3:f32-blocks' also names the store of the
    logits (`paged_attention.SCORE_STORES`); '64:2:f32-descriptor:2048:128' also the largest
    split (0: the occupancy split alone) and the registers per thread (0: ptxas's)."""
    if text == "library":
        return library
    try:
        block_k, stages, *rest = text.split(":")
        if len(rest) > 3:
            raise ValueError("more parts than BLOCK_K:STAGES:STORE:SPLIT_MAX:MAXNREG")
        store = rest[0] if rest else library.store
        split_max = int(rest[1]) or None if len(rest) > 1 else library.split_max
        maxnreg = int(rest[2]) or None if len(rest) > 2 else library.maxnreg
        return pa.ScoreTiles(int(block_k), int(stages), split_max, maxnreg, store)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"bad score tiles {text!r}: {err}") from None


def verify_tiles_arg(text: str) -> str:
    """Checks a `--verify-tiles` entry: 'library' or BLOCK_K:STAGES[:MAXNREG]."""
    if text != "library":
        parse_verify_tiles(text)
    return text


def parse_verify_tiles(text: str) -> pa.VerifyTiles | None:
    """'library' -> None (the library's verify tiles); '64:2' -> 64-key blocks, 2 stages,
    ptxas's registers; '64:3:128' also a cap of 128 registers per thread (0: ptxas's)."""
    if text == "library":
        return None
    try:
        block_k, stages, *rest = (int(x) for x in text.split(":"))
        if len(rest) > 1:
            raise ValueError("more parts than BLOCK_K:STAGES:MAXNREG")
        return pa.VerifyTiles(block_k, stages, rest[0] or None if rest else None)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"bad verify tiles {text!r}: {err}") from None


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """K and V of one position over all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def kv_read_bytes(cfg: ModelConfig, bsz: int, keys: int, rows: int, kv_token: int,
                  context: int | None = None) -> int:
    """K and V bytes a step of `rows` query rows a sequence reads: `keys` positions a
    sequence on a full-attention layer; on a sliding-window layer (gpt-oss's) the rows'
    window, window + rows - 1 positions at most, of the sequence's `context` (default
    `keys`: a draft step's sparse read is over the budget, its window layers over their
    window)."""
    layers = cfg.num_layers
    seen = keys if context is None else context
    per_layer = kv_token // layers
    total = sum(min(seen, w + rows - 1) if (w := cfg.window(i)) else keys
                for i in range(layers))
    return bsz * per_layer * total


def cell_settings(stack: contextlib.ExitStack, device: torch.device, dim: int,
                  tiles: pa.ScoreTiles, sparse: str, keys: str, least: int, fill: str,
                  lanes: int, verify: str) -> None:
    """One cell's kernel settings, entered on `stack` (`kernels.tuned`; the library's on
    `device` where an option says 'library' or 0)."""
    chosen = parse_verify_tiles(verify)
    stack.enter_context(tuned(pa, score_tiles={dim: tiles}, verify_tiles=(
        pa.tuning(device).verify_tiles if chosen is None else {dim: chosen})))
    library = sa.tuning(device)
    stack.enter_context(tuned(sa, programs_per_sm=sparse_programs(
        library.programs_per_sm, sparse, dim), by_head_dim=sparse_key_tiles(
        library.by_head_dim, keys, dim), one_wave=sparse_key_tiles(library.one_wave, keys, dim)))
    stack.enter_context(tuned(tk, min_warps=least or tk.tuning(device).min_warps))
    split = {} if fill == "library" else dict(
        zip(("split_programs_per_sm", "split_min_blocks"), map(int, fill.split(":")),
            strict=True), split_wave_fill=None)
    stack.enter_context(tuned(split_merge, max_lanes=lanes or split_merge.tuning(device).max_lanes,
                              **split))


def fill_name(device: torch.device) -> str:
    """The decode kernels' split as set: waves:FILL:MIN_BLOCKS or PROGRAMS_PER_SM:MIN_BLOCKS."""
    tiles = split_merge.tuning(device)
    if tiles.split_wave_fill is not None:
        return f"waves:{tiles.split_wave_fill}:{tiles.split_min_blocks}"
    return f"{tiles.split_programs_per_sm}:{tiles.split_min_blocks}"


def sparse_splits_arg(text: str) -> str:
    """--sparse-splits: library, paged, or a positive number of programs per SM."""
    if text in ("library", "paged") or (text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"library, paged or a positive integer, not {text!r}")


def sparse_tiles_arg(text: str) -> str:
    """--sparse-tiles: library, or BLOCK_K:STAGES:WARPS of the sparse kernel at the model's
    head dim (`sparse_attention.KeyTiles`)."""
    parts = text.split(":")
    if text == "library" or (len(parts) == 3 and all(p.isdigit() and int(p) > 0
                                                      for p in parts)):
        return text
    raise argparse.ArgumentTypeError(f"library or BLOCK_K:STAGES:WARPS, not {text!r}")


def sparse_key_tiles(library: Mapping[int, sa.KeyTiles], setting: str,
                     dim: int) -> Mapping[int, sa.KeyTiles]:
    """sparse_attention's by_head_dim (or one_wave) for a --sparse-tiles setting: a
    setting given holds for both."""
    if setting == "library":
        return library
    block_k, stages, warps = (int(p) for p in setting.split(":"))
    return {**library, dim: sa.KeyTiles(block_k, stages, warps)}


def sparse_programs(library: Mapping[int, int] | None, setting: str,
                    dim: int) -> Mapping[int, int] | None:
    """sparse_attention's programs_per_sm for a --sparse-splits setting."""
    if setting == "library":
        return library
    if setting == "paged":
        return None
    return {**(library or {}), dim: int(setting)}


def side_by_side(ap: argparse.ArgumentParser, flag: str, text: str, **kwargs: object) -> None:
    """An option of one or more settings, each timed in graphs of its own, side by side."""
    ap.add_argument(flag, nargs="+", help=f"{text}, each in graphs of its own", **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, required=True, help="folder with an HF config.json")
    ap.add_argument("--contexts", type=int, nargs="+", required=True)
    ap.add_argument("--batches", type=int, nargs="+", required=True)
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens-per-iteration", type=float, default=6.3,
                    help="τ of the projected speedup (measured on the real model)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--launches", action="store_true",
                    help="count each step's kernel launches, by kernel (`launches_<step>`): "
                         "the profiler's on CUDA, the interpreter's Triton launches and the "
                         "PyTorch operators that launch a kernel elsewhere")
    ap.add_argument("--projections", action="store_true",
                    help="also time each projection at M = batch and batch x (γ + 1) rows")
    ap.add_argument("--modes", nargs="+", default=["default"], choices=["default", "exact"],
                    help="engine modes to time, each in an engine of its own; both: exact "
                         "mode's cost against the default")
    ap.add_argument("--brief", action="store_true",
                    help="only the plain, verify and draft steps, the selection, the round "
                         "and the host work (not stream's verify nor quest's draft)")
    ap.add_argument("--host-gap-tokens", type=int, default=64,
                    help="new tokens per sequence of the run that measures the host work")
    ap.add_argument("--score-tiles", nargs="+", type=score_tiles_arg, default=["library"],
                    help="how scored attention passes run, 'library' or "
                         "BLOCK_K:STAGES[:STORE[:SPLIT_MAX[:MAXNREG]]] (STORE one of "
                         f"{', '.join(pa.SCORE_STORES)}; 0: no split cap, ptxas's registers; "
                         "omitted parts: the library's), each in graphs of its own")
    ap.add_argument("--draft-weights", nargs="+", default=["model"],
                    choices=["model", "fp8", "int8"],
                    help="the draft steps' weights, each in an engine of its own: the "
                         "model's, or FP8 or INT8 copies (`quant`)")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="the engines' max_model_len, which sizes the static key width "
                         "(0: context + gamma + 64)")
    ap.add_argument("--narrowest-span", type=int, default=0,
                    help="the rounds' graphs also at key widths narrower than "
                         "max_model_len's, halved down to this many tokens, each round at "
                         "the narrowest that holds its context, as the engine runs them "
                         "(EngineConfig.narrowest_span; 0: the whole width)")
    ap.add_argument("--rank-widths", nargs="+", default=["library"],
                    choices=["library", "whole"],
                    help="positions vegas's top-k ranks: up to max_model_len (library) or "
                         "the whole static key width, side by side in one engine")
    side_by_side(ap, "--sparse-splits", default=["library"], type=sparse_splits_arg,
                 text="how the draft steps' sparse attention splits its keys: the library's "
                      "rule (sparse_attention.SparseTuning.programs_per_sm), the paged "
                      "kernel's occupancy split (paged), or a number: the one-wave split with that "
                      "many programs per SM at the model's head dim")
    side_by_side(ap, "--sparse-tiles", default=["library"], type=sparse_tiles_arg,
                 text="the draft steps' sparse kernel at the model's head dim: the library's "
                      "tiles (sparse_attention.SparseTuning.by_head_dim, and one_wave where "
                      "a step's programs fit on the SMs) or BLOCK_K:STAGES:WARPS for every "
                      "step")
    side_by_side(ap, "--draft-copy-rows", type=int, default=[0],
                 text="rows up to which a draft step reads the FP8 copies "
                      "(quant.DRAFT_COPY_ROWS, 0: the library's)")
    side_by_side(ap, "--topk-min-warps", type=int, default=[0],
                 text="the fewest warps of the resident top-k (quest's pages, vegas's "
                      "ranking; topk.TopkTuning.min_warps, 0: the library's)")
    side_by_side(ap, "--topk-sums", default=["yes"], choices=["yes", "no"],
                 text="vegas's collected rows summed inside the top-k as it loads them (the "
                      "attention backend's topk_sum) or summed by PyTorch first")
    side_by_side(ap, "--split-fill", default=["library"],
                 text="the decode kernels' split: library (the paged kernel by whole "
                      "waves of its resident programs, split_merge.SplitTuning's "
                      "split_wave_fill), or PROGRAMS_PER_SM:MIN_BLOCKS, the occupancy split of "
                      "every decode kernel (split_programs_per_sm, split_min_blocks; waves "
                      "off)")
    side_by_side(ap, "--max-lanes", type=int, default=[0],
                 text="query rows x padded heads of one attention program "
                      "(split_merge.SplitTuning.max_lanes, 0: the library's); fewer cut a "
                      "verify step's rows into row blocks that read the same keys side by side")
    side_by_side(ap, "--verify-tiles", type=verify_tiles_arg, default=["library"],
                 text="how unscored decode calls of several rows (stream's verify step) run: "
                      "library (paged_attention.PagedTuning.verify_tiles) or "
                      "BLOCK_K:STAGES[:MAXNREG] at "
                      "the model's head dim")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    spec = SpecConfig(method="vegas", gamma=args.gamma, ratio=args.ratio,
                      min_tokens=args.min_tokens, adaptive=False)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = load_config(resolve(str(args.config)))
    dim = model.head_dim
    tilings = [parse_score_tiles(t, pa.tuning(device).score_tiles_at(dim))
               for t in args.score_tiles]
    bandwidth = copy_bandwidth() if cuda else 1e10
    rows = []
    for context, mode, drafts in itertools.product(args.contexts, args.modes,
                                                   args.draft_weights):
        # One engine per context, mode and draft weights, its static key axis sized for this
        # context.
        slots = max(args.batches) * (context + 128) + 4096
        kv = slots * kv_bytes_per_token(model, 2 if cuda else 4)
        llm = LLM(str(args.config), load_format="dummy", device="cuda" if cuda else "cpu",
                  dtype="bfloat16" if cuda else "float32", kv_cache_bytes=kv,
                  max_model_len=args.max_model_len or context + args.gamma + 64,
                  exact=mode == "exact", draft_weights=drafts,
                  narrowest_span=args.narrowest_span)
        for k, v in llm.engine.runner.cache.layers:
            k.normal_()
            v.normal_()
        if model.num_experts:  # routing follows the values: spread as a trained model's
            spread_biases(llm.engine.runner.model)
        summing = llm.engine.runner.attn.topk_sum
        for (bsz, tiles, width, sparse, keys, least, sums, fill, lanes, verify,
             copy_rows) in itertools.product(args.batches, tilings, args.rank_widths,
                                             args.sparse_splits, args.sparse_tiles,
                                             args.topk_min_warps, args.topk_sums,
                                             args.split_fill, args.max_lanes,
                                             args.verify_tiles, args.draft_copy_rows):
            llm.engine.runner.attn.topk_sum = summing if sums == "yes" else None
            llm.engine.runner.use_graphs(None)
            with contextlib.ExitStack() as settings:  # read when the graphs are captured
                cell_settings(settings, device, dim, tiles, sparse, keys, least, fill, lanes,
                              verify)
                settings.enter_context(unittest.mock.patch.object(
                    quant, "DRAFT_COPY_ROWS", copy_rows or quant.DRAFT_COPY_ROWS))
                verify_now = pa.tuning(device).verify_tiles.get(dim)
                row = {"mode": mode, "draft_weights": drafts,
                       "max_lanes": split_merge.tuning(device).max_lanes,
                       "verify_tiles": "tile_config" if verify_now is None else
                       f"{verify_now.block_k}:{verify_now.stages}:{verify_now.maxnreg or 0}",
                       "sparse_splits": sparse, "sparse_tiles": keys,
                       "draft_copy_rows": quant.DRAFT_COPY_ROWS,
                       "topk_min_warps": tk.tuning(device).min_warps,
                       "topk_sum": sums, "split_fill": fill_name(device),
                       "score_tiles": f"{tiles.block_k}:{tiles.stages}:{tiles.store}",
                       "score_split_max": tiles.split_max, "score_maxnreg": tiles.maxnreg,
                       "max_model_len": llm.max_model_len, "narrowest_span": args.narrowest_span,
                       "rank_width": width,
                       **measure(llm, spec, context, bsz, args, bandwidth, width)}
                row["host_gap_ms"] = host_gap_ms(llm, spec, bsz, args.host_gap_tokens,
                                                 min(256, context // 2))
                if args.projections and cuda:
                    row["projections"] = {m: projection_bandwidth(llm, m, bandwidth, args.reps)
                                          for m in (bsz, bsz * (spec.gamma + 1))}
            project(row, spec.gamma, args.tokens_per_iteration)
            rows.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                              for k, v in row.items() if k not in ("profiles", "launches")}),
                  flush=True)
            for name, text in row.get("profiles", {}).items():
                print(f"--- {name} ---\n{text}", flush=True)
        del llm
        if cuda:
            torch.cuda.empty_cache()
    meta = {"date": time.strftime("%Y-%m-%d"),
            "gpu": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "copy_bandwidth_bytes_per_s": bandwidth,
            "args": {k: str(v) for k, v in vars(args).items()}}
    cost = exact_cost(rows)
    if cost:
        print(cost_table(cost), flush=True)
    if model.num_experts:
        print(moe_table(rows, model.num_experts), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "exact_cost": cost}, indent=1))


if __name__ == "__main__":
    main()
