"""Every bad input is refused with a message that says what is wrong, before any tensor is
touched where possible; and the KV page pool is shared and returned intact."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import close_gguf
from safetensors.torch import load_file, save_file

from vegas_spec.cache import OutOfMemoryError, PagedKVCache
from vegas_spec.config import (
    METHODS,
    ConfigError,
    EngineConfig,
    LastqOptions,
    LengthCapWarning,
    ModelConfig,
    QuestOptions,
    SamplingParams,
    SpecConfig,
    VegasOptions,
    option_names,
    spec_config,
)
from vegas_spec.engine import LLM
from vegas_spec.models.loader import WeightError

SUPPORTED = ("LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
             "Qwen3MoeForCausalLM")


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
    path = _gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gpt2'; supported: llama"):
        LLM(str(path))


# --- prompts and the KV budget ------------------------------------------------------------------

def test_prompt_longer_than_context(tiny_llm: LLM) -> None:
    with pytest.raises(ConfigError, match="prompt has 64 tokens but the model's context is 64"):
        tiny_llm.generate([[5] * 64])
    with pytest.raises(ConfigError, match="prompt has 70 tokens but the model's context is 64"):
        tiny_llm.logits([5] * 70)


def test_bad_prompts(tiny_llm: LLM) -> None:
    with pytest.raises(ConfigError, match="prompt is empty"):
        tiny_llm.generate([[]])
    with pytest.raises(ConfigError, match=r"prompt holds token ids outside \[0, 128\), e\.g\. 128"):
        tiny_llm.generate([[5, 128]])
    with pytest.raises(ConfigError, match="prompts must be a string, a list of strings"):
        tiny_llm.generate([])
    with pytest.raises(ConfigError, match="2 sampling params for 3 prompts"):
        tiny_llm.generate([[5], [6], [7]], [SamplingParams(), SamplingParams()])


def test_sliding_window_exceeded(tmp_path: Path) -> None:
    llm = LLM(str(tiny_checkpoint(tmp_path, family="Mistral", sliding_window=32)),
              kv_cache_bytes=1 << 20)
    assert len(llm.generate([[5] * 10], SamplingParams(max_tokens=8))[0].token_ids) == 8
    with pytest.raises(ConfigError, match=r"prompt would grow to 40 tokens, past the sliding "
                                          r"window \(32 tokens\)"):
        llm.generate([[5] * 20], SamplingParams(max_tokens=20))


def test_batch_over_the_kv_budget(tiny: Path) -> None:
    # 2 layers * 8 slots * 2 kv heads * 8 dims * K and V * 4 bytes = 2 KiB a page; 16 pages
    llm = LLM(str(tiny), kv_cache_bytes=32 << 10, page_size=8)
    cache = llm.engine.runner.cache
    assert cache.num_pages == 16 and cache.bytes_per_page == 2048
    ok = llm.generate([[5] * 20], SamplingParams(max_tokens=8))  # fits alone
    assert len(ok[0].token_ids) == 8
    # 4 sequences of 40 tokens (5 pages each) do not fit together: they queue for pages
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    queued = llm.generate([[5] * 20, [6] * 20, [7] * 20, [8] * 20], params)
    alone = [llm.generate([[t] * 20], params)[0].token_ids for t in (5, 6, 7, 8)]
    assert [o.token_ids for o in queued] == alone
    assert sorted(llm.engine.runner.cache.free_pages) == list(range(16)) and not llm.engine.seqs
    small = LLM(str(tiny), kv_cache_bytes=8 << 10, page_size=8)  # 4 pages: 32 tokens
    with pytest.raises(OutOfMemoryError, match=r"a sequence of 40 tokens needs 5 KV pages "
                                               r"\(10\.0 KiB\) but the pool holds 4 "
                                               r"\(8\.0 KiB\)"):
        small.generate([[5] * 4, [5] * 20], [params, SamplingParams(max_tokens=20)])
    assert sorted(small.engine.runner.cache.free_pages) == list(range(4)) and not small.engine.seqs


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
    ({"stop": None}, r"stop must be a string or a list of strings \(\(\) for none\), got None"),
    ({"stop": ["a", 1]}, r"stop must be a string or a list of strings .*got \['a', 1\]"),
    ({"seed": 2**64}, "seed must fit in 64 bits"),
    ({"ignore_eos": "no"}, "ignore_eos must be True or False, got 'no'"),
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
    ({"method": "quest", "page": 0}, "page must be an integer >= 1, got 0"),
    ({"sink": -1}, "sink must be an integer >= 0, got -1"),
    ({"gamma": True}, r"gamma must be an integer in \[1, 32\], got True"),
    ({"method": "specextend", "chunk": False}, "chunk must be an integer >= 1, got False"),
    # a setting of another method: named, with the methods that have it
    ({"page": 32}, r"method 'vegas' has no setting 'page' \(its own: sink, window, pool, "
                   r"score, collect, granularity; methods that have it: quest\)"),
    ({"method": "stream", "window": 8, "score": "logit"},
     r"method 'stream' has no setting 'window', 'score' \(its own: sink; methods that have "
     "them: lastq, specextend, vegas\\)"),
    ({"method": "full", "sink": 2}, r"method 'full' has no setting 'sink' \(its own: none;"),
    ({"method": "vanilla", "window": 0}, r"method 'vanilla' has no setting 'window'"),
    ({"sink": True}, "sink must be an integer >= 0, got True"),
    ({"window": -1}, "window must be an integer >= 0, got -1"),
    ({"window": 2.0}, "window must be an integer >= 0, got 2.0"),
    ({"pool": 4}, r"pool must be an odd integer >= 1 \(1: no pooling\), got 4"),
    ({"pool": 0}, r"pool must be an odd integer >= 1 \(1: no pooling\), got 0"),
    ({"pool": True}, r"pool must be an odd integer >= 1 \(1: no pooling\), got True"),
    ({"pool": 3.0}, r"pool must be an odd integer >= 1 \(1: no pooling\), got 3.0"),
])
def test_invalid_spec_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SpecConfig(**kwargs)


def test_spec_config_accepts_its_documented_range() -> None:
    assert SpecConfig(gamma=32, ratio=1e-3, granularity="kv_head", score="logit").speculative
    assert not SpecConfig(method="vanilla").speculative
    assert SpecConfig(gamma=1, ratio=1.0, collect=2).options.collect == "2"
    assert (SpecConfig(window=0, pool=1).options.window,
            SpecConfig(window=64, pool=7).options.pool) == (0, 7)
    assert SpecConfig(method="quest", page=32).options == QuestOptions(page=32)


def test_each_method_has_its_own_settings() -> None:
    """A method's settings are its own object; replacing the method keeps those the new
    method shares and drops the rest; the flat form (a config file's) round-trips."""
    spec = SpecConfig(method="vegas", window=16, score="logit", gamma=4)
    assert spec.options == VegasOptions(window=16, score="logit")
    lastq = dataclasses.replace(spec, method="lastq")
    assert lastq.options == LastqOptions(window=16) and lastq.gamma == 4
    assert dataclasses.replace(spec, method="quest").options == QuestOptions()
    assert dataclasses.replace(spec, ratio=0.5).options == spec.options
    for method in METHODS:
        flat = SpecConfig(method=method).as_dict()
        assert spec_config(flat) == SpecConfig(method=method)
        assert set(flat) == {"method", "gamma", "ratio", "min_tokens", "adaptive",
                             *option_names(method)}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dtype": "float64"}, "dtype must be one of float32, bfloat16, float16, got 'float64'"),
    ({"device": "tpu"}, "device must be cpu or cuda, got 'tpu'"),
    ({"device": "gpu"}, "device must be cpu or cuda, got 'gpu'"),
    ({"device": "mps"}, "device must be cpu or cuda, got 'mps'"),
    ({"page_size": 12}, "page_size must be a power of two, got 12"),
    ({"page_size": 0}, "page_size must be a power of two, got 0"),
    ({"prefill_chunk": 0}, "prefill_chunk must be an integer >= 1, got 0"),
    ({"kv_cache_fraction": 0.0}, r"kv_cache_fraction must be in \(0, 1\], got 0\.0"),
    ({"backend": "flash"}, "backend must be auto, torch or triton, got 'flash'"),
    ({"page_size": "8"}, "page_size must be a power of two, got '8'"),
    ({"page_size": True}, "page_size must be a power of two, got True"),
    ({"prefill_chunk": 2.5}, "prefill_chunk must be an integer >= 1, got 2.5"),
    ({"kv_cache_bytes": -(1 << 30)}, "kv_cache_bytes must be a positive number of bytes .*"
                                     "got -1073741824"),
    ({"kv_cache_bytes": "1GB"}, "kv_cache_bytes must be a positive number of bytes"),
    ({"kv_cache_fraction": "half"}, r"kv_cache_fraction must be in \(0, 1\], got 'half'"),
    ({"prefix_cache_bytes": -1}, "prefix_cache_bytes must be an integer >= 0"),
    ({"max_model_len": 10.5}, "max_model_len must be an integer, got 10.5"),
    ({"cuda_graphs": "no"}, "cuda_graphs must be True or False, got 'no'"),
    ({"exact": 1}, "exact must be True or False, got 1"),
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
    cache = tiny_llm.engine.runner.cache
    total = len(cache.free_pages)
    assert total == cache.num_pages
    granted: list[list[int]] = []
    allocate = cache.pages.allocate

    def spy(tokens: int) -> list[int]:
        pages = allocate(tokens)
        granted.append(pages)
        return pages

    prompts = [[7] * 3, [8] * 30, [9] * 12]
    cache.pages.allocate = spy  # type: ignore[method-assign]
    try:
        outs = tiny_llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    finally:
        del cache.pages.allocate
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
    cache = tiny_llm.engine.runner.cache
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
    cache, model = tiny_llm.engine.runner.cache, tiny_llm.engine.runner.model
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


def test_exact_mode_on_cuda_needs_the_triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="exact mode on cuda runs the Triton kernels"):
        EngineConfig(device="cuda", backend="torch", exact=True)
    assert EngineConfig(device="cpu", backend="torch", exact=True).exact


