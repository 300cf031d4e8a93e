"""Plain-PyTorch references of the per-token steps around attention: RMSNorm (with the
residual add before it), SiLU * up, RoPE, and the row-invariant projection of exact mode;
of a mixture of experts' router (`route`) and experts (`moe_experts`);
of the selection's top-k (`topk_positions`, with quest's pages expanded to their tokens
by `expand_pages`); and of quest's page scores (`quest_page_scores_ref`).

They are the torch implementations of the compute seams (`compute.torch_ops`, the attention
backend's defaults) and the oracles of the fused kernels; kept apart from both so that
`models`, `attention`, `compute` and `speculative` need not import each other (the Triton
backend's top-k falls back on `topk_positions` for rows too wide for its kernel). Imports
only `torch`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers: normalise in float32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual -> (rms_norm(h), h): the residual add before a norm."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> silu(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def exact_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul` with each element's bits independent of the tensor's size (exact mode).

    torch's elementwise exp (in F.silu) runs vectorised over the bulk of each thread's range
    and as a scalar function on its tail, which may round differently, so the path an element
    takes depends on the tensor's size and the thread count. A softmax over a last axis of
    two, [g, 0], is sigmoid(g) computed by the same per-row vectorised code for every
    element. Products and casts are correctly rounded on either path."""
    gate, up = gate_up.chunk(2, dim=-1)
    g = gate.float()
    sigmoid = torch.softmax(torch.stack([g, torch.zeros_like(g)], dim=-1), dim=-1)[..., 0]
    return (g * sigmoid).to(gate.dtype) * up


SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid slope


def clamped_swiglu(gate_up: torch.Tensor, limit: float, exact: bool = False) -> torch.Tensor:
    """gate_up [..., 2I] -> gpt-oss's (up + 1) * gate * sigmoid(1.702 * gate) [..., I], gate
    clamped to at most `limit` and up to [-limit, limit] first, in gate_up's dtype as
    transformers computes it. exact: the sigmoid as `exact_silu_mul`'s (one path for every
    element)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    z = gate * SWIGLU_ALPHA
    if exact:
        zf = z.float()
        sigmoid = torch.softmax(torch.stack([zf, torch.zeros_like(zf)], -1), -1)[..., 0]
        sigmoid = sigmoid.to(gate.dtype)
    else:
        sigmoid = torch.sigmoid(z)
    return (up + 1) * (gate * sigmoid)


def expert_activation(limit: float, exact: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The experts' gate/up activation: SiLU(gate) * up, or where limit > 0 gpt-oss's
    `clamped_swiglu`."""
    if limit > 0:
        return lambda gate_up: clamped_swiglu(gate_up, limit, exact)
    return exact_silu_mul if exact else silu_mul


