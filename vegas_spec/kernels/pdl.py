"""Programmatic dependent launch (PDL, sm_90 and later) for the kernels of a decode step.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still
draining its last wave, so the gap between two short kernels (launch, block scheduling, the
pipeline's fill) overlaps the tail of the one before. Such a kernel's first statement is
`wait(PDL)` (`griddepcontrol.wait`): it blocks until the kernel before has completed and its
memory is visible, so nothing is read or written earlier, and the order of the stream holds
(a kernel after it cannot complete before it has waited, so the chain is transitive).

`ENABLED` (off) switches it for every kernel that takes the `PDL` parameter, read when a
launch happens, so a CUDA graph captures the setting of its capture. Only CUDA devices of
compute capability 9.0 or later launch with it; the interpreter never does."""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

ENABLED = False


@lru_cache(maxsize=8)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch(device: torch.device) -> dict[str, bool]:
    """The launch arguments of a kernel that takes `PDL`, on `device`."""
    on = ENABLED and device.type == "cuda" and _capable(
        device.index if device.index is not None else torch.cuda.current_device())
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait(PDL: tl.constexpr):
    """The first statement of a kernel that takes `PDL`: wait for the kernel before."""
    if PDL:
        gdc_wait()
