"""Paged causal attention for 1..n query rows per sequence, with fused selection scores.

Oracle: `vegas_spec.attention.torch_backend.paged_attention_ref`.

Layout of the work: one program per (sequence, kv head, block of query rows, key split). Its
query tile packs block_n rows x all query heads of that kv head, so each K/V row of the cache
is read once per kv head however many query heads share it (GQA) and however many rows the
step has up to block_n (n = 1 decode, γ+1 verify; a prefill chunk of a few hundred rows has
several row blocks, launched side by side so that they walk the same keys together). Query i of
sequence b sees keys 0..positions[b, i]; a program stops at the largest position of its rows,
so short sequences in a batch sized for the longest cost nothing past their end. Long
contexts are cut into key splits merged by `split_merge.merge_splits` (flash-decoding).

Selection scores (ScoreRequest) ride on the same pass, so K is read once:
  * The split kernel also loads the queries of the requested rows as a small tile of their
    own (R rows x the kv head's query heads, padded to 16 lanes on a GPU) and, for every key
    block it has loaded anyway, stores their raw logits q.k into a float32 scratch: in
    "weight" mode one plane per lane of that tile, [B, Hkv, lanes, L'] (lane = r * group_pad
    + head in group; padding lanes are never read), in "logit" mode already summed over the
    query heads of the kv head, [B, R, Hkv, L]. A row is emitted by the program of its row
    block.
  * Weights need each head's final log-sum-exp, known only after the merge. A finalise kernel
    then reads the scratch, forms exp(scale * s - lse_h) per head ("weight") or takes the sums
    ("logit"), sums over the heads of each kv head (G = Hkv) or over all heads (G = 1) and
    writes out [B, R, G, W], 0 wherever the row cannot see the key (and for the padding width).

Extra bytes of score emission, per layer and sequence with R score rows and L keys:
  weight: 4·H·R·L written + 4·H·R·L read + 4·G·R·W written;
  logit:  4·Hkv·R·L written + 4·Hkv·R·L read + 4·G·R·W written;
against 2·Hkv·D·L·itemsize bytes of K and V the attention reads anyway. For Qwen3-8B
(H 32, Hkv 8, D 128, bf16) and Collect-2 (R = 2): weight 520 B per key vs 4096 B of K/V
(+12.7 %), logit 136 B (+3.3 %); for R = γ+1 = 7 rows (collect all) weight is +44 %.
The logits stay float32, which keeps this kernel exact against the reference.

gpt-oss's layers: attention sinks (`sinks`, a logit per query head that joins the softmax
denominator and has no value) are split 0's initial state (`split_merge.initial_state`), so
each row's denominator, and the lse that its weight scores divide by, counts them once. A
sliding window (`window` > 0, WINDOW a constexpr: 0 compiles the kernel without it) masks the
keys before each row's window, and a program starts at the key block of its rows' first
window key, reading no block before it; in the default mode such a call is one split (a row
block reads at most window + n - 1 keys), in exact mode the splits stay exact mode's."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vegas_spec.kernels import for_device, split_merge
from vegas_spec.kernels.split_merge import (
    MIN_DOT,
    Partials,
    TileConfig,
    finish_split,
    initial_state,
    merge_splits,
    output_buffer,
    resident_programs,
    softmax_block,
    split_size_for,
    tile_config,
)

MODES = {"weight": 1, "logit": 2}


# How the weight-mode logits are stored (a score pass's `ScoreTiles.store`): through a
# tensor descriptor (one bulk copy of the [lanes, block_k] tile per key block; steps with
# one row block, pointers otherwise), or through pointers into a scratch sized to whole key
# blocks and masked by lane only, so that a thread's run of consecutive keys becomes one
# vector store; keys past a split's end then receive logits that the finalise kernel never
# reads (it reads keys a row sees). Which store a pass uses: its `ScoreTiles`.


@dataclass(frozen=True)
class ScoreStore:
    """descriptor: a tensor-descriptor store (calls of one row block; pointers otherwise);
    whole_blocks: pointer stores masked by lane only, into a scratch of whole key blocks."""

    descriptor: bool
    whole_blocks: bool


SCORE_STORES = {"f32-descriptor": ScoreStore(descriptor=True, whole_blocks=False),
                "f32-blocks": ScoreStore(descriptor=False, whole_blocks=True)}


@dataclass(frozen=True)
class ScoreTiles:
    """How a score-emitting pass runs: keys per block, pipeline stages, the largest
    split of an occupancy split in keys (None: the occupancy split alone), the registers
    per thread ptxas may use (None: its own choice) and how its weight-mode logits are
    stored (a name of `SCORE_STORES`)."""

    block_k: int
    stages: int
    split_max: int | None
    maxnreg: int | None
    store: str

    def __post_init__(self) -> None:
        if self.store not in SCORE_STORES:
            raise ValueError(f"unknown score store {self.store!r}; one of "
                             f"{', '.join(SCORE_STORES)}")


@dataclass(frozen=True)
class VerifyTiles:
    """How an unscored decode call of several rows (a verify step without selection scores,
    as stream's) runs: keys per block, pipeline stages and the registers per thread ptxas may
    use (None: its own choice)."""

    block_k: int
    stages: int
    maxnreg: int | None = None


@dataclass(frozen=True)
class PagedTuning:
    """The paged kernel's tiles on one device class (beside `split_merge.SplitTuning`, whose
    tiles a call runs where none of these apply).

    score_tiles: a score-emitting pass's tiles by head dim (`score_tiles_other` at a head dim
    not listed). verify_tiles: an unscored call of 2..decode_rows rows a sequence by head dim
    (one not listed runs `tile_config`'s, those of a plain step). Calls of at most
    decode_rows rows are decode steps (a plain step, a verify of γ + 1 rows), split by whole
    waves of their kernel's resident programs; more rows are a prompt's, which keep the
    occupancy split.

    Exact mode: one tiling for every full-attention step, plain or verify, scored or not, at
    any batch size and context: exact_tiles (its block_k, stages, maxnreg and store) and
    splits of exactly exact_split keys, with `SplitTuning.exact_rows` query rows per tile. A
    row's keys are then walked in the same blocks, cut into the same splits and merged in
    split order whatever else the step holds; blocks and splits past the row's last visible
    key add exact zeros (p = 0, alpha = 1), so neither n nor kv_len matters.

    The finalise kernel of the scores: finalise_keys keys and finalise_warps warps a
    program."""

    score_tiles: Mapping[int, ScoreTiles]
    score_tiles_other: ScoreTiles
    verify_tiles: Mapping[int, VerifyTiles]
    decode_rows: int
    exact_tiles: ScoreTiles
    exact_split: int
    finalise_keys: int
    finalise_warps: int

    def __post_init__(self) -> None:
        assert self.exact_split % self.exact_tiles.block_k == 0, "exact_split: whole blocks"

    def score_tiles_at(self, head_dim: int) -> ScoreTiles:
        """The tiles of a score-emitting pass at this head dim."""
        return self.score_tiles.get(head_dim, self.score_tiles_other)


# sm_90: score passes at head dim 64 in 128-key blocks, 3 stages, capped at 168 registers so
# that more programs share an SM; at 128 in 64-key blocks, 2 stages, capped at 128 registers
# (four programs per SM, none spilled); both split by whole waves, their logits stored as
# whole key blocks. Other head dims: 128-key blocks, 3 stages, ptxas's registers, splits of
# at most 2048 keys, the float32 descriptor. Unscored calls of several rows at head dim 64:
# 3 stages, which compile to fewer registers than 2 at seven rows (three programs per SM
# instead of two), so the wave rule needs fewer splits. Measured: docs/kernel-notes.md. The
# keys are read in the same order whichever tiles run, so results change only by the float
# summation order of the online softmax.
_SM90 = PagedTuning(
    score_tiles={64: ScoreTiles(128, 3, None, 168, "f32-blocks"),
                 128: ScoreTiles(64, 2, None, 128, "f32-blocks")},
    score_tiles_other=ScoreTiles(128, 3, 2048, None, "f32-descriptor"),
    verify_tiles={64: VerifyTiles(128, 3)}, decode_rows=16,
    exact_tiles=ScoreTiles(128, 3, None, None, "f32-descriptor"), exact_split=2048,
    finalise_keys=512, finalise_warps=4)
# The interpreter: the decode tiles' small key blocks in one stage for every pass (its cost
# is per program and loop step), the float32 descriptor's store, exact splits of 4 blocks.
_INTERPRETER_TILES = ScoreTiles(32, 1, None, None, "f32-descriptor")
# By device class (`kernels.device_class`).
TUNING: dict[str, PagedTuning] = {
    "sm90": _SM90,
    "default": _SM90,
    "interpreter": PagedTuning(
        score_tiles={}, score_tiles_other=_INTERPRETER_TILES, verify_tiles={}, decode_rows=16,
        exact_tiles=_INTERPRETER_TILES, exact_split=4 * _INTERPRETER_TILES.block_k,
        finalise_keys=64, finalise_warps=4),
}


def tuning(device: torch.device) -> PagedTuning:
    """The entry of `TUNING` that launches on `device` read."""
    return for_device(TUNING, device)


def verify_tiles(q: torch.Tensor, scored: bool) -> VerifyTiles | None:
    """The verify tiles of an unscored call of 2..decode_rows rows, if its head dim is
    listed (`PagedTuning`)."""
    n, dim = q.shape[1], q.shape[3]
    tiles = tuning(q.device)
    return tiles.verify_tiles.get(dim) if not scored and 1 < n <= tiles.decode_rows else None


# The logits are computed in the attention loop, on the key block it has just loaded, so K is
# read once; the finalise kernel runs in line.


@triton.jit
def _emit_scores(q_sc, k, start, kpos, k_ok, sc_base, sc_ok, r_base, r_ok, sc_ptr, sc_desc,
                 desc_row, R_PAD: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                 MODE: tl.constexpr, USE_DESC: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Raw q.k of the score rows only (q_sc [R_PAD * GROUP_PAD, D]) for one key block -> the
    scratch. Weight mode: lane l of the tile goes to scratch row desc_row + l (a whole
    [lanes, BLOCK_K] block through sc_desc when USE_DESC, else the real lanes through
    sc_base [lanes] = row starts). Logit mode: summed over the group, r_base [R_PAD] = row
    starts; sc_ok / r_ok: real lanes / rows."""
    s = tl.dot(q_sc, tl.trans(k), input_precision=DOT_PRECISION)  # [R_PAD * GROUP_PAD, K]
    if MODE == 1:
        if USE_DESC:
            sc_desc.store([desc_row, start], s.to(sc_desc.dtype))
        elif WHOLE_BLOCKS:
            # the scratch is as wide as the key blocks: the lane mask alone, vector stores
            tl.store(sc_ptr + sc_base[:, None] + kpos[None, :], s.to(sc_ptr.dtype.element_ty),
                     mask=sc_ok[:, None])
        else:
            tl.store(sc_ptr + sc_base[:, None] + kpos[None, :], s.to(sc_ptr.dtype.element_ty),
                     mask=sc_ok[:, None] & k_ok[None, :])
    else:
        # Padded head lanes hold q = 0, so they add nothing to the sum over the group.
        summed = tl.sum(tl.reshape(s, [R_PAD, GROUP_PAD, BLOCK_K]), axis=1)  # [R_PAD, K]
        tl.store(sc_ptr + r_base[:, None] + kpos[None, :], summed,
                 mask=r_ok[:, None] & k_ok[None, :])


@triton.jit
def _score_tile(q_ptr, rows_ptr, b, kvh, rb, d, d_ok, num_rows, Hkv, sc_width, stride_qb,
                stride_qn, stride_qh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                BLOCK_N: tl.constexpr, R_PAD: tl.constexpr):
    """The score rows' queries as a tile of their own (rows_ptr [num_rows]) and where their
    logits go: (q_sc, sc_ok, sc_base, r_base, r_ok, desc_row) as `_emit_scores` takes them."""
    sc_lane = tl.arange(0, R_PAD * GROUP_PAD)
    sc_r = sc_lane // GROUP_PAD
    sc_head = kvh * GROUP + sc_lane % GROUP_PAD
    sc_row = tl.load(rows_ptr + sc_r, mask=sc_r < num_rows, other=0)
    # each score row is emitted by the program of its row block, which visits its keys
    sc_ok = (sc_r < num_rows) & (sc_lane % GROUP_PAD < GROUP) & (sc_row // BLOCK_N == rb)
    q_sc = tl.load(q_ptr + b * stride_qb + sc_row[:, None] * stride_qn
                   + sc_head[:, None] * stride_qh + d[None, :],
                   mask=sc_ok[:, None] & d_ok[None, :], other=0.0)
    desc_row = (b * Hkv + kvh) * (R_PAD * GROUP_PAD)  # weight mode: lane-major planes
    sc_base = (desc_row + sc_lane).to(tl.int64) * sc_width
    r = tl.arange(0, R_PAD)
    r_row = tl.load(rows_ptr + r, mask=r < num_rows, other=0)
    r_ok = (r < num_rows) & (r_row // BLOCK_N == rb)
    r_base = ((b * num_rows + r).to(tl.int64) * Hkv + kvh) * sc_width
    return q_sc, sc_ok, sc_base, r_base, r_ok, desc_row


@triton.jit
def _window_start(pos, row_ok, WINDOW: tl.constexpr, BLOCK_K: tl.constexpr):
    """The first key of a sliding window that any real row (row_ok) of the tile sees, rounded
    down to a key block: the blocks before it hold no key a row sees. Blocks stay at fixed
    offsets from key 0 (a split starts on a block), so a row walks the same blocks in any
    call, and a skipped block would have left the row's state as it was (p = 0)."""
    first = tl.min(tl.where(row_ok, pos, 2147483647), axis=0) - WINDOW + 1
    return tl.maximum(first, 0) // BLOCK_K * BLOCK_K


@triton.jit
def _paged_split_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr,
        out_ptr, lse_ptr, acc_ptr, m_ptr, l_ptr, rows_ptr, sc_ptr, sc_desc, sinks_ptr,
        n, H, Hkv, page_size, split_size, scale, rows_total, num_rows, width, sc_width,
        stride_qb, stride_qn, stride_qh, stride_cs, stride_ch, stride_tb, stride_pb, stride_pn,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
        MODE: tl.constexpr, R_PAD: tl.constexpr, USE_DESC: tl.constexpr,
        WHOLE_BLOCKS: tl.constexpr, SINGLE: tl.constexpr,
        WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, SINKS: tl.constexpr,
        WINDOW: tl.constexpr):
    # the row blocks of one (sequence, kv head) are launched side by side, so that they
    # walk the same keys at about the same time (the later ones may find them in L2)
    row_blocks = tl.cdiv(n, BLOCK_N)
    b = tl.program_id(0) // (Hkv * row_blocks)
    kvh = tl.program_id(0) // row_blocks % Hkv
    rb = tl.program_id(0) % row_blocks
    split = tl.program_id(2)
    lane = tl.arange(0, BLOCK_N * GROUP_PAD)  # lane = row_in_block * GROUP_PAD + head_in_group
    row = rb * BLOCK_N + lane // GROUP_PAD
    head = kvh * GROUP + lane % GROUP_PAD
    lane_ok = (row < n) & (lane % GROUP_PAD < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pos = tl.load(pos_ptr + b * stride_pb + row * stride_pn, mask=row < n, other=-1)
    pos = pos.to(tl.int32)
    q = tl.load(q_ptr + b * stride_qb + row[:, None] * stride_qn + head[:, None] * stride_qh
                + d[None, :], mask=lane_ok[:, None] & d_ok[None, :], other=0.0)
    if MODE != 0:
        q_sc, sc_ok, sc_base, r_base, r_ok, desc_row = _score_tile(
            q_ptr, rows_ptr, b, kvh, rb, d, d_ok, num_rows, Hkv, sc_width, stride_qb,
            stride_qn, stride_qh, GROUP, GROUP_PAD, BLOCK_N, R_PAD)
    lo = split * split_size
    # causal: nothing past the last row; nothing past kv_len (= width), as the reference
    hi = tl.minimum(tl.minimum(lo + split_size, tl.max(pos, axis=0) + 1), width)
    if WINDOW > 0:  # from the block of the rows' first key in their window: fewer blocks read
        lo = tl.maximum(lo, _window_start(pos, row < n, WINDOW, BLOCK_K))
    m_i, l_i, acc = initial_state(sinks_ptr, head, lane_ok, split, BLOCK_N * GROUP_PAD,
                                  BLOCK_D, SINKS)
    for start in range(lo, hi, BLOCK_K):
        kpos = start + tl.arange(0, BLOCK_K)
        k_ok = kpos < hi
        page = tl.load(table_ptr + b * stride_tb + kpos // page_size, mask=k_ok, other=0)
        slot = page.to(tl.int64) * page_size + kpos % page_size
        kv_off = slot[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, K] float32
        if MODE != 0:
            # the score rows' logits from the key block just loaded: K is read once
            _emit_scores(q_sc, k, start, kpos, k_ok, sc_base, sc_ok, r_base, r_ok, sc_ptr,
                         sc_desc, desc_row, R_PAD, GROUP_PAD, BLOCK_K, MODE, USE_DESC,
                         WHOLE_BLOCKS, DOT_PRECISION)
        if WINDOW > 0:
            # the last WINDOW keys up to the row's position, 0 <= pos - key < WINDOW, as one
            # unsigned compare (a key past pos wraps around): fewer registers than two
            visible = (pos[:, None] - kpos[None, :]).to(tl.uint32, bitcast=True) < WINDOW
        else:
            visible = kpos[None, :] <= pos[:, None]
        x = tl.where(visible, s * scale, float("-inf"))
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        m_i, l_i, acc = softmax_block(x, v, m_i, l_i, acc, DOT_PRECISION)
    finish_split(m_i, l_i, acc, b * n + row, head, lane_ok, d, d_ok, split, rows_total, H,
                 out_ptr, lse_ptr, acc_ptr, m_ptr, l_ptr, HEAD_DIM, SINGLE, WRITE_LSE)


@triton.jit
def _scores_kernel(sc_ptr, lse_ptr, rows_ptr, pos_ptr, out_ptr,
                   n, H, Hkv, num_rows, width, sc_width, out_width, scale,
                   stride_pb, stride_pn, stride_ob, stride_or, stride_og,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, LANES: tl.constexpr,
                   BLOCK_W: tl.constexpr, MODE: tl.constexpr, PER_KV: tl.constexpr,
                   WINDOW: tl.constexpr):
    """One (sequence, score row, key block): scratch -> out [B, R, G, W] (R = num_rows).
    Weight scratch [B, Hkv, LANES, sc_width] (lane = r * GROUP_PAD + head in group), logit
    scratch [B, R, Hkv, sc_width]. A key the row cannot see (WINDOW > 0: also one before its
    window, whose block the split kernel may have skipped) scores 0; the weights' lse
    includes the sinks."""
    b = tl.program_id(0) // num_rows
    r = tl.program_id(0) % num_rows
    row = tl.load(rows_ptr + r).to(tl.int32)
    pos = tl.load(pos_ptr + b * stride_pb + row * stride_pn).to(tl.int32)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    visible = (w <= pos) & (w < width)
    if WINDOW > 0:
        visible &= w > pos - WINDOW
    e = tl.arange(0, GROUP_PAD)
    total = tl.zeros([BLOCK_W], tl.float32)
    out_row = out_ptr + b * stride_ob + r * stride_or
    for g in range(Hkv):
        if MODE == 1:
            h_ok = e < GROUP
            plane = (b * Hkv + g).to(tl.int64) * LANES + r * GROUP_PAD + e
            # masked by the scratch's width (a multiple of 16), not per key: vector loads;
            # the keys the row cannot see hold logits of no use (or none) and are dropped after
            x = tl.load(sc_ptr + plane[:, None] * sc_width + w[None, :],
                        mask=h_ok[:, None] & (w < sc_width)[None, :], other=float("-inf"))
            x = tl.where(visible[None, :], x.to(tl.float32), float("-inf"))
            lse = tl.load(lse_ptr + (b * n + row) * H + g * GROUP + e, mask=h_ok, other=0.0)
            val = tl.sum(tl.exp(x * scale - lse[:, None]), axis=0)
        else:
            plane = (b * num_rows + r).to(tl.int64) * Hkv + g
            val = tl.load(sc_ptr + plane * sc_width + w, mask=visible, other=0.0)
        if PER_KV:
            tl.store(out_row + g * stride_og + w, val, mask=w < out_width)
        else:
            total += val
    if not PER_KV:
        tl.store(out_row + w, total, mask=w < out_width)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           page_table: torch.Tensor, positions: torch.Tensor, kv_len: int,
           sinks: torch.Tensor | None, window: int) -> None:
    assert q.dim() == 4 and k_cache.dim() == 3 and k_cache.shape == v_cache.shape
    bsz, n, heads, dim = q.shape
    assert dim == k_cache.shape[2] and heads % k_cache.shape[1] == 0
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype
    assert page_table.dim() == 2 and page_table.shape[0] == bsz and page_table.stride(-1) == 1
    assert positions.shape == (bsz, n) and not positions.is_floating_point()
    assert not page_table.is_floating_point() and kv_len >= 1
    assert q.device == k_cache.device == page_table.device == positions.device
    assert sinks is None or (sinks.shape == (heads,) and sinks.is_contiguous()
                             and sinks.device == q.device)
    assert window >= 0


def _check_scores(rows: torch.Tensor, out: torch.Tensor, mode: str, bsz: int, hkv: int,
                  kv_len: int) -> None:
    assert mode in MODES, f"score mode must be one of {sorted(MODES)}"
    assert rows.dim() == 1 and not rows.is_floating_point()
    assert out.dim() == 4 and out.shape[:2] == (bsz, rows.shape[0])
    assert out.shape[2] in (1, hkv) and out.shape[3] >= kv_len
    assert out.dtype == torch.float32 and out.stride(-1) == 1


@dataclass
class _ScoreJob:
    """mode 1 weight / 2 logit; rows [R]; out [B, R, G, W]; lse [B, n, H] float32 (weight
    mode); scratch of raw logits, float32: weight [B, Hkv, lanes, L'] (lane = r * group_pad
    + head in group, L' = L rounded up to 16 for the descriptor's row
    stride and the finalise kernel's vector loads, to whole key blocks for a 'blocks'
    store), logit [B, R, Hkv, L] float32 (plane r of row rows[r])."""

    mode: int
    rows: torch.Tensor
    out: torch.Tensor
    scratch: torch.Tensor
    lse: torch.Tensor | None
    r_pad: int

    @property
    def lanes(self) -> int:
        return self.scratch.shape[2] if self.mode == 1 else 0


def _score_job(rows: torch.Tensor | None, out: torch.Tensor | None, mode_name: str,
               q: torch.Tensor, cfg: TileConfig, hkv: int, kv_len: int,
               store: ScoreStore) -> _ScoreJob | None:
    if rows is None or rows.numel() == 0:
        return None
    assert out is not None, "score_rows needs score_out"
    bsz, n, heads, _ = q.shape
    _check_scores(rows, out, mode_name, bsz, hkv, kv_len)
    mode = MODES[mode_name]
    r_pad = _rows_pad(rows.shape[0], cfg.group_pad, q.is_cuda)
    f32 = dict(dtype=torch.float32, device=q.device)
    if mode == 1:
        align = max(cfg.block_k, 16) if store.whole_blocks else 16
        scratch = torch.empty(bsz, hkv, r_pad * cfg.group_pad, -(-kv_len // align) * align,
                              **f32)
        lse = torch.empty(bsz, n, heads, **f32)
    else:
        scratch, lse = torch.empty(bsz, rows.shape[0], hkv, kv_len, **f32), None
    return _ScoreJob(mode, rows, out, scratch, lse, r_pad)


def _descriptor(job: _ScoreJob, block_k: int) -> TensorDescriptor:
    """The weight scratch as a 2-D tensor of [lanes, block_k] blocks (rows: one per lane)."""
    flat = job.scratch.view(-1, job.scratch.shape[-1])
    return TensorDescriptor.from_tensor(flat, [job.lanes, block_k])


def _rows_pad(rows: int, group_pad: int, gpu: bool) -> int:
    """Score rows per program tile, a power of two; on a GPU the tile (rows x group_pad
    lanes) has at least the 16 lanes tl.dot needs."""
    pad = triton.next_power_of_2(rows)
    return max(pad, MIN_DOT // group_pad, 1) if gpu else pad


def _finalise_scores(job: _ScoreJob, positions: torch.Tensor, scale: float, cfg: TileConfig,
                     hkv: int, width: int, window: int) -> None:
    bsz, num_rows = job.out.shape[:2]
    out = job.out
    tiles = tuning(out.device)
    block_w = tiles.finalise_keys
    grid = (bsz * num_rows, triton.cdiv(out.shape[3], block_w))
    _scores_kernel[grid](
        job.scratch, job.scratch if job.lse is None else job.lse, job.rows,
        positions, out, positions.shape[1], hkv * cfg.group, hkv, num_rows, width,
        job.scratch.shape[-1], out.shape[3], scale,
        positions.stride(0), positions.stride(1), out.stride(0), out.stride(1), out.stride(2),
        GROUP=cfg.group, GROUP_PAD=cfg.group_pad, LANES=max(job.lanes, 1), BLOCK_W=block_w,
        MODE=job.mode, PER_KV=out.shape[2] > 1, WINDOW=window,
        num_warps=tiles.finalise_warps)


# The exact-mode copy of the split kernel: its row counts stay runtime values (Triton would
# otherwise compile n = 1 and batch 1 as constants), so that a plain step and a verify step
# run one compiled program.
_paged_split_kernel_exact = triton.jit(
    _paged_split_kernel.fn,
    do_not_specialize=["n", "rows_total", "num_rows", "width", "sc_width", "stride_qb",
                       "stride_pb"])


def _tiling(q: torch.Tensor, hkv: int, scored: bool, block_k: int | None,
            exact: bool) -> tuple[TileConfig, ScoreTiles | None]:
    """The tile configuration of one call, and the score tiles it runs (scored calls)."""
    table = tuning(q.device)
    if exact:
        exact_tiles = table.exact_tiles
        cfg = tile_config(q, hkv, exact_tiles.block_k, exact=True)
        return dataclasses.replace(cfg, num_stages=exact_tiles.stages,
                                   maxnreg=exact_tiles.maxnreg), None
    tiles = table.score_tiles_at(q.shape[3]) if scored else None
    rows = None if block_k else verify_tiles(q, scored)
    chosen = tiles or rows
    cfg = tile_config(q, hkv, block_k or (chosen.block_k if chosen else None))
    if chosen:
        cfg = dataclasses.replace(cfg, num_stages=chosen.stages, maxnreg=chosen.maxnreg)
    return cfg, tiles


def _split_size(q: torch.Tensor, hkv: int, cfg: TileConfig, tiles: ScoreTiles | None,
                split_size: int | None, kv_len: int, exact: bool,
                resident: int | None, window: int = 0) -> int:
    """Keys per split of one call: exact mode's fixed split; a sliding-window call's one
    split (a row block reads at most window + n - 1 keys, from its window's first block);
    else `split_size_for`'s for the kernel's `resident` programs per SM, within the score
    tiles' largest split."""
    if exact:
        return tuning(q.device).exact_split
    if window and split_size is None:
        return triton.cdiv(kv_len, cfg.block_k) * cfg.block_k
    bsz, n = q.shape[:2]
    row_blocks = triton.cdiv(n, cfg.block_n)
    size = split_size_for(kv_len, bsz * hkv * row_blocks, cfg.block_k, q.device, split_size,
                          resident)
    if tiles and split_size is None and tiles.split_max:
        size = min(size, max(tiles.split_max // cfg.block_k, 1) * cfg.block_k)
    return size


# Resident programs per SM of each compiled variant of the split kernel, by its launch.
_RESIDENT: dict[tuple, int] = {}


def _resident(kernel: triton.runtime.JITFunction, grid: tuple[int, int, int], args: list,
              constexprs: dict, device: torch.device) -> int | None:
    """The resident programs per SM of the variant of `kernel` that a several-split launch
    with these arguments runs (compiled, not launched, the first time), on a GPU."""
    if device.type != "cuda" or split_merge.tuning(device).split_wave_fill is None:
        return None
    # what selects the variant: the constexprs (but SINGLE, passed apart; built in one
    # order), the dtype, and how Triton specializes ints
    key = (kernel, device.index, args[0].dtype, tuple(constexprs.items()),
           tuple((a == 1, a % 16 == 0) for a in args if type(a) is int))
    if key not in _RESIDENT:
        compiled = kernel.warmup(*args, grid=grid, **{**constexprs, "SINGLE": False})
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        _RESIDENT[key] = resident_programs(compiled, device)
    return _RESIDENT[key]


def _score_store(q: torch.Tensor, exact: bool) -> str:
    """How this call stores weight-mode logits (a name of `SCORE_STORES`): the store of the
    tiles it runs, the exact tiles in exact mode, else its head dim's score tiles."""
    tiles = tuning(q.device)
    return (tiles.exact_tiles if exact else tiles.score_tiles_at(q.shape[3])).store


@dataclass
class _Plan:
    """One call's launch but for its split: the kernel, its tiles, score job and arguments
    (those before and after the partial buffers, the split size between `tail` and
    `rest`), and the keys per split."""

    kernel: triton.runtime.JITFunction
    cfg: TileConfig
    hkv: int
    row_blocks: int
    job: _ScoreJob | None
    lse: torch.Tensor | None
    head: list
    tail: list
    rest: list
    constexprs: dict
    size: int


def _plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          page_table: torch.Tensor, positions: torch.Tensor, page_size: int, kv_len: int,
          scale: float, score_rows: torch.Tensor | None, score_out: torch.Tensor | None,
          score_mode: str, block_k: int | None, split_size: int | None, out: torch.Tensor,
          exact: bool, sinks: torch.Tensor | None, window: int) -> _Plan:
    """Everything a call launches with but its partial buffers, which depend on its split
    count; `out` is the result buffer."""
    assert not exact or (block_k is None and split_size is None), "exact mode fixes the tiles"
    bsz, n, heads, dim = q.shape
    hkv = k_cache.shape[1]
    scored = score_rows is not None and score_rows.numel() > 0
    cfg, tiles = _tiling(q, hkv, scored, block_k, exact)
    row_blocks = triton.cdiv(n, cfg.block_n)
    store = SCORE_STORES[_score_store(q, exact)]
    job = _score_job(score_rows, score_out, score_mode, q, cfg, hkv, kv_len, store)
    use_desc = store.descriptor and job is not None and job.mode == 1 and row_blocks == 1
    lse = None if job is None else job.lse
    kernel = _paged_split_kernel_exact if exact else _paged_split_kernel
    head = [q, k_cache, v_cache, page_table, positions, out, out if lse is None else lse]
    tail = [positions if job is None else job.rows, out if job is None else job.scratch,
            _descriptor(job, cfg.block_k) if use_desc else None,
            q if sinks is None else sinks, n, heads, hkv, page_size]
    rest = [scale, bsz * n, 0 if job is None else len(job.rows),
            kv_len, kv_len if job is None else job.scratch.shape[-1],
            q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
            page_table.stride(0), positions.stride(0), positions.stride(1)]
    constexprs = dict(
        GROUP=cfg.group, GROUP_PAD=cfg.group_pad, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_D=cfg.block_d, HEAD_DIM=dim, MODE=0 if job is None else job.mode,
        R_PAD=1 if job is None else job.r_pad, USE_DESC=use_desc,
        WHOLE_BLOCKS=store.whole_blocks and job is not None and not use_desc,
        WRITE_LSE=lse is not None, DOT_PRECISION=cfg.dot_precision, SINKS=sinks is not None,
        WINDOW=window, **cfg.launch_options())
    # decode steps only (plain, verify): a prompt's rows keep the occupancy split, a
    # sliding-window call its one split
    waves = not (exact or split_size is not None or n > tuning(q.device).decode_rows
                 or window)
    resident = None if not waves else _resident(
        kernel, (bsz * hkv * row_blocks, 1, 2), [*head, *(torch.float32,) * 3, *tail, cfg.block_k,
                                             *rest], constexprs, q.device)
    size = _split_size(q, hkv, cfg, tiles, split_size, kv_len, exact, resident, window)
    return _Plan(kernel, cfg, hkv, row_blocks, job, lse, head, tail, rest, constexprs, size)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                    kv_len: int, scale: float, score_rows: torch.Tensor | None = None,
                    score_out: torch.Tensor | None = None, score_mode: str = "weight", *,
                    block_k: int | None = None, split_size: int | None = None,
                    out: torch.Tensor | None = None, exact: bool = False,
                    sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Causal paged attention; query i of sequence b sees keys 0..positions[b, i] (window
    > 0: only the last `window` of them, positions[b, i] - window + 1..positions[b, i]).

    q [B, n, H, D] (RoPE applied); k_cache, v_cache [num_slots, Hkv, D];
    page_table [B, P] (page_size slots per page); positions [B, n]; kv_len >= every sequence
    length (host bound of the key axis). If score_rows [R] is given, score_out [B, R, G, W]
    float32 (G = 1: summed over all query heads, G = Hkv: over each kv head's query heads;
    W >= kv_len) receives softmax weights ("weight") or raw q.k ("logit") of those rows, 0
    where the row cannot see the key. out: optional [B, n, H, D] result buffer. exact: one
    tiling whatever n, B, kv_len and the scores (block_k and split_size are then refused), so
    that each row's bits depend on its own query and keys only. sinks [H] (None: none): a
    logit per query head that joins each row's softmax denominator (the weight scores'
    too) and has no value (`split_merge.initial_state`).
    Returns [B, n, H, D] in q's dtype."""
    _check(q, k_cache, v_cache, page_table, positions, kv_len, sinks, window)
    out = output_buffer(q, out)
    plan = _plan(q, k_cache, v_cache, page_table, positions, page_size, kv_len, scale,
                 score_rows, score_out, score_mode, block_k, split_size, out, exact, sinks,
                 window)
    bsz, n, heads, dim = q.shape
    job, lse = plan.job, plan.lse
    splits = triton.cdiv(kv_len, plan.size)
    parts = Partials.empty(splits, bsz * n, heads, dim, q.device) if splits > 1 else None
    plan.kernel[(bsz * plan.hkv * plan.row_blocks, 1, splits)](
        *plan.head, *((out, out, out) if parts is None else (parts.acc, parts.m, parts.l)),
        *plan.tail, plan.size, *plan.rest, SINGLE=parts is None, **plan.constexprs)
    if parts is not None:
        merge_splits(parts, out, lse, exact)
    if job is not None:
        _finalise_scores(job, positions, scale, plan.cfg, plan.hkv, kv_len, window)
    return out