def test_triton_backend_is_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="backend triton runs its kernels on a GPU .*"
                                          "TRITON_INTERPRET=1.*choose backend torch"):
        EngineConfig(backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig(backend="triton").resolved_backend == "triton"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="backend triton needs the triton package"):
        EngineConfig(backend="triton")
    assert EngineConfig(backend="torch").resolved_backend == "torch"


# --- bad model files: one ConfigError or WeightError naming the file --------------------------

def _gguf(path: Path, architecture: str = "llama") -> Path:
    """A one-block GGUF of `architecture` holding only a 64 x 64 embedding."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.ones(64, 64).numpy())
    close_gguf(writer)
    return path


def _config(tiny: Path, dst: Path, **changes: Any) -> Path:
    """The tiny checkpoint's config.json alone, with `changes` (None: the key removed)."""
    cfg = json.loads((tiny / "config.json").read_text())
    for key, value in changes.items():
        cfg.pop(key) if value is None else cfg.update({key: value})
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _truncated_gguf(tiny: Path, tmp: Path) -> Path:
    path = _gguf(tmp / "cut.gguf")
    path.write_bytes(path.read_bytes()[:-100])
    return path


def _write(path: Path, data: bytes) -> Path:
    """A file (in a new folder for a config.json) -> the model path to give LLM."""
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path.parent if path.name == "config.json" else path


