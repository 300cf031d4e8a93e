"""Sampling on the device in few launches: counter-based draws and the exponential trick,
and the candidates' probabilities after temperature, top-k and top-p.

Oracles: `vegas_spec.sampling.draw_keys` / `uniform` (the draws), `exponential_argmax_ref`
(a token per row) and `candidate_probs_ref` (the candidates' probabilities). The integer hash
is repeated bit for bit on uint32 lanes (where the references mask int64 products to 32 bits),
so the kernels draw the references' uniforms; only log and exp may differ in their last bit.

- `draws`: the key of each (request seed, position, slot), or its uniform: the references
  spend some forty elementwise launches a call on it, one here.
- `sample_tokens`: argmax(p / E), E = -log(u) with u hashed from (the row's key, the token
  id), the key derived in the kernel from the row's seed and position. One program a row
  walks the row in blocks, keeping each lane's best ratio and its token, then reduces the
  lanes: p is read once (4 bytes a token). With an index (`sampling.Candidates`) the row's
  weights are those of the listed token ids, hashed by id, so a candidate row draws what its
  vocabulary-wide row would. Ties go to the lowest token id.
- `candidate_probs`: from the W largest logits of a row, sorted (torch.topk), the
  probabilities after the row's temperature, top-k and top-p, and for a greedy row
  (temperature 0) one-hot at its argmax: one program a row of W values in registers, where
  the reference chains some twenty launches.

Rows belong to sequences in order, `m` rows a sequence (a verify pass's γ+1): the sampling
settings and seeds are read per sequence, at row // m."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_GOLDEN = 0x9E3779B9  # as `sampling._GOLDEN`
MASK32 = 0xFFFFFFFF


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 lanes (products wrap modulo 2^32, shifts are logical)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _draw_key(seed, position, SLOT_KEY: tl.constexpr):
    """`sampling.draw_keys` of int64 lanes: the key of (seed, position) in a slot whose
    constant is SLOT_KEY ((slot * golden) & MASK32)."""
    lo = seed.to(tl.uint32)  # the low 32 bits
    hi = (seed >> 32).to(tl.uint32)
    key = _mix32(lo ^ tl.full(lo.shape, SLOT_KEY, tl.uint32))
    return _mix32(_mix32(key ^ hi) ^ position.to(tl.uint32))


@triton.jit
def _uniform(h):
    """Hashes in [0, 2^32) -> float32 uniforms in (0, 1), from their top 24 bits."""
    return ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def _draws_kernel(seed_ptr, pos_ptr, out_ptr, n, m, SLOT_KEY: tl.constexpr,
                  UNIFORM: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    seed = tl.load(seed_ptr + i // m, mask=mask, other=0)
    position = tl.load(pos_ptr + i, mask=mask, other=0)
    key = _draw_key(seed, position, SLOT_KEY)
    if UNIFORM:
        tl.store(out_ptr + i, _uniform(_mix32(key)), mask=mask)
    else:
        tl.store(out_ptr + i, key.to(tl.int64), mask=mask)


def _slot_key(slot: int) -> int:
    return (slot * _GOLDEN) & MASK32


def _per_row(seeds: torch.Tensor, positions: torch.Tensor) -> int:
    """The rows of each sequence (positions [S, ...] of seeds [S])."""
    assert seeds.dtype == torch.long and positions.dtype == torch.long
    assert positions.shape[0] == seeds.shape[0], (positions.shape, seeds.shape)
    return max(positions[0].numel(), 1) if positions.dim() > 1 else 1


def draws(seeds: torch.Tensor, positions: torch.Tensor, slot: int,
          uniform: bool = False) -> torch.Tensor:
    """seeds [S] int64, positions [S, ...] int64 -> the key of each (seed, position, slot)
    [S, ...] int64 in [0, 2^32) (`sampling.draw_keys`), or with uniform its float32 uniform
    in (0, 1) (`sampling.uniform`)."""
    m = _per_row(seeds, positions)
    pos = positions.contiguous()
    out = torch.empty(pos.shape, dtype=torch.float32 if uniform else torch.long,
                      device=pos.device)
    n = pos.numel()
    if n == 0:
        return out
    block = min(triton.next_power_of_2(n), 1024)
    _draws_kernel[(triton.cdiv(n, block),)](seeds.contiguous(), pos, out, n, m,
                                            SLOT_KEY=_slot_key(slot), UNIFORM=uniform,
                                            BLOCK=block)
    return out


@triton.jit
def _sample_kernel(p_ptr, index_ptr, seed_ptr, pos_ptr, out_ptr, width, m, stride_p,
                   stride_index, SLOT_KEY: tl.constexpr, INDEXED: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    key = _draw_key(tl.load(seed_ptr + row // m), tl.load(pos_ptr + row), SLOT_KEY)
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), -1.0, tl.float32)
    best_token = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, width, BLOCK):
        col = start + lanes.to(tl.int64)
        mask = col < width
        p = tl.load(p_ptr + row * stride_p + col, mask=mask, other=0.0)
        if INDEXED:  # candidates: the token ids of the weights
            token = tl.load(index_ptr + row * stride_index + col, mask=mask, other=0)
        else:
            token = col
        golden = tl.full((BLOCK,), 0x9E3779B9, tl.uint32)
        u = _uniform(_mix32(key ^ _mix32(token.to(tl.uint32) + golden)))
        ratio = tl.where(mask, p / -tl.log(u), -1.0)
        # a lane keeps the lowest token of a tie (in vocabulary order: its first)
        better = (ratio > best) | ((ratio == best) & (token < best_token))
        best = tl.where(better, ratio, best)
        best_token = tl.where(better, token, best_token)
    top = tl.max(best, 0)
    # The lowest token of the row's best ratio, as torch.argmax returns it over a row.
    first = tl.min(tl.where(best == top, best_token, 0x7FFFFFFFFFFFFFFF), 0)
    tl.store(out_ptr + row, first)


def sample_tokens(p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, slot: int,
                  index: torch.Tensor | None = None) -> torch.Tensor:
    """p [R, V] float32 weights (last dim contiguous), seeds [S] int64, positions [S, ...]
    int64 of R entries (the position each row's token is for) -> tokens [R]: argmax(p / E)
    with E from the key of (seed, position, slot); with index [R, W] int64, p [R, W] are
    the weights of those token ids."""
    assert p.dim() == 2 and p.dtype == torch.float32 and p.stride(-1) == 1, p.shape
    assert positions.numel() == p.shape[0], (positions.shape, p.shape)
    assert index is None or (index.shape == p.shape and index.dtype == torch.long
                             and index.stride(-1) == 1)
    m = _per_row(seeds, positions)
    out = torch.empty(p.shape[0], dtype=torch.long, device=p.device)
    if p.shape[0] == 0:
        return out
    block = min(triton.next_power_of_2(p.shape[1]), 2048)
    _sample_kernel[(p.shape[0],)](
        p, p if index is None else index, seeds.contiguous(), positions.contiguous(), out,
        p.shape[1], m, p.stride(0), 0 if index is None else index.stride(0),
        SLOT_KEY=_slot_key(slot), INDEXED=index is not None, BLOCK=block,
        num_warps=8 if index is None else 2)
    return out


@triton.jit
def _candidate_probs_kernel(x_ptr, index_ptr, top_ptr, temp_ptr, top_k_ptr, top_p_ptr,
                            out_v_ptr, out_i_ptr, width, m, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seq = row // m
    col = tl.arange(0, BLOCK)
    valid = col < width
    temperature = tl.load(temp_ptr + seq)
    top_k = tl.load(top_k_ptr + seq)
    top_p = tl.load(top_p_ptr + seq)
    logits = tl.load(x_ptr + row * width + col, mask=valid, other=0.0).to(tl.float32)
    index = tl.load(index_ptr + row * width + col, mask=valid, other=0)
    x = logits / tl.maximum(temperature, 1e-5)
    k = tl.where(top_k > 0, top_k, width)
    x = tl.where(valid & (col < k), x, float("-inf"))  # past the row's k-th: none
    e = tl.exp(x - tl.max(x, 0))
    sp = e / tl.sum(e, 0)
    before = tl.cumsum(sp, 0) - sp  # the mass strictly above each candidate
    # the first candidate is always kept; top_p = 1 keeps everything (the mass above a
    # candidate never reaches 2)
    x = tl.where(before >= tl.where(top_p < 1.0, top_p, 2.0), float("-inf"), x)
    e = tl.exp(x - tl.max(x, 0))
    probs = e / tl.sum(e, 0)
    greedy = temperature == 0.0  # one-hot at the row's argmax
    probs = tl.where(greedy, tl.where(col == 0, 1.0, 0.0), probs)
    index = tl.where(col == 0, tl.where(greedy, tl.load(top_ptr + row), index), index)
    tl.store(out_v_ptr + row * width + col, probs, mask=valid)
    tl.store(out_i_ptr + row * width + col, index, mask=valid)


def candidate_probs(values: torch.Tensor, index: torch.Tensor, top: torch.Tensor,
                    temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """values [R, W] (float32 or the model's dtype), a row's W largest logits in descending
    order, index [R, W] int64 their token ids, top [R] each row's argmax; temperature,
    top_k, top_p [S] of the S sequences (R = S * m) -> (probabilities [R, W] float32,
    token ids [R, W] int64)."""
    rows, width = values.shape
    assert index.shape == values.shape and top.shape == (rows,)
    seqs = temperature.shape[0]
    assert seqs and rows % seqs == 0, (rows, seqs)
    out_v = torch.empty_like(values, dtype=torch.float32)
    out_i = torch.empty_like(index)
    if rows == 0:
        return out_v, out_i
    _candidate_probs_kernel[(rows,)](
        values.contiguous(), index.contiguous(), top.contiguous(), temperature.contiguous(),
        top_k.contiguous(), top_p.contiguous(), out_v, out_i, width, rows // seqs,
        BLOCK=triton.next_power_of_2(width), num_warps=1)
    return out_v, out_i
