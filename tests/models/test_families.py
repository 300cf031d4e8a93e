"""Tiny random checkpoints of every supported family, written by transformers itself, must
give the same logits and the same greedy tokens through our engine as through transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import assert_close_logits, hf_logits, randomize_norms_and_biases

from vegas_spec.config import MAX_GAMMA, SamplingParams, SpecConfig
from vegas_spec.engine import LLM

VOCAB = 256
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2)

LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
        "original_max_position_embeddings": 32}

# name -> (config class, model class, extra config fields)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "llama-llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3}),
    "llama-head-dim": ("LlamaConfig", "LlamaForCausalLM", {"head_dim": 32}),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),  # sliding window 4096 > context
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen3-bias": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "attention_bias": True}),
    "qwen3-yarn": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "rope_parameters": YARN}),
}


def build_hf(family: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A random float32 model whose norms and biases are random too (init leaves them 1 / 0)."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides})
    model = getattr(transformers, model_cls)(config).float().eval()
    randomize_norms_and_biases(model)
    return model


def save(model: transformers.PreTrainedModel, folder: Path, **kwargs: Any) -> Path:
    model.save_pretrained(str(folder), **kwargs)
    return folder


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def engine(folder: Path, **kwargs: Any) -> LLM:
    return LLM(str(folder), kv_cache_bytes=4 << 20, **kwargs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(family: str, tmp_path: Path) -> None:
    model = build_hf(family)
    ids = random_ids(100, seed=1)  # past original_max_position_embeddings of llama3 and yarn
    ours = engine(save(model, tmp_path), prefill_chunk=37).logits(ids)
    ref = hf_logits(model, ids)
    assert ref.std() > 0.5, "the random model is too close to uniform to test anything"
    assert_close_logits(ours, ref)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_is_as_close_as_transformers(dtype: str, tmp_path: Path) -> None:
    """In half precision our logits stay as close to the float32 reference as transformers'
    own half-precision logits do."""
    model = build_hf("qwen2")
    save(model, tmp_path)
    ids = random_ids(60, seed=6)
    ref = hf_logits(model, ids)
    llm = engine(tmp_path, dtype=dtype)
    assert llm.engine.runner.model.layers[0].qkv.weight.dtype == getattr(torch, dtype)
    assert llm.engine.runner.cache.layers[0][0].dtype == getattr(torch, dtype)
    ours = llm.logits(ids)
    theirs = hf_logits(model.to(getattr(torch, dtype)), ids)
    assert ours.dtype == torch.float32
    ours_err, their_err = (ours - ref).abs().max(), (theirs - ref).abs().max()
    assert 1e-4 < ours_err <= 2 * their_err + 1e-2


def test_families_are_what_they_claim(tmp_path: Path) -> None:
    """The config fields that select a code path reach the normalised config."""
    cfgs = {}
    for family in ("llama-tied", "llama-untied", "qwen2", "qwen3", "qwen3-yarn", "llama-llama3"):
        cfgs[family] = engine(save(build_hf(family), tmp_path / family)).model_config
    assert cfgs["llama-tied"].tie_word_embeddings and not cfgs["llama-untied"].tie_word_embeddings
    assert cfgs["qwen2"].qkv_bias and not cfgs["llama-tied"].qkv_bias
    assert cfgs["qwen3"].qk_norm and not cfgs["qwen2"].qk_norm
    assert cfgs["qwen3-yarn"].rope["rope_type"] == "yarn"
    assert cfgs["qwen3-yarn"].rope_theta == 1000000.0
    assert cfgs["llama-llama3"].rope["low_freq_factor"] == 1.0


def test_untied_head_is_not_the_embedding(tmp_path: Path) -> None:
    model = build_hf("llama-untied")
    ours = engine(save(model, tmp_path)).engine.runner.model
    assert not torch.equal(ours.lm_head.weight, ours.embed.weight)
    torch.testing.assert_close(ours.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


def test_sharded_checkpoint(tmp_path: Path) -> None:
    model = build_hf("qwen2")
    save(model, tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the checkpoint was not sharded"
    ids = random_ids(40, seed=2)
    assert_close_logits(engine(tmp_path).logits(ids), hf_logits(model, ids))


def test_old_style_rope_config(tmp_path: Path) -> None:
    """Older config.json files carry `rope_theta` and `rope_scaling` instead of
    `rope_parameters`; they must mean the same thing."""
    model = build_hf("llama-llama3")
    save(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = random_ids(100, seed=3)
    assert_close_logits(engine(tmp_path).logits(ids), hf_logits(model, ids))


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy continuation, ending at the first EOS as generate stops there."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    ids = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@pytest.mark.parametrize("family", ["llama-untied", "qwen3"])
def test_greedy_batch_matches_transformers(family: str, tmp_path: Path) -> None:
    """A batch of three prompts of different lengths; EOS is a token that the first prompt's
    greedy continuation emits early, so one sequence stops before the others."""
    prompts = [random_ids(n, seed=10 + n) for n in (5, 23, 61)]
    new = 20
    first = hf_greedy(build_hf(family, seed=4, eos_token_id=None), prompts[0], new)
    eos = next(t for i, t in enumerate(first) if i >= 3 and t not in first[:i])
    model = build_hf(family, seed=4, eos_token_id=eos)
    outs = engine(save(model, tmp_path), page_size=8).generate(
        prompts, SamplingParams(max_tokens=new))
    reasons = []
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(model, prompt, new)
        assert out.prompt_token_ids == prompt
        assert out.token_ids == ref
        assert out.finish_reason == ("stop" if ref[-1] == eos else "length")
        reasons.append(out.finish_reason)
    assert reasons[0] == "stop" and len(outs[0].token_ids) < new and "length" in reasons


def test_generation_stops_at_the_context_end(tmp_path: Path) -> None:
    """max_tokens past the context is cut at the context; speculative rounds that reach past
    it (gamma draft positions beyond the last one) still run and give the plain tokens."""
    llm = engine(save(build_hf("llama-llama3", max_position_embeddings=64), tmp_path))
    prompt = random_ids(50, seed=5)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = llm.generate([prompt], params)[0]
    assert len(plain.token_ids) == 64 - 50 and plain.finish_reason == "length"
    spec = llm.generate([prompt], params, speculative=SpecConfig(method="full", gamma=MAX_GAMMA))
    assert spec[0].token_ids == plain.token_ids
    assert len(llm.engine.runner.cache.free_pages) == llm.engine.runner.cache.num_pages


def test_eos_ids_of_generation_config(tmp_path: Path) -> None:
    """transformers stops at the EOS ids of generation_config.json, which may differ from
    config.json's (chat models add their end-of-turn token there): so must we."""
    prompt = random_ids(9, seed=7)
    free = hf_greedy(build_hf("qwen2", seed=9, eos_token_id=None), prompt, 20)
    turn_end = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    model = build_hf("qwen2", seed=9, eos_token_id=2)
    model.generation_config.eos_token_id = [2, turn_end]
    save(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == 2
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        ref = loaded.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
    ref_ids = ref[0, len(prompt):].tolist()
    assert ref_ids[-1] == turn_end and len(ref_ids) < 20
    out = engine(tmp_path).generate([prompt], SamplingParams(max_tokens=20))[0]
    assert out.token_ids == ref_ids and out.finish_reason == "stop"
