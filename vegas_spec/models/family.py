"""A model family: its HF architecture name, its decoder layer, the optional tensors its
config switches on, and its weight table, the one place where its tensor names are written.

A `Weight` row names one HF tensor and says where it goes: the model's parameter it fills
(rows naming the same parameter are concatenated in table order: q/k/v into `qkv`, gate/up
into `gate_up`), its full shape from the config, the dim tensor parallelism splits (`ROWS`:
column-parallel outputs and the vocabulary; `COLUMNS`: row-parallel inputs; None: whole),
llama.cpp's name for it in a GGUF file, and for q/k the heads whose rows llama.cpp permutes.
A layer's rows are named after the family's `layer_prefix` (`model.layers.{i}.`) and GGUF's
`blk.{i}.`. A row whose name holds `{e}` (`mlp.experts.{e}.up_proj.weight`) stands for one
tensor per expert of a mixture of experts, its shape and split each expert's; its parameter
stacks them, expert by expert ([experts, rows, columns]), the rows filling one parameter
concatenated within each expert. A row's `convert` puts a checkpoint's tensor in its
parameter's layout (gpt-oss's fused expert stacks, saved transposed and interleaved), its shape
and split staying the checkpoint's. The loader's expected shapes and GGUF names, the dummy
weights, the tensor-parallel slices and the model's fused parameters are all read from these
rows. Where llama.cpp stores one HF tensor as several (gpt-oss's fused gate/up stack as a gate
and an up stack), the row has no GGUF name and a `GgufJoin` of the family's makes the HF
tensor from its parts; a family's `gguf_fields` reads the config keys of its own that a GGUF
file carries (or implies) beyond the shared ones."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from vegas_spec.config import ModelConfig
from vegas_spec.parallel import shard_shape

if TYPE_CHECKING:
    from vegas_spec.models.layers import LayerBase

ROWS, COLUMNS = 0, 1  # the dim of a weight that tensor parallelism splits
GGUF_LAYER_PREFIX = "blk.{i}."

Shape = Callable[[ModelConfig], tuple[int, ...]]
Condition = Callable[[ModelConfig], bool]

SIZES: dict[str, Callable[[ModelConfig], int]] = {
    "hidden": lambda c: c.hidden_size,
    "vocab": lambda c: c.vocab_size,
    "ffn": lambda c: c.intermediate_size,
    "head": lambda c: c.head_dim,
    "q": lambda c: c.num_heads * c.head_dim,
    "kv": lambda c: c.num_kv_heads * c.head_dim,
    "experts": lambda c: c.num_experts,
    "moe_ffn": lambda c: c.moe_intermediate_size,
    "moe_gate_up": lambda c: 2 * c.moe_intermediate_size,
    "heads": lambda c: c.num_heads,
}
EXPERT = "{e}"  # in a row's name: one tensor per expert


def dims(*names: str) -> Shape:
    """A shape of the config's named sizes: dims("q", "hidden") is (num_heads * head_dim,
    hidden_size)."""
    sizes = [SIZES[name] for name in names]
    return lambda cfg: tuple(size(cfg) for size in sizes)


def always(cfg: ModelConfig) -> bool:
    return True


def untied(cfg: ModelConfig) -> bool:
    return not cfg.tie_word_embeddings


@dataclass(frozen=True)
class Weight:
    """One HF tensor of a family's checkpoints (a layer's: named after its layer prefix)."""

    hf: str  # its HF name (a layer's: after the family's layer prefix)
    param: str  # the model's (a layer's) parameter it fills, e.g. "qkv.weight"
    shape: Shape  # its full shape (before tensor parallelism cuts it)
    split: int | None  # ROWS, COLUMNS or None (whole on every rank)
    gguf: str | None  # llama.cpp's name (a layer's: after "blk.{i}."; None: a `GgufJoin`'s)
    when: Condition = always  # whether the config's checkpoints hold it
    rope_heads: Callable[[ModelConfig], int] | None = None  # q/k: heads llama.cpp permutes
    # the checkpoint's tensor -> the parameter's layout (None: as it is), e.g. an expert
    # stack saved transposed; shape and split stay the checkpoint's
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def per_expert(self) -> bool:
        return EXPERT in self.hf

    def names(self, cfg: ModelConfig) -> list[str]:
        """The HF names the row stands for: its own, or one per expert."""
        if not self.per_expert:
            return [self.hf]
        return [self.hf.format(e=e) for e in range(cfg.num_experts)]


class Switches(NamedTuple):
    """The optional tensors a family's config switches on (`ModelConfig`'s fields)."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sinks: bool = False  # attention sinks: a learned logit per query head



