"""vegas-spec: lossless self-speculative decoding with verification-guided sparse attention."""

from __future__ import annotations

from vegas_spec.config import ConfigError, SamplingParams, SpecConfig
from vegas_spec.engine import LLM, RequestOutput

__all__ = ["LLM", "ConfigError", "RequestOutput", "SamplingParams", "SpecConfig"]
__version__ = "0.1.0"
