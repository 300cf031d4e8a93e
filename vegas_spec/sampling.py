"""Token sampling shared by plain decoding, drafting and verification.

The same transform (temperature, top-k, top-p) produces the draft distribution q and the
target distribution p, which is what makes rejection sampling lossless. Randomness is
counter-based: every draw is a hash of (the request's seed, the position of the token it is
for, a slot naming its use, and for a sample the vocabulary index), so a seeded request
draws the same numbers alone or in any batch, eagerly or inside a CUDA graph, and sampling
keeps no generator state and needs no host synchronisation. A sample is argmax(p / E) with
E ~ Exp(1) per token (the exponential trick); on CUDA one Triton kernel hashes, draws and
reduces a row in one read of p (`kernels.sample`), elsewhere `exponential_argmax_ref`.

Slots: a target sample (plain decoding, a round's recovered or bonus token), the uniform
that accepts or rejects a draft, and a draft sample are three independent streams, so the
draws of one use never reveal another's. A position's draft draw can recur in a later round
(its earlier draft was rejected before being looked at), which leaves every emitted token's
draws fresh."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vegas_spec.config import SamplingParams

TARGET, ACCEPT, DRAFT = 0, 1, 2  # the slots of the counter-based draws
MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


@dataclass
class BatchSampling:
    """Per-sequence sampling parameters as tensors. temperature [B] (0 = greedy), top_k [B]
    (0 = off), top_p [B], seeds [B] int64 (the request's seed, or one drawn for it); greedy,
    filtered: the same rows' host flags (greedy, uses top-k or top-p), so that a batch's fast
    paths are chosen without reading the device."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    greedy: list[bool]
    filtered: list[bool]

    @classmethod
    def build(cls, params: list[SamplingParams], device: torch.device) -> BatchSampling:
        seeds = [_signed64(p.seed if p.seed is not None else int(torch.randint(2**62, ())))
                 for p in params]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            seeds=torch.tensor(seeds, dtype=torch.long, device=device),
            greedy=[p.greedy for p in params],
            filtered=[p.top_k > 0 or p.top_p < 1.0 for p in params],
        )

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy)

    @property
    def filters(self) -> bool:
        """Some row uses top-k or top-p (else the sort is skipped)."""
        return any(self.filtered)

    def rows(self, keep: list[int], idx: torch.Tensor) -> BatchSampling:
        """The rows `keep` (idx: the same indices on the device, so nothing is read back)."""
        return BatchSampling(self.temperature[idx], self.top_k[idx], self.top_p[idx],
                             self.seeds[idx], [self.greedy[i] for i in keep],
                             [self.filtered[i] for i in keep])

    def cat(self, other: BatchSampling) -> BatchSampling:
        """These rows followed by `other`'s."""
        return BatchSampling(torch.cat([self.temperature, other.temperature]),
                             torch.cat([self.top_k, other.top_k]),
                             torch.cat([self.top_p, other.top_p]),
                             torch.cat([self.seeds, other.seeds]),
                             self.greedy + other.greedy, self.filtered + other.filtered)


def _signed64(seed: int) -> int:
    """A seed in [-2^63, 2^64) as the int64 with the same low 64 bits."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


# --- counter-based draws ------------------------------------------------------------------


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 values in [0, 2^32); int64 products wrap
    modulo 2^64, so their low 32 bits are the unsigned 32-bit products."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def draw_keys(seeds: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
    """seeds [B] int64, positions [B, ...] int64 -> keys [B, ...] in [0, 2^32): one per
    (seed, position, slot)."""
    shape = (-1,) + (1,) * (positions.dim() - 1)
    lo, hi = (seeds & MASK32).view(shape), ((seeds >> 32) & MASK32).view(shape)
    key = mix32(lo ^ ((slot * _GOLDEN) & MASK32))
    return mix32(mix32(key ^ hi) ^ (positions & MASK32))


def to_uniform(h: torch.Tensor) -> torch.Tensor:
    """Hashes in [0, 2^32) -> float32 uniforms in (0, 1), from their top 24 bits (exact)."""
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def vocab_hash(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [...] -> hashes [..., vocab] of (key, token index)."""
    token = mix32(torch.arange(vocab, device=keys.device) + _GOLDEN)
    return mix32(keys[..., None] ^ token)


def exponential_argmax_ref(p: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """p [R, V] float32 probabilities, keys [R] -> tokens [R]: argmax(p / E), E = -log(u) with
    u the counter-based uniforms of (key, token index). The reference of
    `kernels.sample.exponential_argmax`."""
    noise = -torch.log(to_uniform(vocab_hash(keys, p.shape[-1])))
    return (p / noise).argmax(-1)


def exponential_argmax(p: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    if p.is_cuda:
        from vegas_spec.kernels.sample import exponential_argmax as kernel

        return kernel(p, keys)
    return exponential_argmax_ref(p, keys)


def sample(p: torch.Tensor, s: BatchSampling, positions: torch.Tensor,
           slot: int = TARGET) -> torch.Tensor:
    """p [B, ..., V] probabilities, positions [B, ...] (the positions of the tokens drawn)
    -> token ids [B, ...]."""
    keys = draw_keys(s.seeds, positions, slot)
    flat = p.reshape(-1, p.shape[-1])
    return exponential_argmax(flat.contiguous(), keys.reshape(-1)).view(p.shape[:-1])


def uniform(s: BatchSampling, positions: torch.Tensor, slot: int = ACCEPT) -> torch.Tensor:
    """positions [B, ...] -> uniforms [B, ...] in (0, 1), one per (row's seed, position)."""
    return to_uniform(mix32(draw_keys(s.seeds, positions, slot)))


# --- the shared transform -----------------------------------------------------------------


def probs(logits: torch.Tensor, s: BatchSampling) -> torch.Tensor:
    """logits [B, ..., V] float32 -> probabilities after temperature, top-k and top-p.
    Greedy rows (temperature 0) become one-hot at the argmax."""
    shape = logits.shape
    flat = logits.reshape(shape[0], -1, shape[-1])
    temp = s.temperature.clamp(min=1e-5)[:, None, None]
    x = flat / temp
    if s.filters:
        x = _top_k_top_p(x, s.top_k, s.top_p)
    p = torch.softmax(x, dim=-1)
    greedy = torch.nn.functional.one_hot(flat.argmax(-1), shape[-1]).to(p.dtype)
    p = torch.where((s.temperature == 0)[:, None, None], greedy, p)
    return p.reshape(shape)


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x [B, n, V] -> x with -inf outside each row's top-k (0: all), then outside the fewest
    most likely tokens whose renormalised mass reaches top_p (1: all); one sort for both."""
    vocab = x.shape[-1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None, None]  # [B, 1, 1]
    # Ties with the k-th value stay, as a threshold at the k-th value keeps them.
    kth = sorted_x.gather(-1, (k - 1).expand(*x.shape[:-1], 1))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    sp = torch.softmax(sorted_x, dim=-1)
    before = sp.cumsum(-1) - sp  # mass strictly above each token
    # The first token is always kept; top_p = 1 keeps everything although a float32 cumsum
    # can reach 1 before the last token.
    drop = (before >= top_p[:, None, None]) & (top_p < 1)[:, None, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def next_tokens(logits: torch.Tensor, s: BatchSampling, positions: torch.Tensor) -> torch.Tensor:
    """logits [B, ..., V], positions [B, ...] of the tokens drawn -> tokens [B, ...]; the
    greedy fast path skips the transform."""
    if s.all_greedy:
        return logits.argmax(-1)
    return sample(probs(logits, s), s, positions)
