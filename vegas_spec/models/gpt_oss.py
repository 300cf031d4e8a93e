"""gpt-oss: Llama's attention layout (q/k/v and o_proj biased where `attention_bias`, true in
the published models) with a learned sink logit per query head in every softmax's
denominator (`self_attn.sinks`), a sliding window of `sliding_window` keys on the layers
`layer_types` names `sliding_attention` (every other layer by default) and full attention on
the rest, YaRN RoPE, and a mixture of experts in every layer: a biased router whose top-k
logits are softmaxed (the top-k of the full softmax renormalised: the same probabilities),
experts with biases and the clamped SwiGLU, (up + 1) * gate * sigmoid(1.702 * gate) with
gate <= `swiglu_limit` and |up| <= `swiglu_limit` (7 where the config says nothing, as
transformers).

Checkpoints hold each layer's experts as fused 3-D tensors, as transformers saves them:
`mlp.experts.gate_up_proj` [E, hidden, 2I] (transposed, gate and up interleaved column by
column), `down_proj` [E, I, hidden] and their biases; the table's `convert`s put them in the
shared layer's layout ([E, 2I, hidden], gate rows then up rows; [E, hidden, I]). OpenAI's
published checkpoints store the experts' weights in MXFP4 (`*_blocks`, `*_scales`), which
the loader dequantises (`models.mxfp4`); on a GPU with the Triton backend the engine then
keeps them in MXFP4 again, exactly (`Decoder.keep_mxfp4_experts`), and the fused MoE kernel
reads them as stored.

GGUF files of llama.cpp's `gpt-oss` architecture are read too (MXFP4 expert stacks
dequantised by `gguf`): q/k rows are not permuted, the post-attention norm is
`post_attention_norm`, the sinks `attn_sinks.weight`, and each layer's experts are stacks
(`ffn_gate_exps`, `ffn_up_exps` [E, I, hidden] with biases [E, I], or fused as
`ffn_gate_up_exps` [E, 2I, hidden], gate rows then up rows; `ffn_down_exps` [E, hidden, I]
with its bias) that the family's joins put back in the checkpoint's layout. The
file's `attention.sliding_window` gives the window (every other layer, the first sliding, as
llama.cpp and transformers lay them out), its YaRN keys the RoPE, without truncation as the
published config says, and a `swiglu_limit` key, where a file has one, the clamp (7
otherwise, which llama.cpp fixes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from vegas_spec.config import ConfigError, count_field, real_field
from vegas_spec.models.family import ROWS, Experts, Family, GgufJoin, Switches, Weight, dims
from vegas_spec.models.layers import MoEDecoderLayer
from vegas_spec.models.llama import ATTENTION_WEIGHTS, MODEL_WEIGHTS, NORM_WEIGHTS

ARCHITECTURE = "GptOssForCausalLM"
LAYER_TYPES = {"sliding_attention": True, "full_attention": False}  # -> windowed
QUANTIZATIONS = ("mxfp4",)  # quantization_config.quant_method values the loader reads
SWIGLU_LIMIT = 7.0  # transformers' and the published configs'
SLIDING_WINDOW = 128  # transformers' default


def gate_up_layout(w: torch.Tensor) -> torch.Tensor:
    """[E, hidden, 2I], gate and up columns interleaved -> [E, 2I, hidden], gate rows then up
    rows (a tensor-parallel slice of the interleaved columns holds matching gate and up)."""
    rows = w.transpose(1, 2)
    return torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1).contiguous()


def gate_up_bias_layout(b: torch.Tensor) -> torch.Tensor:
    """[E, 2I] interleaved -> [E, 2I], gate then up."""
    return torch.cat([b[:, 0::2], b[:, 1::2]], dim=1).contiguous()


def down_layout(w: torch.Tensor) -> torch.Tensor:
    """[E, I, hidden] -> [E, hidden, I]."""
    return w.transpose(1, 2).contiguous()


def gguf_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """llama.cpp's gate and up stacks [E, I, hidden] -> the checkpoint's [E, hidden, 2I],
    gate and up columns interleaved."""
    experts, inter, hidden = gate.shape
    return torch.stack([gate, up], dim=2).reshape(experts, 2 * inter, hidden).transpose(1, 2)


def gguf_gate_up_bias(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[E, I] each -> [E, 2I] interleaved."""
    return torch.stack([gate, up], dim=2).reshape(gate.shape[0], -1)


def gguf_fused_gate_up(w: torch.Tensor) -> torch.Tensor:
    """llama.cpp's fused stack [E, 2I, hidden], gate rows then up rows -> the checkpoint's."""
    return gguf_gate_up(*w.chunk(2, dim=1))


def gguf_fused_gate_up_bias(b: torch.Tensor) -> torch.Tensor:
    """[E, 2I], gate then up -> [E, 2I] interleaved."""
    return gguf_gate_up_bias(*b.chunk(2, dim=1))


def gguf_down(w: torch.Tensor) -> torch.Tensor:
    """llama.cpp's down stack [E, hidden, I] -> the checkpoint's [E, I, hidden]."""
    return w.transpose(1, 2)


SINK_WEIGHTS = (
    Weight("self_attn.sinks", "sinks", dims("heads"), ROWS, "attn_sinks.weight"),
)

