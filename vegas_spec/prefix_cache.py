"""Prefix caching by shared pages, as nano-vllm and vLLM do it: a full page of prompt K/V is
named by a hash chain, hash(the previous page's name, the page's token ids), so that one name
stands for the whole prefix up to the page's end. A sequence whose prompt starts with named
pages takes them by reference (`PageAllocator.share`) and prefills only the rest: a prefix
held by many sequences costs its pages once, and a hit copies nothing.

Only full pages are named, and never the page of a prompt's last token when a sequence takes
a prefix (`shareable`): that page, and every page decoding and the drafts write, is the
sequence's own, so a named page is never written again and needs no copy on write. A named
page whose last holder leaves stays cached ("parked") until the allocator needs a page, least
recently used first, and at most `max_parked` are kept. Imports only the standard library."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

Name = bytes  # a page's hash-chain name
ROOT: Name = b""


def page_names(ids: list[int], page_size: int, pages: int) -> list[Name]:
    """The hash chain of the first `pages` full pages of ids (128-bit BLAKE2b, so two
    prefixes that differ do not share a name)."""
    names, parent = [], ROOT
    for i in range(pages):
        tokens = array("q", ids[i * page_size : (i + 1) * page_size]).tobytes()
        parent = hashlib.blake2b(parent + tokens, digest_size=16).digest()
        names.append(parent)
    return names


def shareable(length: int, page_size: int) -> int:
    """Full pages a prompt of `length` tokens may take from the cache: all but the page of its
    last token, which the sequence computes itself (its logits, its first selection's scores)
    into a page of its own."""
    return max(length - 1, 0) // page_size


@dataclass
class PrefixStats:
    queried: int = 0  # prompt tokens of the sequences placed with the cache on
    hit: int = 0  # of those, the tokens found in cached pages (taken by reference)
    evicted: int = 0  # cached pages handed out for other use


class PrefixCache:
    """Names of full pages (name -> page and back) and the parked pages, least recently used
    first. Holds no reference counts: the allocator parks a named page when its last holder
    leaves and takes parked pages back (`unpark`, `evict`)."""

    def __init__(self, page_size: int, max_parked: int) -> None:
        self.page_size, self.max_parked = page_size, max_parked
        self.page_of: dict[Name, int] = {}
        self.name_of: dict[int, Name] = {}
        self.parked: OrderedDict[int, None] = OrderedDict()
        self.stats = PrefixStats()

    def match(self, names: list[Name]) -> list[int]:
        """The pages of the longest run of `names` from the first that are cached."""
        pages = []
        for name in names:
            page = self.page_of.get(name)
            if page is None:
                break
            pages.append(page)
        return pages

    def name(self, ids: list[int], pages: list[int], upto: int,
             names: list[Name] | None = None) -> None:
        """Pages of ids whose positions below `upto` are computed: each full one gets its
        name (from `names` where given), unless the page has one or another page holds that
        prefix already."""
        full = upto // self.page_size
        names = page_names(ids, self.page_size, full) if names is None else names[:full]
        for page, name in zip(pages, names):
            if page not in self.name_of and name not in self.page_of:
                self.page_of[name], self.name_of[page] = page, name

    def park(self, page: int) -> list[int]:
        """A page whose last holder left -> the pages that are free now: the page itself if
        it has no name, else those evicted to keep at most max_parked."""
        if page not in self.name_of:
            return [page]
        self.parked[page] = None
        freed = []
        while len(self.parked) > self.max_parked:
            freed.append(self.evict())
        return freed

    def unpark(self, page: int) -> None:
        """A parked page taken by reference again."""
        del self.parked[page]

    def evict(self) -> int:
        """The least recently parked page, its name forgotten, for other use."""
        page, _ = self.parked.popitem(last=False)
        del self.page_of[self.name_of.pop(page)]
        self.stats.evicted += 1
        return page
