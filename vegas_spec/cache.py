"""Paged KV cache: one pool of fixed-size pages shared by all sequences.

Per layer the cache is a [num_pages * page_size, Hkv, D] tensor for K and one for V; a
sequence owns a list of pages (its page table) and token position p lives in slot
page_table[p // page_size] * page_size + p % page_size."""

from __future__ import annotations

import math
import os

import torch

from vegas_spec.config import ConfigError, ModelConfig


def slots_of(page_table: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """page_table [B, P], pos [B, ...] (>= 0) -> cache slots [B, ...]."""
    flat = pos.reshape(pos.shape[0], -1)
    pages = torch.gather(page_table.long(), 1, torch.div(flat, page_size, rounding_mode="floor"))
    return (pages * page_size + flat % page_size).reshape(pos.shape)


class OutOfMemoryError(ConfigError):
    """The requested batch does not fit the KV budget."""


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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
    try:  # a container's limit (cgroup v2)
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                avail = min(avail, int(limit) - int(f.read()))
    except (OSError, ValueError):
        pass
    return max(avail, 0)


def check_memory(budget_bytes: int, device: torch.device) -> None:
    """Refuse a KV budget larger than the memory available for it, before allocating."""
    avail = available_bytes(device)
    if avail is not None and budget_bytes > avail:
        raise OutOfMemoryError(f"a KV cache of {fmt_bytes(budget_bytes)} does not fit in the "
                               f"{fmt_bytes(avail)} of memory available on {device.type}; "
                               "lower the KV budget (--kv-cache-gb, kv_cache_bytes)")


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cfg, self.page_size, self.num_pages = cfg, page_size, num_pages
        self.bytes_per_page = page_bytes(cfg, page_size, dtype)
        shape = (num_pages * page_size, cfg.num_kv_heads, cfg.head_dim)
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device),
                        torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(cfg.num_layers)]
        self.free_pages = list(range(num_pages - 1, -1, -1))

    @classmethod
    def from_budget(cls, cfg: ModelConfig, budget_bytes: int, page_size: int,
                    dtype: torch.dtype, device: torch.device) -> PagedKVCache:
        pages = budget_bytes // page_bytes(cfg, page_size, dtype)
        if pages < 1:
            raise OutOfMemoryError(f"KV budget {fmt_bytes(budget_bytes)} holds no page of "
                                   f"{fmt_bytes(page_bytes(cfg, page_size, dtype))}")
        check_memory(pages * page_bytes(cfg, page_size, dtype), device)
        return cls(cfg, pages, page_size, dtype, device)

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def check_fits(self, token_counts: list[int]) -> None:
        """Refuse up front a batch whose sequences cannot all be resident at once."""
        need = sum(self.pages_for(t) for t in token_counts)
        if need > len(self.free_pages):
            raise OutOfMemoryError(
                f"batch needs {need} KV pages ({fmt_bytes(need * self.bytes_per_page)}) but "
                f"only {len(self.free_pages)} are free "
                f"({fmt_bytes(len(self.free_pages) * self.bytes_per_page)} "
                f"of a {fmt_bytes(self.num_pages * self.bytes_per_page)} pool); "
                "lower the batch size or max_tokens, or raise the KV budget")

    def allocate(self, tokens: int) -> list[int]:
        """Pages for `tokens` slots."""
        self.check_fits([tokens])
        return self.take(self.pages_for(tokens))

    def take(self, pages: int) -> list[int]:
        """`pages` free pages (the caller has checked that they are free)."""
        return [self.free_pages.pop() for _ in range(pages)]

    def release(self, pages: list[int]) -> None:
        self.free_pages.extend(reversed(pages))
