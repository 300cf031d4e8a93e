"""Rotary position embeddings with the scaling variants of Llama/Mistral/Qwen configs
(default, linear, llama3, yarn), computed as `transformers` does, and the per-frequency
divisors that llama.cpp stores as a GGUF's `rope_freqs` tensor (Llama 3.1 and later)."""

from __future__ import annotations

import math
from typing import Any

import torch

from vegas_spec.config import ConfigError, ModelConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg: ModelConfig, dim: int, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = rope["factor"]
    base = cfg.rope_theta
    orig = rope.get("original_max_position_embeddings") or cfg.max_position_embeddings
    attention = rope.get("attention_factor")
    if attention is None:
        ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all) if ms and ms_all
                     else _yarn_mscale(factor))
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def inv_freq_and_scale(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    rope, dim = cfg.rope, cfg.head_dim
    kind = rope["rope_type"]
    if kind == "yarn":
        return _yarn(cfg, dim, rope)
    inv_freq = _base_inv_freq(cfg.rope_theta, dim)
    if kind == "freq_factors":  # llama.cpp: theta_i = pos * base^(-2i/d) / factors[i]
        factors = torch.tensor(rope["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ConfigError(f"rope_freqs has {factors.numel()} factors, the head dim needs "
                              f"{inv_freq.numel()}")
        return inv_freq / factors, 1.0
    if kind == "linear":
        inv_freq = inv_freq / rope["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, rope)
    return inv_freq, 1.0


def rope_table(cfg: ModelConfig, length: int, device: torch.device) -> torch.Tensor:
    """[length, D] float32: cos in the first half of the last axis, sin in the second."""
    inv_freq, scale = inv_freq_and_scale(cfg)
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1).to(device)
