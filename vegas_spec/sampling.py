"""Token sampling shared by plain decoding, drafting and verification.

The same transform (temperature, top-k, top-p) produces the draft distribution q and the
target distribution p, which is what makes rejection sampling lossless. Random draws come
from one generator per sequence (seeded runs are reproducible whatever the batch) and use
the exponential trick, so sampling needs no host synchronisation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vegas_spec.config import SamplingParams


@dataclass
class BatchSampling:
    """Per-sequence sampling parameters as tensors. temperature [B] (0 = greedy), top_k [B]
    (0 = off), top_p [B], generators: one per sequence; greedy, filtered: the same rows'
    host flags (greedy, uses top-k or top-p), so that a batch's fast paths are chosen
    without reading the device."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    generators: list[torch.Generator]
    greedy: list[bool]
    filtered: list[bool]

    @classmethod
    def build(cls, params: list[SamplingParams], device: torch.device) -> BatchSampling:
        gens = []
        for p in params:
            g = torch.Generator(device=device)
            g.manual_seed(p.seed if p.seed is not None else int(torch.randint(2**62, ()).item()))
            gens.append(g)
        return cls(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            generators=gens,
            greedy=[p.greedy for p in params],
            filtered=[p.top_k > 0 or p.top_p < 1.0 for p in params],
        )

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy)

    @property
    def filters(self) -> bool:
        """Some row uses top-k or top-p (else both sorts are skipped)."""
        return any(self.filtered)

    def rows(self, keep: list[int], idx: torch.Tensor) -> BatchSampling:
        """The rows `keep` (idx: the same indices on the device, so nothing is read back)."""
        return BatchSampling(self.temperature[idx], self.top_k[idx], self.top_p[idx],
                             [self.generators[i] for i in keep],
                             [self.greedy[i] for i in keep], [self.filtered[i] for i in keep])

    def cat(self, other: BatchSampling) -> BatchSampling:
        """These rows followed by `other`'s."""
        return BatchSampling(torch.cat([self.temperature, other.temperature]),
                             torch.cat([self.top_k, other.top_k]),
                             torch.cat([self.top_p, other.top_p]),
                             self.generators + other.generators,
                             self.greedy + other.greedy, self.filtered + other.filtered)


def probs(logits: torch.Tensor, s: BatchSampling) -> torch.Tensor:
    """logits [B, ..., V] float32 -> probabilities after temperature, top-k and top-p.
    Greedy rows (temperature 0) become one-hot at the argmax."""
    shape = logits.shape
    flat = logits.reshape(shape[0], -1, shape[-1])
    temp = s.temperature.clamp(min=1e-5)[:, None, None]
    x = flat / temp
    if s.filters:
        x = _top_p(_top_k(x, s.top_k), s.top_p)
    p = torch.softmax(x, dim=-1)
    greedy = torch.nn.functional.one_hot(flat.argmax(-1), shape[-1]).to(p.dtype)
    p = torch.where((s.temperature == 0)[:, None, None], greedy, p)
    return p.reshape(shape)


def _top_k(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = x.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # [B]
    kth = torch.sort(x, dim=-1, descending=True).values.gather(
        -1, (k - 1)[:, None, None].expand(*x.shape[:-1], 1))
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    sp = torch.softmax(sorted_x, dim=-1)
    before = sp.cumsum(-1) - sp  # mass strictly above each token
    # The first token is always kept; top_p = 1 keeps everything although a float32 cumsum
    # can reach 1 before the last token.
    drop_sorted = (before >= top_p[:, None, None]) & (top_p < 1)[:, None, None]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def sample(p: torch.Tensor, s: BatchSampling) -> torch.Tensor:
    """p [B, ..., V] probabilities -> token ids [B, ...] via argmax(p / Exp(1))."""
    noise = torch.stack([
        torch.empty(p.shape[1:], device=p.device).exponential_(generator=g)
        for g in s.generators])
    return (p / noise).argmax(-1)


def uniform(shape: tuple[int, ...], s: BatchSampling, device: torch.device) -> torch.Tensor:
    """[B, *shape] uniforms in [0, 1), one generator per row."""
    return torch.stack([torch.rand(shape, device=device, generator=g) for g in s.generators])


def next_tokens(logits: torch.Tensor, s: BatchSampling) -> torch.Tensor:
    """logits [B, ..., V] -> tokens [B, ...]; the greedy fast path skips the transform."""
    if s.all_greedy:
        return logits.argmax(-1)
    return sample(probs(logits, s), s)
