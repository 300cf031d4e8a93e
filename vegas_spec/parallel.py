"""Tensor parallelism, Megatron-style, on `torch.distributed` (gloo on CPU, NCCL on GPUs).

A `TPGroup` is this process's place in the group: world size, rank and the process group.
World size 1 (`SINGLE`, the default) runs the single-process code unchanged and calls
nothing in `torch.distributed`. At world size N each rank holds:

- q/k/v and gate/up column-parallel: its 1/N of the query heads and of the KV heads (the q,
  k and v rows of those heads, fused as at N = 1) and its 1/N of the gate and up rows, so
  attention, RoPE, the KV cache (its KV heads only) and SiLU * up run locally;
- o_proj and down row-parallel: the matching 1/N of their input columns; their partial
  outputs are summed by one all_reduce each (their bias, if any, added once after it);
- a mixture of experts likewise, expert by expert: every rank holds every expert's 1/N of
  the gate/up rows and of the down columns, and the router whole, so every rank routes
  each token to the same experts; the weighted sum of a token's experts' partial outputs
  is summed over the ranks by one all_reduce;
- the embeddings and the LM head vocab-parallel: rows [r V/N, (r+1) V/N) of the vocabulary.
  An embedding lookup zeroes the ids outside the rank's rows and all_reduces (one non-zero
  term per element, so the sum is exact); the LM head's logit slices are all_gathered into
  the full vocabulary rather than all_reduced as zero-padded full-vocab tensors: a gather
  moves (N-1)/N of the logits per rank where a ring all_reduce moves twice that, and it
  does no arithmetic, so every rank's logits are bit-identical to the slices computed.

Norms and RoPE tables are replicated. Everything after the LM head (sampling, acceptance,
selection's host bounds) sees the same full-vocabulary logits on every rank, so every rank
takes the same decisions. Only the partial sums of o_proj and down are added in another
order than at N = 1, so logits agree with one rank to float rounding, not bit for bit.

Weights are sharded as they are read, one tensor at a time, so a rank keeps only its
slices: safetensors checkpoints are read slice by slice from the memory-mapped file
(`safe_open(...).get_slice`); GGUF tensors are read and dequantised whole (quantised blocks
do not split along every dim), then sliced (`shard_tensor`).
Dummy weights are generated whole from one seed, then sliced, so they are the same model
at every world size.

How the engine runs under TP (`vegas_spec.executor`): the scheduler and the engine stay in
rank 0; ranks 1..N-1 are workers that make each `ModelRunner` call rank 0 makes, above all
one `execute` per step with the scheduler's `StepPlan` (plain host data, broadcast over a
gloo group before the call), so every rank runs the same forwards on the same shapes (one
CUDA graph per rank, the collectives captured inside). Greedy and sampled tokens come from
logits that are identical on every rank, with the same counter-based draws (rank 0 seeds
unseeded requests in the plan; the plan says whether the iteration drafts), so all ranks
accept the same drafts; workers hold no sequences: which rows finish (EOS, stop strings,
aborts) rank 0 decides, and the next plan (or a `drop`) takes their rows out. Selection
reads each rank's
own heads' scores: per-KV-head selection (`granularity="kv_head"`) is local by nature;
head-aggregated scores are all_reduced (`TPGroup.sum_scores`: summed over the ranks' heads,
one all_reduce of [layers, B, R, 1, W] float32 a round, W the scored KV length) before the
top-k, so every rank selects the same positions as one rank would, to rounding. Without it
each rank's drafts would attend to its own selection: still lossless (verification is full
attention), but acceptance would differ from one rank's. quest ranks pages with each rank's
own queries inside its draft steps, so its selection is per rank (not yet reduced).

Exact mode sums the row-parallel partials in rank order (`sum_in_order`: an all_gather,
then N - 1 adds) at more than 2 ranks: a ring all_reduce adds an element's partials in an
order set by its place in the flattened tensor, which moves with the batch's shape. At 2
ranks a + b = b + a, so the all_reduce is row-invariant as it is.

Without a launch (`join` called directly, as the tests of this module do) every rank runs the
whole engine on the same requests (SPMD), which the identical logits and rank 0's measured
times (`from_rank0`: the prefill pacer and adaptive speculation plan by them) keep in step;
the CLI and the server use the one-scheduler layout above.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vegas_spec.config import ConfigError, ModelConfig

# NVLink multicast (NVLS) stays off in every process that joins a group.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class TPGroup:
    """This process's rank in a tensor-parallel group of `world_size` ranks; `group` is the
    torch.distributed ProcessGroup (None: the default group, or world size 1)."""

    world_size: int = 1
    rank: int = 0
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] -> the sum of every rank's x (in place)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def sum_in_order(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] -> the sum of every rank's x added in rank order, the same order for every
        element whatever x's shape (exact mode; an all_reduce's order follows the element's
        place in the tensor, which moves with the batch's shape)."""
        if self.world_size <= 2:  # a + b = b + a: any order gives the same bits
            return self.all_reduce(x)
        parts = self._all_gather(x)
        out = parts[0]
        for part in parts[1:]:
            out = out + part
        return out

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., C] -> [..., N C]: every rank's x side by side along the last dim, rank 0
        first."""
        if self.world_size == 1:
            return x
        return torch.cat(self._all_gather(x), dim=-1)

    def _all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x, rank 0 first."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def from_rank0(self, values: tuple[float, ...]) -> tuple[float, ...]:
        """Rank 0's `values` on every rank (a host read; this rank's own at world size 1)."""
        if self.world_size == 1:
            return values
        import torch.distributed as dist

        box = [values]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return tuple(box[0])

    def rank_slice(self, length: int) -> slice:
        """This rank's part of an axis of `length` split evenly over the ranks."""
        size = length // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def sum_scores(self, scores: torch.Tensor | None, per_kv_head: bool) -> torch.Tensor | None:
        """Selection scores [layers, B, R, G, W] of this rank's heads -> what every rank
        selects from: head-aggregated ones (G = 1) summed over all ranks' heads, so every rank
        selects the positions one rank would; per-KV-head ones (G = this rank's KV heads)
        as they are, each rank selecting for the KV heads it holds."""
        if self.world_size == 1 or scores is None or per_kv_head:
            return scores
        return self.all_reduce(scores.clone(memory_format=torch.contiguous_format))

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., hidden]: rows of the vocabulary-parallel table weight [V/N,
        hidden] (at N = 1 the whole table)."""
        if self.world_size == 1:
            return F.embedding(ids, weight)
        start = self.rank * weight.shape[0]
        local = ids - start
        outside = (local < 0) | (local >= weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), weight)
        return self.all_reduce(x.masked_fill(outside[..., None], 0.0))


SINGLE = TPGroup()
_current = SINGLE


def current() -> TPGroup:
    """The group this process's engine joins (SINGLE unless `join` was called)."""
    return _current


