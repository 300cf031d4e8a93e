"""The layers the model families share, each through the compute seams: the ops
(`compute.base.Ops`: projections, norms, SiLU * up, the experts, the collectives) and the
attention backend (`attention.backend.AttentionBackend`).

A decoder layer is `LayerBase` (its place, its norms, the draft copies of its projections and
the pre-norm residual step) with an attention block and an MLP block mixed in: `Attention`
(q/k/v fused in one projection, optional biases and q/k RMSNorm, the backend's attention over
the paged cache, o_proj) and `DenseMLP` (gate/up fused, SiLU * up, down). `DecoderLayer` is
both, the layer of every dense family; `MoEDecoderLayer` has a mixture of experts, `MoEMLP`,
in its place (a router, then each token's top-k experts, each a gated MLP). A block's
parameters are attributes of the layer (`qkv`, `o_proj`, `gate_up`, `down`, `router`,
`experts_gate_up`, ...), the names a family's weight table fills.

The residual stream runs beside the hidden states (as vLLM's): each norm also adds the
residual before it, so the ops can fuse add + norm and SiLU * up, and the attention backend
RoPE + KV store, into one kernel each. Under tensor parallelism `cfg` holds one rank's heads
and intermediate size, and the ops' `row_linear` sums o_proj's and down's partial outputs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from vegas_spec import quant
from vegas_spec.config import ModelConfig
from vegas_spec.quant import QUANTIZERS, DraftWeight, Mxfp4, mxfp4_exact

if TYPE_CHECKING:  # the seams' types only: models imports neither attention nor compute
    from vegas_spec.attention.backend import AttentionBackend
    from vegas_spec.attention.context import StepContext
    from vegas_spec.compute.base import Ops


def norm(size: int) -> nn.Parameter:
    """An RMSNorm's weight (the ops' `norm`/`add_norm` apply it)."""
    return nn.Parameter(torch.ones(size))


def embedding(cfg: ModelConfig) -> nn.Embedding:
    # given its weight, nn.Embedding skips its random init (on the meta device that init
    # alone imports seconds of PyTorch's reference ops); the loader sets the weights
    return nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                        _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))


def lm_head(cfg: ModelConfig) -> nn.Linear:
    return nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class LayerBase(nn.Module):
    """One decoder layer: x -> attention and MLP, each behind an add + RMSNorm."""

    projections: tuple[str, ...] = ()  # the nn.Linear attributes a draft step may read in FP8

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.cfg, self.index = cfg, index
        self.input_norm, self.post_norm = norm(cfg.hidden_size), norm(cfg.hidden_size)
        self.drafts: dict[str, DraftWeight] | None = None  # the draft steps' copies

    def weight(self, name: str, ctx: StepContext) -> torch.Tensor | DraftWeight:
        """Projection `name`'s weight for this step: its draft copy in a draft step of at
        most `quant.DRAFT_COPY_ROWS` rows where the model made one (`make_drafts`), else the
        model's."""
        if ctx.draft and self.drafts is not None and ctx.positions.numel() <= quant.DRAFT_COPY_ROWS:
            return self.drafts[name]
        return getattr(self, name).weight

    def make_drafts(self, kind: str = "fp8") -> int:
        """`kind` (fp8, int8 or int4) copies of the layer's projections -> their bytes."""
        quantize = QUANTIZERS[kind]
        self.drafts = {name: quantize(getattr(self, name).weight) for name in self.projections}
        return sum(w.nbytes for w in self.drafts.values())

    def attention(self, h: torch.Tensor, rope: torch.Tensor, cache: tuple[torch.Tensor, ...],
                  ops: Ops, attn: AttentionBackend, ctx: StepContext) -> torch.Tensor:
        raise NotImplementedError

    def mlp(self, h: torch.Tensor, ops: Ops, ctx: StepContext) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: torch.Tensor,
                cache: tuple[torch.Tensor, ...], ops: Ops, attn: AttentionBackend,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (the embeddings, residual None, for the first layer)
        -> (this layer's output, the residual stream before it)."""
        eps = self.cfg.rms_norm_eps
        if residual is None:
            h, residual = ops.norm(x, self.input_norm, eps), x
        else:
            h, residual = ops.add_norm(x, residual, self.input_norm, eps)
        h, residual = ops.add_norm(self.attention(h, rope, cache, ops, attn, ctx), residual,
                                   self.post_norm, eps)
        return self.mlp(h, ops, ctx), residual


class Attention(LayerBase):
    """Self-attention: q/k/v in one projection (bias where cfg.qkv_bias), q/k RMSNorm per head
    where cfg.qk_norm, RoPE + KV store + attention by the backend, o_proj. Where cfg.sinks a
    learned logit per query head (`sinks` [H]) joins the softmax denominator; the layer's
    sliding window (`cfg.window(index)`, 0: none) limits the keys a query sees."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(cfg, index)
        d, h = cfg.head_dim, cfg.hidden_size
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=cfg.o_bias)
        self.q_norm = norm(d) if cfg.qk_norm else None
        self.k_norm = norm(d) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.sinks else None
        self.window = cfg.window(index)

    def attention(self, h: torch.Tensor, rope: torch.Tensor, cache: tuple[torch.Tensor, ...],
                  ops: Ops, attn: AttentionBackend, ctx: StepContext) -> torch.Tensor:
        """h [B, n, hidden] (normed) -> [B, n, hidden]."""
        cfg = self.cfg
        bsz, n, _ = h.shape
        qkv = ops.linear(h, self.weight("qkv", ctx), self.qkv.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(bsz, n, cfg.num_heads, cfg.head_dim)
        k = k.view(bsz, n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(bsz, n, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = ops.norm(q, self.q_norm, cfg.rms_norm_eps)
            k = ops.norm(k, self.k_norm, cfg.rms_norm_eps)
        out = attn.attend(self.index, q, k, v, cache[0], cache[1], ctx, rope, self.sinks,
                          self.window)
        return ops.row_linear(out.reshape(bsz, n, self.q_size), self.weight("o_proj", ctx),
                              self.o_proj.bias)


class DenseMLP(LayerBase):
    """down(SiLU(gate) * up), gate and up in one projection (biases where cfg.mlp_bias)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(cfg, index)
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_up = nn.Linear(h, 2 * i, bias=cfg.mlp_bias)
        self.down = nn.Linear(i, h, bias=cfg.mlp_bias)

    def mlp(self, h: torch.Tensor, ops: Ops, ctx: StepContext) -> torch.Tensor:
        """h [B, n, hidden] (normed) -> [B, n, hidden]."""
        up = ops.silu_mul(ops.linear(h, self.weight("gate_up", ctx), self.gate_up.bias))
        return ops.row_linear(up, self.weight("down", ctx), self.down.bias)


class MoEMLP(LayerBase):
    """A mixture of experts: a router [E, hidden] (whole on every rank) picks each token's
    cfg.experts_per_token experts, whose gated MLPs (gate/up fused per expert,
    experts_gate_up [E, 2I, hidden]; experts_down [E, hidden, I]) the ops' `moe` runs,
    the outputs weighted by the router's (renormalised where cfg.norm_topk_prob)
    probabilities. Draft steps read the model's own expert weights (no draft copies).
    gpt-oss's: a router bias (cfg.router_bias), each expert's biases (cfg.expert_bias:
    experts_gate_up_bias [E, 2I], experts_down_bias [E, hidden]) and the clamped SwiGLU
    (cfg.swiglu_limit > 0)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(cfg, index)
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.router = nn.Linear(h, e, bias=cfg.router_bias)
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.experts_down = nn.Parameter(torch.empty(e, h, i))
        biased = cfg.expert_bias
        self.experts_gate_up_bias = nn.Parameter(torch.empty(e, 2 * i)) if biased else None
        self.experts_down_bias = nn.Parameter(torch.empty(e, h)) if biased else None
        self.packed: tuple[Mxfp4, Mxfp4] | None = None  # (gate_up, down) kept in MXFP4

    def keep_mxfp4(self) -> bool:
        """Both expert stacks kept in MXFP4 in place of their dense values where those are
        exactly MXFP4 (an MXFP4 checkpoint's, dequantised at load: `quant.mxfp4_exact`): a
        quarter of bfloat16's bytes, read as stored by the ops' `moe`, the same values.
        False, and nothing changed, where they are not."""
        if self.packed is None:
            gate_up, down = mxfp4_exact(self.experts_gate_up), mxfp4_exact(self.experts_down)
            if gate_up is None or down is None:
                return False
            self.packed = gate_up, down
            self.experts_gate_up, self.experts_down = None, None  # type: ignore[assignment]
        return True

    def mlp(self, h: torch.Tensor, ops: Ops, ctx: StepContext) -> torch.Tensor:
        """h [B, n, hidden] (normed) -> [B, n, hidden]."""
        cfg = self.cfg
        logits = ops.linear(h, self.router.weight, self.router.bias)  # [B, n, E]
        gate_up, down = self.packed or (self.experts_gate_up, self.experts_down)
        return ops.moe(h, logits, gate_up, down, cfg.experts_per_token, cfg.norm_topk_prob,
                       self.experts_gate_up_bias, self.experts_down_bias, cfg.swiglu_limit)


class DecoderLayer(Attention, DenseMLP):
    """The dense families' layer: attention, then the gated MLP."""

    projections = ("qkv", "o_proj", "gate_up", "down")


class MoEDecoderLayer(Attention, MoEMLP):
    """A mixture-of-experts family's layer: attention, then the experts."""

    projections = ("qkv", "o_proj")
