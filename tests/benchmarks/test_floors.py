"""The floors benchmarks divide by: prefill_bench's FLOPs of a prompt (a sliding-window layer's
query sees at most its window of keys; a mixture of experts multiplies each token by its router
and the experts it is routed to, not by every expert) and moe_kernel's bytes of a call."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from conftest import benchmark_script

from vegas_spec.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pb() -> ModuleType:
    return benchmark_script("prefill_bench")


def config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((ROOT / "benchmarks" / "configs" / name /
                                           "config.json").read_text()))


@pytest.mark.parametrize("n,window", [(1, 0), (9, 0), (9, 4), (9, 9), (9, 20), (130, 128)])
def test_window_pairs_count_each_querys_visible_keys(pb: ModuleType, n: int,
                                                     window: int) -> None:
    visible = sum(min(i + 1, window) if window else i + 1 for i in range(n))
    assert pb.window_pairs(n, window) == visible


def test_gpt_oss_attention_windows_every_other_layer(pb: ModuleType) -> None:
    cfg = config("gpt-oss-20b")
    context = 32768
    full = 4.0 * cfg.num_heads * cfg.head_dim * context * (context + 1) / 2
    windowed = 4.0 * cfg.num_heads * cfg.head_dim * (128 * 129 / 2 + (context - 128) * 128)
    assert pb.attention_flops(cfg, context, 2) == pytest.approx(2 * 12 * (full + windowed))


@pytest.mark.parametrize("name,active,heads", [("gpt-oss-20b", 3.61e9, 1),
                                               ("qwen3-30b-a3b", 3.3e9, 2)])
def test_moe_counts_the_routed_experts_only(pb: ModuleType, name: str, active: float,
                                            heads: int) -> None:
    """Against the published active parameters: gpt-oss-20b's 3.61B count the LM head,
    Qwen3-30B-A3B's 3.3B the embedding and the LM head."""
    cfg = config(name)
    head = cfg.hidden_size * cfg.vocab_size
    assert pb.matmul_params(cfg) + heads * head == pytest.approx(active, rel=0.03)
    every_expert = cfg.num_layers * 3 * cfg.hidden_size * cfg.moe_intermediate_size \
        * cfg.num_experts
    assert pb.matmul_params(cfg) < every_expert / 3


def test_dense_counts_every_weight(pb: ModuleType) -> None:
    cfg = config("llama-3.1-8b")  # 8.03B of which 2 x 0.53B embedding and LM head
    head = cfg.hidden_size * cfg.vocab_size
    assert pb.matmul_params(cfg) + 2 * head == pytest.approx(8.03e9, rel=0.01)


def test_moe_kernel_floor_counts_each_expert_hit_once() -> None:
    """moe_kernel.py's floor: the distinct experts of a call's routing, each once, however
    many tokens it serves, plus the activations."""
    import torch

    moe_kernel = benchmark_script("moe_kernel")
    cfg = config("qwen3-30b-a3b")
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    expert = 2 * 3 * h * i
    one = moe_kernel.read_bytes(cfg, torch.tensor([[3, 5]]), 2)
    same = moe_kernel.read_bytes(cfg, torch.tensor([[3, 5], [5, 3]]), 2)
    assert one // expert == 2 and same // expert == 2  # the second token hits no new expert
    assert same - one == 2 * (2 * h + 2 * (4 * i + 2 * i + 2 * h))  # its activations only


def test_moe_kernel_floor_of_mxfp4_experts_is_their_packed_bytes() -> None:
    """An MXFP4 expert's matrices are half a byte a value and a scale byte a 32: 17/64 of
    their bfloat16 bytes; the activations are the same."""
    import torch

    moe_kernel = benchmark_script("moe_kernel")
    cfg = config("gpt-oss-20b")
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    ids = torch.tensor([[0, 1, 2, 3]])
    bf16, fp4 = (moe_kernel.read_bytes(cfg, ids, 2, fmt) for fmt in ("bf16", "mxfp4"))
    assert bf16 - fp4 == 4 * (2 * 3 * h * i - 3 * h * i * 17 // 32)
