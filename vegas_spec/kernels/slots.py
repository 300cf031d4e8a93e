"""A step's cache slots: position p of sequence b lives in slot page_table[b, p // page_size]
* page_size + p % page_size. Oracle: `vegas_spec.cache.slots_of`.

Every forward of the decode loop maps its [B, n] positions to slots; the reference's chain
(a cast of the page table, a division, a gather, a product, a remainder, a sum) is six
launches, one program a row here."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _slots_kernel(table_ptr, pos_ptr, out_ptr, cols, stride_tb, stride_pb, stride_pn,
                  page_size, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    mask = j < cols
    pos = tl.load(pos_ptr + b * stride_pb + j * stride_pn, mask=mask, other=0)
    page = tl.load(table_ptr + b * stride_tb + pos // page_size, mask=mask, other=0)
    tl.store(out_ptr + b * cols + j, page.to(tl.int64) * page_size + pos % page_size,
             mask=mask)


def slots(page_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """page_table [B, P] (last dim contiguous), positions [B, n] int64 (>= 0, any strides)
    -> slots [B, n] int64."""
    assert page_table.dim() == 2 and page_table.stride(-1) == 1
    assert positions.dim() == 2 and positions.shape[0] == page_table.shape[0]
    assert positions.dtype == torch.long
    rows, cols = positions.shape
    out = torch.empty(rows, cols, dtype=torch.long, device=positions.device)
    if out.numel() == 0:
        return out
    _slots_kernel[(rows,)](page_table, positions, out, cols, page_table.stride(0),
                           positions.stride(0), positions.stride(1), page_size,
                           BLOCK=triton.next_power_of_2(cols), num_warps=1)
    return out
