"""Shared inputs of the kernel tests: the device, dtypes with their tolerances, and a paged
KV cache whose pages are shuffled (so a wrong page-table walk cannot pass), and outputs poisoned
with NaN (so an element a kernel forgets to write cannot pass)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

import vegas_spec.kernels

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# Half precision only where the kernels are compiled; the interpreter checks float32 logic.
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if CUDA else [])


def tol(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return {"atol": 1e-4, "rtol": 1e-4}
    return {"atol": 2e-2, "rtol": 2e-2}


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32,
          ) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


@dataclass
class PagedCache:
    k: torch.Tensor  # [num_slots, Hkv, D]
    v: torch.Tensor  # [num_slots, Hkv, D]
    page_table: torch.Tensor  # [B, P] int32
    page_size: int


def paged_cache(bsz: int, max_len: int, hkv: int, dim: int, page_size: int,
                dtype: torch.dtype, gen: torch.Generator) -> PagedCache:
    """Random K/V in a pool with two spare pages; sequence pages in a random order."""
    pages = -(-max_len // page_size)
    pool = bsz * pages + 2
    order = torch.randperm(pool, generator=gen)[: bsz * pages].view(bsz, pages)
    slots = pool * page_size
    return PagedCache(randn(slots, hkv, dim, gen=gen, dtype=dtype),
                      randn(slots, hkv, dim, gen=gen, dtype=dtype),
                      order.to(device=DEVICE, dtype=torch.int32), page_size)


def query_positions(lens: list[int], n: int) -> torch.Tensor:
    """[B, n]: the last n positions of each sequence (a decode or verify step)."""
    length = torch.tensor(lens)[:, None]
    return (length - n + torch.arange(n)).to(DEVICE)


def as_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA devices read the sm_90 entries of the kernels' tuning tables, a GPU present or not
    (an H100's or H200's tile choices checked on any machine)."""
    monkeypatch.setattr(vegas_spec.kernels, "device_class",
                        lambda device: "sm90" if device.type == "cuda" else "interpreter")


def retune(monkeypatch: pytest.MonkeyPatch, module: object, **fields: object) -> None:
    """Every entry of `module.TUNING` (every device class) with these fields, for the test."""
    for key, entry in list(module.TUNING.items()):  # type: ignore[attr-defined]
        monkeypatch.setitem(module.TUNING, key,  # type: ignore[attr-defined]
                            dataclasses.replace(entry, **fields))


def poisoned(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An output buffer full of NaN, so an element the kernel forgets fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@contextmanager
def nan_empty() -> Iterator[None]:
    """Inside, torch.empty and friends return NaN-filled memory: for outputs that the kernels'
    host wrappers allocate themselves."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]