def join(world_size: int, rank: int, group: Any = None) -> TPGroup:
    """Make this process rank `rank` of `world_size` for every engine it builds from now on;
    torch.distributed must already be initialised with that many ranks."""
    global _current
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"tensor-parallel rank {rank} is not in 0..{world_size - 1}")
    if world_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size(group) != world_size:
            raise ConfigError(f"tensor parallelism over {world_size} ranks needs "
                              "torch.distributed initialised with that many ranks")
        os.environ.update(NO_MULTICAST)
    _current = TPGroup(world_size, rank, group)
    return _current


def leave() -> None:
    """Back to one process (the group itself is destroyed by its owner)."""
    global _current
    _current = SINGLE


def check_divisible(cfg: ModelConfig, world_size: int) -> None:
    """ConfigError naming every size of the model that tensor parallelism over world_size
    ranks cannot split evenly."""
    if world_size < 1:
        raise ConfigError(f"tensor parallelism needs at least 1 rank, got {world_size}")
    sizes = {"query heads (num_attention_heads)": cfg.num_heads,
             "KV heads (num_key_value_heads)": cfg.num_kv_heads,
             "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    if cfg.num_experts:
        sizes["moe_intermediate_size"] = cfg.moe_intermediate_size
    bad = [f"{n} = {v}" for n, v in sizes.items() if v % world_size]
    if bad:
        raise ConfigError(f"tensor parallelism over {world_size} ranks needs the model's "
                          f"{', '.join(bad)} divisible by {world_size}")


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The sizes one rank's layers hold: heads and intermediate sizes (every expert's too)
    divided by world_size. vocab_size stays whole: the LM head's gathered logits cover the
    full vocabulary; the experts stay whole in number (each rank holds a slice of each)."""
    check_divisible(cfg, world_size)
    if world_size == 1:
        return cfg
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world_size,
                               num_kv_heads=cfg.num_kv_heads // world_size,
                               intermediate_size=cfg.intermediate_size // world_size,
                               moe_intermediate_size=cfg.moe_intermediate_size // world_size)


def shard(w: torch.Tensor, dim: int | None, tp: TPGroup) -> torch.Tensor:
    """Rank tp.rank's slice of the full tensor w along dim (None: w whole), a copy: the full
    tensor can go. Heads are contiguous rows of q/k/v (HF layout), so a row slice holds
    whole heads."""
    if tp.world_size == 1 or dim is None or w.dim() <= dim:
        return w
    part = tp.rank_slice(w.shape[dim])
    return w.narrow(dim, part.start, part.stop - part.start).clone()


def shard_shape(shape: tuple[int, ...], dim: int | None, world_size: int) -> tuple[int, ...]:
    """A full shape -> the shape of one rank's slice along dim."""
    if dim is None or dim >= len(shape):
        return shape
    return shape[:dim] + (shape[dim] // world_size,) + shape[dim + 1:]


# Which dim of a tensor is split (0 for column-parallel outputs and the vocabulary's rows, 1
# for row-parallel inputs, None: replicated) is written in its family's weight table; the
# functions below look an HF name up in the registered families' tables.

def split_dim(name: str) -> int | None:
    """The dim of HF-named tensor `name` that tensor parallelism splits (None: whole)."""
    from vegas_spec.models import registry  # the families' tables name their tensors

    return registry.split_dim(name)


def shard_tensor(name: str, w: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Rank tp.rank's slice of the full HF-named tensor w."""
    return shard(w, split_dim(name), tp)


def shard_shapes(shapes: dict[str, tuple[int, ...]], world_size: int,
                 ) -> dict[str, tuple[int, ...]]:
    """Expected full shapes of HF-named tensors -> the shapes of one rank's slices."""
    return {name: shard_shape(shape, split_dim(name), world_size)
            for name, shape in shapes.items()}
