"""Token sampling shared by plain decoding, drafting and verification.

The same transform (temperature, top-k, top-p) produces the draft distribution q and the
target distribution p, which is what makes rejection sampling lossless. Randomness is
counter-based: every draw is a hash of (the request's seed, the position of the token it is
for, a slot naming its use, and for a sample the vocabulary index), so a seeded request
draws the same numbers alone or in any batch, eagerly or inside a CUDA graph, and sampling
keeps no generator state and needs no host synchronisation. A sample is argmax(p / E) with
E ~ Exp(1) per token (the exponential trick). On CUDA the draws, the sample and the
candidates' transform are one Triton kernel each (`kernels.sample`: a sampled draft step
launches the top-k, an argmax and two kernels, where the references below chain some
seventy elementwise launches); elsewhere the references run.
Where every row of a batch is greedy or filters to a top-k of at most CANDIDATES tokens,
`dist` keeps each distribution as those candidates (`Candidates`: probabilities and token
ids) rather than a vocabulary-wide row, so a draft step's sampling touches 64 values a row,
not the vocabulary; its draws are the dense row's to the bit (the same hash per token id,
the same ratio, ties to the lowest id).

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
# A batch whose sampled rows all use a top-k of at most this many tokens ranks only that many
# candidates per row (torch.topk) instead of sorting the vocabulary: at a 128K vocabulary and
# 32 rows the sort of a draft step costs more than the step's attention.
CANDIDATES = 64
MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


@dataclass
class BatchSampling:
    """Per-sequence sampling parameters as tensors. temperature [B] (0 = greedy), top_k [B]
    (0 = off), top_p [B], seeds [B] int64 (the request's seed, or one drawn for it); greedy,
    filtered, bounded: the same rows' host flags (greedy, uses top-k or top-p, greedy or a
    top-k of at most CANDIDATES), so that a batch's fast paths are chosen without reading the
    device."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    greedy: list[bool]
    filtered: list[bool]
    bounded: list[bool]

    @classmethod
    def build(cls, params: list[SamplingParams], device: torch.device) -> BatchSampling:
        seeds = [_signed64(p.seed if p.seed is not None else int(torch.randint(2**62, ())))
                 for p in params]
        greedy, filtered, bounded = host_flags(params)
        return cls(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            seeds=torch.tensor(seeds, dtype=torch.long, device=device),
            greedy=greedy, filtered=filtered, bounded=bounded,
        )

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy)

    @property
    def filters(self) -> bool:
        """Some row uses top-k or top-p (else the sort is skipped)."""
        return any(self.filtered)

    @property
    def candidates(self) -> bool:
        """Every row is greedy or samples from a top-k within CANDIDATES tokens."""
        return all(self.bounded)

    def rows(self, keep: list[int], idx: torch.Tensor) -> BatchSampling:
        """The rows `keep` (idx: the same indices on the device, so nothing is read back)."""
        return BatchSampling(self.temperature[idx], self.top_k[idx], self.top_p[idx],
                             self.seeds[idx], [self.greedy[i] for i in keep],
                             [self.filtered[i] for i in keep], [self.bounded[i] for i in keep])

    def cat(self, other: BatchSampling) -> BatchSampling:
        """These rows followed by `other`'s."""
        return BatchSampling(torch.cat([self.temperature, other.temperature]),
                             torch.cat([self.top_k, other.top_k]),
                             torch.cat([self.top_p, other.top_p]),
                             torch.cat([self.seeds, other.seeds]),
                             self.greedy + other.greedy, self.filtered + other.filtered,
                             self.bounded + other.bounded)


def host_flags(params: list[SamplingParams]) -> tuple[list[bool], list[bool], list[bool]]:
    """BatchSampling's host flags of these rows: greedy, filtered, bounded."""
    return ([p.greedy for p in params], [p.top_k > 0 or p.top_p < 1.0 for p in params],
            [p.greedy or 0 < p.top_k <= CANDIDATES for p in params])


