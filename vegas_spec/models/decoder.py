"""One decoder for Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm).

`forward(input_ids, ctx, kv_caches, backend)` is the only forward: prefill, plain decode, draft and
verify differ only in the StepContext the attention backend reads. Every projection and the
LM head go through the backend's `linear` (in exact mode a row-invariant product); under
tensor parallelism `cfg` holds one rank's heads and intermediate size, the weights its
slices, and the backend's `row_linear`, `embed` and `head_linear` do the collectives. Weights
keep their HF names at load time; q/k/v and gate/up are fused into one matmul each. The
residual stream runs beside the hidden states (as vLLM's): each norm also adds the residual
before it, so the backend can fuse add + norm, RoPE + KV store and SiLU * up into one kernel
each.

A model may also hold draft copies of its projections (`make_draft_weights`: FP8, one scale
per output row, or INT4, one scale per row and group), which the projections of draft steps
(`ctx.draft`) read instead.

The plain-PyTorch references of those steps live in `vegas_spec.ops`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from vegas_spec.config import MAX_GAMMA, ModelConfig
from vegas_spec.models.rope import rope_table
from vegas_spec.quant import QUANTIZERS, DraftWeight

if TYPE_CHECKING:  # the seam's types only: models and attention do not import each other
    from vegas_spec.attention.backend import AttentionBackend
    from vegas_spec.attention.context import StepContext


PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")  # a layer's fused projections


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.cfg, self.index = cfg, index
        d, h = cfg.head_dim, cfg.hidden_size
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=cfg.o_bias)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_norm = nn.Parameter(torch.ones(h))
        self.q_norm = nn.Parameter(torch.ones(d)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(d)) if cfg.qk_norm else None
        self.drafts: dict[str, DraftWeight] | None = None  # the draft steps' copies

    def weight(self, name: str, ctx: StepContext) -> torch.Tensor | DraftWeight:
        """Projection `name`'s weight for this step: its draft copy in a draft step where the
        model made one (`Decoder.make_draft_weights`), else the model's."""
        if ctx.draft and self.drafts is not None:
            return self.drafts[name]
        return getattr(self, name).weight

    def attention(self, h: torch.Tensor, rope: torch.Tensor, cache: tuple[torch.Tensor, ...],
                  backend: AttentionBackend, ctx: StepContext) -> torch.Tensor:
        cfg = self.cfg
        bsz, n, _ = h.shape
        qkv = backend.linear(h, self.weight("qkv", ctx), self.qkv.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(bsz, n, cfg.num_heads, cfg.head_dim)
        k = k.view(bsz, n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(bsz, n, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = backend.norm(q, self.q_norm, cfg.rms_norm_eps)
            k = backend.norm(k, self.k_norm, cfg.rms_norm_eps)
        out = backend.attend(self.index, q, k, v, cache[0], cache[1], ctx, rope)
        return backend.row_linear(out.reshape(bsz, n, self.q_size), self.weight("o_proj", ctx),
                                  self.o_proj.bias)

    def mlp(self, h: torch.Tensor, backend: AttentionBackend, ctx: StepContext) -> torch.Tensor:
        up = backend.silu_mul(backend.linear(h, self.weight("gate_up", ctx), self.gate_up.bias))
        return backend.row_linear(up, self.weight("down", ctx), self.down.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: torch.Tensor,
                cache: tuple[torch.Tensor, ...], backend: AttentionBackend, ctx: StepContext,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (the embeddings, residual None, for the first layer)
        -> (this layer's output, the residual stream before it)."""
        eps = self.cfg.rms_norm_eps
        if residual is None:
            h, residual = backend.norm(x, self.input_norm, eps), x
        else:
            h, residual = backend.add_norm(x, residual, self.input_norm, eps)
        h, residual = backend.add_norm(self.attention(h, rope, cache, backend, ctx), residual,
                                       self.post_norm, eps)
        return self.mlp(h, backend, ctx), residual


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # given its weight, nn.Embedding skips its random init (on the meta device that
        # init alone imports seconds of PyTorch's reference ops); load_hf sets the weights
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = torch.zeros(0)  # [max_pos + MAX_GAMMA + 1, D] cos|sin, by load_hf

    def forward(self, input_ids: torch.Tensor, ctx: StepContext,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                backend: AttentionBackend) -> torch.Tensor:
        """input_ids [B, n] -> final hidden states [B, n, hidden] (normed)."""
        x, residual = backend.embed(input_ids, self.embed.weight), None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, self.rope, cache, backend, ctx)
        assert residual is not None, "a decoder has layers"
        return backend.add_norm(x, residual, self.norm, self.cfg.rms_norm_eps)[0]

    def make_draft_weights(self, kind: str = "fp8") -> int:
        """`kind` (fp8 or int4, `quant.QUANTIZERS`) copies of every layer's projections for
        the draft steps (embeddings, norms and the LM head stay the model's) -> their bytes."""
        quantize = QUANTIZERS[kind]
        for layer in self.layers:
            layer.drafts = {name: quantize(getattr(layer, name).weight)
                            for name in PROJECTIONS}
        return self.draft_weight_bytes()

    def draft_weight_bytes(self) -> int:
        """Bytes of the draft copies (0: none, drafts read the model's weights)."""
        return sum(w.nbytes for layer in self.layers for w in (layer.drafts or {}).values())

    def head(self, hidden: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., V] in the model's dtype."""
        return backend.head_linear(hidden, self.lm_head.weight)

    def logits(self, hidden: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., V] float32."""
        return self.head(hidden, backend).float()

    @torch.no_grad()
    def load_hf(self, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> None:
        """Copy checked HF-named tensors into the fused layout, then move and cast. Takes
        each layer's tensors out of `weights` as it fuses them, so that loading holds one
        copy of the weights and one layer's fused tensors, not two copies."""
        w = weights
        self.embed.weight = nn.Parameter(w["model.embed_tokens.weight"])
        self.norm = nn.Parameter(w["model.norm.weight"])
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        self.lm_head.weight = self.embed.weight if head is w["model.embed_tokens.weight"] \
            else nn.Parameter(head)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            names = [k for k in w if k.startswith(prefix)]
            _load_layer(layer, {k[len(prefix):]: w.pop(k) for k in names})
            layer.to(device=device, dtype=dtype)
        self.to(device=device, dtype=dtype)
        # Draft and verify rows of a sequence at the end of the context sit up to gamma + 1
        # positions past it; their tokens are never emitted, but their RoPE must exist.
        self.rope = rope_table(self.cfg, self.cfg.max_position_embeddings + MAX_GAMMA + 1, device)


def _cat(w: dict[str, torch.Tensor], names: list[str], suffix: str) -> nn.Parameter:
    return nn.Parameter(torch.cat([w[f"{n}.{suffix}"] for n in names]))


def _load_layer(layer: Layer, w: dict[str, torch.Tensor]) -> None:
    qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    gate_up = ["mlp.gate_proj", "mlp.up_proj"]
    layer.qkv.weight = _cat(w, qkv, "weight")
    layer.gate_up.weight = _cat(w, gate_up, "weight")
    if layer.qkv.bias is not None:
        layer.qkv.bias = _cat(w, qkv, "bias")
    if layer.gate_up.bias is not None:
        layer.gate_up.bias = _cat(w, gate_up, "bias")
        layer.down.bias = nn.Parameter(w["mlp.down_proj.bias"])
    layer.o_proj.weight = nn.Parameter(w["self_attn.o_proj.weight"])
    if layer.o_proj.bias is not None:
        layer.o_proj.bias = nn.Parameter(w["self_attn.o_proj.bias"])
    layer.down.weight = nn.Parameter(w["mlp.down_proj.weight"])
    layer.input_norm = nn.Parameter(w["input_layernorm.weight"])
    layer.post_norm = nn.Parameter(w["post_attention_layernorm.weight"])
    if layer.q_norm is not None:
        layer.q_norm = nn.Parameter(w["self_attn.q_norm.weight"])
        layer.k_norm = nn.Parameter(w["self_attn.k_norm.weight"])


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> Decoder:
    with torch.device("meta"):
        model = Decoder(cfg)
    model.load_hf(weights, dtype, device)
    return model.eval().requires_grad_(False)