def _with_file(name: str, data: bytes):  # noqa: ANN202
    """A copy of the tiny checkpoint with `name` replaced by `data`."""
    def build(tiny: Path, tmp: Path) -> Path:
        folder = copy_checkpoint(tiny, tmp / "m")
        (folder / name).write_bytes(data)
        return folder
    return build


BAD_MODEL_FILES = [
    ("config-not-json", lambda tiny, tmp: _write(tmp / "m" / "config.json", b"{not json"),
     ConfigError, r"config\.json is not valid JSON: Expecting property name enclosed in double "
                  r"quotes at line 1 column 2"),
    ("config-a-list", lambda tiny, tmp: _write(tmp / "m" / "config.json", b"[1, 2]"),
     ConfigError, r"config\.json must hold a JSON object, got list"),
    ("config-not-utf8", lambda tiny, tmp: _write(tmp / "m" / "config.json", b"\xff\xfe{}"),
     ConfigError, r"config\.json is not valid JSON: it is not UTF-8 text"),
    ("config-lacks-heads", lambda tiny, tmp: _config(tiny, tmp / "m", num_attention_heads=None),
     ConfigError, r"config\.json: the model config lacks 'num_attention_heads'"),
    ("config-bad-layers", lambda tiny, tmp: _config(tiny, tmp / "m", num_hidden_layers="two"),
     ConfigError, r"config\.json: the model config's 'num_hidden_layers' must be a positive "
                  r"integer, got 'two'"),
    ("config-zero-heads", lambda tiny, tmp: _config(tiny, tmp / "m", num_attention_heads=0),
     ConfigError, "'num_attention_heads' must be a positive integer, got 0"),
    ("config-bad-rope", lambda tiny, tmp: _config(tiny, tmp / "m", rope_scaling="linear"),
     ConfigError, "'rope_scaling' must be an object, got 'linear'"),
    ("config-bad-eos", lambda tiny, tmp: _config(tiny, tmp / "m", eos_token_id="</s>"),
     ConfigError, "eos_token_id must be token ids, got '</s>'"),
    ("generation-config-not-json", _with_file("generation_config.json", b"{"),
     ConfigError, r"generation_config\.json is not valid JSON"),
    ("safetensors-garbage", _with_file("model.safetensors", b"garbage"),
     WeightError, r"model\.safetensors is not a readable safetensors file: Error while "
                  r"deserializing header"),
    ("safetensors-empty", _with_file("model.safetensors", b""),
     WeightError, r"model\.safetensors is not a readable safetensors file"),
    ("index-not-json", _with_file("model.safetensors.index.json", b"{"),
     WeightError, r"model\.safetensors\.index\.json is not valid JSON"),
    ("index-without-map", _with_file("model.safetensors.index.json", b"{}"),
     WeightError, r"index\.json has no 'weight_map'"),
    ("gguf-random-bytes", lambda tiny, tmp: _write(tmp / "r.gguf", bytes(range(256)) * 8),
     ConfigError, r"r\.gguf is not a GGUF file: it does not start with the bytes 'GGUF'"),
    ("gguf-empty", lambda tiny, tmp: _write(tmp / "e.gguf", b""),
     ConfigError, r"e\.gguf is not a GGUF file"),
    ("gguf-truncated", _truncated_gguf,
     ConfigError, r"cut\.gguf is a truncated or corrupt GGUF file \(\d+ bytes; reading it "
                  r"failed with \w+Error"),
    ("gguf-header-only", lambda tiny, tmp: _write(tmp / "h.gguf", b"GGUF\x03\x00\x00\x00"),
     ConfigError, r"h\.gguf is a truncated or corrupt GGUF file"),
    ("gguf-without-metadata", lambda tiny, tmp: _gguf(tmp / "g.gguf"),
     ConfigError, r"g\.gguf: the model config lacks 'num_attention_heads'"),
]


