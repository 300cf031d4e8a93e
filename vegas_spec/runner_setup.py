"""What a model runner runs on, loaded and sized once: the model (this rank's share under
tensor parallelism, shared by the engines of a process: `models.shared`) and its FP8 or INT4
draft copies, the compute seams (the ops, with this rank's tensor-parallel group, and the
attention backend), the KV pool sized from the memory they leave (its pages with the prefix
cache where it is on), the scratch page of the static shapes and the prefill graphs; and, for
each method and batch size, the decode loop's static shapes and the `GraphRunner` over them,
rebuilt only when they change or the batch outgrows it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vegas_spec import parallel
from vegas_spec.attention.backend import AttentionBackend, make_backend
from vegas_spec.cache import PagedKVCache, available_bytes
from vegas_spec.compute.base import Ops, make_ops
from vegas_spec.config import MAX_GAMMA, ConfigError, EngineConfig, ModelConfig, SpecConfig
from vegas_spec.graphs import GraphRunner, Span, StaticShapes, bucket_for, with_length
from vegas_spec.input_batch import InputBatch
from vegas_spec.models.decoder import Decoder, build_model
from vegas_spec.models.loader import ModelSource, dummy_weights, load_config, load_weights
from vegas_spec.models.registry import family
from vegas_spec.models.shared import ModelKey, file_stamps, shared_model
from vegas_spec.prefill import Prefiller
from vegas_spec.prefill_graphs import PrefillGraphs
from vegas_spec.quant import fp8_supported
from vegas_spec.speculative.adaptive import draft_lengths
from vegas_spec.speculative.policies import Policy, max_budget

CPU_KV_BYTES = 2 << 30
# Key widths the decode graphs are captured at, the whole one included (`span_lengths`)
MAX_SPANS = 4

# "auto" draft weights are FP8 on GPUs that have FP8 conversions, for dense models whose
# layers hold at least FP8_AUTO_LAYER_BYTES of projections in the model's dtype, where the
# copies take at most FP8_AUTO_MEMORY_SHARE of the device's memory (the rest is the KV pool's).
# Measured (H100, BENCHMARKS.md §1.2): at the 8B shapes (436 MB a layer) the draft step on FP8
# copies takes 0.69-0.77x the model-weight one; at SmolLM2's (7 MB a layer, launch-bound) 1.14-
# 1.21x. The bound between them is not measured.
FP8_AUTO_LAYER_BYTES = 64 << 20
FP8_AUTO_MEMORY_SHARE = 0.25


@dataclass(frozen=True)
class Loaded:
    """A runner's model and memory. model_config: the whole model's; local_config: this
    rank's share (its heads, its KV heads in the cache); scratch_page: the page that padding
    rows of the static shapes write (-1: no static shapes); ops and attn: the compute seams,
    both of the configured backend, the ops with this rank's tensor-parallel group."""

    model_config: ModelConfig
    local_config: ModelConfig
    model: Decoder
    ops: Ops
    attn: AttentionBackend
    cache: PagedKVCache
    scratch_page: int
    draft_weight_bytes: int
    max_model_len: int
    draft_weight_kind: str = "model"  # what draft steps read: fp8, int8, int4 or model


def load(config: EngineConfig, source: ModelSource) -> Loaded:
    """The model, its draft copies, the compute seams and the KV pool, in that order (the
    pool takes what the weights leave)."""
    device = torch.device(config.device)
    cfg = load_config(source)
    if (config.max_model_len or 0) > cfg.max_position_embeddings:
        raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's "
                          f"{cfg.max_position_embeddings} positions")
    tp = parallel.current()
    local = parallel.shard_config(cfg, tp.world_size)
    # One model per checkpoint, dtype, device, rank and draft kind in a process: another
    # engine's if one holds it. A draft copy is made before the KV budget, which the memory
    # it takes then leaves out.
    kind = draft_kind(config, device, local)
    packs = keeps_mxfp4(config, device)
    key = ModelKey(file_stamps(source), config.load_format, config.torch_dtype, device,
                   tp.rank, tp.world_size, kind, packs)
    model = shared_model(key, lambda: _load_model(config, source, cfg, local, kind, device, tp,
                                                  packs))
    drafts = model.draft_weight_bytes()
    ops = make_ops(config.resolved_backend, config.exact, tp)
    attn = make_backend(config.resolved_backend, config.exact)
    cache = PagedKVCache.from_budget(local, kv_budget(config, device), config.page_size,
                                     config.torch_dtype, device, config.prefix_cache_bytes)
    scratch = cache.allocate(1)[0] if config.static else -1
    return Loaded(cfg, local, model, ops, attn, cache, scratch, drafts,
                  config.max_model_len or cfg.max_position_embeddings, kind)


