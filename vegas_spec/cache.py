"""Paged KV cache: one pool of fixed-size pages shared by all sequences.

Per layer the cache is a [num_pages * page_size, Hkv, D] tensor for K and one for V; a
sequence holds a list of pages (its page table) and token position p lives in slot
page_table[p // page_size] * page_size + p % page_size. Which pages are free, held or shared
is the host's `pages.PageAllocator`, which the pool carries beside its tensors."""

from __future__ import annotations

import os

import torch

from vegas_spec.config import ModelConfig
from vegas_spec.pages import OutOfMemoryError, PageAllocator, fmt_bytes
from vegas_spec.prefix_cache import PrefixCache

__all__ = ["OutOfMemoryError", "PagedKVCache", "available_bytes", "check_memory", "fmt_bytes",
           "page_bytes", "slots_of", "step_slots"]


def slots_of(page_table: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """page_table [B, P], pos [B, ...] (>= 0) -> cache slots [B, ...]."""
    flat = pos.reshape(pos.shape[0], -1)
    pages = torch.gather(page_table.long(), 1, torch.div(flat, page_size, rounding_mode="floor"))
    return (pages * page_size + flat % page_size).reshape(pos.shape)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [S, ...] at slots [...] -> [..., *cache.shape[1:]]: `cache[slots]` through
    `index_select`, which copies whole rows (on CPU 4-10x faster than advanced indexing).
    A negative slot counts from the end, as in indexing (the unused entries of a fixed-shape
    page table, masked by their readers)."""
    flat = slots.reshape(-1)
    rows = cache.index_select(0, torch.where(flat < 0, flat + cache.shape[0], flat))
    return rows.view(*slots.shape, *cache.shape[1:])


def gather_head_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [S, Hkv, D] at slots [..., Hkv, L], each kv head at its own slots -> [..., Hkv,
    L, D]: `cache[slots, head]` (head broadcast along L) as `gather_slots` of the (slot, head)
    rows. A negative slot counts from the end, as in indexing: slot · Hkv + head is then the
    negative index of the same row among the flattened rows."""
    hkv = cache.shape[1]
    head = torch.arange(hkv, device=slots.device)[:, None]
    return gather_slots(cache.flatten(0, 1), slots * hkv + head)


def step_slots(page_table: torch.Tensor, positions: torch.Tensor,
               page_size: int) -> torch.Tensor:
    """`slots_of` of a step's positions [B, n]: one kernel on CUDA (`kernels.slots`)."""
    if positions.is_cuda:
        from vegas_spec.kernels.slots import slots

        return slots(page_table, positions, page_size)
    return slots_of(page_table, positions, page_size)


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can take now: free device memory (plus what PyTorch's caching
    allocator holds unused) on CUDA; on CPU MemAvailable of /proc/meminfo (else the free
    physical pages), bounded by a cgroup's memory limit. None where it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    room = cgroup_room()
    return max(avail if room is None else min(avail, room), 0)


def cgroup_room(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> int | None:
    """Bytes the process's memory cgroup (v2, or v1's memory controller) may still take:
    its limit less its usage, at the container's root and at the process's own group (a
    job may run in a group of its own below it). None where no limit is set or none can
    be read."""
    try:
        with open(own) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    v2 = [line.split(":", 2)[2] for line in lines if line.startswith("0::")]
    v1 = [line.split(":", 2)[2] for line in lines if line.split(":")[1:2] == ["memory"]]
    groups = [(root, "memory.max", "memory.current")]
    groups += [(f"{root}{path}", "memory.max", "memory.current") for path in v2 if path != "/"]
    groups += [(f"{root}/memory{path}", "memory.limit_in_bytes", "memory.usage_in_bytes")
               for path in v1]
    rooms = [r for r in (_room(*g) for g in groups) if r is not None]
    return min(rooms) if rooms else None


def _room(folder: str, limit_file: str, usage_file: str) -> int | None:
    try:
        with open(f"{folder}/{limit_file}") as f:
            limit = f.read().strip()
        if limit == "max" or int(limit) >= 1 << 62:  # no limit (v1 writes a huge number)
            return None
        with open(f"{folder}/{usage_file}") as f:
            return int(limit) - int(f.read())
    except (OSError, ValueError):
        return None


def check_memory(budget_bytes: int, device: torch.device) -> None:
    """Refuse a KV budget larger than the memory available for it, before allocating."""
    avail = available_bytes(device)
    if avail is not None and budget_bytes > avail:
        raise OutOfMemoryError(f"a KV cache of {fmt_bytes(budget_bytes)} does not fit in the "
                               f"{fmt_bytes(avail)} of memory available on {device.type}; "
                               "lower the KV budget (--kv-cache-gb, kv_cache_bytes)")


class PagedKVCache:
    """The KV pool: the K/V tensors of every layer and their dtype on the device, and the
    pages that index them on the host (`pages`, a `PageAllocator`: free list, reference
    counts and, with prefix_bytes > 0, the prefix cache's shared pages, of which up to
    prefix_bytes stay cached while no sequence holds them). The scheduler takes and releases
    the pages; the runner reads and writes the tensors."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, prefix_bytes: int = 0) -> None:
        self.cfg, self.page_size, self.dtype = cfg, page_size, dtype
        self.bytes_per_page = page_bytes(cfg, page_size, dtype)
        shape = (num_pages * page_size, cfg.num_kv_heads, cfg.head_dim)
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device),
                        torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(cfg.num_layers)]
        prefix = PrefixCache(page_size, prefix_bytes // self.bytes_per_page) \
            if prefix_bytes > 0 else None
        self.pages = PageAllocator(num_pages, page_size, self.bytes_per_page, prefix)

    @classmethod
    def from_budget(cls, cfg: ModelConfig, budget_bytes: int, page_size: int,
                    dtype: torch.dtype, device: torch.device,
                    prefix_bytes: int = 0) -> PagedKVCache:
        pages = budget_bytes // page_bytes(cfg, page_size, dtype)
        if pages < 1:
            raise OutOfMemoryError(f"KV budget {fmt_bytes(budget_bytes)} holds no page of "
                                   f"{fmt_bytes(page_bytes(cfg, page_size, dtype))}")
        check_memory(pages * page_bytes(cfg, page_size, dtype), device)
        return cls(cfg, pages, page_size, dtype, device, prefix_bytes)

    # The pages' side, for setup and tests: the scheduler works on `pages` itself.
    num_pages = property(lambda self: self.pages.num_pages)
    free_pages = property(lambda self: self.pages.free_pages)

    def pages_for(self, tokens: int) -> int:
        return self.pages.pages_for(tokens)

    def check_fits(self, token_counts: list[int]) -> None:
        self.pages.check_fits(token_counts)

    def allocate(self, tokens: int) -> list[int]:
        return self.pages.allocate(tokens)

    def release(self, pages: list[int]) -> None:
        self.pages.release(pages)
