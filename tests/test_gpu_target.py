"""`make test-gpu` runs every test file that holds a test needing CUDA: CI has no GPU, so a
GPU-only test outside that target would never run anywhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# How a test file says it runs something only on CUDA: a skip when CUDA is missing (or there
# are fewer than two GPUs), the `gpu` marker, a test for the GPU's device, or a device that
# is CUDA wherever CUDA is there (conftest's TRITON_DEVICE among them, and its
# family_engine on the Triton backend).
NEEDS_CUDA = re.compile(r"skipif\(\s*not (?:torch\.cuda\.is_available\(\)|CUDA\b)"
                        r"|mark\.gpu\b|TWO_GPUS|DEVICE\.type != \"cuda\""
                        r"|\"cuda\" if torch\.cuda\.is_available\(\)|\bTRITON_DEVICE\b"
                        r"|family_engine\([^)]*backend=\"triton\"")


def gpu_recipe() -> str:
    """The commands of the Makefile's test-gpu target."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(r"^test-gpu:\n((?:\t.*\n)+)", text, re.M)
    assert match, "the Makefile has a test-gpu target"
    return match.group(1)


def test_every_file_with_a_cuda_test_is_in_the_gpu_target() -> None:
    recipe = gpu_recipe()
    named = set(re.findall(r"tests/[\w/]+(?:\.py)?", recipe))
    files = (p for p in (ROOT / "tests").rglob("test_*.py") if p != Path(__file__).resolve())
    needing = sorted(p.relative_to(ROOT).as_posix() for p in files
                     if NEEDS_CUDA.search(p.read_text()))
    assert "tests/kernels/test_paged_attention.py" in needing  # the pattern finds them
    assert "tests/speculative/test_lossless_gpu.py" in needing
    assert "tests/test_engine_prefill.py" in needing and "tests/test_parallel.py" in needing
    assert "tests/models/test_gpt_oss.py" in needing
    assert "tests/models/test_qwen3_moe.py" in needing
    missing = [f for f in needing
               if not any(f == n or f.startswith(n.rstrip("/") + "/") for n in named)]
    assert not missing, f"tests needing CUDA that `make test-gpu` does not run: {missing}"


def test_the_gpu_target_runs_pytest_on_paths_that_exist() -> None:
    recipe = gpu_recipe()
    assert recipe.count("-m pytest") == 4
    for path in re.findall(r"tests/[\w/]+(?:\.py)?", recipe):
        assert (ROOT / path).exists(), path