# tensor parallelism splits each expert's intermediate axis: gate_up's interleaved columns
# (dim 2), down's rows (dim 1), gate_up's bias (dim 1); the down bias is whole (rank 0 adds it)
EXPERT_WEIGHTS = (
    Weight("mlp.router.weight", "router.weight", dims("experts", "hidden"), None,
           "ffn_gate_inp.weight"),
    Weight("mlp.router.bias", "router.bias", dims("experts"), None, "ffn_gate_inp.bias"),
    Weight("mlp.experts.gate_up_proj", "experts_gate_up", dims("experts", "hidden", "moe_gate_up"),
           2, None, convert=gate_up_layout),
    Weight("mlp.experts.gate_up_proj_bias", "experts_gate_up_bias",
           dims("experts", "moe_gate_up"), 1, None, convert=gate_up_bias_layout),
    Weight("mlp.experts.down_proj", "experts_down", dims("experts", "moe_ffn", "hidden"), 1,
           None, convert=down_layout),
    Weight("mlp.experts.down_proj_bias", "experts_down_bias", dims("experts", "hidden"), None,
           "ffn_down_exps.bias"),
)


# the post-attention norm under llama.cpp's gpt-oss name
GPT_OSS_NORM_WEIGHTS = tuple(
    dataclasses.replace(w, gguf="post_attention_norm.weight") if w.gguf == "ffn_norm.weight"
    else w for w in NORM_WEIGHTS)

GGUF_JOINS = (
    GgufJoin("mlp.experts.gate_up_proj", ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
             gguf_gate_up),
    GgufJoin("mlp.experts.gate_up_proj_bias", ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
             gguf_gate_up_bias),
    GgufJoin("mlp.experts.down_proj", ("ffn_down_exps.weight",), gguf_down),
    # the converter's fused variant: one gate/up stack and bias, gate rows then up rows
    GgufJoin("mlp.experts.gate_up_proj", ("ffn_gate_up_exps.weight",), gguf_fused_gate_up),
    GgufJoin("mlp.experts.gate_up_proj_bias", ("ffn_gate_up_exps.bias",),
             gguf_fused_gate_up_bias),
)


def gpt_oss_gguf_fields(field: Callable[..., Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The window, the experts' width, YaRN without truncation and the clamp, from a
    `gpt-oss` GGUF file's keys."""
    out: dict[str, Any] = {"intermediate_size": field("expert_feed_forward_length",
                                                      cfg["intermediate_size"]),
                           "sliding_window": field("attention.sliding_window", SLIDING_WINDOW)}
    limit = field("swiglu_limit")
    if limit is not None:
        out["swiglu_limit"] = limit
    if cfg.get("rope_scaling"):
        out["rope_scaling"] = {**cfg["rope_scaling"], "truncate": False}
    return out


def gpt_oss_switches(hf: dict[str, Any]) -> Switches:
    attention = bool(hf.get("attention_bias", True))
    return Switches(qkv_bias=attention, o_bias=attention, sinks=True)


def gpt_oss_experts(hf: dict[str, Any]) -> Experts:
    """The experts' sizes and activation; ConfigError for a quantization it does not read."""
    quant = hf.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if quant is not None and method not in QUANTIZATIONS:
        raise ConfigError(f"{ARCHITECTURE} quantized as {method!r} is not supported; "
                          f"supported: unquantized, {', '.join(QUANTIZATIONS)}")
    key = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    experts, top_k = count_field(hf, key), count_field(hf, "num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok={top_k} is more than the {experts} experts")
    return Experts(experts, top_k, count_field(hf, "intermediate_size"), norm_topk_prob=True,
                   router_bias=True, expert_bias=True,
                   swiglu_limit=real_field(hf, "swiglu_limit", SWIGLU_LIMIT),
                   mxfp4_experts=quant is not None)


def gpt_oss_windows(hf: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's window: `sliding_window` (transformers' 128 where the config says none)
    on `sliding_attention` layers, 0 on `full_attention` ones (`layer_types`; by default the
    even layers slide)."""
    layers = count_field(hf, "num_hidden_layers")
    types = hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    unknown = sorted({str(t) for t in types} - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"unsupported layer_types {', '.join(unknown)}; supported: "
                          f"{', '.join(LAYER_TYPES)}")
    if len(types) != layers:
        raise ConfigError(f"layer_types names {len(types)} layers, num_hidden_layers is "
                          f"{layers}")
    if not any(LAYER_TYPES[t] for t in types):
        return (0,) * layers
    window = count_field(hf, "sliding_window", SLIDING_WINDOW)
    return tuple(window if LAYER_TYPES[t] else 0 for t in types)


GPT_OSS = Family(ARCHITECTURE, "gpt_oss", MoEDecoderLayer, MODEL_WEIGHTS,
                 ATTENTION_WEIGHTS + SINK_WEIGHTS + EXPERT_WEIGHTS + GPT_OSS_NORM_WEIGHTS,
                 gpt_oss_switches, gguf="gpt-oss", experts=gpt_oss_experts,
                 windows=gpt_oss_windows, gguf_joins=GGUF_JOINS,
                 gguf_fields=gpt_oss_gguf_fields)
