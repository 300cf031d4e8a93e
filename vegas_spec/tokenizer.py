"""Tokenizer and chat template through `transformers.AutoTokenizer`.

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is cached on disk
(keyed by the file's name, size and modification time). A GGUF file whose architecture
transformers cannot convert (llama.cpp's gpt-oss) but whose vocabulary is byte-level BPE
(`tokenizer.ggml.model` "gpt2") is built here with the `tokenizers` library: its tokens and
merges, the pre-tokenizer its `tokenizer.ggml.pre` names (`PRE_TOKENIZERS`), its control
tokens special, its BOS/EOS/padding ids and chat template."""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from vegas_spec.config import ConfigError

if TYPE_CHECKING:  # the loader imports torch; `vegas --help` reads this module without it
    from vegas_spec.models.loader import ModelSource


def cache_dir() -> Path:
    root = os.environ.get("VEGAS_SPEC_CACHE") or Path.home() / ".cache" / "vegas_spec"
    return Path(root) / "tokenizers"


def load_tokenizer(source: ModelSource):  # noqa: ANN201 - a transformers tokenizer
    if not source.is_gguf:
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        if not any((source.path / n).exists() for n in names):
            raise ConfigError(f"{source.path} has no tokenizer files: pass prompts as token-id "
                              "lists, or add the tokenizer to the folder")
    try:
        return _load(source)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"cannot load the tokenizer of {source.path}: "
                          f"{type(err).__name__}: {err}") from err
    except Exception as err:
        # the `tokenizers` library reports a malformed tokenizer.json as a bare Exception
        if type(err) is not Exception:
            raise
        raise ConfigError(f"cannot load the tokenizer of {source.path}: {err}") from err


def _load(source: ModelSource):  # noqa: ANN202
    from transformers import AutoTokenizer

    if not source.is_gguf:
        return AutoTokenizer.from_pretrained(str(source.path))
    st = source.path.stat()
    key = hashlib.sha1(f"{source.path.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    cached = cache_dir() / key[:16]
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    try:
        tok = AutoTokenizer.from_pretrained(str(source.folder), gguf_file=source.path.name)
    except (TypeError, ValueError, KeyError):
        tok = _byte_level_bpe(source.path)
        if tok is None:
            raise
    try:
        tok.save_pretrained(str(cached))
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return tok


# llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`) -> the split before byte-level BPE
# (None: GPT-2's own, the ByteLevel pre-tokenizer's regex). gpt-4o's is tiktoken's o200k.
PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "gpt-4o": "|".join([
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]),
}
CONTROL = 3  # llama.cpp's token type of a control (special) token


def _byte_level_bpe(path: Path):  # noqa: ANN202 - a PreTrainedTokenizerFast, or None
    """The tokenizer of a GGUF file's byte-level BPE vocabulary (None: not one); ValueError
    for a pre-tokenizer it does not know."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from vegas_spec.models.gguf_file import read_gguf

    fields = read_gguf(path).fields
    if fields.get("tokenizer.ggml.model") != "gpt2":
        return None
    pre = str(fields.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"the vocabulary's pre-tokenizer {pre!r} is not one this engine "
                         f"builds ({', '.join(PRE_TOKENIZERS)})")
    tokens = [str(t) for t in fields["tokenizer.ggml.tokens"]]  # type: ignore[union-attr]
    merges = [tuple(str(m).split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    kinds = list(fields.get("tokenizer.ggml.token_type", [1] * len(tokens)))  # type: ignore[arg-type]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    split = PRE_TOKENIZERS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    tok.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, kinds) if kind == CONTROL])

    def token(key: str) -> str | None:
        index = fields.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=token("bos"),
                                   eos_token=token("eos"), pad_token=token("padding"),
                                   chat_template=fields.get("tokenizer.chat_template"))


def text_decoder(tok) -> Callable[[list[int]], str]:  # noqa: ANN001
    """ids -> text, special tokens skipped and spaces left as they are: the `tokenizers`
    backend's own decode where transformers' decode only forwards to it (its Python wrapper
    costs several times the decode of the few ids a detokenizer step reads), else the
    tokenizer's decode with those settings."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    kind = type(tok)
    if isinstance(tok, PreTrainedTokenizerFast) \
            and kind._decode is PreTrainedTokenizerFast._decode \
            and kind.decode is PreTrainedTokenizerBase.decode:
        return functools.partial(tok.backend_tokenizer.decode, skip_special_tokens=True)
    return functools.partial(tok.decode, skip_special_tokens=True,
                             clean_up_tokenization_spaces=False)


def check_text(text: str, what: str = "the prompt") -> None:
    """A ConfigError naming the first lone surrogate (a UTF-16 half, which JSON's \\uD800
    escapes can carry) in text: it is no Unicode text, and no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} holds a lone surrogate (U+{ord(text[e.start]):04X} at "
                          f"character {e.start}), which is not valid Unicode text") from None


def longest_token(tok) -> int:  # noqa: ANN001
    """Characters of the vocabulary's longest token as the tokenizer writes it (a byte-level
    BPE: one character a byte; SentencePiece: one a character, byte tokens longer), so that a
    text of n characters takes at least n / longest_token(tok) tokens."""
    longest = getattr(tok, "_vegas_longest_token", None)
    if longest is None:
        longest = max((len(t) for t in tok.get_vocab()), default=1)
        tok._vegas_longest_token = longest
    return longest


def encode(tok, prompt: str, chat: bool) -> list[int]:  # noqa: ANN001
    if not chat:  # a chat's messages are checked by encode_chat
        check_text(prompt)
        return tok(prompt, add_special_tokens=True)["input_ids"]
    return encode_chat(tok, [{"role": "user", "content": prompt}])


def encode_chat(tok, messages: list[dict[str, str]]) -> list[int]:  # noqa: ANN001
    """A conversation ({"role", "content"} messages) through the model's chat template,
    ending where the assistant's answer begins."""
    if tok.chat_template is None:
        raise ConfigError("chat mode needs a tokenizer with a chat template; this model has none")
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), str):
            check_text(m["content"], f"message {i}'s content")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