def keeps_mxfp4(config: EngineConfig, device: torch.device) -> bool:
    """Whether a model whose experts are exactly MXFP4 keeps them so: where the fused MoE
    kernel reads them (a GPU, the Triton backend). Under tensor parallelism each rank packs
    its own slices, which stay exact where a slice holds whole blocks of 32 (a rank whose
    slices do not keeps them dense: `quant.mxfp4_exact`)."""
    return device.type == "cuda" and config.resolved_backend == "triton"


def _load_model(config: EngineConfig, source: ModelSource, cfg: ModelConfig,
                local: ModelConfig, kind: str, device: torch.device,
                tp: parallel.TPGroup, mxfp4: bool = False) -> Decoder:
    """This rank's model read from the source (or drawn: load_format "dummy"), with its
    `kind` draft copies (fp8 or int4; model: none), and with mxfp4 its experts kept in
    MXFP4 where their values are (`Decoder.keep_mxfp4_experts`; the dense stacks' memory
    then goes back before the KV budget is set)."""
    if config.load_format == "dummy":
        weights = dummy_weights(cfg, config.torch_dtype, device, tp=tp)
    else:
        weights = load_weights(source, cfg, tp, config.torch_dtype)
    model = build_model(local, weights, config.torch_dtype, device)
    if mxfp4 and model.keep_mxfp4_experts() and device.type == "cuda":
        torch.cuda.empty_cache()
    if kind != "model":
        model.make_draft_weights(kind)
    return model


def fp8_pays(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether "auto" draft weights are FP8 for this rank's `cfg` (`FP8_AUTO_LAYER_BYTES`,
    `FP8_AUTO_MEMORY_SHARE`): a dense model with FP8 conversions on its device."""
    if cfg.num_experts or not fp8_supported(device):
        return False
    params = family(cfg.architecture).projection_params(cfg)
    copies = cfg.num_layers * params  # a byte a weight
    total = torch.cuda.get_device_properties(device).total_memory
    return (params * dtype.itemsize >= FP8_AUTO_LAYER_BYTES
            and copies <= FP8_AUTO_MEMORY_SHARE * total)


def draft_kind(config: EngineConfig, device: torch.device, cfg: ModelConfig) -> str:
    """What `draft_weights` asks the draft steps to read: fp8, int8, int4 or model; "auto" is fp8
    where it pays for this rank's `cfg` (`fp8_pays`), else model."""
    mode = config.draft_weights
    if mode == "auto":
        mode = "fp8" if fp8_pays(cfg, config.torch_dtype, device) else "model"
    if mode == "fp8" and device.type == "cuda" and not fp8_supported(device):
        raise ConfigError("draft_weights fp8 needs a GPU with FP8 conversions (compute "
                          "capability 8.9 or newer)")
    return mode


def kv_budget(config: EngineConfig, device: torch.device) -> int:
    """Bytes of the KV pool: the configured ones, else a fraction of the free memory (on
    CPU at most CPU_KV_BYTES)."""
    if config.kv_cache_bytes is not None:
        return int(config.kv_cache_bytes)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * config.kv_cache_fraction)
    avail = available_bytes(device)
    return CPU_KV_BYTES if avail is None else \
        min(CPU_KV_BYTES, int(avail * config.kv_cache_fraction))


def span_lengths(max_len: int, narrowest: int) -> tuple[int, ...]:
    """The lengths of the key widths narrower than max_len's that the decode graphs are
    also captured at: max_len halved while at least `narrowest` (0: none), at most
    MAX_SPANS - 1 of them, ascending."""
    lengths: list[int] = []
    length = max_len // 2
    while narrowest and length >= narrowest and len(lengths) < MAX_SPANS - 1:
        lengths.append(length)
        length //= 2
    return tuple(reversed(lengths))


