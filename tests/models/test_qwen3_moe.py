"""Qwen3-MoE on a tiny random checkpoint written by transformers itself: the same logits as
transformers (one prefill chunk or many, both backends, exact mode), the checkpoint's
per-expert tensors read by the family's table and cut for tensor parallelism, greedy output
of every speculative method equal to plain decoding's (default and exact mode, model or FP8
/INT4 draft copies), and layouts the family does not run refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import (
    TINY_IDS,
    TINY_METHODS,
    TRITON_DEVICE,
    assert_close_logits,
    hf_logits,
    random_prompts,
    randomize_norms_and_biases,
    tiny_spec,
)
from safetensors import safe_open

from vegas_spec import parallel
from vegas_spec.config import ConfigError, ModelConfig, SamplingParams, SpecConfig
from vegas_spec.engine import LLM
from vegas_spec.models import loader, registry

VOCAB = 256
TINY_MOE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                max_position_embeddings=128, initializer_range=0.1, bos_token_id=1,
                eos_token_id=2)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
PLAIN = SpecConfig(method="vanilla")


def build_hf(seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A random float32 Qwen3-MoE whose norms are random too (init leaves them 1)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**{**TINY_MOE, **overrides})
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    randomize_norms_and_biases(model)
    return model


@pytest.fixture(scope="module")
def hf() -> transformers.PreTrainedModel:
    return build_hf()


@pytest.fixture(scope="module")
def folder(hf: transformers.PreTrainedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-moe")
    hf.save_pretrained(str(path))
    return path


def engine(folder: Path, **kwargs: Any) -> LLM:
    if kwargs.get("backend") == "triton":
        kwargs.setdefault("device", TRITON_DEVICE)
    return LLM(str(folder), kv_cache_bytes=4 << 20, **kwargs)


PROMPT = random_prompts(1, (60,), VOCAB)[0]

# the Triton kernels run under the interpreter (slow: one setting)
SETTINGS = {"one-chunk": {}, "chunks-of-7": {"prefill_chunk": 7}, "exact": {"exact": True},
            "triton-exact-chunks": {"backend": "triton", "exact": True, "prefill_chunk": 16}}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_logits_match_transformers(hf: transformers.PreTrainedModel, folder: Path,
                                   setting: str) -> None:
    ref = hf_logits(hf, PROMPT)
    assert ref.std() > 0.5, "the random model is too close to uniform to test anything"
    assert_close_logits(engine(folder, **SETTINGS[setting]).logits(PROMPT), ref)


def test_probabilities_as_they_are_without_norm_topk_prob(tmp_path: Path) -> None:
    model = build_hf(seed=1, norm_topk_prob=False, num_experts_per_tok=3)
    model.save_pretrained(str(tmp_path))
    llm = engine(tmp_path)
    assert not llm.model_config.norm_topk_prob and llm.model_config.experts_per_token == 3
    assert_close_logits(llm.logits(PROMPT), hf_logits(model, PROMPT))


def test_the_checkpoint_holds_one_tensor_per_expert(folder: Path) -> None:
    """What transformers saves is what the table names; the model stacks the experts."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    cfg = loader.load_config(loader.resolve(folder))
    assert saved == loader.expected_shapes(cfg)
    assert saved["model.layers.1.mlp.experts.7.gate_proj.weight"] == (32, 64)
    assert saved["model.layers.1.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert saved["model.layers.0.mlp.gate.weight"] == (8, 64)
    layer = engine(folder).engine.runner.model.layers[1]
    assert layer.experts_gate_up.shape == (8, 64, 64) and layer.experts_down.shape == (8, 64, 32)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        up = f.get_tensor("model.layers.1.mlp.experts.5.up_proj.weight")
        down = f.get_tensor("model.layers.1.mlp.experts.5.down_proj.weight")
    assert torch.equal(layer.experts_gate_up[5, 32:], up)
    assert torch.equal(layer.experts_down[5], down)


def test_tensor_parallel_slices_cut_every_expert(folder: Path) -> None:
    """Each expert's gate/up by rows, down by columns, the router whole: the slices of two
    ranks read from the file join into the whole tensors."""
    source = loader.resolve(folder)
    cfg = loader.load_config(source)
    whole = loader.load_weights(source, cfg)
    shards = [loader.load_weights(source, cfg, parallel.TPGroup(2, r)) for r in range(2)]
    assert shards[0]["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (16, 64)
    assert shards[0]["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (64, 16)
    assert shards[1]["model.layers.0.mlp.gate.weight"].shape == (8, 64)
    for name, w in whole.items():
        dim = parallel.split_dim(name)
        joined = w if dim is None else torch.cat([s[name] for s in shards], dim)
        assert torch.equal(joined, w) and torch.equal(shards[1][name], parallel.shard_tensor(
            name, w, parallel.TPGroup(2, 1))), name
    assert parallel.shard_config(cfg, 2).moe_intermediate_size == 16
    with pytest.raises(ConfigError, match="moe_intermediate_size = 32"):
        parallel.check_divisible(cfg, 3)


@pytest.mark.parametrize("method", TINY_METHODS[1:], ids=TINY_IDS[1:])
def test_every_method_gives_plain_tokens(family_llm: LLM, family_prompts: list[list[int]],
                                         family_plain: list[list[int]], method: dict) -> None:
    outs = family_llm.generate(family_prompts, PARAMS, speculative=tiny_spec(method))
    assert [o.token_ids for o in outs] == family_plain
    if method["method"] != "full":
        assert outs[0].stats["budget_mean"] < 0.5 * len(family_prompts[0])  # the drafts are sparse


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_draft_copies_leave_the_experts_to_the_model(folder: Path, family_prompts: list[list[int]],
                                                     kind: str) -> None:
    """Draft copies of attention's projections only; the experts' own weights serve the
    drafts, on the static shapes' buffers too, and the tokens stay plain decoding's."""
    llm = engine(folder, draft_weights=kind, static_shapes=True)
    layer = llm.engine.runner.model.layers[0]
    assert layer.drafts is not None and set(layer.drafts) == {"qkv", "o_proj"}
    plain = [o.token_ids for o in llm.generate(family_prompts, PARAMS, speculative=PLAIN)]
    outs = llm.generate(family_prompts, PARAMS, speculative=tiny_spec({"method": "vegas"}))
    assert [o.token_ids for o in outs] == plain


def test_a_prompt_alone_gives_its_tokens_in_a_batch_in_exact_mode(
        folder: Path, family_prompts: list[list[int]]) -> None:
    """bfloat16, where rounding shows: a prompt alone (prefilled in chunks of 16) against the
    batch (one chunk). The fused kernel's rows: tests/kernels/test_fused_moe.py."""
    batch = engine(folder, exact=True, dtype="bfloat16")
    chunked = engine(folder, exact=True, dtype="bfloat16", prefill_chunk=16)
    together = [o.token_ids for o in batch.generate(family_prompts, PARAMS, speculative=PLAIN)]
    alone = [chunked.generate([p], PARAMS, speculative=PLAIN)[0].token_ids for p in family_prompts]
    assert alone == together


def test_triton_kernels_on_fixed_shapes_give_plain_tokens(folder: Path,
                                                          family_prompts: list[list[int]]) -> None:
    """The fused kernel in decode, draft and verify steps (the interpreter is slow: vegas, a
    short prompt, the static shapes' buffers a GPU captures)."""
    llm = engine(folder, backend="triton", static_shapes=True)
    short, params = [family_prompts[0][:18]], SamplingParams(max_tokens=4, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(short, params, speculative=PLAIN)]
    outs = llm.generate(short, params, speculative=tiny_spec({"method": "vegas"}))
    assert [o.token_ids for o in outs] == plain


LAYOUTS = {"decoder_sparse_step": 2, "mlp_only_layers": [1]}


@pytest.mark.parametrize("field", list(LAYOUTS))
def test_a_layout_with_dense_layers_is_refused(folder: Path, tmp_path: Path, field: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    config[field] = LAYOUTS[field]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        LLM(str(tmp_path), load_format="dummy", kv_cache_bytes=1 << 20)
    message = str(err.value)
    assert "\n" not in message and "Qwen3MoeForCausalLM with dense layers" in message
    assert f"{field}={LAYOUTS[field]}" in message


def test_more_experts_a_token_than_experts_is_refused() -> None:
    config = {**TINY_MOE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts_per_tok": 9}
    with pytest.raises(ConfigError, match="^num_experts_per_tok=9 is more than the 8 experts$"):
        ModelConfig.from_hf(config)


def test_gguf_files_of_the_family_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="^GGUF architecture 'qwen3moe' is Qwen3MoeForCausalLM, "
                                          "which is read from safetensors checkpoints only"):
        registry.by_gguf("qwen3moe")
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'foo'"):
        registry.by_gguf("foo")
