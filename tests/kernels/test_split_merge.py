"""The merge of key splits against the log-sum-exp merge in plain PyTorch, by the library's
tiling and with the splits a step forced (`merge_tiled`), with splits in which rows saw no
key; the tiling rule itself."""

from __future__ import annotations

import pytest
import torch
import triton
from kernel_cases import DEVICE, as_sm90, generator, retune

from vegas_spec.kernels import split_merge
from vegas_spec.kernels.split_merge import Partials, merge_splits, merge_tiled


def merge(parts: Partials, out: torch.Tensor, lse: torch.Tensor | None,
          per_step: int | None) -> None:
    """The library's merge (per_step None), or one that takes `per_step` splits a step."""
    if per_step is None:
        merge_splits(parts, out, lse)
        return
    splits, _, heads, dim = parts.acc.shape
    block_s = min(per_step, triton.next_power_of_2(splits))
    tile = block_s * triton.next_power_of_2(dim)
    merge_tile = split_merge.tuning(DEVICE).merge_tile
    block_h = max(min(triton.next_power_of_2(heads), 16, merge_tile // tile), 1)
    merge_tiled(parts, out, lse, (block_s, block_h, 4 if block_s == 1 else 1))


def merged_ref(parts: Partials) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [rows, H, D], lse [rows, H]): m = the largest m_s of the live splits (l_s > 0),
    l = sum l_s exp(m_s - m), out = sum acc_s exp(m_s - m) / l, lse = m + log l (a row no
    split saw: out 0, lse -inf)."""
    live = parts.l > 0
    m = torch.where(live, parts.m, float("-inf")).amax(0)
    m_use = torch.where(torch.isinf(m), 0.0, m)
    w = torch.where(live, torch.exp(parts.m - m_use), 0.0)
    acc = torch.where(live[..., None], parts.acc, 0.0)  # unwritten where l_s = 0
    l_sum = (parts.l * w).sum(0)
    l_safe = torch.where(l_sum > 0, l_sum, 1.0)
    return (acc * w[..., None]).sum(0) / l_safe[..., None], m + torch.log(l_safe)


def partials(splits: int, rows: int, heads: int, dim: int, gen: torch.Generator) -> Partials:
    """Random partial states; about a fifth of the (split, row, head) entries saw no key
    (l = 0, acc NaN: the split kernels leave it unwritten), and row 0's head 0 none at all."""
    parts = Partials.empty(splits, rows, heads, dim, DEVICE)
    parts.m.copy_(torch.randn(splits, rows, heads, generator=gen) * 4)
    seen = torch.rand(splits, rows, heads, generator=gen) > 0.2
    seen[:, 0, 0] = False
    parts.l.copy_(torch.where(seen, torch.rand(splits, rows, heads, generator=gen) + 0.5, 0.0))
    acc = torch.randn(splits, rows, heads, dim, generator=gen)
    parts.acc.copy_(torch.where(seen[..., None], acc, float("nan")))
    return parts


@pytest.mark.parametrize("per_step", [None, 1, 2, 8])
@pytest.mark.parametrize("shape", [(1, 3, 4, 64), (5, 7, 9, 64), (16, 4, 32, 128),
                                   (11, 2, 6, 80)],
                         ids=lambda s: "x".join(map(str, s)))
def test_merge_matches_the_log_sum_exp_merge(shape: tuple[int, int, int, int],
                                             per_step: int | None) -> None:
    """Splits fewer than, equal to and not a multiple of the splits merged per step; a head
    dim that is not a power of two; an output in bfloat16 rounded from the same float32."""
    splits, rows, heads, dim = shape
    parts = partials(splits, rows, heads, dim, generator(splits * 31 + heads))
    want_out, want_lse = merged_ref(parts)
    out = torch.full((rows, 1, heads, dim), float("nan"), device=DEVICE)
    lse = torch.full((rows, 1, heads), float("nan"), device=DEVICE)
    merge(parts, out, lse, per_step)
    torch.testing.assert_close(out[:, 0], want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, 0], want_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0, 0, 0], torch.zeros(dim, device=DEVICE))  # saw no key
    half = torch.empty(rows, 1, heads, dim, device=DEVICE, dtype=torch.bfloat16)
    merge(parts, half, None, per_step)
    torch.testing.assert_close(half, out.to(torch.bfloat16), atol=0, rtol=0)


def test_splits_per_step_must_be_a_power_of_two() -> None:
    parts = partials(4, 2, 2, 64, generator(1))
    with pytest.raises(AssertionError, match="power of 2"):
        merge_tiled(parts, torch.empty(2, 1, 2, 64, device=DEVICE), None, (3, 2, 1))