def static_shapes(parts: Loaded, spec: SpecConfig, policy: Policy | None,
                  narrowest: int = 0) -> StaticShapes:
    """The shapes of the method's decode loop, with the narrower key widths of
    `span_lengths(max_model_len, narrowest)`. The greedy round (`spec`) is captured with
    the buffers; the sampled rounds at their first use (one engine serves both)."""
    cache, max_len = parts.cache, parts.max_model_len
    narrower = span_lengths(max_len, narrowest)
    if policy is None:
        return StaticShapes(("plain",), 0, cache.pages_for(max_len), rank_width=max_len,
                            spans=tuple(Span(n, cache.pages_for(n)) for n in narrower))
    gamma, hkv = spec.gamma, parts.local_config.num_kv_heads
    kmax = max_budget(spec, max_len)

    def span(length: int) -> Span:
        most = max_budget(spec, length)
        return Span(length, cache.pages_for(length), most, policy.index_width(most))

    spans = tuple(span(n) for n in narrower)
    # adaptive speculation drafts fewer tokens, or none (a plain step), where γ would not pay
    lengths = draft_lengths(gamma) if spec.adaptive else (gamma,)
    rounds = tuple(with_length("spec", g, gamma) for g in lengths)
    return StaticShapes(
        kinds=(*rounds, "plain") if spec.adaptive else rounds, verify_rows=gamma + 1,
        lengths=lengths,
        score_rows_of=tuple(tuple(policy.score_rows(g + 1, False)) for g in lengths)
        if policy.wants_scores else (),
        draft_kind="plain" if policy.full_drafts else "draft",
        plans=not policy.full_drafts,
        pages=cache.pages_for(max_len + gamma + 1), kmax=kmax, rank_width=max_len,
        index_width=policy.index_width(kmax), index_groups=hkv if policy.per_kv_head else 1,
        recent_max=policy.recent_max(gamma),
        score_rows=tuple(policy.score_rows(gamma + 1, False)) if policy.wants_scores else (),
        score_groups=hkv if policy.per_kv_head else 1, score_mode=policy.score_mode,
        per_kv_head=policy.per_kv_head, spans=spans)


def reserve(rows: InputBatch, parts: Loaded, config: EngineConfig, spec: SpecConfig,
            policy: Policy | None, bsz: int) -> None:
    """The rows' static buffers (and graphs) for the method's shapes and bsz rows, rounded
    up to a bucket: rebuilt only when the shapes change or the batch outgrows them, and
    always with the policy that the round graphs make the next selection with."""
    # exact mode keeps one width: a row's attention must not depend on its batch's longest row
    narrowest = 0 if config.exact else config.narrowest_span
    shapes, old = static_shapes(parts, spec, policy, narrowest), rows.graphs
    same = (old.policy.cfg if old and old.policy else None) == (policy.cfg if policy else None)
    if old is not None and old.shapes == shapes and old.capacity >= bsz and same:
        return
    rows.graphs = None  # free the old buffers and graphs before capturing new ones
    rows.graphs = GraphRunner(parts.model, parts.cache.layers, parts.ops, parts.attn, shapes,
                              bucket_for(bsz), config.page_size, parts.scratch_page,
                              config.graphs, policy)


def prefiller(parts: Loaded, config: EngineConfig) -> Prefiller:
    """The prefill step: under static shapes on the prefill graphs' buffers (their pages
    the widest row's)."""
    graphs = None
    if config.static:
        pages = parts.cache.pages_for(parts.max_model_len + MAX_GAMMA + 1)
        graphs = PrefillGraphs(parts.model, parts.cache.layers, parts.ops, parts.attn,
                               config.page_size, pages, parts.scratch_page, config.graphs)
    cfg = parts.model_config
    return Prefiller(parts.model, parts.cache, parts.ops, parts.attn, cfg.vocab_size,
                     config.prefill_tokens(cfg), graphs)
