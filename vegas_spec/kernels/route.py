"""A mixture of experts' routing in one kernel: each token's softmax over the router logits
(float32), its top_k probabilities and their experts, renormalised to sum to 1 where the
model says so, as `ops.route` computes them (its oracle, to rounding: the softmax's sum and
the renormalising sum run in the kernel's order; experts of equal probability are taken in
index order).

One program per token: the logits' row [E] is loaded once, its maximum and exp-sum reduce in
registers, and the top_k are k passes of an argmax over the row, each taking its maximum out
(k ≤ 8 and E ≤ 256 for the models here: a few hundred compares a pass). A decode step's
routing was five launches (softmax, top-k, sum, divide, cast), now one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr,
                  K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program t: token t's row of logits -> its TOP_K weights and experts (slots of K_PAD,
    a power of two, the ones past TOP_K zero and not stored)."""
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(logits_ptr + token * stride_l + e, mask=ok, other=float("-inf"))
    x = x.to(tl.float32)
    top = tl.max(x, axis=0)
    p = tl.exp(x - top)
    p = tl.where(ok, p, 0.0)
    probs = p / tl.sum(p, axis=0)
    left = tl.where(ok, probs, -1.0)  # a taken expert drops to -1: below every probability
    slots = tl.arange(0, K_PAD)
    chosen = tl.zeros([K_PAD], tl.float32)
    chosen_ids = tl.zeros([K_PAD], tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        first = tl.min(tl.where(left == best, e, BLOCK_E), axis=0)  # the lowest index of it
        chosen = tl.where(slots == j, best, chosen)
        chosen_ids = tl.where(slots == j, first.to(tl.int64), chosen_ids)
        left = tl.where(e == first, -1.0, left)
    if RENORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=0)
    tl.store(w_ptr + token * TOP_K + slots, chosen.to(w_ptr.dtype.element_ty),
             mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_ids, mask=slots < TOP_K)


def route(logits: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (last dim contiguous) -> (weights [T, k] in the logits' dtype,
    expert ids [T, k] int64), `ops.route`'s contract, in one launch."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    t, experts = logits.shape
    assert 0 < top_k <= experts
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
                            K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                            BLOCK_E=max(16, triton.next_power_of_2(experts)), num_warps=4)
    return weights, ids