class Experts(NamedTuple):
    """A mixture of experts' sizes, read from the HF config (`ModelConfig`'s fields); the
    defaults are a dense model's."""

    num_experts: int = 0
    experts_per_token: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's
    norm_topk_prob: bool = False  # the top-k probabilities renormalised to sum to 1
    router_bias: bool = False
    expert_bias: bool = False  # each expert's gate/up and down biased
    swiglu_limit: float = 0.0  # > 0: gpt-oss's clamped SwiGLU (`ModelConfig.swiglu_limit`)
    mxfp4_experts: bool = False  # quantization_config says MXFP4


@dataclass(frozen=True)
class GgufJoin:
    """An HF tensor of a layer (name relative to the layer prefix) that a GGUF file holds as
    `parts` (llama.cpp's names after "blk.{i}."), made by `join` from the parts' tensors in
    that order, in the HF checkpoint's layout."""

    hf: str
    parts: tuple[str, ...]
    join: Callable[..., torch.Tensor]


# accessor(key, default) of the file's "{arch}.{key}" fields, the config read so far -> the
# family's own config fields
GgufFields = Callable[[Callable[..., Any], dict[str, Any]], dict[str, Any]]


def no_gguf_fields(field: Callable[..., Any], cfg: dict[str, Any]) -> dict[str, Any]:
    return {}


def dense(hf: dict[str, Any]) -> Experts:
    return Experts()


def full_attention(hf: dict[str, Any]) -> tuple[int, ...]:
    """Every layer attends to every earlier position (`ModelConfig.layer_windows` ())."""
    return ()


