"""Qwen3-MoE on a tiny random checkpoint written by transformers itself: the same logits as
transformers (one prefill chunk or many, both backends, exact mode), the checkpoint's
per-expert tensors read by the family's table and cut for tensor parallelism, greedy output
of every speculative method equal to plain decoding's (default and exact mode, model or FP8
/INT4 draft copies), and layouts the family does not run refused in one line; the same
model as llama.cpp's qwen3moe GGUF file (F32, Q8_0 experts) read to the same weights and
logits."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from conftest import (
    TINY_IDS,
    TINY_METHODS,
    assert_close_logits,
    assert_gguf_weights_equal,
    assert_vegas_gives_plain_tokens,
    close_gguf,
    family_engine,
    gguf_expert_fields,
    gguf_model_fields,
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



PROMPT = random_prompts(1, (60,), VOCAB)[0]

# the Triton kernels run under the interpreter (slow: one setting)
SETTINGS = {"one-chunk": {}, "chunks-of-7": {"prefill_chunk": 7}, "exact": {"exact": True},
            "triton-exact-chunks": {"backend": "triton", "exact": True, "prefill_chunk": 16}}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_logits_match_transformers(hf: transformers.PreTrainedModel, folder: Path,
                                   setting: str) -> None:
    ref = hf_logits(hf, PROMPT)
    assert ref.std() > 0.5, "the random model is too close to uniform to test anything"
    assert_close_logits(family_engine(folder, **SETTINGS[setting]).logits(PROMPT), ref)


def test_probabilities_as_they_are_without_norm_topk_prob(tmp_path: Path) -> None:
    model = build_hf(seed=1, norm_topk_prob=False, num_experts_per_tok=3)
    model.save_pretrained(str(tmp_path))
    llm = family_engine(tmp_path)
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
    layer = family_engine(folder).engine.runner.model.layers[1]
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
    llm = family_engine(folder, draft_weights=kind, static_shapes=True)
    layer = llm.engine.runner.model.layers[0]
    assert layer.drafts is not None and set(layer.drafts) == {"qkv", "o_proj"}
    plain = [o.token_ids for o in llm.generate(family_prompts, PARAMS, speculative=PLAIN)]
    outs = llm.generate(family_prompts, PARAMS, speculative=tiny_spec({"method": "vegas"}))
    assert [o.token_ids for o in outs] == plain


def test_a_prompt_alone_gives_its_tokens_in_a_batch_in_exact_mode(
        folder: Path, family_prompts: list[list[int]]) -> None:
    """bfloat16, where rounding shows: a prompt alone (prefilled in chunks of 16) against the
    batch (one chunk). The fused kernel's rows: tests/kernels/test_fused_moe.py."""
    batch = family_engine(folder, exact=True, dtype="bfloat16")
    chunked = family_engine(folder, exact=True, dtype="bfloat16", prefill_chunk=16)
    together = [o.token_ids for o in batch.generate(family_prompts, PARAMS, speculative=PLAIN)]
    alone = [chunked.generate([p], PARAMS, speculative=PLAIN)[0].token_ids for p in family_prompts]
    assert alone == together


def test_triton_kernels_on_fixed_shapes_give_plain_tokens(folder: Path,
                                                          family_prompts: list[list[int]]) -> None:
    """The fused kernel in decode, draft and verify steps (the interpreter is slow: vegas, a
    short prompt, the static shapes' buffers a GPU captures)."""
    llm = family_engine(folder, backend="triton", static_shapes=True)
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


# --- llama.cpp's qwen3moe GGUF files ----------------------------------------------------------

GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "mlp.gate": "ffn_gate_inp"}
EXPERT_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def gguf_tensors(model: transformers.PreTrainedModel) -> dict[str, np.ndarray]:
    """model's tensors by llama.cpp's qwen3moe names: q/k as they are (not permuted), each
    layer's experts stacked, gate [E, I, hidden], up [E, I, hidden], down [E, hidden, I]."""
    out = {}
    for key, t in model.state_dict().items():
        a = t.float().numpy()
        if key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[{"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[key]] = a
            continue
        layer, rest = key.split(".")[2], ".".join(key.split(".")[3:])
        blk = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, hidden]: gate rows, then up rows
            half = a.shape[1] // 2
            out[blk + "ffn_gate_exps.weight"] = a[:, :half]
            out[blk + "ffn_up_exps.weight"] = a[:, half:]
        elif rest == "mlp.experts.down_proj":
            out[blk + "ffn_down_exps.weight"] = a
        else:
            out[blk + GGUF_NAMES[rest.rpartition(".")[0]] + ".weight"] = a
    return {name: np.ascontiguousarray(a) for name, a in out.items()}


def write_gguf(path: Path, model: transformers.PreTrainedModel, quantized: Any = None,
               weights_norm: bool | None = None, flat: str = "") -> None:
    """model as a qwen3moe GGUF (F32 tensors; the experts' stacks in `quantized`, a GGML
    type, where given; the tensor named `flat` 2-D), with a byte-level vocabulary of VOCAB
    tokens for the tokenizer."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    gguf_model_fields(w, cfg)
    gguf_expert_fields(w, cfg.head_dim, cfg.num_experts, cfg.num_experts_per_tok,
                       cfg.moe_intermediate_size)
    if weights_norm is not None:
        w.add_expert_weights_norm(weights_norm)
    chars = bytes_to_unicode()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([chars[b] for b in range(VOCAB - 2)] + [chars[32] + "t", chars[32] + "a"])
    w.add_token_merges([f"{chars[32]} t", f"{chars[32]} a"])  # transformers reads one as a string
    w.add_token_types([1] * VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, a in gguf_tensors(model).items():
        if name == flat:
            w.add_tensor(name, a.reshape(-1, a.shape[-1]))
        elif quantized is not None and name.split(".")[-2] in EXPERT_STACKS:
            w.add_tensor(name, gguf.quants.quantize(a, quantized), raw_dtype=quantized)
        else:
            w.add_tensor(name, a)
    close_gguf(w)


@pytest.fixture(scope="module")
def gguf_path(hf: transformers.PreTrainedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-moe-gguf") / "tiny-qwen3moe.F32.gguf"
    write_gguf(path, hf)
    return path


def test_gguf_config_is_the_checkpoints(folder: Path, gguf_path: Path) -> None:
    """The qwen3moe keys give the config of the HF checkpoint (norm_topk_prob: llama.cpp
    renormalises where the file says nothing)."""
    ours = loader.load_config(loader.resolve(gguf_path))
    want = loader.load_config(loader.resolve(folder))
    assert registry.by_gguf("qwen3moe") is registry.family("Qwen3MoeForCausalLM")
    assert ours.architecture == "Qwen3MoeForCausalLM"
    assert (ours.num_experts, ours.experts_per_token, ours.moe_intermediate_size,
            ours.norm_topk_prob) == (8, 2, 32, True)
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "tie_word_embeddings", "num_experts", "experts_per_token",
                  "moe_intermediate_size", "norm_topk_prob"):
        assert getattr(ours, field) == getattr(want, field), field
    for field in ("rms_norm_eps", "rope_theta"):  # GGUF stores them as float32
        assert getattr(ours, field) == pytest.approx(getattr(want, field), rel=1e-6), field


def test_gguf_weights_are_the_checkpoints(folder: Path, gguf_path: Path) -> None:
    """The stacked experts become the table's per-expert tensors, equal to transformers'."""
    assert_gguf_weights_equal(folder, gguf_path)
    source = loader.resolve(folder)
    cfg = loader.load_config(source)
    want = loader.load_weights(source, cfg)
    half = [loader.load_weights(loader.resolve(gguf_path), cfg, parallel.TPGroup(2, r))
            for r in range(2)]
    assert half[1]["model.layers.1.mlp.experts.6.up_proj.weight"].shape == (16, 64)
    assert torch.equal(half[1]["model.layers.1.mlp.experts.6.down_proj.weight"],
                       want["model.layers.1.mlp.experts.6.down_proj.weight"][:, 16:])


def test_gguf_weights_come_in_the_models_dtype(gguf_path: Path) -> None:
    """Each tensor is cast to the model's dtype as it is read (the host never holds the
    whole model in float32): the float32 tensors rounded, experts and TP slices too."""
    source = loader.resolve(gguf_path)
    cfg = loader.load_config(source)
    whole = loader.load_weights(source, cfg)
    for tp in (parallel.SINGLE, parallel.TPGroup(2, 1)):
        cast = loader.load_weights(source, cfg, tp, torch.bfloat16)
        assert cast.keys() == whole.keys()
        for name, w in whole.items():
            want = parallel.shard_tensor(name, w, tp).to(torch.bfloat16)
            assert cast[name].dtype == torch.bfloat16 and torch.equal(cast[name], want), name


@pytest.mark.parametrize("setting", ["one-chunk", "exact"])
def test_gguf_logits_match_transformers(hf: transformers.PreTrainedModel, gguf_path: Path,
                                        setting: str) -> None:
    assert_close_logits(family_engine(gguf_path, **SETTINGS[setting]).logits(PROMPT),
                        hf_logits(hf, PROMPT))


def test_quantized_gguf_experts_give_transformers_logits_on_their_values(
        hf: transformers.PreTrainedModel, tmp_path: Path) -> None:
    """Q8_0 expert stacks: the logits of transformers' model holding the dequantised values
    (and not those of the unquantised one)."""
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    write_gguf(tmp_path / "tiny.Q8_0.gguf", hf, quantized=q8)
    ref = copy.deepcopy(hf)
    tensors = gguf_tensors(hf)
    back = {name: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, q8), q8))
            for name, a in tensors.items() if name.split(".")[-2] in EXPERT_STACKS}
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            experts = layer.mlp.experts
            experts.gate_up_proj.copy_(torch.cat([back[f"blk.{i}.ffn_gate_exps.weight"],
                                                  back[f"blk.{i}.ffn_up_exps.weight"]], dim=1))
            experts.down_proj.copy_(back[f"blk.{i}.ffn_down_exps.weight"])
    got = family_engine(tmp_path / "tiny.Q8_0.gguf").logits(PROMPT)
    assert_close_logits(got, hf_logits(ref, PROMPT))
    assert not torch.allclose(got, hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


def test_gguf_expert_weights_norm_false_keeps_the_probabilities(tmp_path: Path) -> None:
    model = build_hf(seed=1, norm_topk_prob=False, num_experts_per_tok=3)
    write_gguf(tmp_path / "tiny.gguf", model, weights_norm=False)
    llm = family_engine(tmp_path / "tiny.gguf")
    assert not llm.model_config.norm_topk_prob and llm.model_config.experts_per_token == 3
    assert_close_logits(llm.logits(PROMPT), hf_logits(model, PROMPT))


def test_vegas_on_the_gguf_gives_plain_tokens(gguf_path: Path,
                                              family_prompts: list[list[int]]) -> None:
    assert_vegas_gives_plain_tokens(gguf_path, family_prompts)


def test_an_expert_tensor_that_is_not_a_stack_is_refused(hf: transformers.PreTrainedModel,
                                                         tmp_path: Path) -> None:
    write_gguf(tmp_path / "flat.gguf", hf, flat="blk.0.ffn_up_exps.weight")
    with pytest.raises(loader.WeightError, match=r"blk\.0\.ffn_up_exps\.weight has shape "
                                                 r"\(256, 64\), not the experts' stack"):
        family_engine(tmp_path / "flat.gguf")


def test_gguf_architectures_not_read_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'foo'; supported: "
                                          "llama, mistral, qwen2, qwen3, qwen3moe, gpt-oss$"):
        registry.by_gguf("foo")