def _signed64(seed: int) -> int:
    """A seed in [-2^63, 2^64) as the int64 with the same low 64 bits."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass
class Candidates:
    """A distribution over at most W tokens of the vocabulary: probabilities values [..., W]
    float32 of the token ids index [..., W] int64 (the rest of the vocabulary has
    probability 0; an id may recur with probability 0)."""

    values: torch.Tensor
    index: torch.Tensor

    def __getitem__(self, key: object) -> Candidates:
        return Candidates(self.values[key], self.index[key])

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dense(self, vocab: int) -> torch.Tensor:
        """The same distribution as a vocabulary-wide row [..., vocab] (a reference)."""
        out = torch.zeros(*self.values.shape[:-1], vocab, device=self.values.device)
        return out.scatter_add_(-1, self.index, self.values)


Dist = torch.Tensor | Candidates  # a dense row [..., V] or candidates


def stack(dists: list[Dist], dim: int) -> Dist:
    if isinstance(dists[0], Candidates):
        return Candidates(torch.stack([d.values for d in dists], dim),  # type: ignore[union-attr]
                          torch.stack([d.index for d in dists], dim))  # type: ignore[union-attr]
    return torch.stack(dists, dim)  # type: ignore[arg-type]


def cat(dists: list[Dist], dim: int) -> Dist:
    if isinstance(dists[0], Candidates):
        return Candidates(torch.cat([d.values for d in dists], dim),  # type: ignore[union-attr]
                          torch.cat([d.index for d in dists], dim))  # type: ignore[union-attr]
    return torch.cat(dists, dim)  # type: ignore[arg-type]


def prob_at(d: Dist, tokens: torch.Tensor) -> torch.Tensor:
    """d [B, n, W or V]; tokens [B, n] -> [B, n], or tokens [B, n, m] -> [B, n, m]: the
    probability of each token."""
    many = tokens.dim() == len(d.shape)
    if isinstance(d, Candidates):
        values, index = d.values, d.index
        if many:
            values, index = values[..., None, :], index[..., None, :]
        return (values * (index == tokens[..., None])).sum(-1)  # one match; + 0.0 is exact
    return d.gather(-1, tokens) if many else d.gather(-1, tokens[..., None])[..., 0]


def residual(p: Dist, q: Dist) -> Dist:
    """max(0, p - q), unnormalised, where it has mass, else p (where p == q a rejection has
    probability 0): the recovered token's weights, which the exponential trick samples as
    they are (a row's scale does not move its argmax). p [B, n, *], q [B, n, *]."""
    if isinstance(p, Candidates):
        left = (p.values - prob_at(q, p.index)).clamp(min=0)
        mass = left.sum(-1, keepdim=True)
        return Candidates(torch.where(mass > 0, left, p.values), p.index)
    left = (p - q).clamp(min=0)  # type: ignore[operator]
    return torch.where(left.sum(-1, keepdim=True) > 0, left, p)


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


def exponential_argmax_ref(p: torch.Tensor, keys: torch.Tensor,
                           index: torch.Tensor | None = None) -> torch.Tensor:
    """p [R, V] float32 weights, keys [R] -> tokens [R]: argmax(p / E), E = -log(u) with u
    the counter-based uniforms of (key, token id), ties to the lowest id; with index [R, W]
    p [R, W] are the weights of those token ids (candidates). The reference of
    `kernels.sample.sample_tokens` (which derives the keys: `draw_keys`)."""
    if index is None:
        noise = -torch.log(to_uniform(vocab_hash(keys, p.shape[-1])))
        return (p / noise).argmax(-1)
    token = mix32(index + _GOLDEN)
    noise = -torch.log(to_uniform(mix32(keys[:, None] ^ token)))
    ratio = p / noise
    best = ratio.max(-1, keepdim=True).values
    return torch.where(ratio == best, index, torch.iinfo(torch.long).max).min(-1).values


def _kernels(t: torch.Tensor) -> bool:
    """Whether the Triton kernels of `kernels.sample` run on t (CUDA; else the references)."""
    return t.is_cuda


def sample(p: Dist, s: BatchSampling, positions: torch.Tensor,
           slot: int = TARGET) -> torch.Tensor:
    """p [B, ..., V] weights (or candidates), positions [B, ...] (the positions of the
    tokens drawn) -> token ids [B, ...]."""
    values, index = (p.values, p.index) if isinstance(p, Candidates) else (p, None)
    width = values.shape[-1]
    flat = values.reshape(-1, width).contiguous()
    flat_index = None if index is None else index.reshape(-1, width).contiguous()
    if _kernels(flat):  # keys, hashes and the argmax in one kernel
        from vegas_spec.kernels.sample import sample_tokens

        tokens = sample_tokens(flat, s.seeds, positions, slot, flat_index)
    else:
        keys = draw_keys(s.seeds, positions, slot).reshape(-1)
        tokens = exponential_argmax_ref(flat, keys, flat_index)
    return tokens.view(values.shape[:-1])


def uniform(s: BatchSampling, positions: torch.Tensor, slot: int = ACCEPT) -> torch.Tensor:
    """positions [B, ...] -> uniforms [B, ...] in (0, 1), one per (row's seed, position)."""
    if _kernels(positions):
        from vegas_spec.kernels.sample import draws

        return draws(s.seeds, positions, slot, uniform=True)
    return to_uniform(mix32(draw_keys(s.seeds, positions, slot)))


# --- the shared transform -----------------------------------------------------------------


def probs(logits: torch.Tensor, s: BatchSampling) -> torch.Tensor:
    """logits [B, ..., V] float32 -> probabilities after temperature, top-k (the k likeliest
    tokens) and top-p. Greedy rows (temperature 0) become one-hot at the argmax."""
    shape = logits.shape
    flat = logits.reshape(shape[0], -1, shape[-1])
    x = flat / s.temperature.clamp(min=1e-5)[:, None, None]
    if s.filters:
        p = _filtered_probs(x, s)
    else:
        p = torch.softmax(x, dim=-1)
    greedy = (s.temperature == 0)[:, None, None]
    top = flat.argmax(-1, keepdim=True)
    p = p.masked_fill_(greedy, 0.0).scatter_(-1, top, torch.where(greedy, 1.0, p.gather(-1, top)))
    return p.reshape(shape)


def _filtered_probs(x: torch.Tensor, s: BatchSampling) -> torch.Tensor:
    """x [B, n, V] -> probabilities after top-k and top-p. A row whose top-k fits CANDIDATES
    ranks that many tokens whatever its neighbours use (the two rankings may keep different
    tokens of a tie at the k-th value, so each row keeps one), the others sort the whole
    vocabulary; a batch of the first kind only skips the sort."""
    width = min(CANDIDATES, x.shape[-1])
    ranked = _candidate_probs(x, s.top_k, s.top_p, width)
    if s.candidates:
        return ranked
    rows = ((s.top_k > 0) & (s.top_k <= width))[:, None, None]
    return torch.where(rows, ranked, torch.softmax(_top_k_top_p(x, s.top_k, s.top_p), dim=-1))


def _nucleus(sorted_x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """sorted_x [B, n, W] descending -> -inf past each row's k-th (0: none), then past the
    fewest likeliest tokens whose renormalised mass reaches top_p (1: none)."""
    width = sorted_x.shape[-1]
    k = torch.where(top_k > 0, top_k, width).clamp(max=width)[:, None, None]  # [B, 1, 1]
    sorted_x = sorted_x.masked_fill(torch.arange(width, device=k.device) >= k, float("-inf"))
    sp = torch.softmax(sorted_x, dim=-1)
    before = sp.cumsum(-1) - sp  # mass strictly above each token
    # The first token is always kept; top_p = 1 keeps everything although a float32 cumsum
    # can reach 1 before the last token.
    drop = (before >= top_p[:, None, None]) & (top_p < 1)[:, None, None]
    return sorted_x.masked_fill(drop, float("-inf"))


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x [B, n, V] -> x with -inf outside each row's filters (`_nucleus`), by one sort."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    return torch.empty_like(x).scatter_(-1, order, _nucleus(sorted_x, top_k, top_p))


def _candidates(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                width: int) -> Candidates:
    """x [B, n, V] -> the filtered distribution where every row's top-k is at most width:
    the width likeliest tokens ranked by torch.topk, as candidates."""
    values, index = torch.topk(x, width, dim=-1)  # sorted, descending
    return Candidates(torch.softmax(_nucleus(values, top_k, top_p), dim=-1), index)


def _candidate_probs(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     width: int) -> torch.Tensor:
    """`_candidates` as a vocabulary-wide row, the rest of the vocabulary zero."""
    c = _candidates(x, top_k, top_p, width)
    return torch.zeros_like(x).scatter_(-1, c.index, c.values)


def dist(logits: torch.Tensor, s: BatchSampling) -> Dist:
    """`probs` as the sampler and the acceptance read it: where every row is greedy or
    filters to a top-k of at most CANDIDATES tokens, candidates [B, ..., CANDIDATES] (greedy
    rows one-hot at the argmax in the first slot), else the dense row."""
    if not (s.filters and s.candidates):
        return probs(logits, s)
    shape, width = logits.shape, min(CANDIDATES, logits.shape[-1])
    flat = logits.reshape(-1, shape[-1])
    # the largest logits are the largest after any temperature: one ranking for every row
    values, index = torch.topk(flat, width, dim=-1)  # sorted, descending
    top = flat.argmax(-1)
    if _kernels(flat):  # the transform of the W values in one kernel
        from vegas_spec.kernels.sample import candidate_probs

        values, index = candidate_probs(values, index, top, s.temperature, s.top_k, s.top_p)
    else:
        values, index = candidate_probs_ref(values, index, top, s.temperature, s.top_k,
                                            s.top_p)
    return Candidates(values.view(*shape[:-1], width), index.view(*shape[:-1], width))


def candidate_probs_ref(values: torch.Tensor, index: torch.Tensor, top: torch.Tensor,
                        temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """values [R, W] a row's W largest logits, descending, index [R, W] their token ids, top
    [R] each row's argmax; temperature, top_k, top_p [S] of S sequences of R / S rows each ->
    the candidates' probabilities [R, W] after the row's transform (a greedy row: one-hot at
    its argmax, in the first slot) and their ids [R, W]. The reference of
    `kernels.sample.candidate_probs`."""
    rows, width = values.shape
    seqs = temperature.shape[0]
    x = values.view(seqs, -1, width) / temperature.clamp(min=1e-5)[:, None, None]
    p = torch.softmax(_nucleus(x, top_k, top_p), dim=-1)
    greedy = (temperature == 0)[:, None, None]
    first = torch.arange(width, device=values.device) == 0
    p = torch.where(greedy, first.float(), p)
    ids = torch.where(greedy & first, top.view(seqs, -1, 1), index.view(seqs, -1, width))
    return p.view(rows, width), ids.view(rows, width)


def next_tokens(logits: torch.Tensor, s: BatchSampling, positions: torch.Tensor) -> torch.Tensor:
    """logits [B, ..., V], positions [B, ...] of the tokens drawn -> tokens [B, ...]; the
    greedy fast path skips the transform."""
    if s.all_greedy:
        return logits.argmax(-1)
    return sample(dist(logits, s), s, positions)