@dataclass(frozen=True)
class Family:
    architecture: str  # the HF `architectures` name
    model_type: str  # the HF `model_type` (a config that lists no architectures)
    layer: type[LayerBase]  # built as layer(cfg, index)
    weights: tuple[Weight, ...]  # the model's own tensors (embeddings, final norm, LM head)
    layer_weights: tuple[Weight, ...]  # every layer's
    switches: Callable[[dict[str, Any]], Switches]  # read from the HF config
    layer_prefix: str = "model.layers.{i}."
    gguf: str | None = None  # GGUF's `general.architecture` (None: not read from GGUF)
    gguf_permuted: bool = False  # llama.cpp interleaves the RoPE halves of q/k rows
    experts: Callable[[dict[str, Any]], Experts] = dense  # read from the HF config
    # each layer's sliding window, read from the HF config (`ModelConfig.layer_windows`)
    windows: Callable[[dict[str, Any]], tuple[int, ...]] = full_attention
    gguf_joins: tuple[GgufJoin, ...] = ()  # HF tensors a GGUF file holds in parts
    gguf_fields: GgufFields = no_gguf_fields  # config fields of the family's GGUF keys

    def shapes(self, cfg: ModelConfig, world_size: int = 1) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of cfg holds -> its shape, in table order (at world_size
        > 1: the shape of one tensor-parallel rank's slice)."""
        rows = {w.hf: w for w in self.weights if w.when(cfg)}
        for i in range(cfg.num_layers):
            prefix = self.layer_prefix.format(i=i)
            rows.update({prefix + name: w for w in self.layer_weights if w.when(cfg)
                         for name in w.names(cfg)})
        return {name: shard_shape(w.shape(cfg), w.split, world_size) for name, w in rows.items()}

    def projection_params(self, cfg: ModelConfig) -> int:
        """Weights of one layer's projections that draft steps may read as copies (its
        layer's `projections`), by the table's shapes of cfg (a rank's, under TP)."""
        params = {f"{name}.weight" for name in self.layer.projections}
        return sum(math.prod(w.shape(cfg)) for w in self.layer_weights
                   if w.param in params and w.when(cfg))

    def entry(self, name: str) -> Weight | None:
        """The row of full HF name `name` (None: not one of the family's)."""
        layer = _layer_part(name, self.layer_prefix)
        rows, rel = (self.weights, name) if layer is None else (self.layer_weights, layer[1])
        return next((w for w in rows if _matches(rel, w.hf)), None)

    def split_dim(self, name: str) -> int | None:
        """The dim of HF-named tensor `name` that tensor parallelism splits (None: whole)."""
        row = self.entry(name)
        return None if row is None else row.split

    def from_gguf(self, name: str) -> str:
        """llama.cpp's tensor name -> the HF name (one not in the table unchanged, so that the
        weight check reports it as unexpected)."""
        layer = _layer_part(name, GGUF_LAYER_PREFIX)
        if layer is None:
            rows, rel, prefix = self.weights, name, ""
        else:
            rows, rel, prefix = self.layer_weights, layer[1], self.layer_prefix.format(i=layer[0])
        row = next((w for w in rows if w.gguf == rel), None)  # gguf None: never a match
        return name if row is None else prefix + row.hf

    def gguf_join(self, name: str) -> tuple[str, GgufJoin, int] | None:
        """llama.cpp's tensor name -> (the HF name of the tensor it is a part of, the join,
        the part's place in it), or None where it is no join's part."""
        layer = _layer_part(name, GGUF_LAYER_PREFIX)
        if layer is None:
            return None
        found = next((j for j in self.gguf_joins if layer[1] in j.parts), None)
        if found is None:
            return None
        return self.layer_prefix.format(i=layer[0]) + found.hf, found, found.parts.index(layer[1])


def _layer_part(name: str, prefix: str) -> tuple[int, str] | None:
    """("model.layers.3.mlp.up_proj.weight", "model.layers.{i}.") -> (3, "mlp.up_proj.weight");
    None where name is not a layer's."""
    head, _, tail = prefix.partition("{i}")
    if not name.startswith(head):
        return None
    index, sep, rest = name[len(head):].partition(tail)
    return (int(index), rest) if sep and index.isdigit() else None


def _matches(name: str, row: str) -> bool:
    """Whether HF name `name` is the row's: its own, or for a per-expert row one expert's
    ("mlp.experts.3.up_proj.weight" of "mlp.experts.{e}.up_proj.weight")."""
    head, marker, tail = row.partition(EXPERT)
    if not marker:
        return name == row
    if len(name) <= len(head) + len(tail) or not (name.startswith(head) and name.endswith(tail)):
        return False
    return name[len(head):len(name) - len(tail)].isdigit()


def _tensor(w: Weight, tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The row's tensor in its parameter's layout; a per-expert row's stacked [experts, ...]."""
    if not w.per_expert:
        tensor = tensors[w.hf]
    else:
        tensor = torch.stack([tensors[name] for name in w.names(cfg)])
    return tensor if w.convert is None else w.convert(tensor)


def fill(module: nn.Module, rows: tuple[Weight, ...], tensors: dict[str, torch.Tensor],
         cfg: ModelConfig) -> None:
    """Set module's parameters from the HF tensors its rows name (row names relative to
    module), concatenating the rows that fill one parameter."""
    parts: dict[str, list[torch.Tensor]] = {}
    for w in rows:
        if w.when(cfg):
            parts.setdefault(w.param, []).append(_tensor(w, tensors, cfg))
    for param, ts in parts.items():
        owner, _, leaf = param.rpartition(".")
        # rows join along the output rows: dim 0, or 1 within each expert of a stack
        value = ts[0] if len(ts) == 1 else torch.cat(ts, dim=max(ts[0].dim() - 2, 0))
        setattr(module.get_submodule(owner), leaf, nn.Parameter(value))
