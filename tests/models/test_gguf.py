"""GGUF loading: the llama.cpp q/k permutation is undone, and the real SmolLM2 GGUF gives the
logits of transformers' own GGUF loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vegas_spec.models.loader import _unpermute
from vegas_spec.models.rope import apply_rope


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj / k_proj rows (and biases)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's RoPE: rotates adjacent pairs (x[2i], x[2i+1]) of every head.
    x [n, heads, D], positions [n]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angle = positions[:, None, None].float() * inv_freq  # [n, 1, D/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * angle.cos() - odd * angle.sin()
    out[..., 1::2] = even * angle.sin() + odd * angle.cos()
    return out


def rotate_half_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Our (transformers') RoPE on x [n, heads, D]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.arange(int(positions.max()) + 1).float()[:, None] * inv_freq
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return apply_rope(x[None], table, positions[None])[0]


@pytest.mark.parametrize("heads", [1, 3, 8])
@pytest.mark.parametrize("trailing", [(), (5,)])
def test_unpermute_inverts_llama_cpp(heads: int, trailing: tuple[int, ...]) -> None:
    w = np.random.default_rng(heads).standard_normal((heads * 16, *trailing)).astype(np.float32)
    permuted = llama_cpp_permute(w, heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(_unpermute(permuted, heads), w)


def test_unpermuted_weights_give_transformers_rope() -> None:
    """Rotating llama.cpp's permuted q with llama.cpp's RoPE, then undoing the permutation,
    is the same as rotating transformers' q with transformers' RoPE: this is the reason for
    the permutation, and what must hold for our logits to match."""
    heads, dim, hidden, n = 3, 16, 24, 7
    g = torch.Generator().manual_seed(0)
    w = torch.randn(heads * dim, hidden, generator=g)
    x = torch.randn(n, hidden, generator=g)
    positions = torch.arange(n) * 5
    ours = rotate_half_rope((x @ w.T).view(n, heads, dim), positions, 10000.0)
    w_gguf = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
    rotated = interleaved_rope((x @ w_gguf.T).view(n, heads, dim), positions, 10000.0)
    back = _unpermute(rotated.reshape(n, heads * dim).T.numpy(), heads).T
    torch.testing.assert_close(torch.from_numpy(np.ascontiguousarray(back)),
                               ours.reshape(n, heads * dim), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_real_gguf_config_matches_transformers(llm, hf_model) -> None:
    ours, ref = llm.model_config, hf_model.config
    assert ours.architecture == "LlamaForCausalLM"
    assert (ours.vocab_size, ours.hidden_size, ours.num_layers) == \
        (ref.vocab_size, ref.hidden_size, ref.num_hidden_layers)
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == \
        (ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim)
    assert ours.rope_theta == ref.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert ours.tie_word_embeddings and ours.max_position_embeddings == 8192
    assert ours.eos_token_ids == (ref.eos_token_id,)


@pytest.mark.slow
def test_real_gguf_weights_equal_transformers(llm, hf_model) -> None:
    """Dequantised and un-permuted q/k equal transformers' tensors exactly."""
    cfg = llm.model_config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i in (0, cfg.num_layers - 1):
        ours = llm.model.layers[i].qkv.weight
        ref = hf_model.model.layers[i].self_attn
        assert torch.equal(ours[:q], ref.q_proj.weight)
        assert torch.equal(ours[q : q + kv], ref.k_proj.weight)
        assert torch.equal(ours[q + kv :], ref.v_proj.weight)
    assert torch.equal(llm.model.embed.weight, hf_model.model.embed_tokens.weight)


@pytest.mark.slow
def test_real_gguf_logits_match_transformers(llm, hf_model, essays) -> None:
    text = "The quick brown fox jumps over the lazy dog. " + essays[0][:1500]
    ids = llm.tokenizer(text)["input_ids"][:256]
    assert len(ids) == 256
    ours = llm.logits(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    rel = diff / ref.abs().max().item()
    assert diff <= 1e-3 or rel <= 1e-4, f"max abs diff {diff:.3g}, relative {rel:.3g}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
