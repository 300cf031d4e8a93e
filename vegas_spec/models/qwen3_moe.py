"""Qwen3-MoE: Qwen3's attention (an RMSNorm per head on q and k; q/k/v and o_proj biased where
`attention_bias`) with a mixture of experts as every layer's MLP: a router over `num_experts`
experts (`num_local_experts` in the files transformers 5 writes) of `moe_intermediate_size`,
`num_experts_per_tok` of them a token, their probabilities renormalised where
`norm_topk_prob`. Checkpoints hold one tensor per expert (`mlp.experts.{e}.gate_proj.weight`:
what Qwen publishes and transformers saves). Layouts with dense layers (`mlp_only_layers`,
`decoder_sparse_step` > 1) are refused.

GGUF files of llama.cpp's `qwen3moe` architecture are read too: its `expert_count`,
`expert_used_count` and `expert_feed_forward_length` keys give the experts' sizes (the
top-k probabilities renormalised, as llama.cpp does, unless `expert_weights_norm` is
false), q/k rows are not permuted, and each layer's experts are stacked tensors
(`ffn_gate_exps`, `ffn_up_exps` [E, I, hidden], `ffn_down_exps` [E, hidden, I]) that the
loader cuts into the table's per-expert ones."""

from __future__ import annotations

from typing import Any

from vegas_spec.config import ConfigError, count_field
from vegas_spec.models.family import COLUMNS, ROWS, Experts, Family, Weight, dims
from vegas_spec.models.layers import MoEDecoderLayer
from vegas_spec.models.llama import ATTENTION_WEIGHTS, MODEL_WEIGHTS, NORM_WEIGHTS
from vegas_spec.models.qwen3 import QK_NORM_WEIGHTS, qwen3_switches

ARCHITECTURE = "Qwen3MoeForCausalLM"

EXPERT_WEIGHTS = (
    Weight("mlp.gate.weight", "router.weight", dims("experts", "hidden"), None,
           "ffn_gate_inp.weight"),
    Weight("mlp.experts.{e}.gate_proj.weight", "experts_gate_up", dims("moe_ffn", "hidden"),
           ROWS, "ffn_gate_exps.weight"),
    Weight("mlp.experts.{e}.up_proj.weight", "experts_gate_up", dims("moe_ffn", "hidden"),
           ROWS, "ffn_up_exps.weight"),
    Weight("mlp.experts.{e}.down_proj.weight", "experts_down", dims("hidden", "moe_ffn"),
           COLUMNS, "ffn_down_exps.weight"),
)


def qwen3_moe_experts(hf: dict[str, Any]) -> Experts:
    """The experts' sizes; ConfigError for a layout with dense layers."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step not in (1, None) or dense:
        raise ConfigError(f"{ARCHITECTURE} with dense layers (decoder_sparse_step={step}, "
                          f"mlp_only_layers={dense}) is not supported: every layer must be a "
                          "mixture of experts (decoder_sparse_step 1, no mlp_only_layers)")
    key = "num_local_experts" if hf.get("num_experts") is None \
        and hf.get("num_local_experts") is not None else "num_experts"
    experts, top_k = count_field(hf, key), count_field(hf, "num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok={top_k} is more than the {experts} experts")
    return Experts(experts, top_k, count_field(hf, "moe_intermediate_size"),
                   bool(hf.get("norm_topk_prob", False)))


QWEN3_MOE = Family(ARCHITECTURE, "qwen3_moe", MoEDecoderLayer, MODEL_WEIGHTS,
                   ATTENTION_WEIGHTS + EXPERT_WEIGHTS + NORM_WEIGHTS + QK_NORM_WEIGHTS,
                   qwen3_switches, gguf="qwen3moe", experts=qwen3_moe_experts)
