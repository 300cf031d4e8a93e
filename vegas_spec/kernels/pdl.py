"""Programmatic dependent launch (compute capability 9.0 on): a kernel launched with it may be
started by the GPU before the kernel ahead of it on the stream has finished, and waits at its
top (`await_prior`, griddepcontrol.wait) until that kernel's writes are visible. What it
saves is the gap between two kernels of a decode step (their launch and the ahead kernel's
tail), which at a step's few rows is much of a small kernel's time; captured graphs keep it
as a programmatic edge. Each kernel that takes it (RMSNorm, SiLU * up, rope_store, the
paged and sparse attention kernels and the split merge) waits before its first load, so it
reads what it would have read launched in order, and signals its own dependents as it
starts.

Off unless `VEGAS_SPEC_PDL=1` (not yet measured against plain stream order on a GPU);
the interpreter always launches in stream order."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from vegas_spec.kernels import interpreting


@functools.lru_cache(maxsize=16)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents: VEGAS_SPEC_PDL=1 and a
    CUDA device of compute capability 9.0 or more, compiled (not interpreted)."""
    if device.type != "cuda" or interpreting() or os.environ.get("VEGAS_SPEC_PDL") != "1":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict[str, bool]:
    """The launch options of a kernel that calls `await_prior` with PDL = enabled(device)."""
    return {"launch_pdl": True} if enabled(device) else {}


@triton.jit
def await_prior(PDL: tl.constexpr):
    """With PDL: wait until the kernel ahead on the stream has finished and its writes are
    visible, then let the kernel behind start. Call before the first load."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
