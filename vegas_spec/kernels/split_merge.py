"""Split-K (flash-decoding) plumbing shared by the paged and the sparse attention kernels.

A decode or verify step has few query rows, so one program per (sequence, kv head) leaves most
of the GPU idle on long contexts. The key axis is therefore cut into splits: each split program
writes its partial softmax state (running max m, sum l and unnormalised output acc, all float32)
and `merge_splits` combines them:

    m = max_s m_s,   l = sum_s l_s exp(m_s - m),   out = sum_s acc_s exp(m_s - m) / l,
    lse = m + log l   (natural log of the softmax denominator of scale * q.k).

A split in which a row sees no key has l_s = 0 and leaves acc_s unwritten; the merge reads
acc_s only where l_s > 0. With a single split the split kernel normalises in place and the
merge is skipped. The sparse kernel merges in the same launch: the last of a group's split
programs to finish merges the group's lanes (`merge_when_last`).

Attention sinks (a logit per query head in the denominator, no value) are split 0's initial
state (`initial_state`: m = sink, l = 1), so the merge counts each sink once.

Also here: the block update of the online softmax and the split kernels' initial state and
epilogue (`triton.jit` helpers), the tile configuration and the split-size heuristic, with
their tuning (`SplitTuning`, one entry per device class in `TUNING`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vegas_spec.kernels import device_sms, for_device

MIN_DOT = 16  # tl.dot's smallest tile side on GPUs (more lanes would make warpgroup MMAs)


@dataclass(frozen=True)
class SplitTuning:
    """The decode kernels' shared tiles and key split, and the merge's tiling, on one device
    class (the paged and the sparse kernels' own tables add theirs).

    Tiles (`tile_config`): keys per loop step `block_k` at head dims up to 64, `block_k_wide`
    past 64; `warps` and pipeline `stages` of an attention program (the score and verify
    tiles of `paged_attention` set their own stages); at most `max_lanes` query rows x
    padded heads per program (a max_lanes x D float32 accumulator); in exact mode
    `exact_rows` query rows per tile whatever the step's n (a plain step's one row and a
    verify step's γ+1 <= 8 rows then go through the same tl.dot shapes).

    Split (`split_size_for`): `split_blocks` key blocks a split whatever the launch, or, where
    None, at least `split_min_blocks` key blocks a split and as many splits as fill whole
    waves of the kernel's resident programs to `split_wave_fill` (a partly filled last wave
    costs a whole one), or without those (or with split_wave_fill None) about
    `split_programs_per_sm` programs per SM.

    Merge (`merge_tiling`): a program folds its row's splits, `merge_max_step` at a time, into
    a [heads, D] state, with as few heads (at most `merge_heads`) as keep a step's tile
    [splits, heads, D] within `merge_tile` float32 elements, in `merge_step_warps` warps, so
    that a step's reduction over the splits stays inside the warp and the loads of a step's
    splits are independent; a row of at most `merge_serial_max_splits` splits, where that
    gains nothing, is merged one split at a time in `merge_serial_warps` warps."""

    block_k: int
    block_k_wide: int
    warps: int
    stages: int
    max_lanes: int
    exact_rows: int
    split_blocks: int | None
    split_min_blocks: int
    split_wave_fill: float | None
    split_programs_per_sm: int
    merge_max_step: int
    merge_heads: int
    merge_tile: int
    merge_step_warps: int
    merge_serial_max_splits: int
    merge_serial_warps: int


_SM90 = SplitTuning(block_k=128, block_k_wide=64, warps=4, stages=2, max_lanes=64, exact_rows=8,
                    split_blocks=None, split_min_blocks=4, split_wave_fill=0.95,
                    split_programs_per_sm=2, merge_max_step=16, merge_heads=16,
                    merge_tile=4096, merge_step_warps=1, merge_serial_max_splits=2,
                    merge_serial_warps=4)
# By device class (`kernels.device_class`). The interpreter: small key blocks, whose cost is
# per program and loop step, one stage, and splits of 4 blocks, so that even the tests'
# short contexts run several splits and the merge.
TUNING: dict[str, SplitTuning] = {
    "sm90": _SM90,
    "default": _SM90,
    "interpreter": dataclasses.replace(_SM90, block_k=32, block_k_wide=32, stages=1,
                                       split_blocks=4),
}


def tuning(device: torch.device) -> SplitTuning:
    """The entry of `TUNING` that launches on `device` read."""
    return for_device(TUNING, device)


@dataclass(frozen=True)
class TileConfig:
    group: int  # query heads per kv head
    group_pad: int  # group rounded up to a power of two (lanes per query row)
    block_n: int  # query rows per program
    block_k: int  # keys per inner-loop step
    block_d: int  # head dim rounded up to a power of two
    num_warps: int
    num_stages: int
    dot_precision: str
    maxnreg: int | None = None  # registers per thread ptxas may use (None: its own choice)

    def launch_options(self) -> dict[str, int]:
        """The compile options of a kernel launched with these tiles."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        return opts