def apply_rope(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [B, n, heads, D], positions [B, n] -> rotated x (rotate-half convention); table
    [max_pos, D] float32 holds cos in the first half of the last axis, sin in the second."""
    half = x.shape[-1] // 2
    cs = table[positions][:, :, None, :].to(x.dtype)  # [B, n, 1, D]
    cos, sin = cs[..., :half].repeat(1, 1, 1, 2), cs[..., half:].repeat(1, 1, 1, 2)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# Rows per call of the row-invariant projection: every call has this many rows.
EXACT_ROWS = 16


# Rows of a float32 product on CPU that `dense_linear` computes as weight @ x^T: for them
# MKL's F.linear runs a GEMV a row, which streams the weight once per row, where the
# transposed product (a GEMM of 2-4 columns) streams it once (on an AVX2 core, SmolLM2's
# gate/up and LM head at 3 rows took about half the time; one row and bfloat16 gained
# nothing, so they stay with F.linear).
CPU_FEW_ROWS = (2, 4)
# Weights smaller than this stay with F.linear whatever the rows: they sit in the cache, where
# streaming them once or per row costs about the same and the transposed product's extra
# calls cost more. So do weights with fewer outputs than inputs (a down projection), where
# the transposed product measured slower (benchmarks/cpu_products.py).
CPU_STREAMED_BYTES = 1 << 20


# Rows from which a bfloat16 product on CPU runs in float32: a core without bfloat16
# instructions (AVX2) multiplies bfloat16 at a fraction of its float32 rate, so from a few
# rows on, converting the weight and computing in float32 wins (on an AVX2 core, SmolLM2's
# gate/up took 2x less time at 16 rows, 6x less at 256; below 8 rows the conversion costs
# more than it saves). The product's terms are exact in float32 either way.
CPU_UPCAST_ROWS = 16


def _upcast_on_cpu(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and rows >= CPU_UPCAST_ROWS)


def _transposed_on_cpu(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    low, high = CPU_FEW_ROWS
    return (x.dtype == torch.float32 and weight.dtype == torch.float32
            and low <= rows <= high and weight.numel() * 4 >= CPU_STREAMED_BYTES
            and weight.shape[0] >= weight.shape[1])


def dense_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, except on CPU: 2-4 float32 rows (`CPU_FEW_ROWS`) of a weight of at least
    CPU_STREAMED_BYTES and no fewer outputs than inputs take weight @ x^T, and bfloat16
    from CPU_UPCAST_ROWS rows on runs in float32, rounded back once."""
    if x.device.type != "cpu":  # a GPU's path: cuBLAS as it is
        return F.linear(x, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    if _upcast_on_cpu(x, weight, rows):
        return F.linear(x.float(), weight.float(),
                        None if bias is None else bias.float()).to(x.dtype)
    if not _transposed_on_cpu(x, weight, rows):
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, -1).t()).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def exact_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N], each row's bits independent of
    the number of rows (the CPU path of exact mode; `kernels.exact_matmul` on a GPU).

    A BLAS chooses its kernel, blocking, threading and split of the reduction from the shape,
    so `F.linear` on 1 row and on 448 rows may sum a row's K products in different orders.
    Here the rows are padded with zeros to a multiple of EXACT_ROWS and every block of
    EXACT_ROWS rows is one `F.linear` call of the same shape [EXACT_ROWS, K]: one shape, one
    kernel and one order of summation, in which a row's result depends only on that row (a
    GEMM's inner loop runs over K the same way for every row of the block)."""
    flat = x.reshape(-1, x.shape[-1])
    m, n = flat.shape[0], weight.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    pad = -m % EXACT_ROWS
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    dtype = flat.dtype
    if _upcast_on_cpu(flat, weight, EXACT_ROWS):  # every block the same float32 product
        flat, weight = flat.float(), weight.float()
        bias = None if bias is None else bias.float()
    out = torch.cat([F.linear(block, weight, bias) for block in flat.split(EXACT_ROWS)])
    return out[:m].to(dtype).view(*x.shape[:-1], n)


def route(logits: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64):
    the top_k of softmax(logits) taken in float32, renormalised to sum to 1 where
    `renormalize` (the config's `norm_topk_prob`), as transformers' Qwen3-MoE router; experts
    of equal probability in index order (a stable sort: torch.topk leaves their order to the
    device, and on CUDA it differs). Each row alone (softmax, top-k and the sum are per row),
    so exact mode needs no variant."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.sort(dim=-1, descending=True, stable=True)
    weights, ids = weights[..., :top_k].contiguous(), ids[..., :top_k].contiguous()
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def sum_slots(y: torch.Tensor) -> torch.Tensor:
    """y [T, k, H] -> y[:, 0] + y[:, 1] + ... in slot order (the same for every row and T)."""
    out = y[:, 0]
    for j in range(1, y.shape[1]):
        out = out + y[:, j]
    return out


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                weights: torch.Tensor, ids: torch.Tensor, exact: bool = False,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                limit: float = 0.0) -> torch.Tensor:
    """A mixture of experts: x [T, H] -> [T, H], token t the sum over its slots j of
    weights[t, j] * expert ids[t, j]'s down(SiLU(gate) * up) of x[t]; gate_up [E, 2I, H]
    (each expert's gate rows, then its up rows), down [E, H, I], weights [T, k] in x's dtype.
    Each product is rounded to x's dtype as transformers rounds it (gate/up, SiLU * up, down,
    times the weight), the slots summed in slot order (`sum_slots`).

    The oracle of `kernels.fused_moe` and the CPU path: every expert runs on every token and
    the tokens it is not routed to are dropped, E / k times the products of the routed
    computation but of fixed shapes, with no read of the routing on the host. In exact mode
    the products are `exact_linear`'s and SiLU `exact_silu_mul`'s: each row alone.

    gpt-oss's experts: biases gate_up_bias [E, 2I] and down_bias [E, H] added to each
    expert's products, and with limit > 0 the `clamped_swiglu` activation."""
    linear, act = exact_linear if exact else F.linear, expert_activation(limit, exact)
    out = x.new_zeros(*ids.shape, x.shape[-1])  # [T, k, H]
    for e in range(gate_up.shape[0]):
        b_up = None if gate_up_bias is None else gate_up_bias[e]
        b_down = None if down_bias is None else down_bias[e]
        y = linear(act(linear(x, gate_up[e], b_up)), down[e], b_down)  # [T, H]
        out = torch.where((ids == e)[..., None], y[:, None] * weights[..., None], out)
    return sum_slots(out)


