"""Every bad input is refused with a message that says what is wrong, before any tensor is
touched where possible; and the KV page pool is shared and returned intact."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from vegas_spec.cache import OutOfMemoryError, PagedKVCache
from vegas_spec.config import (
    ConfigError,
    EngineConfig,
    ModelConfig,
    SamplingParams,
    SpecConfig,
)
from vegas_spec.engine import LLM
from vegas_spec.models.loader import WeightError

SUPPORTED = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"


def tiny_checkpoint(folder: Path, family: str = "Llama", **overrides: Any) -> Path:
    config = getattr(transformers, f"{family}Config")(**{
        "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "tie_word_embeddings": False, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    model.save_pretrained(str(folder), **({"max_shard_size": "20KB"} if family == "Qwen2"
                                          else {}))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_llm(tiny: Path) -> LLM:
    return LLM(str(tiny), kv_cache_bytes=1 << 20, page_size=8, prefill_chunk=8)


def edit_weights(folder: Path, edit) -> None:  # noqa: ANN001
    weights = load_file(str(folder / "model.safetensors"))
    edit(weights)
    save_file(weights, str(folder / "model.safetensors"))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# --- model sources ----------------------------------------------------------------------------

def test_unknown_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ConfigError, match=f"unsupported architecture GPT2LMHeadModel; "
                                          f"supported: {SUPPORTED}"):
        LLM(str(tmp_path))


def test_unknown_rope_type(tiny: Path) -> None:
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="unsupported rope type 'dynamic'; supported: default"):
        ModelConfig.from_hf(cfg)
    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="rope type 'linear' needs a 'factor'"):
        ModelConfig.from_hf(cfg)


def test_heads_not_divisible_by_kv_heads(tiny: Path) -> None:
    cfg = {**json.loads((tiny / "config.json").read_text()), "num_key_value_heads": 3}
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not a multiple of kv heads 3"):
        ModelConfig.from_hf(cfg)


def test_missing_tensor(tiny: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny, tmp_path / "m")
    edit_weights(folder, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightError, match=r"1 missing tensors, e\.g\. "
                                          r"\['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        LLM(str(folder))


def test_untied_checkpoint_without_lm_head(tiny: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny, tmp_path / "m")
    edit_weights(folder, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(WeightError, match=r"missing tensors, e\.g\. \['lm_head\.weight'\]"):
        LLM(str(folder))


def test_extra_tensor(tiny: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny, tmp_path / "m")
    edit_weights(folder, lambda w: w.update({"model.layers.0.self_attn.o_proj.bias":
                                             torch.zeros(32)}))
    with pytest.raises(WeightError, match=r"1 unexpected tensors, e\.g\. "
                                          r"\['model\.layers\.0\.self_attn\.o_proj\.bias'\]"):
        LLM(str(folder))


def test_misshaped_tensor(tiny: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny, tmp_path / "m")
    edit_weights(folder, lambda w: w.update({"model.layers.1.self_attn.k_proj.weight":
                                             torch.zeros(32, 32)}))
    with pytest.raises(WeightError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight has "
                                          r"shape \(32, 32\), config says \(16, 32\)"):
        LLM(str(folder))


def test_missing_shard(tmp_path: Path) -> None:
    folder = tiny_checkpoint(tmp_path / "m", family="Qwen2")
    shards = sorted(set(json.loads(
        (folder / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(shards) > 1
    (folder / shards[-1]).unlink()
    with pytest.raises(WeightError, match=f"shard {shards[-1]} named by the index is missing"):
        LLM(str(folder))


def test_folder_without_weights(tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((tiny / "config.json").read_text())
    with pytest.raises(WeightError, match=r"no \*\.safetensors files"):
        LLM(str(tmp_path))


def test_model_path_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model path .*nowhere.* does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_folder_that_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no config.json and 0 .gguf files"):
        LLM(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ConfigError, match="neither a model folder nor a .gguf file"):
        LLM(str(tmp_path / "weights.bin"))


def test_gguf_of_unknown_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gpt2'; supported: llama"):
        LLM(str(path))


# --- prompts and the KV budget ------------------------------------------------------------------

def test_prompt_longer_than_context(tiny_llm: LLM) -> None:
    with pytest.raises(ConfigError, match="prompt has 64 tokens but the model's context is 64"):
        tiny_llm.generate([[5] * 64])
    with pytest.raises(ConfigError, match="prompt has 70 tokens but the model's context is 64"):
        tiny_llm.logits([5] * 70)


def test_bad_prompts(tiny_llm: LLM) -> None:
    with pytest.raises(ConfigError, match="empty prompt"):
        tiny_llm.generate([[]])
    with pytest.raises(ConfigError, match=r"prompt token ids must lie in \[0, 128\)"):
        tiny_llm.generate([[5, 128]])
    with pytest.raises(ConfigError, match="prompts must be a string, a list of strings"):
        tiny_llm.generate([])
    with pytest.raises(ConfigError, match="2 sampling params for 3 prompts"):
        tiny_llm.generate([[5], [6], [7]], [SamplingParams(), SamplingParams()])


def test_sliding_window_exceeded(tmp_path: Path) -> None:
    llm = LLM(str(tiny_checkpoint(tmp_path, family="Mistral", sliding_window=32)),
              kv_cache_bytes=1 << 20)
    assert len(llm.generate([[5] * 10], SamplingParams(max_tokens=8))[0].token_ids) == 8
    with pytest.raises(ConfigError, match=r"longer than the sliding window \(32 tokens\)"):
        llm.generate([[5] * 20], SamplingParams(max_tokens=20))


def test_batch_over_the_kv_budget(tiny: Path) -> None:
    # 2 layers * 8 slots * 2 kv heads * 8 dims * K and V * 4 bytes = 2 KiB a page; 16 pages
    llm = LLM(str(tiny), kv_cache_bytes=32 << 10, page_size=8)
    assert llm.cache.num_pages == 16 and llm.cache.bytes_per_page == 2048
    ok = llm.generate([[5] * 20], SamplingParams(max_tokens=8))  # fits alone
    assert len(ok[0].token_ids) == 8
    with pytest.raises(OutOfMemoryError, match=r"batch needs \d+ KV pages \(\d+\.\d KiB\) but only "
                                               r"16 are free \(32\.0 KiB of a 32\.0 KiB pool\)"):
        llm.generate([[5] * 20] * 4, SamplingParams(max_tokens=20))
    assert sorted(llm.cache.free_pages) == list(range(16))


def test_kv_budget_below_one_page(tiny: Path) -> None:
    with pytest.raises(OutOfMemoryError, match=r"KV budget 1\.0 KiB holds no page of 2\.0 KiB"):
        LLM(str(tiny), kv_cache_bytes=1024, page_size=8)


# --- settings ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": -0.5}, r"temperature must be >= 0, got -0\.5"),
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"top_p": 0.0}, r"top_p must be .*in \(0, 1\], got 0\.0"),
    ({"top_p": 1.5}, r"top_p must be .*in \(0, 1\], got 1\.5"),
    ({"top_p": float("nan")}, r"top_p must be .*in \(0, 1\], got nan"),
    ({"top_k": -1}, r"top_k must be an integer >= 0 \(0 disables it\), got -1"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({"max_tokens": -3}, "max_tokens must be an integer >= 1, got -3"),
    ({"seed": "abc"}, "seed must be an integer, got 'abc'"),
    ({"stop": ("",)}, "stop strings must be non-empty"),
])
def test_invalid_sampling_params(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs)


def test_single_stop_string_becomes_a_tuple() -> None:
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gamma": 0}, r"gamma must be an integer in \[1, 32\], got 0"),
    ({"gamma": 33}, r"gamma must be an integer in \[1, 32\], got 33"),
    ({"gamma": 2.0}, r"gamma must be an integer in \[1, 32\], got 2\.0"),
    ({"ratio": 0.0}, r"ratio must be .*in \(0, 1\], got 0\.0"),
    ({"ratio": 1.5}, r"ratio must be .*in \(0, 1\], got 1\.5"),
    ({"method": "magic"}, "unknown method 'magic'; choose from vanilla, vegas"),
    ({"score": "attention"}, "score must be one of weight, logit, got 'attention'"),
    ({"collect": 3}, "collect must be one of 2, all, got '3'"),
    ({"granularity": "head"}, "granularity must be one of layer, kv_head, got 'head'"),
    ({"min_tokens": 0}, "min_tokens must be an integer >= 1, got 0"),
    ({"page": 0}, "page must be a positive integer, got 0"),
    ({"sink": -1}, "sink must be a positive integer, got -1"),
])
def test_invalid_spec_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SpecConfig(**kwargs)


def test_spec_config_accepts_its_documented_range() -> None:
    assert SpecConfig(gamma=1, ratio=1.0, collect=2).collect == "2"
    assert SpecConfig(gamma=32, ratio=1e-3, granularity="kv_head", score="logit").speculative
    assert not SpecConfig(method="vanilla").speculative


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dtype": "float64"}, "dtype must be one of float32, bfloat16, float16, got 'float64'"),
    ({"device": "tpu"}, "device must be cpu or cuda, got 'tpu'"),
    ({"device": "gpu"}, "device must be cpu or cuda, got 'gpu'"),
    ({"device": "mps"}, "device must be cpu or cuda, got 'mps'"),
    ({"page_size": 12}, "page_size must be a power of two, got 12"),
    ({"page_size": 0}, "page_size must be a power of two, got 0"),
    ({"prefill_chunk": 0}, "prefill_chunk must be >= 1, got 0"),
    ({"kv_cache_fraction": 0.0}, r"kv_cache_fraction must be in \(0, 1\], got 0\.0"),
    ({"backend": "flash"}, "backend must be auto, torch or triton, got 'flash'"),
])
def test_invalid_engine_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(tiny: Path) -> None:
    with pytest.raises(ConfigError, match="device cuda requested but CUDA is not available"):
        LLM(str(tiny), device="cuda")
    with pytest.raises(ConfigError, match="device cuda requested but CUDA is not available"):
        EngineConfig(device="cuda:1")


def test_engine_settings_are_checked_before_loading(tmp_path: Path) -> None:
    # the path does not exist: the dtype error must come first
    with pytest.raises(ConfigError, match="dtype must be one of"):
        LLM(str(tmp_path / "nowhere"), dtype="int8")
    with pytest.raises(ConfigError, match="unknown method 'magic'"):
        LLM(str(tmp_path / "nowhere"), speculative={"method": "magic"})


# --- the KV page pool ---------------------------------------------------------------------------

def test_page_pool_allocation() -> None:
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                               "hidden_size": 16, "intermediate_size": 32,
                               "num_hidden_layers": 1, "num_attention_heads": 2})
    cache = PagedKVCache(cfg, num_pages=10, page_size=4, dtype=torch.float32,
                         device=torch.device("cpu"))
    assert cache.layers[0][0].shape == (40, 2, 8)
    a, b = cache.allocate(9), cache.allocate(4)
    assert (len(a), len(b)) == (3, 1) and not set(a) & set(b)
    cache.check_fits([4 * 6])
    with pytest.raises(OutOfMemoryError, match=r"batch needs 7 KV pages"):
        cache.check_fits([1, 4 * 6])
    cache.release(a)
    c = cache.allocate(40 - 4)
    assert len(c) == 9 and not set(c) & set(b)
    with pytest.raises(OutOfMemoryError, match="only 0 are free"):
        cache.allocate(1)
    cache.release(b)
    cache.release(c)
    assert sorted(cache.free_pages) == list(range(10))


def test_sequences_of_different_lengths_share_the_pool(tiny_llm: LLM) -> None:
    cache = tiny_llm.cache
    total = len(cache.free_pages)
    assert total == cache.num_pages
    granted: list[list[int]] = []
    allocate = cache.allocate

    def spy(tokens: int) -> list[int]:
        pages = allocate(tokens)
        granted.append(pages)
        return pages

    prompts = [[7] * 3, [8] * 30, [9] * 12]
    cache.allocate = spy  # type: ignore[method-assign]
    try:
        outs = tiny_llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    finally:
        del cache.allocate
    assert [len(o.token_ids) for o in outs] == [10, 10, 10]
    assert len(granted) == 3
    flat = [p for pages in granted for p in pages]
    assert len(set(flat)) == len(flat), "two sequences were given the same page"
    for prompt, pages in zip(prompts, granted, strict=True):
        assert len(pages) >= math.ceil((len(prompt) + 10) / cache.page_size)
    assert len(granted[1]) > len(granted[2]) > len(granted[0])
    assert len(cache.free_pages) == total and sorted(cache.free_pages) == list(range(total))


def test_fragmented_pool_gives_the_same_tokens(tiny_llm: LLM) -> None:
    """Non-contiguous, out-of-order page tables must not change what is computed."""
    prompts = [[11, 12, 13, 14, 15] * 5, [21, 22, 23] * 3]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fresh = [o.token_ids for o in tiny_llm.generate(prompts, params)]
    cache = tiny_llm.cache
    held = [cache.allocate(8 * 3) for _ in range(6)]
    for pages in held[::2]:
        cache.release(pages)
    try:
        assert [o.token_ids for o in tiny_llm.generate(prompts, params)] == fresh
        assert [o.token_ids for o in tiny_llm.generate(prompts[::-1], params)] == fresh[::-1]
    finally:
        for pages in held[1::2]:
            cache.release(pages)
    assert sorted(cache.free_pages) == list(range(cache.num_pages))


def test_pages_are_released_after_a_failed_request(tiny_llm: LLM,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cache, model = tiny_llm.cache, tiny_llm.model
    forward, calls = model.forward, []

    def failing(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("forward failed")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", failing)
    with pytest.raises(RuntimeError, match="forward failed"):
        tiny_llm.generate([[5] * 4, [6] * 9], SamplingParams(max_tokens=8))
    calls.clear()
    with pytest.raises(RuntimeError, match="forward failed"):
        tiny_llm.logits([5] * 40)  # five chunks of 8; the fourth fails
    assert len(calls) == 4
    assert sorted(cache.free_pages) == list(range(cache.num_pages))