def tile_config(q: torch.Tensor, hkv: int, block_k: int | None = None,
                exact: bool = False) -> TileConfig:
    """q [B, n, H, D]: the query tile packs block_n rows x group_pad heads of one kv head, so
    K and V are read once per kv head (GQA); at least 16 lanes on a GPU for tl.dot. exact:
    block_n does not depend on n. The numbers: `tuning(q.device)`."""
    n, heads, dim = q.shape[1], q.shape[2], q.shape[3]
    group = heads // hkv
    group_pad = triton.next_power_of_2(group)
    tiles = tuning(q.device)
    rows_cap = max(1, tiles.max_lanes // group_pad)
    block_n = min(tiles.exact_rows if exact else triton.next_power_of_2(n), rows_cap)
    if q.is_cuda:
        block_n = max(block_n, MIN_DOT // group_pad, 1)
    block_k = block_k or (tiles.block_k_wide if dim > 64 else tiles.block_k)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    return TileConfig(group, group_pad, block_n, block_k, max(triton.next_power_of_2(dim), 16),
                      num_warps=tiles.warps, num_stages=tiles.stages, dot_precision=precision)


def splits_to_fill(programs: int, device: torch.device, per_sm: int) -> int:
    """Splits that give a launch of `programs` programs per split about `per_sm` programs
    per SM of the CUDA `device` (at least 1)."""
    return max(1, math.ceil(per_sm * device_sms(device) / max(programs, 1)))


def resident_limit(regs: int, shared: int, warps: int, sm_regs: int = 65536,
                   sm_shared: int = 233472, sm_threads: int = 2048,
                   most: int = 32) -> int:
    """Programs of `warps` warps, `regs` registers per thread and `shared` bytes of shared
    memory that one SM holds at once: registers are allocated per warp in units of 256, and
    each program reserves 1 KB of shared memory beside its own."""
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = (sm_regs // per_warp) // warps if per_warp else most
    by_shared = sm_shared // (shared + 1024)
    by_threads = sm_threads // (32 * warps)
    return max(1, min(by_regs, by_shared, by_threads, most))


def resident_programs(kernel: object, device: torch.device) -> int:
    """`resident_limit` of a compiled Triton kernel on the CUDA `device`."""
    kernel._init_handles()  # type: ignore[attr-defined]  # loads it: n_regs is known then
    props = torch.cuda.get_device_properties(device)
    return resident_limit(kernel.n_regs, kernel.metadata.shared,  # type: ignore[attr-defined]
                          kernel.metadata.num_warps,  # type: ignore[attr-defined]
                          getattr(props, "regs_per_multiprocessor", 65536),
                          getattr(props, "shared_memory_per_multiprocessor", 233472),
                          getattr(props, "max_threads_per_multi_processor", 2048))


def wave_splits(programs: int, slots: int, most: int, fill: float) -> int:
    """Of 1..most splits of a launch of `programs` programs per split on a GPU that holds
    `slots` programs at once, the fewest whose waves are at least `fill` full, else the one
    that fills them best (the fewest of those)."""
    best, best_fill = 1, 0.0
    for splits in range(1, max(most, 1) + 1):
        total = splits * max(programs, 1)
        filled = total / (math.ceil(total / slots) * slots)
        if filled >= fill:
            return splits
        if filled > best_fill + 1e-9:
            best, best_fill = splits, filled
    return best


def split_size_for(length: int, programs: int, block_k: int, device: torch.device,
                   split_size: int | None = None, resident: int | None = None) -> int:
    """Keys per split (a multiple of block_k), by `tuning(device)`: its split_blocks key
    blocks where set; else at least split_min_blocks key blocks each, and given the kernel's
    `resident` programs per SM (and a split_wave_fill), as many splits as fill whole waves of
    them (`wave_splits`), otherwise enough to give the GPU about split_programs_per_sm
    programs per SM."""
    if split_size is not None:
        assert split_size > 0 and split_size % block_k == 0, "split_size: a multiple of block_k"
        return split_size
    tiles = tuning(device)
    if tiles.split_blocks is not None:
        return tiles.split_blocks * block_k
    blocks = max(math.ceil(length / block_k), 1)
    most = math.ceil(blocks / tiles.split_min_blocks)
    if resident is not None and tiles.split_wave_fill is not None:
        splits = wave_splits(programs, resident * device_sms(device), most,
                             tiles.split_wave_fill)
    else:
        splits = max(1, min(splits_to_fill(programs, device, tiles.split_programs_per_sm),
                            most))
    return math.ceil(blocks / splits) * block_k


@dataclass
class Partials:
    """Per-split softmax state: acc [S, B*n, H, D], m and l [S, B*n, H], all float32."""

    acc: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor  # noqa: E741

    @classmethod
    def empty(cls, splits: int, rows: int, heads: int, dim: int,
              device: torch.device) -> Partials:
        f32 = torch.float32
        return cls(torch.empty(splits, rows, heads, dim, dtype=f32, device=device),
                   torch.empty(splits, rows, heads, dtype=f32, device=device),
                   torch.empty(splits, rows, heads, dtype=f32, device=device))


def output_buffer(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The [B, n, H, D] result buffer: the caller's (a static one, a poisoned one in tests)
    or a new one."""
    if out is None:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    return out


@triton.jit
def initial_state(sinks_ptr, head, lane_ok, split, M: tl.constexpr, BLOCK_D: tl.constexpr,
                  SINKS: tl.constexpr):
    """The online softmax's state before a split's first key: (m, l, acc) [M], [M], [M,
    BLOCK_D] float32, nothing seen (m = -inf, l = 0, acc = 0). SINKS: split 0 starts from
    each lane's head sink logit (sinks_ptr [H]) as a key of value 0 (m = sink, l = 1), so the
    sink joins the row's softmax denominator once, whatever the split count: the merge adds
    it with split 0's state, and the max includes it."""
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, BLOCK_D], tl.float32)
    if SINKS:
        sink = tl.load(sinks_ptr + head, mask=lane_ok, other=0.0).to(tl.float32)
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    return m_i, l_i, acc


@triton.jit
def softmax_block(x, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One key block of the online softmax. x [M, K] scaled logits (-inf = not visible),
    v [K, D]; m_i, l_i [M] and acc [M, D] float32. A row that has seen no key keeps m = -inf,
    l = 0, acc = 0 (m_use = 0 avoids inf - inf)."""
    m_new = tl.maximum(m_i, tl.max(x, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(x - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _store_normalised(acc, l_run, flat_row, head, ok, d, d_ok, H, out_ptr,
                      HEAD_DIM: tl.constexpr):
    """out[flat_row, head] = acc / l (l = 0, a row that saw no key: acc itself, zeros), in
    out's dtype, for the lanes ok -> l with its zeros as ones (for the lse)."""
    l_safe = tl.where(l_run > 0, l_run, 1.0)
    o_off = (flat_row.to(tl.int64) * H + head)[:, None] * HEAD_DIM + d[None, :]
    tl.store(out_ptr + o_off, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
             mask=ok[:, None] & d_ok[None, :])
    return l_safe


@triton.jit
def finish_split(m_i, l_i, acc, flat_row, head, lane_ok, d, d_ok, split, rows_total, H,
                 out_ptr, lse_ptr, acc_ptr, m_ptr, l_ptr,
                 HEAD_DIM: tl.constexpr, SINGLE: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Epilogue of a split program. flat_row = b * n + row, head, lane_ok: [M] per lane.
    SINGLE: normalise into out [B, n, H, D] (and lse [B, n, H]); else write the partials."""
    if SINGLE:
        l_safe = _store_normalised(acc, l_i, flat_row, head, lane_ok, d, d_ok, H, out_ptr,
                                   HEAD_DIM)
        if WRITE_LSE:
            tl.store(lse_ptr + flat_row * H + head, m_i + tl.log(l_safe), mask=lane_ok)
    else:
        base = (split * rows_total + flat_row).to(tl.int64) * H + head
        tl.store(m_ptr + base, m_i, mask=lane_ok)
        tl.store(l_ptr + base, l_i, mask=lane_ok)
        live = lane_ok & (l_i > 0)
        tl.store(acc_ptr + base[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=live[:, None] & d_ok[None, :])


@triton.jit
def _merge_one(m_run, l_run, acc, m_s, l_s, a_s):
    """One split's partial state (m_s, l_s [M], a_s [M, D]; l_s = 0: the split saw no key)
    folded into the running (m, l, acc) of the serial merge -> the new running state."""
    live = l_s > 0
    m_new = tl.maximum(m_run, tl.where(live, m_s, float("-inf")))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_run - m_use)
    beta = tl.where(live, tl.exp(m_s - m_use), 0.0)
    return m_new, l_run * alpha + l_s * beta, acc * alpha[:, None] + a_s * beta[:, None]


@triton.jit
def merge_when_last(counter, num_splits, flat_row, head, lane_ok, d, d_ok, rows_total, H,
                    out_ptr, acc_ptr, m_ptr, l_ptr, M: tl.constexpr, BLOCK_D: tl.constexpr,
                    HEAD_DIM: tl.constexpr):
    """After a split program's `finish_split` (partials written): the last of the split
    programs of its lanes to arrive (`counter`, one per group of such programs, counted with
    acquire-release order) merges every split's partials of those lanes into out [B, n, H, D]
    in split order, one split at a time as the serial merge does, and sets the counter back to
    zero: a launch without `merge_splits`'s."""
    tl.debug_barrier()  # every thread's partials are written before the count says so
    if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
        tl.debug_barrier()
        m_run = tl.full([M], float("-inf"), tl.float32)
        l_run = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, BLOCK_D], tl.float32)
        for split in range(0, num_splits):
            base = (split * rows_total + flat_row).to(tl.int64) * H + head
            m_s = tl.load(m_ptr + base, mask=lane_ok, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(l_ptr + base, mask=lane_ok, other=0.0, cache_modifier=".cg")
            a_s = tl.load(acc_ptr + base[:, None] * HEAD_DIM + d[None, :],
                          mask=(l_s > 0)[:, None] & d_ok[None, :], other=0.0,
                          cache_modifier=".cg")
            m_run, l_run, acc = _merge_one(m_run, l_run, acc, m_s, l_s, a_s)
        _store_normalised(acc, l_run, flat_row, head, lane_ok, d, d_ok, H, out_ptr, HEAD_DIM)
        tl.atomic_xchg(counter, 0)


@triton.jit
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, lse_ptr, num_splits, rows_total, H,
                  HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Program (row, block of BLOCK_H heads): the row's splits, BLOCK_S at a time, folded
    into a running max, sum and output (BLOCK_S = 1: one split at a time)."""
    flat_row = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok, d_ok = h < H, d < HEAD_DIM
    m_run = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        if BLOCK_S == 1:  # one split: [BLOCK_H] and [BLOCK_H, BLOCK_D] tiles, no reductions
            base = (first * rows_total + flat_row).to(tl.int64) * H + h
            m_s = tl.load(m_ptr + base, mask=h_ok, other=float("-inf"))
            l_s = tl.load(l_ptr + base, mask=h_ok, other=0.0)
            a_s = tl.load(acc_ptr + base[:, None] * HEAD_DIM + d[None, :],
                          mask=(l_s > 0)[:, None] & d_ok[None, :], other=0.0)
            m_run, l_run, acc = _merge_one(m_run, l_run, acc, m_s, l_s, a_s)
        else:  # BLOCK_S splits: [BLOCK_S, BLOCK_H(, BLOCK_D)] tiles summed over the splits
            s = first + tl.arange(0, BLOCK_S)
            base2 = (s[:, None] * rows_total + flat_row).to(tl.int64) * H + h[None, :]
            ok = (s < num_splits)[:, None] & h_ok[None, :]
            m_s2 = tl.load(m_ptr + base2, mask=ok, other=float("-inf"))
            l_s2 = tl.load(l_ptr + base2, mask=ok, other=0.0)
            live2 = l_s2 > 0
            a_s2 = tl.load(acc_ptr + base2[:, :, None] * HEAD_DIM + d[None, None, :],
                           mask=live2[:, :, None] & d_ok[None, None, :], other=0.0)
            m_new = tl.maximum(m_run, tl.max(tl.where(live2, m_s2, float("-inf")), axis=0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_run - m_use)
            beta2 = tl.where(live2, tl.exp(m_s2 - m_use[None, :]), 0.0)
            l_run = l_run * alpha + tl.sum(l_s2 * beta2, axis=0)
            acc = acc * alpha[:, None] + tl.sum(a_s2 * beta2[:, :, None], axis=0)
            m_run = m_new
    l_safe = _store_normalised(acc, l_run, flat_row, h, h_ok, d, d_ok, H, out_ptr, HEAD_DIM)
    if WRITE_LSE:
        tl.store(lse_ptr + flat_row.to(tl.int64) * H + h, m_run + tl.log(l_safe), mask=h_ok)


def merge_tiling(splits: int, heads: int, dim: int, device: torch.device,
                 exact: bool = False) -> tuple[int, int, int]:
    """(splits a step, heads a program, warps) of the merge of `splits` splits on `device`
    (`SplitTuning`). exact: one split a step, the serial merge's, whatever the splits, so that
    a row's bits do not depend on how many splits its call has (a split past the row's keys
    then adds exact zeros; a sum over several splits at once would group them by the call's
    count)."""
    tiles = tuning(device)
    heads_pad = triton.next_power_of_2(heads)
    if exact:
        return 1, min(heads_pad, tiles.merge_heads), tiles.merge_serial_warps
    per_step = 1 if splits <= tiles.merge_serial_max_splits else tiles.merge_max_step
    block_s = min(per_step, triton.next_power_of_2(splits))
    tile = block_s * triton.next_power_of_2(dim)
    block_h = max(min(heads_pad, tiles.merge_heads, tiles.merge_tile // tile), 1)
    warps = tiles.merge_serial_warps if block_s == 1 else tiles.merge_step_warps
    return block_s, block_h, warps


def merge_splits(parts: Partials, out: torch.Tensor, lse: torch.Tensor | None,
                 exact: bool = False) -> None:
    """parts (S splits) -> out [B, n, H, D] (contiguous) and, if given, lse [B, n, H] float32.
    exact: exact mode's tiling (`merge_tiling`)."""
    splits, rows, heads, dim = parts.acc.shape
    assert out.is_contiguous() and out.shape[0] * out.shape[1] == rows
    assert out.shape[2:] == (heads, dim)
    if lse is not None:
        assert lse.is_contiguous() and lse.dtype == torch.float32 and lse.numel() == rows * heads
    merge_tiled(parts, out, lse, merge_tiling(splits, heads, dim, out.device, exact))


def merge_tiled(parts: Partials, out: torch.Tensor, lse: torch.Tensor | None,
                tiling: tuple[int, int, int]) -> None:
    """`merge_splits` with a given (splits a step, a power of two; heads a program; warps)."""
    splits, rows, heads, dim = parts.acc.shape
    block_s, block_h, warps = tiling
    assert block_s >= 1 and block_s & (block_s - 1) == 0, "splits a step: a power of 2"
    grid = (rows, triton.cdiv(heads, block_h))
    _merge_kernel[grid](parts.acc, parts.m, parts.l, out, out if lse is None else lse,
                        splits, rows, heads, HEAD_DIM=dim, BLOCK_H=block_h,
                        BLOCK_D=triton.next_power_of_2(dim),
                        BLOCK_S=block_s, WRITE_LSE=lse is not None, num_warps=warps)