def topk_positions(scores: torch.Tensor, rankable: torch.Tensor, k: torch.Tensor,
                   kmax: int | None = None, page: int = 1,
                   limit: torch.Tensor | None = None) -> torch.Tensor:
    """scores [..., B, G, W] -> the k[b] best positions < rankable[b], ascending, -1 padded:
    [..., B, G, min(kmax, W)]; kmax (a host bound on k) defaults to max(k), a host sync.
    With page > 1 or a limit [B], the positions are units of `page` tokens, expanded by
    `expand_pages`: [..., B, G, min(kmax, W) * page]."""
    width = scores.shape[-1]
    kmax = max(int(k.max()), 1) if kmax is None else kmax
    pos = torch.arange(width, device=scores.device)
    visible = pos < rankable[:, None, None]
    masked = scores.masked_fill(~visible, float("-inf"))
    # topk's output is in descending order: its first k[b] are row b's k[b] best.
    idx = masked.topk(min(kmax, width), dim=-1).indices
    keep = torch.arange(idx.shape[-1], device=idx.device) < k[:, None, None]
    best = sorted_positions(torch.where(keep, idx, -1))
    return best if page == 1 and limit is None else expand_pages(best, page, limit)


def expand_pages(best: torch.Tensor, page: int, limit: torch.Tensor | None) -> torch.Tensor:
    """Units best [..., B, G, n] (-1: none) -> their tokens [..., B, G, n * page]: unit u at
    slot i gives u * page + j at i * page + j (j < page), -1 for a -1 unit and for tokens >=
    limit[b] (None: no bound), so the -1s of a partial last page stay inside its slot."""
    pos = best[..., None] * page + torch.arange(page, device=best.device)
    keep = best[..., None] >= 0
    if limit is not None:
        keep = keep & (pos < limit[:, None, None, None])
    return torch.where(keep, pos, -1).flatten(-2)


def sorted_positions(idx: torch.Tensor) -> torch.Tensor:
    """Ascending valid positions first, -1 padding last (sorted as int32: positions are far
    below 2^31, and the radix sort needs half the passes of int64)."""
    big = torch.iinfo(torch.int32).max
    s = torch.sort(torch.where(idx < 0, big, idx).int(), dim=-1).values
    return torch.where(s == big, -1, s).long()


def cat_padded(x: torch.Tensor, y: torch.Tensor, fill: float, dim: int,
               axis: int = -1) -> torch.Tensor:
    """x and y joined along `dim` after padding `axis` to the larger of the two with fill."""
    width = max(x.shape[axis], y.shape[axis])
    return torch.cat([_pad(x, width, fill, axis), _pad(y, width, fill, axis)], dim=dim)


def _pad(x: torch.Tensor, width: int, fill: float, axis: int) -> torch.Tensor:
    missing = width - x.shape[axis]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[axis] = missing
    return torch.cat([x, torch.full(shape, fill, dtype=x.dtype, device=x.device)], dim=axis)


def quest_page_scores_ref(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                          pages: torch.Tensor, rope: torch.Tensor | None = None,
                          positions: torch.Tensor | None = None) -> torch.Tensor:
    """quest's page scores: q [B, 1, H, D], lo/hi [B, NP, Hkv, D] page bounds, pages [B]
    -> [B, Hkv, NP] float32, sum over the kv head's query heads of sum_d max(q_d lo_d,
    q_d hi_d), -inf for pages >= pages[b]. With rope (the RoPE table) and positions [B, 1],
    q is before RoPE (`apply_rope` first)."""
    if rope is not None:
        assert positions is not None
        q = apply_rope(q, rope, positions)
    bsz, _, heads, dim = q.shape
    hkv = lo.shape[2]
    qg = q[:, 0].float().view(bsz, hkv, heads // hkv, dim)
    # max(q_d lo_d, q_d hi_d) is q_d hi_d where q_d >= 0 and q_d lo_d elsewhere (lo <= hi),
    # so the sum over d and the group's heads is two batched products, no [.., NP, D] temp
    up, down = qg.clamp(min=0).sum(2), qg.clamp(max=0).sum(2)  # [B, Hkv, D]
    scores = (torch.einsum("bhd,bphd->bhp", up, hi.float())
              + torch.einsum("bhd,bphd->bhp", down, lo.float()))
    visible = torch.arange(lo.shape[1], device=q.device) < pages[:, None, None]
    return scores.masked_fill(~visible, float("-inf"))
