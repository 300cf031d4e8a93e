"""Frozen configuration objects: the model (normalised once from HF `config.json`), sampling,
speculation and engine settings. Every check on user input lives here so errors are raised
before any tensor is touched."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A model, sampling or engine setting that the engine cannot honour."""


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
    qkv_bias: bool
    qk_norm: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    o_bias: bool = False

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = _architecture(cfg)
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ConfigError(
                f"num_attention_heads={heads} is not a multiple of kv heads {kv_heads}")
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        theta, rope = _rope(cfg)
        qkv_bias, o_bias, mlp_bias = _biases(arch, cfg)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=tuple(sorted(rope.items())),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            mlp_bias=mlp_bias,
            sliding_window=_sliding_window(cfg),
            eos_token_ids=_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            o_bias=o_bias,
        )


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not known:
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        if not archs and cfg.get("model_type") in by_type:
            return by_type[cfg["model_type"]]
        name = ", ".join(archs) or f"model_type={cfg.get('model_type')!r}"
        raise ConfigError(
            f"unsupported architecture {name}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return known[0]


def _biases(arch: str, cfg: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(q/k/v, o_proj, MLP) biases as transformers builds each family: Qwen2 always has q/k/v
    bias and nothing else; `attention_bias` also biases o_proj in Llama and Qwen3; only Llama
    reads `mlp_bias`; Mistral has none."""
    if arch == "Qwen2ForCausalLM":
        return True, False, False
    if arch == "MistralForCausalLM":
        return False, False, False
    attn = bool(cfg.get("attention_bias", False))
    return attn, attn, arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False))


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files use
    # `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
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
    return int(window)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


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
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_GAMMA = 32
METHODS = ("vanilla", "vegas", "stream", "quest", "lastq", "specextend", "full")


@dataclass(frozen=True)
class SpecConfig:
    """Self-speculative decoding settings (see METHOD.md)."""

    method: str = "vegas"
    gamma: int = 6
    ratio: float = 0.05
    min_tokens: int = 256
    score: str = "weight"
    collect: str = "2"
    granularity: str = "layer"
    sink: int = 4
    page: int = 16
    chunk: int = 32

    def __post_init__(self) -> None:
        object.__setattr__(self, "collect", str(self.collect))
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if not isinstance(self.gamma, int) or not 1 <= self.gamma <= MAX_GAMMA:
            raise ConfigError(f"gamma must be an integer in [1, {MAX_GAMMA}], got {self.gamma!r}")
        if not _is_number(self.ratio) or not 0.0 < self.ratio <= 1.0:
            raise ConfigError(f"ratio must be a number in (0, 1], got {self.ratio!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 1:
            raise ConfigError(f"min_tokens must be an integer >= 1, got {self.min_tokens!r}")
        _choice("score", self.score, ("weight", "logit"))
        _choice("collect", self.collect, ("2", "all"))
        _choice("granularity", self.granularity, ("layer", "kv_head"))
        for name in ("sink", "page", "chunk"):
            value = getattr(self, name)
            if not _is_int(value) or value < (0 if name == "sink" else 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

    @property
    def speculative(self) -> bool:
        return self.method != "vanilla"


def _is_int(value: Any) -> bool:
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
    backend: str = "auto"
    prefix_cache_bytes: int = 0  # > 0: keep prompt KV of up to this many bytes for reuse
    load_format: str = "auto"  # "dummy": random weights from the config, for timing
    # Decode-loop forwards as CUDA graphs per batch-size bucket; None: on for CUDA, off for CPU.
    cuda_graphs: bool | None = None
    # Fixed-shape decode buffers without graphs (implied by cuda_graphs; the CPU test path).
    static_shapes: bool = False
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a power of two, got {self.page_size}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ConfigError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"backend must be auto, torch or triton, got {self.backend!r}")
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
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def prefill_tokens(self, model: ModelConfig) -> int:
        """prefill_chunk, or by default the tokens whose activations (the widest tensors a
        layer holds at once: gate/up and its product, q/k/v, attention output and the
        residual stream) fit PREFILL_ACTIVATION_BYTES, in [2048, 32768] (Llama-3.1-8B in
        bf16: 8192; SmolLM2-135M: 32768)."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        width = 3 * model.intermediate_size + (2 * model.num_heads + 2 * model.num_kv_heads) \
            * model.head_dim + 3 * model.hidden_size
        tokens = PREFILL_ACTIVATION_BYTES // (width * DTYPES[self.dtype].itemsize)
        return max(2048, min(32768, tokens // 1024 * 1024))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def graphs(self) -> bool:
        """Capture CUDA graphs: as asked, else on for CUDA."""
        if self.cuda_graphs is None:
            return torch.device(self.device).type == "cuda"
        return self.cuda_graphs

    @property
    def static(self) -> bool:
        """Decode-loop forwards read fixed-shape buffers (graphs need them)."""
        return self.static_shapes or self.graphs

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "triton" if torch.device(self.device).type == "cuda" else "torch"