@pytest.mark.parametrize(("build", "error", "message"), [c[1:] for c in BAD_MODEL_FILES],
                         ids=[c[0] for c in BAD_MODEL_FILES])
def test_bad_model_files(tiny: Path, tmp_path: Path, build, error: type, message: str) -> None:  # noqa: ANN001
    with pytest.raises(error, match=message) as info:
        LLM(str(build(tiny, tmp_path)))
    assert "\n" not in str(info.value)


def test_malformed_tokenizer(tiny: Path, tmp_path: Path) -> None:
    folder = _with_file("tokenizer.json", b'{"model": {"type": "BPE", "vocab": 5}}')(tiny, tmp_path)
    llm = LLM(str(folder), kv_cache_bytes=1 << 20)
    with pytest.raises(ConfigError, match=r"cannot load the tokenizer of .*m: KeyError"):
        llm.generate("hello")


# --- the Python API: every bad argument is a ConfigError, and the engine goes on ---------------

FEW = SamplingParams(max_tokens=4)
BAD_CALLS = [
    ("mixed-ints-and-strings", lambda llm: llm.generate([5, "a"]),
     r"prompts\[1\] is 'a' \(str\), not a token id"),
    ("none-prompt", lambda llm: llm.generate([None]),
     r"prompts\[0\] is None \(NoneType\): each prompt must be a string or a list of token ids"),
    ("none-token", lambda llm: llm.generate([[5], [5, None]]),
     r"prompts\[1\]\[1\] is None \(NoneType\), not a token id"),
    ("bool-token", lambda llm: llm.generate([[True, 5]]),
     r"prompts\[0\]\[0\] is True \(a bool\), not a token id"),
    ("bool-in-flat-prompt", lambda llm: llm.generate([5, False]),
     r"prompts\[1\] is False \(a bool\), not a token id"),
    ("float-token", lambda llm: llm.generate([[1.5]]), r"prompts\[0\]\[0\] is 1\.5 \(float\)"),
    ("tensor-prompts", lambda llm: llm.generate(torch.tensor([1, 2])),
     "prompts must be a string, a list of strings or of token-id lists, got Tensor"),
    ("bytes-prompt", lambda llm: llm.generate(b"abc"), "got bytes"),
    ("params-dict", lambda llm: llm.generate([[5]], {"max_tokens": 3}),
     r"params must be a SamplingParams, a list of them \(one per prompt\) or None, got dict; "
     r"build one with SamplingParams\(\*\*d\)"),
    ("params-list-of-dicts", lambda llm: llm.generate([[5]], [{"max_tokens": 3}]),
     r"params\[0\] must be a SamplingParams, got dict"),
    ("params-string", lambda llm: llm.generate([[5]], "greedy"),
     "params must be a SamplingParams, .* got str"),
    ("speculative-unknown-key", lambda llm: llm.generate([[5]], speculative={"gama": 4}),
     r"unknown speculative setting 'gama' \(did you mean 'gamma'\?\); known: method, gamma"),
    ("speculative-a-string", lambda llm: llm.generate([[5]], speculative="vegas"),
     r"speculative must be a SpecConfig, a dict of its fields or None, got str 'vegas'"),
    ("speculative-bool-gamma", lambda llm: llm.generate([[5]], speculative={"gamma": True}),
     r"gamma must be an integer in \[1, 32\], got True"),
    ("batch-prompt-too-long", lambda llm: llm.generate([[5] * 3, [6] * 64], FEW),
     r"prompts\[1\] has 64 tokens but the model's context is 64: nothing is left to generate"),
    ("batch-prompt-empty", lambda llm: llm.generate([[5], []], FEW), r"prompts\[1\] is empty"),
    ("batch-token-out-of-range", lambda llm: llm.generate([[5], [6], [7, -1]], FEW),
     r"prompts\[2\] holds token ids outside \[0, 128\), e\.g\. -1"),
]


