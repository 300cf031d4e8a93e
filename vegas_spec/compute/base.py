"""The ops seam: a model step's dense compute around attention, and the tensor-parallel
collectives it meets, with its implementations chosen by name from a registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from vegas_spec.ops import route
from vegas_spec.parallel import SINGLE, TPGroup
from vegas_spec.quant import DraftWeight, Mxfp4


class Ops(ABC):
    """One object per engine, built with its mode and its tensor-parallel group; every layer
    of every step calls it for everything but attention (`attention.backend`): the
    projections (`linear`, with the draft steps' FP8 or INT4 copies), the per-token steps
    (`norm`, `add_norm`, `silu_mul`) and a mixture of experts (`moe`, whose experts run in
    `experts`). An implementation gives those five; the rest is composed here from them and
    the group's collectives.

    Exact mode (`exact=True`): every row is computed the same way whatever the number of
    rows in the step (batch size x query rows): the products through a row-invariant
    `linear`, the experts' too. The per-token steps are row-wise: RMSNorm reduces one row
    (its rsqrt is correctly rounded on every path) and SiLU * up is elementwise, with one
    path for every element's exp.

    Tensor parallelism (`tp`, see `vegas_spec.parallel`): the decoder calls `row_linear`
    for o_proj and down and `moe` for the experts (the partial products summed over the
    ranks, `sum_ranks`; in exact mode in rank order), `embed` for the vocabulary-parallel
    embeddings and `head_linear` for the LM head (the logit slices gathered); `sum_scores`
    sums the selection scores of the ranks' heads before a selection. At world size 1 they
    are `linear`, a plain lookup and nothing."""

    name = "abstract"

    def __init__(self, exact: bool = False, tp: TPGroup = SINGLE) -> None:
        self.exact = exact
        self.tp = tp

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor | DraftWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype; weight may be
        a draft step's FP8 or INT4 copy (drafts only, in any mode)."""

    @abstractmethod
    def experts(self, x: torch.Tensor, gate_up: torch.Tensor | Mxfp4,
                down: torch.Tensor | Mxfp4, weights: torch.Tensor, ids: torch.Tensor,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                limit: float = 0.0) -> torch.Tensor:
        """x [T, H] through the experts ids [T, k] weighted by weights [T, k] -> [T, H]
        (the contract of `ops.moe_experts`); stacks in MXFP4 (`quant.Mxfp4`) give their
        dequantised values' products."""

    @abstractmethod
    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., N] -> RMSNorm(x) * weight."""

    @abstractmethod
    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [..., N] -> (norm(h), h) with h = x + residual."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [..., 2I] -> silu(gate) * up [..., I]."""

    def row_linear(self, x: torch.Tensor, weight: torch.Tensor | DraftWeight,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """Row-parallel `linear`: x [..., K/N] @ weight [N_out, K/N]^T summed over the ranks
        (in exact mode in rank order, the same for every shape), + bias [N_out] once after
        the sum."""
        if self.tp.world_size == 1:
            return self.linear(x, weight, bias)
        out = self.sum_ranks(self.linear(x, weight))
        return out if bias is None else out + bias

    def sum_ranks(self, part: torch.Tensor) -> torch.Tensor:
        """A row-parallel block's partial output [...] summed over the ranks (in exact mode in
        rank order, the same for every shape)."""
        if self.tp.world_size == 1:
            return part
        return self.tp.sum_in_order(part) if self.exact else self.tp.all_reduce(part)

    def sum_scores(self, scores: torch.Tensor | None, per_kv_head: bool) -> torch.Tensor | None:
        """Selection scores [layers, B, R, G, W] of this rank's heads -> what every rank
        selects from (`TPGroup.sum_scores`: head-aggregated ones summed over the ranks)."""
        return self.tp.sum_scores(scores, per_kv_head)

    def moe(self, x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor | Mxfp4,
            down: torch.Tensor | Mxfp4, top_k: int, renormalize: bool,
            gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
            limit: float = 0.0) -> torch.Tensor:
        """A mixture of experts: x [..., H] (normed) -> [..., H]. router_logits [..., E] pick
        each token's top_k experts (`route`), `experts` runs them on this rank's slice of
        every expert (gate_up [E, 2I/N, H], down [E, H, I/N]; gpt-oss's biases gate_up_bias
        [E, 2I/N] and down_bias [E, H], the latter in rank 0's part only, so that the sum
        adds it once; its clamped SwiGLU where limit > 0), and the partial outputs are summed
        over the ranks."""
        weights, ids = self.route(router_logits.reshape(-1, router_logits.shape[-1]), top_k,
                                  renormalize)
        if self.tp.rank != 0:
            down_bias = None
        out = self.experts(x.reshape(-1, x.shape[-1]), gate_up, down, weights, ids,
                           gate_up_bias, down_bias, limit)
        return self.sum_ranks(out).view(x.shape)

    def route(self, logits: torch.Tensor, top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> each token's top_k (weights, expert ids): `ops.route`."""
        return route(logits, top_k, renormalize)

    def head_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel LM head: x [..., hidden] @ weight [V/N, hidden]^T, the ranks'
        slices gathered -> [..., V]."""
        return self.tp.gather_last(self.linear(x, weight))

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """ids [...] -> rows of the (vocabulary-parallel) embedding table [..., hidden]."""
        return self.tp.embed(ids, weight)


def _torch(exact: bool, tp: TPGroup) -> Ops:
    from vegas_spec.compute.torch_ops import TorchOps

    return TorchOps(exact, tp)


def _triton(exact: bool, tp: TPGroup) -> Ops:
    from vegas_spec.compute.triton_ops import TritonOps  # imports Triton

    return TritonOps(exact, tp)


# The registry, listed explicitly: each implementation is imported only when it is asked for.
OPS: dict[str, Callable[[bool, TPGroup], Ops]] = {"torch": _torch, "triton": _triton}


def make_ops(name: str, exact: bool = False, tp: TPGroup = SINGLE) -> Ops:
    if name not in OPS:
        raise ValueError(f"unknown ops {name!r}; choose from {sorted(OPS)}")
    return OPS[name](exact, tp)
