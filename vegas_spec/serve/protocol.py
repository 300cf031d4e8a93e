"""The OpenAI wire format: request bodies, their conversion to `SamplingParams` (checked by
the same code as the offline API), response and stream chunks, and error bodies."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vegas_spec.config import SamplingParams


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status, message, kind, param, code)
        self.headers = headers  # sent with the answer (429: Retry-After)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False  # one more chunk before [DONE]: no choices, the usage


# Request fields are strict (no "10" for 10, no true for 1, no "yes" for true); floats finite.
_STRICT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
# Fields the API defines that this server does not implement: refused by name unless they
# carry their "off" value.
_UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
                "best_of", "logit_bias", "suffix", "echo", "top_logprobs", "response_format")


def _off(name: str, value: Any) -> bool:
    """Whether an unsupported field's value asks for nothing (a bool is no count: true is
    not best_of 1)."""
    if value is None or value is False or value == [] or value == {}:
        return True
    if name == "best_of":
        return type(value) is int and value == 1
    if name == "response_format":
        return value == {"type": "text"}
    return name in ("tool_choice", "function_call") and value == "none"


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI's own server does with e.g. `user`; the API's
    # fields this server does not implement are refused by name (`check_supported`).
    model_config = _STRICT

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    # null is the default, as in OpenAI's API
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    n: int | None = None
    ignore_eos: bool = False
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true",
                           param="stream_options")
        if self.n is not None and self.n != 1:
            raise APIError(400, f"n must be 1 (one choice per request), got {self.n}", param="n")
        if self.logprobs not in (None, False):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise APIError(400, f"{name} is not supported", param=name)
        for name in _UNSUPPORTED:
            if not _off(name, (self.model_extra or {}).get(name)):
                raise APIError(400, f"{name} is not supported", param=name)

    def sampling(self, default_max: int) -> SamplingParams:
        """The request's sampling settings, checked by SamplingParams itself."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            max_tokens=self.max_tokens or default_max, stop=tuple(stop), seed=self.seed,
            ignore_eos=self.ignore_eos)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)

    def single_prompt(self) -> str | list[int]:
        """One prompt: a string or token ids (a batch of prompts needs one request each)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "one prompt per request", param="prompt")
            return p[0]
        return p  # type: ignore[return-value]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message; `developer` is a system message (OpenAI's newer name), content a string or
    a list of text parts (joined), null only for an assistant's message."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None

    def template_message(self) -> dict[str, str]:
        if self.content is None and self.role != "assistant":
            raise APIError(400, f"a {self.role} message needs content", param="messages")
        text = self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def sampling(self, default_max: int) -> SamplingParams:
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling(default_max)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_body(rid: str, model: str, text: str, finish: str | None,
                    use: dict[str, int] | None = None, chunk: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if use is not None and not chunk:
        body["usage"] = use
    return body


def chat_body(rid: str, model: str, text: str, finish: str | None,
              use: dict[str, int] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}],
            "usage": use}


def usage_chunk(rid: str, model: str, chat: bool, use: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a stream that asked for usage: no choices."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": [], "usage": use}


def chat_chunk(rid: str, model: str, delta: dict[str, str], finish: str | None,
               ) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
