"""A byte-bounded LRU of prompt KV, keyed by the prompt's token ids.

An entry keeps what a prefill computed for one prompt: K and V of every position, the
next-token logits of its last row and that row's rotated query in every layer. A repeated
prompt (the same context under another method, a benchmark's second run) then runs no forward
at all: its KV and logits are restored and its first selection is scored again from the kept
queries, so KV, logits and scores are bit-identical to the first run. A prompt that extends a
stored one restores the stored positions and prefills only the rest, whose attention reads the
restored keys from the pages."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [tokens, Hkv, D]


@dataclass
class PrefixEntry:
    kv: KV
    logits: torch.Tensor  # [V] float32, after the last token
    q_last: torch.Tensor  # [layers, H, D]: the last row's rotated query in each layer

    @property
    def nbytes(self) -> int:
        tensors = [t for pair in self.kv for t in pair] + [self.logits, self.q_last]
        return sum(t.numel() * t.element_size() for t in tensors)


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self.bytes = 0

    def get(self, key: tuple[int, ...]) -> PrefixEntry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def longest(self, ids: list[int]) -> tuple[int, PrefixEntry | None]:
        """The longest stored prompt that ids starts with (ids itself included) -> (its
        length, its entry), or (0, None)."""
        best: tuple[int, ...] | None = None
        for key in self.entries:
            if len(key) <= len(ids) and (best is None or len(key) > len(best)) \
                    and list(key) == ids[: len(key)]:
                best = key
        if not best:
            return 0, None
        return len(best), self.get(best)

    def put(self, key: tuple[int, ...], entry: PrefixEntry) -> None:
        size = entry.nbytes
        if size > self.max_bytes or key in self.entries:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
        self.entries[key] = entry
        self.bytes += size