@pytest.mark.parametrize(("call", "message"), [c[1:] for c in BAD_CALLS],
                         ids=[c[0] for c in BAD_CALLS])
def test_bad_api_calls(tiny_llm: LLM, call, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match=message):
        call(tiny_llm)
    cache = tiny_llm.engine.runner.cache
    assert sorted(cache.free_pages) == list(range(cache.num_pages))
    out = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_llm_arguments_are_checked_before_loading(tmp_path: Path) -> None:
    nowhere = str(tmp_path / "nowhere")  # loading would fail with another message
    with pytest.raises(ConfigError, match=r"unknown engine setting 'unknown_kwarg'; known: "
                                          r"device, dtype"):
        LLM(nowhere, unknown_kwarg=1)
    with pytest.raises(ConfigError, match=r"unknown engine setting 'kv_cache_byte' \(did you "
                                          r"mean 'kv_cache_bytes'\?\)"):
        LLM(nowhere, kv_cache_byte=1 << 20)
    with pytest.raises(ConfigError, match="speculative must be a SpecConfig, .* got int 3"):
        LLM(nowhere, speculative=3)
    with pytest.raises(ConfigError, match="unknown speculative setting 'methd'"):
        LLM(nowhere, speculative={"methd": "vegas"})
    with pytest.raises(ConfigError, match=r"model must be a path \(a folder or a \.gguf file\) "
                                          r"or None, got int 5"):
        LLM(5)  # type: ignore[arg-type]


