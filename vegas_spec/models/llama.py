"""Llama and Mistral: dense decoder layers (q/k/v and o_proj biases where `attention_bias`,
MLP biases where Llama's `mlp_bias`; Mistral has none), the embeddings, a final RMSNorm and
an LM head tied or not. Their tables are the dense layout that Qwen2 and Qwen3 reuse."""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from vegas_spec.models.family import COLUMNS, ROWS, Family, Switches, Weight, dims, untied
from vegas_spec.models.layers import DecoderLayer

QKV_BIAS, O_BIAS, MLP_BIAS = attrgetter("qkv_bias"), attrgetter("o_bias"), attrgetter("mlp_bias")
Q_HEADS, KV_HEADS = attrgetter("num_heads"), attrgetter("num_kv_heads")

MODEL_WEIGHTS = (
    Weight("model.embed_tokens.weight", "embed.weight", dims("vocab", "hidden"), ROWS,
           "token_embd.weight"),
    Weight("model.norm.weight", "norm", dims("hidden"), None, "output_norm.weight"),
    Weight("lm_head.weight", "lm_head.weight", dims("vocab", "hidden"), ROWS, "output.weight",
           untied),
)

ATTENTION_WEIGHTS = (
    Weight("self_attn.q_proj.weight", "qkv.weight", dims("q", "hidden"), ROWS,
           "attn_q.weight", rope_heads=Q_HEADS),
    Weight("self_attn.k_proj.weight", "qkv.weight", dims("kv", "hidden"), ROWS,
           "attn_k.weight", rope_heads=KV_HEADS),
    Weight("self_attn.v_proj.weight", "qkv.weight", dims("kv", "hidden"), ROWS, "attn_v.weight"),
    Weight("self_attn.q_proj.bias", "qkv.bias", dims("q"), ROWS, "attn_q.bias", QKV_BIAS,
           Q_HEADS),
    Weight("self_attn.k_proj.bias", "qkv.bias", dims("kv"), ROWS, "attn_k.bias", QKV_BIAS,
           KV_HEADS),
    Weight("self_attn.v_proj.bias", "qkv.bias", dims("kv"), ROWS, "attn_v.bias", QKV_BIAS),
    Weight("self_attn.o_proj.weight", "o_proj.weight", dims("hidden", "q"), COLUMNS,
           "attn_output.weight"),
    Weight("self_attn.o_proj.bias", "o_proj.bias", dims("hidden"), None, "attn_output.bias",
           O_BIAS),  # added once, after the ranks' partial sums
)

MLP_WEIGHTS = (
    Weight("mlp.gate_proj.weight", "gate_up.weight", dims("ffn", "hidden"), ROWS,
           "ffn_gate.weight"),
    Weight("mlp.up_proj.weight", "gate_up.weight", dims("ffn", "hidden"), ROWS, "ffn_up.weight"),
    Weight("mlp.gate_proj.bias", "gate_up.bias", dims("ffn"), ROWS, "ffn_gate.bias", MLP_BIAS),
    Weight("mlp.up_proj.bias", "gate_up.bias", dims("ffn"), ROWS, "ffn_up.bias", MLP_BIAS),
    Weight("mlp.down_proj.weight", "down.weight", dims("hidden", "ffn"), COLUMNS,
           "ffn_down.weight"),
    Weight("mlp.down_proj.bias", "down.bias", dims("hidden"), None, "ffn_down.bias", MLP_BIAS),
)

NORM_WEIGHTS = (
    Weight("input_layernorm.weight", "input_norm", dims("hidden"), None, "attn_norm.weight"),
    Weight("post_attention_layernorm.weight", "post_norm", dims("hidden"), None,
           "ffn_norm.weight"),
)

LAYER_WEIGHTS = ATTENTION_WEIGHTS + MLP_WEIGHTS + NORM_WEIGHTS


def llama_switches(hf: dict[str, Any]) -> Switches:
    attention = bool(hf.get("attention_bias", False))
    return Switches(qkv_bias=attention, o_bias=attention, mlp_bias=bool(hf.get("mlp_bias", False)))


def no_switches(hf: dict[str, Any]) -> Switches:
    return Switches()


LLAMA = Family("LlamaForCausalLM", "llama", DecoderLayer, MODEL_WEIGHTS, LAYER_WEIGHTS,
               llama_switches, gguf="llama", gguf_permuted=True)
MISTRAL = Family("MistralForCausalLM", "mistral", DecoderLayer, MODEL_WEIGHTS, LAYER_WEIGHTS,
                 no_switches, gguf="mistral", gguf_permuted=True)
