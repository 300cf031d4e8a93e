"""One copy of a model per process: engines that load the same checkpoint in the same dtype,
on the same device and tensor-parallel rank, share the model that the first of them built,
for as long as any of them holds it.

No engine writes its model's weights (a step reads them; FP8 draft copies are made at load,
and an engine that wants them gets a model of its own kind, `ModelKey.drafts`), so the
sharing changes no output; it saves the weights' memory and their load for every engine but
the first (540 MB and about a second for SmolLM2-135M in float32): a server beside an offline
`LLM`, a benchmark's engines of several settings, a test file's engines. The registry holds
weak references only: a model goes with the last engine that holds it. Its key holds the
size and modification time of the checkpoint's files, so a checkpoint rewritten in place is
read again."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vegas_spec.models.decoder import Decoder
from vegas_spec.models.loader import ModelSource

# (path, size in bytes, modification time in ns) of each file a model is read from
FileStamp = tuple[str, int, int]


@dataclass(frozen=True)
class ModelKey:
    files: tuple[FileStamp, ...]
    load_format: str  # "auto" (the checkpoint's weights) or "dummy" (seeded random ones)
    dtype: torch.dtype
    device: torch.device
    rank: int  # tensor parallelism: the rank's slices
    world_size: int
    drafts: str  # the copies of its projections draft steps read: fp8, int8, int4 or model (none)
    mxfp4_experts: bool = False  # experts whose values are MXFP4 kept so (`keep_mxfp4_experts`)


_MODELS: weakref.WeakValueDictionary[ModelKey, Decoder] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def file_stamps(source: ModelSource) -> tuple[FileStamp, ...]:
    """The files a model is read from: a GGUF file, or a folder's JSON and safetensors."""
    if source.is_gguf:
        paths = [source.path]
    else:
        paths = sorted(p for p in source.path.iterdir() if p.suffix in (".json", ".safetensors"))
    stamps = []
    for path in paths:
        st = path.stat()
        stamps.append((str(path.resolve()), st.st_size, st.st_mtime_ns))
    return tuple(stamps)


def shared_model(key: ModelKey, build: Callable[[], Decoder]) -> Decoder:
    """The model of `key` that another engine of this process holds, else `build()`'s."""
    with _LOCK:  # two engines built at once in two threads load the model once
        model = _MODELS.get(key)
        if model is None:
            model = build()
            _MODELS[key] = model
        return model


def loaded_models() -> int:
    """How many models engines of this process hold now."""
    return len(_MODELS)