# --- memory ---------------------------------------------------------------------------------

def test_kv_budget_beyond_the_machine_is_refused_before_loading(tmp_path: Path) -> None:
    with pytest.raises(OutOfMemoryError, match=r"a KV cache of 1048576\.0 TiB does not fit in "
                                               r"the [\d.]+ [KMGT]?i?B of memory available on "
                                               r"cpu"):
        LLM(str(tmp_path / "nowhere"), kv_cache_bytes=1 << 60)


def test_default_cpu_budget_fits_the_available_memory(tiny: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import vegas_spec.cache
    import vegas_spec.runner_setup

    for module in (vegas_spec.cache, vegas_spec.runner_setup):
        monkeypatch.setattr(module, "available_bytes", lambda device: 64 << 10)
    llm = LLM(str(tiny), page_size=8)  # half of the 64 KiB: 16 pages of 2 KiB
    assert llm.engine.runner.cache.num_pages == 16
    with pytest.raises(OutOfMemoryError, match=r"a KV cache of 128\.0 KiB does not fit in the "
                                               r"64\.0 KiB of memory available on cpu"):
        LLM(str(tiny), kv_cache_bytes=128 << 10)


# --- outputs that explain themselves --------------------------------------------------------

def test_max_tokens_beyond_the_context_is_capped_with_a_warning(tiny_llm: LLM) -> None:
    params = SamplingParams(max_tokens=10**9, ignore_eos=True)
    with pytest.warns(LengthCapWarning, match=r"^prompt leaves room for 6 new tokens in the "
                                              r"model's context of 64: max_tokens 1000000000 "
                                              r"is capped to 6$"):
        (out,) = tiny_llm.generate([[5] * 58], params)
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    with pytest.warns(LengthCapWarning, match=r"^prompts\[1\] leaves room for 4 new tokens"):
        tiny_llm.generate([[5] * 2, [6] * 60], SamplingParams(max_tokens=5, ignore_eos=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny_llm.generate([[5] * 58], SamplingParams(max_tokens=6, ignore_eos=True))


def test_statistics_of_plain_decoding(tiny_llm: LLM) -> None:
    outs = tiny_llm.generate([[5] * 4, [6] * 9], SamplingParams(max_tokens=6, ignore_eos=True))
    stats = outs[0].stats
    assert [o.stats["sequence"]["iterations"] for o in outs] == [5, 5]  # one step per token
    assert stats["iterations"] == 10 and stats["generated_tokens"] == 12
    assert stats["decode_tokens_per_s"] == pytest.approx(10 / stats["decode_s"], rel=1e-3)
    for max_tokens in (1, 2):  # the prefill's token, then at most one decoded: no rate
        (out,) = tiny_llm.generate([[5] * 4], SamplingParams(max_tokens=max_tokens,
                                                             ignore_eos=True))
        assert out.stats["decode_tokens_per_s"] is None
        assert out.stats["iterations"] == max_tokens - 1
