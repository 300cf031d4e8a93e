"""The KV pool's pages on the host: which pages are free, how many sequences hold each, and,
with the prefix cache on, which full pages are named and shareable (`prefix_cache`).

A page is free, held (its reference count: the sequences whose page tables list it) or, with
the prefix cache, parked: named, held by no one, its K/V kept for a later prompt that starts
the same way until a page is needed and none is free. `take` hands out free pages first, then
the least recently parked; `share` takes named pages by reference; `release` drops a
reference, and a page that no one holds is freed or parked. The scheduler alone takes and
releases pages; the device tensors they index are `cache.PagedKVCache`'s. Imports `config`
(`ConfigError`) and `prefix_cache`."""

from __future__ import annotations

import math

from vegas_spec.config import ConfigError
from vegas_spec.prefix_cache import Name, PrefixCache, page_names, shareable


class OutOfMemoryError(ConfigError):
    """The requested batch does not fit the KV budget."""


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, bytes_per_page: int,
                 prefix: PrefixCache | None = None) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.bytes_per_page, self.prefix = bytes_per_page, prefix
        self.free = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        self.refs = [0] * num_pages
        self.peak = 0  # the most pages held at once

    @property
    def num_free(self) -> int:
        """Pages a `take` may hand out: the free ones and the parked ones."""
        return len(self.free) + (len(self.prefix.parked) if self.prefix is not None else 0)

    @property
    def free_pages(self) -> list[int]:
        """Every page a `take` may hand out (a new list: count them with `num_free`)."""
        return self.free + (list(self.prefix.parked) if self.prefix is not None else [])

    @property
    def used(self) -> int:
        """Pages held by sequences now."""
        return self.num_pages - self.num_free

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def check_fits(self, token_counts: list[int]) -> None:
        """Refuse up front a batch whose sequences cannot all be resident at once."""
        need, free, size = sum(self.pages_for(t) for t in token_counts), self.num_free, \
            self.bytes_per_page
        if need > free:
            raise OutOfMemoryError(
                f"batch needs {need} KV pages ({fmt_bytes(need * size)}) but only {free} are "
                f"free ({fmt_bytes(free * size)} of a {fmt_bytes(self.num_pages * size)} "
                "pool); lower the batch size or max_tokens, or raise the KV budget")

    def allocate(self, tokens: int) -> list[int]:
        """Pages for `tokens` slots."""
        self.check_fits([tokens])
        return self.take(self.pages_for(tokens))

    def take(self, pages: int) -> list[int]:
        """`pages` pages that nobody holds (the caller has checked that there are so many):
        free ones first, then the least recently parked."""
        taken = [self._one() for _ in range(pages)]
        self.peak = max(self.peak, self.used)
        return taken

    def _one(self) -> int:
        page = self.free.pop() if self.free or self.prefix is None else self.prefix.evict()
        self.refs[page] = 1
        return page

    def share(self, pages: list[int]) -> None:
        """Take named pages (`cached_prefix`) by reference."""
        for page in pages:
            if self.refs[page] == 0:
                self.prefix.unpark(page)  # type: ignore[union-attr]
            self.refs[page] += 1
        self.peak = max(self.peak, self.used)

    def release(self, pages: list[int]) -> None:
        """A holder gives its pages back; those no one holds are freed or parked (the last
        of a prompt first, so that a prefix is evicted from its end)."""
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.extend(self.prefix.park(page) if self.prefix is not None else [page])

    def unheld(self, pages: list[int]) -> int:
        """How many of `pages` no one holds (parked: sharing them takes them from the free)."""
        return sum(self.refs[p] == 0 for p in pages)

    def names(self, ids: list[int]) -> list[Name]:
        """The names of the full pages of ids ([]: prefix cache off)."""
        return [] if self.prefix is None else \
            page_names(ids, self.page_size, len(ids) // self.page_size)

    def cached_prefix(self, ids: list[int], names: list[Name] | None = None) -> list[int]:
        """The named pages of the longest cached prefix of ids (`names`: theirs, if made
        already), never the page of its last token ([]: prefix cache off)."""
        if self.prefix is None:
            return []
        names = self.names(ids) if names is None else names
        return self.prefix.match(names[: shareable(len(ids), self.page_size)])

    def name(self, ids: list[int], pages: list[int], upto: int,
             names: list[Name] | None = None) -> None:
        """Positions below `upto` of ids are computed into pages: the full ones become
        shareable (nothing with the prefix cache off); names: ids' page names, if made."""
        if self.prefix is not None:
            self.prefix.name(ids, pages, upto, names)

    def shrink(self, num_pages: int) -> None:
        """Use only pages below num_pages (before any is taken: tensor parallelism's ranks
        agree on the smallest pool)."""
        assert not any(self.refs[num_pages:]) and self.num_free == len(self.free)
        self.num_pages = min(num_pages, self.num_pages)
        self.free = [p for p in self.free if p < self.num_pages]
        self.refs = self.refs[: self.num_pages]
