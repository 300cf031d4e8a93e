"""Frozen configuration objects: the model (normalised once from HF `config.json`), sampling,
speculation and engine settings. Every check on user input lives here so errors are raised
before any tensor is touched."""

from __future__ import annotations

import difflib
import importlib.util
import math
import numbers
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")


class _Dtypes(Mapping):
    """Type names -> torch dtypes, torch imported on the first lookup: the command line's
    parser and its errors need only the names (torch takes seconds to import)."""

    names = ("float32", "bfloat16", "float16")

    def __getitem__(self, name: str) -> torch.dtype:
        if name not in self.names:
            raise KeyError(name)
        import torch

        return getattr(torch, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


DTYPES: Mapping[str, torch.dtype] = _Dtypes()
# What the draft steps' projections may read (`EngineConfig.draft_weights`).
DRAFT_WEIGHTS = ("auto", "fp8", "int8", "int4", "model")


class ConfigError(ValueError):
    """A model, sampling or engine setting that the engine cannot honour."""


def _prompt_name(index: int | None) -> str:
    return "prompt" if index is None else f"prompts[{index}]"


class PromptError(ConfigError):
    """A prompt the engine cannot run. `index`: its place in the batch (None for a single
    prompt); `problem`: what is wrong, worded to follow the prompt's name."""

    def __init__(self, problem: str, index: int | None = None) -> None:
        self.problem, self.index = problem, index
        super().__init__(f"{_prompt_name(index)} {problem}")


class LengthCapWarning(UserWarning):
    """max_tokens asks for more tokens than the model's context leaves after a prompt: they
    are capped to what it leaves (`index`, `problem` as in PromptError)."""

    def __init__(self, problem: str, index: int | None = None) -> None:
        self.problem, self.index = problem, index
        super().__init__(f"{_prompt_name(index)} {problem}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    # the optional tensors the config switches on, as its family reads them
    # (`models.family.Switches`; o_bias too)
    qkv_bias: bool
    qk_norm: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    o_bias: bool = False
    sinks: bool = False  # a learned logit per query head in every softmax's denominator
    # each layer's sliding window (its family's `windows`): a query at position p sees keys
    # p - w + 1 .. p; 0: full attention; () every layer full. Unlike `sliding_window` (one
    # window for every layer, refused past it), these windows are attended as they are.
    layer_windows: tuple[int, ...] = ()
    # a mixture of experts' sizes, as its family reads them (`models.family.Experts`; 0 and
    # False: a dense model)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_bias: bool = False
    expert_bias: bool = False  # each expert's gate/up and down biased
    # > 0: the experts' activation is gpt-oss's clamped SwiGLU, (up + 1) * gate *
    # sigmoid(1.702 * gate) with gate <= limit and |up| <= limit; 0: SiLU(gate) * up
    swiglu_limit: float = 0.0
    mxfp4_experts: bool = False  # the checkpoint ships its experts in MXFP4 (gpt-oss's)

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Raises ConfigError for a missing or malformed field, or one this engine does not
        support. The architecture's family (`models.registry`, imported when this runs) says
        which optional tensors the config switches on and, for a mixture of experts, its
        experts' sizes."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"the model config must be a JSON object, got {type(cfg).__name__}")
        from vegas_spec.models.registry import family_of

        family = family_of(cfg)
        heads = _count(cfg, "num_attention_heads")
        kv_heads = _count(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigError(
                f"num_attention_heads={heads} is not a multiple of kv heads {kv_heads}")
        hidden = _count(cfg, "hidden_size")
        head_dim = _count(cfg, "head_dim", hidden // heads)
        theta, rope = _rope(cfg)
        windows = family.windows(cfg)
        return cls(
            architecture=family.architecture,
            vocab_size=_count(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_count(cfg, "intermediate_size"),
            num_layers=_count(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_real(cfg, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=tuple(sorted(rope.items())),
            max_position_embeddings=_count(cfg, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=None if windows else _sliding_window(cfg),
            layer_windows=windows,
            eos_token_ids=_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            **family.switches(cfg)._asdict(),
            **family.experts(cfg)._asdict(),
        )


def count_field(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer field of an HF config (a family's own fields); missing (or null)
    takes the default, else is a ConfigError naming the field."""
    return _count(cfg, key, default)


def real_field(cfg: dict[str, Any], key: str, default: float) -> float:
    """A positive number field of an HF config (a family's own fields), as `count_field`."""
    return _real(cfg, key, default)


def _count(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer field; missing (or null) takes the default, else is an error."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ConfigError(f"the model config lacks {key!r}")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value) or value < 1:
        raise ConfigError(f"the model config's {key!r} must be a positive integer, got {value!r}")
    return value


def _real(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    value = default if value is None else value
    if not _is_number(value) or value <= 0:
        raise ConfigError(f"the model config's {key!r} must be a positive number, got {value!r}")
    return float(value)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files use
    # `rope_theta` + `rope_scaling`.
    params, scaling = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ConfigError(f"the model config's {key!r} must be an object, got {value!r}")
    params, scaling = dict(params), dict(scaling)
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    if not _is_number(theta) or theta <= 0:
        raise ConfigError(f"the model config's rope_theta must be a positive number, "
                          f"got {theta!r}")
    theta = float(theta)
    rope = {**scaling, **params}
    rope_type = rope.pop("rope_type", rope.pop("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "freq_factors":  # llama.cpp's per-frequency divisors (GGUF rope_freqs)
        rope["factors"] = tuple(float(f) for f in rope.get("factors") or ())
        if not rope["factors"]:
            raise ConfigError("rope type 'freq_factors' needs its 'factors'")
    elif rope_type != "default" and "factor" not in rope:
        raise ConfigError(f"rope type {rope_type!r} needs a 'factor'")
    rope["rope_type"] = rope_type
    return theta, rope


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return None
    return _count(cfg, "sliding_window")


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, (list, tuple)) else [value]
    if not all(is_int(v) for v in ids):
        raise ConfigError(f"the model config's eos_token_id must be token ids, got {value!r}")
    return tuple(ids)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_number(self.temperature):
            raise ConfigError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ConfigError(f"seed must fit in 64 bits, got {self.seed}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ConfigError("stop must be a string or a list of strings (() for none), "
                              f"got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_GAMMA = 32
# The local context of the window policies by default (their options' window, pool; 0, 1:
# the paper's pure top-k), from benchmarks/selection_sweep.py (BENCHMARKS.md §1.4): vegas
# keeps the 192 positions before the selection row (at 4K contexts, where the budget is its
# 256-token floor, 192 drafted as many or more tokens per iteration than 64 and 128 on long
# generation, essays and code, greedy and sampled; every window beat the pure top-k); lastq
# and specextend, not swept at 192, keep 64; no pooling.
DEFAULT_WINDOW, VEGAS_WINDOW, DEFAULT_POOL = 64, 192, 1


def _int_at_least(name: str, value: Any, low: int) -> None:
    if not is_int(value) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class PolicyOptions:
    """A selection policy's own settings (the base: a method that has none)."""

    def __post_init__(self) -> None:
        pass


@dataclass(frozen=True)
class SinkOptions(PolicyOptions):
    # the first positions every recent-range selection keeps (the attention sink)
    sink: int = 4

    def __post_init__(self) -> None:
        _int_at_least("sink", self.sink, 0)


@dataclass(frozen=True)
class WindowOptions(SinkOptions):
    # the positions just before the selection row always selected (inside the budget k:
    # min(window, 3k/4) of them), as the start of the recent range; 0: none
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        super().__post_init__()
        _int_at_least("window", self.window, 0)


@dataclass(frozen=True)
class LastqOptions(WindowOptions):
    # the odd width of a max-pool over neighbouring positions of the scores before the
    # top-k (1: none)
    pool: int = DEFAULT_POOL

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_int(self.pool) or self.pool < 1 or self.pool % 2 == 0:
            raise ConfigError(f"pool must be an odd integer >= 1 (1: no pooling), got "
                              f"{self.pool!r}")


@dataclass(frozen=True)
class VegasOptions(LastqOptions):
    window: int = VEGAS_WINDOW
    score: str = "weight"  # the verify pass's attention weights, or its raw logits
    collect: str = "2"  # the verify rows aggregated: the first and last, or all
    granularity: str = "layer"  # one selection per layer, or per kv head

    def __post_init__(self) -> None:
        object.__setattr__(self, "collect", str(self.collect))
        super().__post_init__()
        _choice("score", self.score, ("weight", "logit"))
        _choice("collect", self.collect, ("2", "all"))
        _choice("granularity", self.granularity, ("layer", "kv_head"))


@dataclass(frozen=True)
class SpecExtendOptions(WindowOptions):
    chunk: int = 32  # tokens per scored chunk

    def __post_init__(self) -> None:
        super().__post_init__()
        _int_at_least("chunk", self.chunk, 1)


@dataclass(frozen=True)
class QuestOptions(PolicyOptions):
    page: int = 16  # tokens per page whose min and max keys are scored

    def __post_init__(self) -> None:
        _int_at_least("page", self.page, 1)


# Each method's settings, beside the ones every method shares (SpecConfig's fields).
POLICY_OPTIONS: dict[str, type[PolicyOptions]] = {
    "vanilla": PolicyOptions, "vegas": VegasOptions, "stream": SinkOptions,
    "quest": QuestOptions, "lastq": LastqOptions, "specextend": SpecExtendOptions,
    "full": PolicyOptions}
# The built-in methods, for command-line choices; SpecConfig accepts every key of
# POLICY_OPTIONS, to which `speculative.policies.register_method` adds a policy of one's own.
METHODS = tuple(POLICY_OPTIONS)


def option_names(method: str) -> tuple[str, ...]:
    return tuple(f.name for f in fields(POLICY_OPTIONS[method]))


@dataclass(frozen=True, init=False)
class SpecConfig:
    """Self-speculative decoding settings (see docs/method.md): the method and what every
    method shares (γ, the budget's ratio and floor, adaptive speculation), and the method's
    own settings (`options`, a `POLICY_OPTIONS` class), given as a PolicyOptions or as
    keywords: `SpecConfig(method="quest", page=32)`. A keyword that is not one of the
    method's settings is an error that names the method's own."""

    method: str = "vegas"
    gamma: int = 6
    ratio: float = 0.05
    min_tokens: int = 256
    # Per iteration, a round only where the engine's own timings say it beats a plain step
    # (`speculative.adaptive`); False: always γ drafts (benchmarks of a fixed γ).
    adaptive: bool = True
    options: PolicyOptions = PolicyOptions()

    def __init__(self, method: str = "vegas", gamma: int = 6, ratio: float = 0.05,
                 min_tokens: int = 256, adaptive: bool = True,
                 options: PolicyOptions | None = None, **settings: Any) -> None:
        if method not in POLICY_OPTIONS:
            raise ConfigError(f"unknown method {method!r}; choose from "
                              f"{', '.join(POLICY_OPTIONS)}")
        for name, value in (("method", method), ("gamma", gamma), ("ratio", ratio),
                            ("min_tokens", min_tokens), ("adaptive", adaptive)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "options", _options(method, options, settings))
        self.__post_init__()

    def __post_init__(self) -> None:
        if not is_int(self.gamma) or not 1 <= self.gamma <= MAX_GAMMA:
            raise ConfigError(f"gamma must be an integer in [1, {MAX_GAMMA}], got {self.gamma!r}")
        if not _is_number(self.ratio) or not 0.0 < self.ratio <= 1.0:
            raise ConfigError(f"ratio must be a number in (0, 1], got {self.ratio!r}")
        _int_at_least("min_tokens", self.min_tokens, 1)
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"adaptive must be True or False, got {self.adaptive!r}")

    @property
    def speculative(self) -> bool:
        return self.method != "vanilla"

    def as_dict(self) -> dict[str, Any]:
        """The settings as one flat dict (a config file's "speculative" object): the shared
        fields and the method's own."""
        shared = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}
        return {**shared, **{f.name: getattr(self.options, f.name)
                             for f in fields(self.options)}}


def _options(method: str, options: PolicyOptions | None,
             settings: dict[str, Any]) -> PolicyOptions:
    """The method's settings: `options` (another method's: those of its fields this method
    has, as `dataclasses.replace(spec, method=...)` gives), with `settings` over them."""
    kind = POLICY_OPTIONS[method]
    names = option_names(method)
    unknown = [k for k in settings if k not in names]
    if unknown:
        owners = sorted(m for m in POLICY_OPTIONS if any(k in option_names(m) for k in unknown))
        where = f"; methods that have {'it' if len(unknown) == 1 else 'them'}: " \
            f"{', '.join(owners)}" if owners else ""
        raise ConfigError(f"method {method!r} has no setting {', '.join(map(repr, unknown))} "
                          f"(its own: {', '.join(names) or 'none'}{where})")
    carried = {} if options is None else {
        f.name: getattr(options, f.name) for f in fields(options) if f.name in names}
    return kind(**{**carried, **settings})


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{name} must be one of {', '.join(options)}, got {value!r}")


PREFILL_ACTIVATION_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float = 0.5
    # Tokens per prefill forward, summed over the prompts it packs (a longer prompt is cut
    # across forwards): bounds the activations, never the prompt length. None: as many as
    # keep a forward's activations near PREFILL_ACTIVATION_BYTES (`prefill_tokens`).
    prefill_chunk: int | None = None
    # While rows decode, prefill about this many decode iterations' time worth of prompt tokens
    # per step (scheduler.PrefillPacer), so that arriving prompts stretch the running
    # requests' inter-token latency by at most about 1 + this; None: every step may prefill
    # prefill_chunk tokens (the most throughput, the longest stalls).
    prefill_pacing: float | None = None
    backend: str = "auto"
    prefix_cache_bytes: int = 0  # > 0: keep prompt KV of up to this many bytes for reuse
    load_format: str = "auto"  # "dummy": random weights from the config, for timing
    # Decode-loop forwards as CUDA graphs per batch-size bucket; None: on for CUDA, off for CPU.
    cuda_graphs: bool | None = None
    # Fixed-shape decode buffers without graphs (implied by cuda_graphs; the CPU test path).
    static_shapes: bool = False
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # Every kernel computes a row the same way whatever the number of rows in the step, so
    # that greedy speculative output is plain output token for token in bf16 too, and a prompt
    # gives the same tokens alone or in a batch (slower; see docs/method.md).
    exact: bool = False
    # The draft steps' copy of the projection weights: "fp8" (e4m3), a scale per output row;
    # "int8" or "int4", a scale per row and group of input channels (lossless: drafts are
    # verified by the model's own weights); "model" (none: drafts read the model's weights);
    # "auto": `runner_setup.draft_kind`.
    draft_weights: str = "auto"
    # Static shapes: the decode graphs are captured at max_model_len's key width and at
    # narrower ones, max_model_len halved down to this many tokens (at most three), and a
    # batch runs the narrowest that holds its longest row, so that short contexts (a long
    # generation's first thousands of tokens) do not split, merge and rank keys sized for
    # max_model_len; 0: the whole width alone (and always in exact mode, where a row's
    # attention must not depend on its batch's longest row).
    narrowest_span: int = 2048

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not is_int(self.page_size) or self.page_size < 1 \
                or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a power of two, got {self.page_size!r}")
        if self.prefill_chunk is not None and (not is_int(self.prefill_chunk)
                                               or self.prefill_chunk < 1):
            raise ConfigError(f"prefill_chunk must be an integer >= 1, got "
                              f"{self.prefill_chunk!r} (None: sized by the activation budget)")
        if self.prefill_pacing is not None and (not _is_number(self.prefill_pacing)
                                                or not 0.0 < self.prefill_pacing <= 100.0):
            raise ConfigError(f"prefill_pacing must be a number in (0, 100] (None: off), got "
                              f"{self.prefill_pacing!r}")
        if self.kv_cache_bytes is not None:
            if not _is_number(self.kv_cache_bytes) or self.kv_cache_bytes < 1:
                raise ConfigError("kv_cache_bytes must be a positive number of bytes (None: "
                                  f"the default), got {self.kv_cache_bytes!r}")
            object.__setattr__(self, "kv_cache_bytes", int(self.kv_cache_bytes))
        fraction = self.kv_cache_fraction
        if not _is_number(fraction) or not 0.0 < fraction <= 1.0:
            raise ConfigError(f"kv_cache_fraction must be in (0, 1], got {fraction!r}")
        if not is_int(self.narrowest_span) or self.narrowest_span < 0:
            raise ConfigError("narrowest_span must be an integer >= 0 (0: graphs at "
                              f"max_model_len's key width alone), got {self.narrowest_span!r}")
        if not is_int(self.prefix_cache_bytes) or self.prefix_cache_bytes < 0:
            raise ConfigError("prefix_cache_bytes must be an integer >= 0 (0: no prefix cache), "
                              f"got {self.prefix_cache_bytes!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ConfigError(f"draft_weights must be one of {', '.join(DRAFT_WEIGHTS)}, got "
                              f"{self.draft_weights!r}")
        if self.backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"backend must be auto, torch or triton, got {self.backend!r}")
        for name in ("cuda_graphs", "static_shapes", "exact"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "cuda_graphs" and value is None):
                raise ConfigError(f"{name} must be True or False, got {value!r}")
        import torch

        if not isinstance(self.device, (str, torch.device)):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device cuda requested but CUDA is not available")
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        if self.cuda_graphs and dev.type != "cuda":
            raise ConfigError("cuda_graphs needs device cuda (static_shapes=True runs the same "
                              "fixed-shape buffers eagerly)")
        if self.max_model_len is not None and not is_int(self.max_model_len):
            raise ConfigError(f"max_model_len must be an integer, got {self.max_model_len!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.resolved_backend == "triton":
            _check_triton(dev.type)
        if self.exact and dev.type == "cuda" and self.resolved_backend != "triton":
            raise ConfigError("exact mode on cuda runs the Triton kernels (backend triton or "
                              "auto); the torch backend's exact path is for cpu")

    def prefill_tokens(self, model: ModelConfig) -> int:
        """prefill_chunk, or by default the tokens whose activations (the widest tensors a
        layer holds at once: gate/up and its product, each of a token's experts' in a
        mixture of experts, with their outputs; q/k/v, attention output and the residual
        stream) fit PREFILL_ACTIVATION_BYTES, in [2048, 32768] (Llama-3.1-8B in bf16: 8192;
        SmolLM2-135M: 32768)."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        mlp = 3 * model.intermediate_size if not model.num_experts else \
            model.experts_per_token * (3 * model.moe_intermediate_size + model.hidden_size)
        width = mlp + (2 * model.num_heads + 2 * model.num_kv_heads) * model.head_dim \
            + 3 * model.hidden_size
        tokens = PREFILL_ACTIVATION_BYTES // (width * DTYPES[self.dtype].itemsize)
        return max(2048, min(32768, tokens // 1024 * 1024))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def graphs(self) -> bool:
        """Capture CUDA graphs: as asked, else on for CUDA."""
        if self.cuda_graphs is None:
            return _device_type(self.device) == "cuda"
        return self.cuda_graphs

    @property
    def static(self) -> bool:
        """Decode-loop forwards read fixed-shape buffers (graphs need them)."""
        return self.static_shapes or self.graphs

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "triton" if _device_type(self.device) == "cuda" else "torch"


def _device_type(device: str | torch.device) -> str:
    import torch

    return torch.device(device).type


def _check_triton(device_type: str) -> None:
    """Refuse the Triton backend where its kernels cannot run, before any loading."""
    if importlib.util.find_spec("triton") is None:
        raise ConfigError("backend triton needs the triton package, which is not installed: "
                          "`pip install triton`, or choose backend torch")
    interpreting = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")
    if device_type == "cpu" and not interpreting:
        raise ConfigError("backend triton runs its kernels on a GPU (device cuda); on CPU only "
                          "under Triton's slow interpreter (set TRITON_INTERPRET=1 before "
                          "starting): choose backend torch for CPU")


# --- one place that checks a request's arguments (the engine's API and any front end) ------

def _unknown(kind: str, names: list[str], known: list[str]) -> ConfigError:
    name = names[0]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown {kind} {name!r}{hint}; known: {', '.join(known)}")


def engine_config(kwargs: dict[str, Any]) -> EngineConfig:
    """EngineConfig from LLM(...)'s keyword arguments, naming any it does not know."""
    known = [f.name for f in fields(EngineConfig)]
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        raise _unknown("engine setting", unknown, known)
    return EngineConfig(**kwargs)


def spec_config(spec: Any) -> SpecConfig:
    """`speculative`: a SpecConfig, a dict of its fields, or None (plain decoding)."""
    if spec is None:
        return SpecConfig(method="vanilla")
    if isinstance(spec, SpecConfig):
        return spec
    if not isinstance(spec, dict):
        raise ConfigError("speculative must be a SpecConfig, a dict of its fields or None, got "
                          f"{type(spec).__name__} {spec!r} (a method by name: "
                          "{'method': 'vegas'})")
    known = [f.name for f in fields(SpecConfig) if f.name != "options"]
    every = known + sorted({n for m in POLICY_OPTIONS for n in option_names(m)})
    unknown = [k for k in spec if k not in every]
    if unknown:
        raise _unknown("speculative setting", unknown, every)
    return SpecConfig(**spec)


def _token_ids(prompt: list | tuple, where: str) -> list[int]:
    if set(map(type, prompt)) <= {int}:  # the common case, at C speed (a bool's type is bool)
        return list(prompt)
    ids = []
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            kind = "a bool" if isinstance(t, bool) else type(t).__name__
            raise ConfigError(f"{where}[{i}] is {t!r} ({kind}), not a token id: a prompt is "
                              "a string or a list of int token ids")
        ids.append(int(t))
    return ids


def prompt_list(prompts: Any) -> tuple[list[str | list[int]], bool]:
    """One prompt (a string, or a list of token ids) or a list of prompts -> (the prompts,
    each a string or a list of ints; whether a batch was given)."""
    if isinstance(prompts, str):
        return [prompts], False
    if not isinstance(prompts, (list, tuple)) or not prompts:
        got = "an empty list" if isinstance(prompts, (list, tuple)) else type(prompts).__name__
        raise ConfigError("prompts must be a string, a list of strings or of token-id lists, "
                          f"got {got}")
    if any(isinstance(p, numbers.Integral) for p in prompts):  # one prompt of token ids
        return [_token_ids(prompts, "prompts")], False
    out: list[str | list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, (list, tuple)):
            out.append(_token_ids(p, f"prompts[{i}]"))
        else:
            raise ConfigError(f"prompts[{i}] is {p!r} ({type(p).__name__}): each prompt must be "
                              "a string or a list of token ids")
    return out, True


def sampling_list(params: Any, n: int) -> list[SamplingParams]:
    """`params`: None (defaults), one SamplingParams for all prompts, or one per prompt."""
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    hint = "; build one with SamplingParams(**d)" if isinstance(params, dict) else ""
    if not isinstance(params, (list, tuple)):
        raise ConfigError("params must be a SamplingParams, a list of them (one per prompt) or "
                          f"None, got {type(params).__name__}{hint}")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            hint = "; build one with SamplingParams(**d)" if isinstance(p, dict) else ""
            raise ConfigError(f"params[{i}] must be a SamplingParams, got "
                              f"{type(p).__name__}{hint}")
    if len(params) != n:
        raise ConfigError(f"{len(params)} sampling params for {n} prompts")
    return list(params)
