"""Qwen2: the dense Llama layout, with q/k/v biases always and no other bias."""

from __future__ import annotations

from typing import Any

from vegas_spec.models.family import Family, Switches
from vegas_spec.models.layers import DecoderLayer
from vegas_spec.models.llama import LAYER_WEIGHTS, MODEL_WEIGHTS


def qwen2_switches(hf: dict[str, Any]) -> Switches:
    return Switches(qkv_bias=True)


QWEN2 = Family("Qwen2ForCausalLM", "qwen2", DecoderLayer, MODEL_WEIGHTS, LAYER_WEIGHTS,
               qwen2_switches, gguf="qwen2")
