"""Sparse draft attention: each (sequence, kv head) reads only a list of positions plus the
recent range.

Oracle: `vegas_spec.attention.torch_backend.sparse_attention_ref`.

The keys of sequence b and kv head h form one virtual list: indices[b, g] (g = 0 when the
list is shared by all kv heads, g = h otherwise; -1 = unused) followed by recent_start[b] + j
for j < recent_max. Query i sees a listed or recent position p if 0 <= p <= positions[b, i].
Like the reference, a position listed twice (or listed and recent) counts twice. The list is
walked in blocks of keys gathered through the page table and cut into splits for large
budgets, merged in the same launch by the last split program of each (sequence, kv head, row
block) to finish (`split_merge.merge_when_last`, in split order); the query tile packs all
query heads of the kv head, so each selected K/V row is read once per kv head. Recent
positions past the last query's position are never visited. Attention sinks (gpt-oss's, a
logit per query head in the softmax denominator) are split 0's initial state, counted once
by the merge. A sliding-window layer's draft steps attend to its window through the paged
kernel (the window is the draft's), so this kernel takes no window.

With `new` (a one-row draft step), the kernel also does `rope_store`'s work, so the step
launches one kernel fewer per layer: q arrives before RoPE and is rotated as it is loaded
(`rope_store.rotate_tile`'s bits, through `tile_operands` and `rotate_loaded`), and the
program whose split holds the step's own position, the only one that reads it, first
writes that token's rotated k and its v into their cache slot, then waits for its threads
(a CTA barrier) before walking its keys. Oracle: `ops.apply_rope` and `store_kv_ref`, then
the plain path.

A program is a chain of dependent loads (positions; list entries; pages; K/V rows), each a
trip to memory, and a one-row step's programs are few, so the chain is what it costs: the
first block's list entries and pages are loaded before the step's own k and v are stored
(they never hold that position's row), every split loads those (the owner alone stores
them, with no branch between the loads), V's rows load beside K's in 16-bit dtypes (in
float32 the two tiles of a 512-key block overflow shared memory), and each loop step
loads the next block's list entries while its rows arrive."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vegas_spec.kernels import device_sms, for_device, interpreting, split_counters
from vegas_spec.kernels.rope_store import rotate_loaded, tile_operands
from vegas_spec.kernels.split_merge import (
    Partials,
    TileConfig,
    finish_split,
    initial_state,
    merge_when_last,
    output_buffer,
    softmax_block,
    split_size_for,
    tile_config,
)


@dataclass(frozen=True)
class KeyTiles:
    """Keys per loop step, pipeline stages and warps (None: `split_merge.SplitTuning`'s) of
    the sparse kernel at one head dim."""

    block_k: int
    stages: int
    warps: int | None = None


@dataclass(frozen=True)
class SparseTuning:
    """The sparse kernel's tiles and split on one device class (its warps, and its stages at
    head dims not in by_head_dim, are `split_merge.SplitTuning`'s).

    block_k: keys per loop step at head dims not in by_head_dim. Gathered rows arrive from
    scattered pages, so more keys in flight per program hide more latency.

    by_head_dim: keys per loop step, stages and warps at the listed head dims (`KeyTiles`). A small
    head dim takes wider blocks: each block is a chain of dependent loads (list entry, page,
    K/V rows), so fewer, wider blocks wait on fewer chains.

    programs_per_sm: programs of 4 warps one SM holds, by head dim (None: none listed). A
    small budget is bound by latency unless the SMs hold many programs: the list is cut into
    as many splits as fill those slots in one wave, at least min_split_blocks key blocks
    each, or one block each where those programs fit on the SMs one apiece (few sequences:
    the chains then run side by side and the merge is cheap) (`sparse_split_size`). Head
    dims not listed keep the paged kernel's split (`split_size_for`).

    one_wave: the tiles at the listed head dims of a launch whose programs fit on the SMs
    one apiece (a draft step of few sequences, `_tiles`): each SM then runs one program and
    its memory pipes idle between that program's dependent loads, so a wider block walked
    by more warps keeps more gathered rows in flight per SM. Where the programs outnumber
    the SMs, several share an SM and hide each other's latency: by_head_dim's tiles."""

    block_k: int
    programs_per_sm: Mapping[int, int] | None
    min_split_blocks: int
    by_head_dim: Mapping[int, KeyTiles]
    one_wave: Mapping[int, KeyTiles] = dataclasses.field(default_factory=dict)


_SM90 = SparseTuning(block_k=128, programs_per_sm={64: 3}, min_split_blocks=2,
                     by_head_dim={64: KeyTiles(block_k=256, stages=1)},
                     one_wave={64: KeyTiles(block_k=512, stages=1, warps=8)})
# By device class (`kernels.device_class`). The interpreter: the decode tiles' small key
# blocks and their split (`split_merge.TUNING`).
TUNING: dict[str, SparseTuning] = {
    "sm90": _SM90,
    "default": _SM90,
    "interpreter": SparseTuning(block_k=32, programs_per_sm=None, min_split_blocks=2,
                                by_head_dim={}),
}


def tuning(device: torch.device) -> SparseTuning:
    """The entry of `TUNING` that launches on `device` read."""
    return for_device(TUNING, device)


@triton.jit
def _list_entries(idx_row, j, hi, num_listed, recent0, max_pos):
    """Positions and validity of keys j of a row's virtual list (its listed indices, then
    the recent range from recent0), visible up to max_pos and before hi; one load."""
    listed = j < num_listed
    chosen = tl.load(idx_row + j, mask=listed & (j < hi), other=-1).to(tl.int32)
    kpos = tl.where(listed, chosen, recent0 + j - num_listed)
    k_ok = (j < hi) & (kpos >= 0) & (kpos <= max_pos)
    return tl.where(k_ok, kpos, 0), k_ok


@triton.jit
def _cache_slots(table_row, kpos, k_ok, page_size):
    """Cache slots of positions kpos through the row's page table (0 where not k_ok)."""
    page = tl.load(table_row + kpos // page_size, mask=k_ok, other=0)
    return page.to(tl.int64) * page_size + kpos % page_size


@triton.jit
def _sparse_split_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, idx_ptr, start_ptr, listed_ptr,
        out_ptr, lse_ptr, acc_ptr, m_ptr, l_ptr, kn_ptr, vn_ptr, rope_ptr, slot_ptr, sinks_ptr,
        cnt_ptr, n, H, Hkv, page_size, split_size, num_splits, scale, rows_total, width,
        recent_max,
        stride_qb, stride_qn, stride_qh, stride_cs, stride_ch, stride_tb, stride_pb, stride_pn,
        stride_ib, stride_ig, stride_kb, stride_kh, stride_vb, stride_vh, stride_rope,
        stride_sb,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
        SINGLE: tl.constexpr, DOT_PRECISION: tl.constexpr, ROPE: tl.constexpr,
        MUL_RN: tl.constexpr, SINKS: tl.constexpr, LISTED: tl.constexpr,
        V_WITH_K: tl.constexpr):
    b = tl.program_id(0) // Hkv
    kvh = tl.program_id(0) % Hkv
    rb = tl.program_id(1)
    split = tl.program_id(2)
    lane = tl.arange(0, BLOCK_N * GROUP_PAD)  # lane = row_in_block * GROUP_PAD + head_in_group
    row = rb * BLOCK_N + lane // GROUP_PAD
    head = kvh * GROUP + lane % GROUP_PAD
    lane_ok = (row < n) & (lane % GROUP_PAD < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pos = tl.load(pos_ptr + b * stride_pb + row * stride_pn, mask=row < n, other=-1)
    pos = pos.to(tl.int32)
    q_rows = q_ptr + b * stride_qb + row[:, None] * stride_qn + head[:, None] * stride_qh
    q_mask = lane_ok[:, None] & d_ok[None, :]
    max_pos = tl.max(pos, axis=0)
    recent0 = tl.load(start_ptr + b).to(tl.int32)
    num_listed = width  # the row's list: its first listed[b] indices, or the whole width
    if LISTED:
        num_listed = tl.minimum(tl.load(listed_ptr + b).to(tl.int32), width)
    recent = tl.minimum(recent_max, tl.maximum(max_pos - recent0 + 1, 0))  # visible ones only
    lo = split * split_size
    hi = tl.minimum(lo + split_size, num_listed + recent)
    idx_row = idx_ptr + b * stride_ib + kvh * stride_ig  # stride_ig = 0: shared list
    table_row = table_ptr + b * stride_tb
    # The first block's list entries: their loads do not wait for the step's own k and v.
    kpos, k_ok = _list_entries(idx_row, lo + tl.arange(0, BLOCK_K), hi, num_listed, recent0,
                               max_pos)
    if ROPE:  # n = 1: q rotated as it is loaded; the step's own k and v stored first
        half = HEAD_DIM // 2
        first = d < half
        partner = tl.where(first, d + half, d - half)
        own = num_listed + max_pos - recent0  # the step's position in the virtual list
        owner = tl.where((own >= 0) & (own < num_listed + recent_max), own // split_size, 0)
        # Every split loads the step's own k and v, the owner's stores them: no branch, so
        # these loads, q's and the first block's pages are in flight together.
        slot = tl.load(slot_ptr + b * stride_sb).to(tl.int64)
        k_row = kn_ptr + b * stride_kb + kvh * stride_kh
        new_ok = d_ok & (max_pos >= 0)
        k_ops = tile_operands(k_row + d, k_row + partner,
                              rope_ptr + max_pos.to(tl.int64) * stride_rope + d % half,
                              new_ok, half)
        v_new = tl.load(vn_ptr + b * stride_vb + kvh * stride_vh + d, mask=new_ok)
        q_ops = tile_operands(q_rows + d[None, :], q_rows + partner[None, :],
                              rope_ptr + pos.to(tl.int64)[:, None] * stride_rope
                              + (d % half)[None, :], q_mask, half)
        cache_slots = _cache_slots(table_row, kpos, k_ok, page_size)
        k_new = rotate_loaded(k_ops[0], k_ops[1], k_ops[2], k_ops[3], first, MUL_RN)
        q = rotate_loaded(q_ops[0], q_ops[1], q_ops[2], q_ops[3], first[None, :], MUL_RN)
        kv_ok = new_ok & (slot >= 0) & (split == owner)
        cache_row = slot * stride_cs + kvh * stride_ch + d
        tl.store(k_ptr + cache_row, k_new.to(k_ptr.dtype.element_ty), mask=kv_ok)
        tl.store(v_ptr + cache_row, v_new.to(v_ptr.dtype.element_ty), mask=kv_ok)
        tl.debug_barrier()  # the stores above are seen by every thread's loads below
    else:
        q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0)
        cache_slots = _cache_slots(table_row, kpos, k_ok, page_size)
    m_i, l_i, acc = initial_state(sinks_ptr, head, lane_ok, split, BLOCK_N * GROUP_PAD,
                                  BLOCK_D, SINKS)
    for start in range(lo, hi, BLOCK_K):
        kv_off = cache_slots[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if V_WITH_K:  # V's rows in flight beside K's (both tiles then live at the dot)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        # The next block's list entries while this one's rows arrive (masked past hi).
        kpos_next, k_ok_next = _list_entries(idx_row, start + BLOCK_K + tl.arange(0, BLOCK_K),
                                             hi, num_listed, recent0, max_pos)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, K] float32
        if not V_WITH_K:
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        visible = k_ok[None, :] & (kpos[None, :] <= pos[:, None])
        x = tl.where(visible, s * scale, float("-inf"))
        m_i, l_i, acc = softmax_block(x, v, m_i, l_i, acc, DOT_PRECISION)
        kpos, k_ok = kpos_next, k_ok_next
        cache_slots = _cache_slots(table_row, kpos, k_ok, page_size)
    finish_split(m_i, l_i, acc, b * n + row, head, lane_ok, d, d_ok, split, rows_total, H,
                 out_ptr, lse_ptr, acc_ptr, m_ptr, l_ptr, HEAD_DIM, SINGLE, False)
    if not SINGLE:  # the group's last split program merges: no second launch
        counter = cnt_ptr + tl.program_id(0) * tl.num_programs(1) + rb
        merge_when_last(counter, num_splits, b * n + row, head, lane_ok, d, d_ok, rows_total,
                        H, out_ptr, acc_ptr, m_ptr, l_ptr, BLOCK_N * GROUP_PAD, BLOCK_D,
                        HEAD_DIM)


def key_tiles(device: torch.device, dim: int, n: int, programs: int) -> KeyTiles | None:
    """The device's keys per loop step, stages and warps (`SparseTuning`) for a launch of
    `programs` (sequence, kv head) programs of n query rows at head dim `dim`: the one-wave
    tiles where a one-row step's programs fit on the SMs one apiece, else by_head_dim's
    (None: neither lists `dim`)."""
    tiles = tuning(device)
    if (dim in tiles.one_wave and n == 1 and device.type == "cuda"
            and programs <= device_sms(device)):
        return tiles.one_wave[dim]
    return tiles.by_head_dim.get(dim)


def _tiles(q: torch.Tensor, hkv: int, block_k: int | None) -> TileConfig:
    """The launch's tiles: `block_k` keys a loop step where given (stages then
    `split_merge`'s), else the device's (`key_tiles`) for q's head dim, else its block_k."""
    bsz, n, _, dim = q.shape
    keys = None if block_k is not None else key_tiles(q.device, dim, n, bsz * hkv)
    if keys is None:
        return tile_config(q, hkv, block_k or tuning(q.device).block_k)
    cfg = tile_config(q, hkv, keys.block_k)
    return dataclasses.replace(cfg, num_stages=keys.stages, num_warps=keys.warps or cfg.num_warps)


def sparse_split_size(length: int, programs: int, block_k: int, device: torch.device,
                      head_dim: int) -> int:
    """Keys per split (a multiple of block_k) of a list of `length` keys walked by `programs`
    programs per split: at a head dim with programs per SM listed (`SparseTuning`), one
    block a split where that many programs fit on the SMs one each, else as many splits as
    fill the SMs' program slots in one wave, each at least min_split_blocks blocks long;
    elsewhere `split_size_for`'s."""
    tiles = tuning(device)
    per_sm = (tiles.programs_per_sm or {}).get(head_dim)
    if per_sm is None:
        return split_size_for(length, programs, block_k, device)
    blocks, sms, programs = max(triton.cdiv(length, block_k), 1), device_sms(device), \
        max(programs, 1)
    if programs * blocks <= sms:
        return block_k
    splits = max(1, min(per_sm * sms // programs, blocks // tiles.min_split_blocks))
    return triton.cdiv(blocks, splits) * block_k


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           page_table: torch.Tensor, positions: torch.Tensor, indices: torch.Tensor,
           recent_start: torch.Tensor, recent_max: int) -> None:
    assert q.dim() == 4 and k_cache.dim() == 3 and k_cache.shape == v_cache.shape
    bsz, n, heads, dim = q.shape
    hkv = k_cache.shape[1]
    assert dim == k_cache.shape[2] and heads % hkv == 0
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype
    assert page_table.dim() == 2 and page_table.shape[0] == bsz and page_table.stride(-1) == 1
    assert positions.shape == (bsz, n) and not positions.is_floating_point()
    assert indices.dim() == 3 and indices.shape[:2] in ((bsz, 1), (bsz, hkv))
    assert indices.stride(-1) == 1 or indices.shape[2] <= 1
    assert not indices.is_floating_point() and not page_table.is_floating_point()
    assert recent_start.shape == (bsz,) and recent_start.is_contiguous() and recent_max >= 0
    assert q.device == k_cache.device == indices.device == recent_start.device


@dataclass
class NewKV:
    """A one-row step's own k and v before RoPE ([B, 1, Hkv, D], any strides with the last
    contiguous), the RoPE table [max_pos, D] float32 (cos | sin) and their slots [B, 1]
    (negative: not stored): `sparse_attention` then does `rope_store`'s work itself."""

    k: torch.Tensor
    v: torch.Tensor
    rope: torch.Tensor
    slots: torch.Tensor


def _check_new(new: NewKV, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    bsz, n, _, dim = q.shape
    assert n == 1, "the step's own k and v are stored by one-row steps only"
    assert new.k.shape == new.v.shape == (bsz, 1, k_cache.shape[1], dim) and dim % 2 == 0
    assert new.k.stride(-1) == 1 and new.v.stride(-1) == 1 and new.k.dtype == q.dtype
    assert new.rope.dtype == torch.float32 and new.rope.shape[1] == dim
    assert new.rope.stride(-1) == 1 and new.slots.shape == (bsz, 1)
    assert not new.slots.is_floating_point() and new.slots.device == q.device


def sparse_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                     indices: torch.Tensor, recent_start: torch.Tensor, recent_max: int,
                     scale: float, *, block_k: int | None = None,
                     split_size: int | None = None,
                     out: torch.Tensor | None = None, new: NewKV | None = None,
                     sinks: torch.Tensor | None = None,
                     listed: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over listed positions plus a contiguous recent range.

    q [B, n, H, D]; k_cache, v_cache [num_slots, Hkv, D]; page_table [B, P];
    positions [B, n]; indices [B, G, K] positions (-1 = unused; G = 1 shared by every kv
    head, or G = Hkv); recent_start [B]; recent_max: host bound on the recent range length.
    Query i sees every listed p with 0 <= p <= positions[b, i] and recent_start[b] + j for
    j < recent_max up to positions[b, i]. Returns [B, n, H, D] in q's dtype.
    new: q is before RoPE, and the step's own k and v go to their slots first (`NewKV`).
    sinks [H] (None: none): a logit per query head in each row's softmax denominator, split
    0's initial state (`split_merge.initial_state`).
    listed [B] (None: K): a row's list is its first listed[b] indices: the kernel walks
    those and the recent range, not the static width (a plan's budget at a short context
    lists far fewer than the width its graph was captured for)."""
    _check(q, k_cache, v_cache, page_table, positions, indices, recent_start, recent_max)
    assert sinks is None or (sinks.shape == (q.shape[2],) and sinks.is_contiguous()
                             and sinks.device == q.device)
    assert listed is None or (listed.shape == (q.shape[0],) and listed.is_contiguous()
                              and not listed.is_floating_point() and listed.device == q.device)
    if new is not None:
        _check_new(new, q, k_cache)
    bsz, n, heads, dim = q.shape
    hkv = k_cache.shape[1]
    if indices.shape[2] == 0:  # nothing listed: keep a valid pointer
        indices = torch.full((bsz, 1, 1), -1, dtype=torch.int64, device=q.device)
    cfg = _tiles(q, hkv, block_k)
    row_blocks = triton.cdiv(n, cfg.block_n)
    length = indices.shape[2] + recent_max
    programs = bsz * hkv * row_blocks
    size = (split_size_for(length, programs, cfg.block_k, q.device, split_size) if split_size
            else sparse_split_size(length, programs, cfg.block_k, q.device, dim))
    splits = triton.cdiv(length, size)
    out = output_buffer(q, out)
    parts = Partials.empty(splits, bsz * n, heads, dim, q.device) if splits > 1 else None
    counters = split_counters(bsz * hkv * row_blocks, q.device) if parts is not None else out
    stride_ig = indices.stride(1) if indices.shape[1] > 1 else 0
    kn, vn, rope, slots = (q, q, q, positions) if new is None else \
        (new.k, new.v, new.rope, new.slots)
    _sparse_split_kernel[(bsz * hkv, row_blocks, splits)](
        q, k_cache, v_cache, page_table, positions, indices, recent_start,
        recent_start if listed is None else listed, out, out,
        *((out, out, out) if parts is None else (parts.acc, parts.m, parts.l)),
        kn, vn, rope, slots, q if sinks is None else sinks, counters,
        n, heads, hkv, page_size, size, splits, scale, bsz * n, indices.shape[2], recent_max,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
        page_table.stride(0), positions.stride(0), positions.stride(1),
        indices.stride(0), stride_ig, kn.stride(0), kn.stride(2), vn.stride(0), vn.stride(2),
        rope.stride(0), slots.stride(0),
        GROUP=cfg.group, GROUP_PAD=cfg.group_pad, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_D=cfg.block_d, HEAD_DIM=dim, SINGLE=parts is None,
        DOT_PRECISION=cfg.dot_precision, ROPE=new is not None, MUL_RN=not interpreting(),
        SINKS=sinks is not None, LISTED=listed is not None, V_WITH_K=q.element_size() <= 2,
        **cfg.launch_options())
    return out
