"""Qwen3: the dense Llama layout with an RMSNorm per head on q and k (before RoPE); q/k/v and
o_proj biased where `attention_bias`."""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from vegas_spec.models.family import Family, Switches, Weight, dims
from vegas_spec.models.layers import DecoderLayer
from vegas_spec.models.llama import LAYER_WEIGHTS, MODEL_WEIGHTS

QK_NORM = attrgetter("qk_norm")
QK_NORM_WEIGHTS = (
    Weight("self_attn.q_norm.weight", "q_norm", dims("head"), None, "attn_q_norm.weight", QK_NORM),
    Weight("self_attn.k_norm.weight", "k_norm", dims("head"), None, "attn_k_norm.weight", QK_NORM),
)


def qwen3_switches(hf: dict[str, Any]) -> Switches:
    attention = bool(hf.get("attention_bias", False))
    return Switches(qkv_bias=attention, o_bias=attention, qk_norm=True)


QWEN3 = Family("Qwen3ForCausalLM", "qwen3", DecoderLayer, MODEL_WEIGHTS,
               LAYER_WEIGHTS + QK_NORM_WEIGHTS, qwen3_switches, gguf="qwen3")
