"""vegas-spec: lossless self-speculative decoding with verification-guided sparse attention."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vegas_spec.config import ConfigError, SamplingParams, SpecConfig
    from vegas_spec.engine import LLM, RequestOutput

__all__ = ["LLM", "ConfigError", "RequestOutput", "SamplingParams", "SpecConfig"]
__version__ = "0.1.0"

# The names load on first use, so that `vegas` (vegas_spec.cli) starts with the standard
# library only and catches Ctrl-C while torch is imported.
_HOME = {"LLM": "engine", "RequestOutput": "engine", "ConfigError": "config",
         "SamplingParams": "config", "SpecConfig": "config"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'vegas_spec' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"vegas_spec.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
