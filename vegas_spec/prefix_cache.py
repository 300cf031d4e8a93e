"""A byte-bounded LRU of prompt KV, keyed by the prompt's token ids.

Prefill computes every prompt position but the last in packed chunks and the last token in a
step of its own (that step also yields the first selection's scores). The chunked part is what
this cache keeps. A new prompt restores the longest stored key that is a prefix of it and
prefills only the rest, whose attention reads the restored positions from the pages; a
repeated prompt (the same context under another method, a benchmark's second run) skips the
chunked part entirely and produces bit-identical KV, logits and scores."""

from __future__ import annotations

from collections import OrderedDict

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [tokens, Hkv, D]


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self.bytes = 0

    def get(self, key: tuple[int, ...]) -> KV | None:
        kv = self.entries.get(key)
        if kv is not None:
            self.entries.move_to_end(key)
        return kv

    def longest(self, ids: list[int]) -> tuple[int, KV | None]:
        """The longest stored key that is a prefix of ids -> (its length, its KV), or
        (0, None)."""
        best: tuple[int, ...] | None = None
        for key in self.entries:
            if len(key) <= len(ids) and (best is None or len(key) > len(best)) \
                    and list(key) == ids[: len(key)]:
                best = key
        if best is None or not best:
            return 0, None
        kv = self.get(best)
        return len(best), kv

    def put(self, key: tuple[int, ...], kv: KV) -> None:
        size = _size(kv)
        if size > self.max_bytes or key in self.entries:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= _size(old)
        self.entries[key] = kv
        self.bytes += size


def _size(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
