"""GGUF loading: the llama.cpp q/k permutation is undone, and the real SmolLM2 GGUF gives the
logits of transformers' own GGUF loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import close_gguf, gguf_model_fields

from vegas_spec.models.loader import _unpermute
from vegas_spec.ops import apply_rope


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
        ours = llm.engine.runner.model.layers[i].qkv.weight
        ref = hf_model.model.layers[i].self_attn
        assert torch.equal(ours[:q], ref.q_proj.weight)
        assert torch.equal(ours[q : q + kv], ref.k_proj.weight)
        assert torch.equal(ours[q + kv :], ref.v_proj.weight)
    assert torch.equal(llm.engine.runner.model.embed.weight, hf_model.model.embed_tokens.weight)


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


# --- Llama 3.1-style GGUF: RoPE scaling stored as the rope_freqs tensor ------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def write_tiny_llama_gguf(path, hf_model, rope_freqs: np.ndarray | None) -> None:  # noqa: ANN001
    """hf_model's weights as llama.cpp writes them (q/k permuted), plus rope_freqs."""
    import gguf

    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), "llama")
    gguf_model_fields(w, cfg)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, t in hf_model.state_dict().items():
        a = t.float().numpy()
        if key == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a)
        elif key == "model.norm.weight":
            w.add_tensor("output_norm.weight", a)
        elif key == "lm_head.weight":
            w.add_tensor("output.weight", a)
        else:
            layer, rest = key.split(".")[2], ".".join(key.split(".")[3:-1])
            if rest == "self_attn.q_proj":
                a = llama_cpp_permute(a, cfg.num_attention_heads)
            elif rest == "self_attn.k_proj":
                a = llama_cpp_permute(a, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{layer}.{names[rest]}.weight", a)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    close_gguf(w)


def test_rope_freqs_gguf_gives_transformers_llama3_logits(tmp_path) -> None:  # noqa: ANN001
    """A GGUF whose RoPE scaling is llama.cpp's rope_freqs tensor (as converted Llama 3.1
    files carry) loads, and past the original context gives the logits of transformers'
    llama3 RoPE; without the tensor the logits differ there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vegas_spec import LLM
    from vegas_spec.models.rope import _base_inv_freq, _llama3

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-6, tie_word_embeddings=False,
                      rope_parameters={"rope_theta": 10000.0, **LLAMA3})
    hf = LlamaForCausalLM(cfg).eval()
    base = _base_inv_freq(10000.0, 16)
    freqs = (base / _llama3(base, LLAMA3)).numpy()  # what llama.cpp's converter writes
    assert not np.allclose(freqs, 1.0)
    ids = torch.randint(3, 64, (120,)).tolist()  # well past the original 32 positions
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    for name, tensor in (("scaled.gguf", freqs), ("plain.gguf", None)):
        write_tiny_llama_gguf(tmp_path / name, hf, tensor)
        got = LLM(str(tmp_path / name), kv_cache_bytes=1 << 24).logits(ids)
        close = torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        assert close == (tensor is not None), name


def test_freq_factors_rope_needs_its_factors() -> None:
    from vegas_spec.config import ConfigError, ModelConfig

    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}
    with pytest.raises(ConfigError, match="needs its 'factors'"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "freq_factors"}})
    cfg = ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "freq_factors",
                                                        "factors": [1.0, 2.0, 4.0, 8.0]}})
    assert cfg.rope["factors"] == (1.0, 2.0, 4.0, 8.0)