@pytest.mark.parametrize(("splits", "heads", "dim", "want"), [
    (1, 32, 128, (1, 16, 4)),  # at most two splits: one by one, 16 heads, 4 warps
    (2, 9, 64, (1, 16, 4)),
    (3, 32, 128, (4, 8, 1)),  # more: all splits (at most 16) a step, one warp
    (16, 32, 128, (16, 2, 1)),
    (64, 32, 128, (16, 2, 1)),
    (9, 9, 64, (16, 4, 1)),
    (40, 4, 256, (16, 1, 1)),  # never fewer than one head
])
def test_merge_tiling(splits: int, heads: int, dim: int, want: tuple[int, int, int]) -> None:
    assert split_merge.merge_tiling(splits, heads, dim, DEVICE) == want
    # exact mode: one split a step in 4 warps (the serial merge) for every count
    serial = (1, min(triton.next_power_of_2(heads), 16), 4)
    assert split_merge.merge_tiling(splits, heads, dim, DEVICE, exact=True) == serial


@pytest.mark.parametrize("live", [1, 2, 3, 9])
def test_exact_merge_does_not_depend_on_the_split_count(live: int) -> None:
    """Exact mode: a row whose keys lie in its first `live` splits gets the same bits from a
    call of `live` splits as from calls with more splits past its keys (l = 0), as a plain
    step's row does in a verify step over a wider key bound."""
    gen = generator(live)
    parts = partials(live, 5, 9, 64, gen)
    outs = []
    for extra in (0, 1, 2, 7, 24):
        wide = Partials.empty(live + extra, 5, 9, 64, DEVICE)
        for name in ("acc", "m", "l"):
            getattr(wide, name)[:live].copy_(getattr(parts, name))
        wide.m[live:] = float("-inf")
        wide.l[live:] = 0.0
        wide.acc[live:] = float("nan")
        out = torch.empty(5, 1, 9, 64, device=DEVICE)
        lse = torch.empty(5, 1, 9, device=DEVICE)
        merge_splits(wide, out, lse, exact=True)
        outs.append((out, lse))
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])
    want_out, _ = merged_ref(parts)
    torch.testing.assert_close(outs[0][0][:, 0], want_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("regs", "shared", "warps", "want"), [
    (118, 38912, 4, 4),  # the paged kernel, one row, head dim 128, on an H200
    (144, 45056, 4, 3),  # seven rows, unscored
    (128, 53248, 4, 4),  # seven rows, scored, 128 registers at most
    (32, 100000, 4, 2),  # bound by shared memory
    (16, 0, 32, 2),  # by threads
    (0, 0, 1, 32),  # by the most programs an SM holds
])
def test_resident_limit(regs: int, shared: int, warps: int, want: int) -> None:
    assert split_merge.resident_limit(regs, shared, warps) == want


@pytest.mark.parametrize(("programs", "slots", "most", "want"), [
    (128, 528, 129, 4),  # 16 x 8 programs, 4 resident on 132 SMs: 512 of 528
    (32, 528, 513, 16),  # 4 x 8 programs: 512
    (128, 396, 129, 3),  # 3 resident: 384 of 396
    (32, 396, 513, 12),
    (192, 528, 16, 8),  # 1,536 programs in three waves of 528
    (600, 528, 3, 3),  # no split count fills 95%: the best of 1..3 (1,800 of 2,112)
    (1, 528, 1, 1),
    (512, 528, 64, 1),
])
def test_wave_splits(programs: int, slots: int, most: int, want: int) -> None:
    assert split_merge.wave_splits(programs, slots, most, 0.95) == want


def test_split_size_by_waves_or_by_occupancy(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernel's resident programs the split fills whole waves; without them, or
    with split_wave_fill None, it aims at split_programs_per_sm programs per SM (sm_90's
    settings, 132 SMs)."""
    as_sm90(monkeypatch)
    monkeypatch.setattr(split_merge, "device_sms", lambda device: 132)
    gpu = torch.device("cuda")
    # Llama-3.1-8B shape, 16 x 32K, one row: 513 key blocks of 64 over 128 programs
    assert split_merge.split_size_for(32832, 128, 64, gpu, resident=4) == 129 * 64  # 4 splits
    assert split_merge.split_size_for(32832, 128, 64, gpu) == 171 * 64  # 3 splits
    assert split_merge.split_size_for(32832, 128, 64, gpu, split_size=128) == 128
    retune(monkeypatch, split_merge, split_wave_fill=None)
    assert split_merge.split_size_for(32832, 128, 64, gpu, resident=4) == 171 * 64
    # the fewest key blocks a split holds caps the splits
    retune(monkeypatch, split_merge, split_wave_fill=0.95)
    assert split_merge.split_size_for(512, 32, 64, gpu, resident=4) == 4 * 64
