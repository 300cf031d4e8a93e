"""The attention-backend seam and its backends, chosen by name from a registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from vegas_spec.attention.context import StepContext


class AttentionBackend(ABC):
    """One object per engine; `attend` is called by every attention layer of every step.

    Shapes: q [B, n, H, D] (RoPE applied), k/v [B, n, Hkv, D], caches [num_slots, Hkv, D].
    Returns [B, n, H, D]. Writes k/v into their slots first, then attends: full causal
    attention when `ctx.sparse` is None, else sparse draft attention over the plan.
    """

    name = "abstract"

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        self.store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        if ctx.sparse is None:
            return self.full(layer, q, k_cache, v_cache, ctx)
        plan = ctx.sparse
        if plan.selector is not None:
            indices = plan.selector(layer, q, ctx)
        else:
            assert plan.indices is not None
            indices = plan.indices[layer]
        return self.sparse(q, k_cache, v_cache, indices, ctx)

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    @abstractmethod
    def full(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             ctx: StepContext) -> torch.Tensor: ...

    @abstractmethod
    def sparse(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               indices: torch.Tensor, ctx: StepContext) -> torch.Tensor: ...


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        cls.name = name
        BACKENDS[name] = cls
        return cls

    return wrap


def make_backend(name: str) -> AttentionBackend:
    if name == "triton":
        import vegas_spec.attention.triton_backend  # noqa: F401  (registers itself)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name]()
