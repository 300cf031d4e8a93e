"""The model families the engine runs, by HF architecture name: the one list of them.

A family is one file (`llama`, `qwen2`, `qwen3`, `qwen3_moe`, `gpt_oss`) of a `Family` over
the shared layers; adding one is its file and its line in `FAMILIES`. `ModelConfig.from_hf` asks
`family_of` which family an HF config is (refusing the others by name, listing these), the
GGUF reader asks `by_gguf`, and the model, the loader and tensor parallelism read the
family's weight table."""

from __future__ import annotations

from typing import Any

from vegas_spec.config import ConfigError
from vegas_spec.models import gpt_oss, llama, qwen2, qwen3, qwen3_moe
from vegas_spec.models.family import Family

FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    llama.LLAMA,
    llama.MISTRAL,
    qwen2.QWEN2,
    qwen3.QWEN3,
    qwen3_moe.QWEN3_MOE,
    gpt_oss.GPT_OSS,
)}


def _unsupported(name: str) -> ConfigError:
    return ConfigError(f"unsupported architecture {name}; supported: {', '.join(FAMILIES)}")


def family(architecture: str) -> Family:
    if architecture not in FAMILIES:
        raise _unsupported(architecture)
    return FAMILIES[architecture]


def family_of(hf: dict[str, Any]) -> Family:
    """The family of an HF config: the first of its `architectures` registered, or for a
    config that lists none, the family of its `model_type`."""
    archs = hf.get("architectures") or []
    known = [a for a in archs if a in FAMILIES]
    if known:
        return FAMILIES[known[0]]
    by_type = next((f for f in FAMILIES.values() if f.model_type == hf.get("model_type")), None)
    if not archs and by_type is not None:
        return by_type
    raise _unsupported(", ".join(archs) or f"model_type={hf.get('model_type')!r}")


def by_gguf(name: Any) -> Family:  # noqa: ANN401 - a GGUF field, of any type
    """The family of GGUF `general.architecture` name."""
    found = next((f for f in FAMILIES.values() if f.gguf is not None and f.gguf == name), None)
    if found is None:
        names = ", ".join(f.gguf for f in FAMILIES.values() if f.gguf is not None)
        raise ConfigError(f"unsupported GGUF architecture {name!r}; supported: {names}")
    return found


def split_dim(name: str) -> int | None:
    """The dim of HF-named tensor `name` that tensor parallelism splits, by the first family
    whose table names it (None: whole, or no family's)."""
    row = next((r for f in FAMILIES.values() if (r := f.entry(name)) is not None), None)
    return None if row is None else row.split
