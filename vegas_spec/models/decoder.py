"""The model: embeddings, its family's decoder layers, a final RMSNorm and the LM head.

`forward(input_ids, ctx, kv_caches, ops, attn)` is the only forward: prefill, plain decode,
draft and verify differ only in the StepContext the attention backend (`attn`) reads. Every
projection and the LM head go through the ops' `linear` (in exact mode a row-invariant
product); under tensor parallelism `cfg` holds one rank's heads and intermediate size, the
weights its slices, and the ops' `row_linear`, `embed` and `head_linear` do the collectives. Weights
keep their HF names until `load_hf` puts them where the family's weight table says, q/k/v and
gate/up fused into one matmul each (`models.family`); the layers are `models.layers`'.

A model may also hold draft copies of its projections (`make_draft_weights`: FP8, one scale
per output row, or INT4, one scale per row and group), which the projections of draft steps
(`ctx.draft`) read instead.

The plain-PyTorch references of the seams' steps live in `vegas_spec.ops`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from vegas_spec.config import MAX_GAMMA, ModelConfig
from vegas_spec.models import layers, registry
from vegas_spec.models.family import fill
from vegas_spec.models.rope import rope_table

if TYPE_CHECKING:  # the seams' types only: models imports neither attention nor compute
    from vegas_spec.attention.backend import AttentionBackend
    from vegas_spec.attention.context import StepContext
    from vegas_spec.compute.base import Ops


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg, self.family = cfg, registry.family(cfg.architecture)
        self.embed = layers.embedding(cfg)
        self.layers = nn.ModuleList(self.family.layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = layers.norm(cfg.hidden_size)
        self.lm_head = layers.lm_head(cfg)
        self.rope = torch.zeros(0)  # [max_pos + MAX_GAMMA + 1, D] cos|sin, by load_hf

    def forward(self, input_ids: torch.Tensor, ctx: StepContext,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], ops: Ops,
                attn: AttentionBackend) -> torch.Tensor:
        """input_ids [B, n] -> final hidden states [B, n, hidden] (normed)."""
        x, residual = ops.embed(input_ids, self.embed.weight), None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, self.rope, cache, ops, attn, ctx)
        assert residual is not None, "a decoder has layers"
        return ops.add_norm(x, residual, self.norm, self.cfg.rms_norm_eps)[0]

    def make_draft_weights(self, kind: str = "fp8") -> int:
        """`kind` (fp8, int8 or int4, `quant.QUANTIZERS`) copies of every layer's projections for
        the draft steps (embeddings, norms and the LM head stay the model's) -> their bytes."""
        return sum(layer.make_drafts(kind) for layer in self.layers)

    def keep_mxfp4_experts(self) -> int:
        """Every MoE layer's experts kept in MXFP4 where their values are exactly MXFP4
        (`MoEMLP.keep_mxfp4`) -> the number of layers that keep them so."""
        return sum(layer.keep_mxfp4() for layer in self.layers
                   if isinstance(layer, layers.MoEMLP))

    def draft_weight_bytes(self) -> int:
        """Bytes of the draft copies (0: none, drafts read the model's weights)."""
        return sum(w.nbytes for layer in self.layers for w in (layer.drafts or {}).values())

    def head(self, hidden: torch.Tensor, ops: Ops) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., V] in the model's dtype."""
        return ops.head_linear(hidden, self.lm_head.weight)

    def logits(self, hidden: torch.Tensor, ops: Ops) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., V] float32."""
        return self.head(hidden, ops).float()

    @torch.no_grad()
    def load_hf(self, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> None:
        """Copy checked HF-named tensors into the fused layout, then move and cast. Takes
        each layer's tensors out of `weights` as it fuses them, so that loading holds one
        copy of the weights and one layer's fused tensors, not two copies."""
        family, cfg = self.family, self.cfg
        fill(self, family.weights, weights, cfg)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        for i, layer in enumerate(self.layers):
            prefix = family.layer_prefix.format(i=i)
            names = [k for k in weights if k.startswith(prefix)]
            fill(layer, family.layer_weights, {k[len(prefix):]: weights.pop(k) for k in names},
                 cfg)
            layer.to(device=device, dtype=dtype)
        self.to(device=device, dtype=dtype)
        # Draft and verify rows of a sequence at the end of the context sit up to gamma + 1
        # positions past it; their tokens are never emitted, but their RoPE must exist.
        self.rope = rope_table(cfg, cfg.max_position_embeddings + MAX_GAMMA + 1, device)


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> Decoder:
    with torch.device("meta"):
        model = Decoder(cfg)
    model.load_hf(weights, dtype, device)
    return model.eval().requires_grad_(False)
