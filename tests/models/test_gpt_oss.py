"""gpt-oss on a tiny random checkpoint written by transformers itself: the same logits as
transformers on prompts longer than the sliding window (one prefill chunk or many, exact
mode), the fused 3-D expert tensors read by the family's table (and cut for tensor
parallelism), greedy output of every speculative method equal to plain decoding's (default
and exact mode), and the variants the family does not run refused in one line; the same
model as llama.cpp's gpt-oss GGUF file (F32, MXFP4 experts) read to the same config, weights
and logits. MXFP4 expert weights of safetensors checkpoints: tests/models/test_mxfp4.py."""

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
from transformers.convert_slow_tokenizer import bytes_to_unicode

from vegas_spec import parallel
from vegas_spec.attention.torch_backend import paged_attention_ref
from vegas_spec.config import ConfigError, ModelConfig, SamplingParams, SpecConfig
from vegas_spec.engine import LLM
from vegas_spec.models import loader, registry

VOCAB = 256
WINDOW = 8
LIMIT = 1.5  # a clamp the random model's activations reach (the published models': 7)
TINY_OSS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
                initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                 "original_max_position_embeddings": 64})
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
PLAIN = SpecConfig(method="vanilla")


def build_hf(seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A random float32 gpt-oss whose norms, biases and sinks are random too, its SwiGLU
    clamped at LIMIT."""
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**{**TINY_OSS, **overrides})
    model = transformers.GptOssForCausalLM(config).float().eval()
    randomize_norms_and_biases(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.experts.limit = LIMIT
    return model


def save(model: transformers.PreTrainedModel, path: Path) -> Path:
    """The checkpoint, its config saying the clamp (transformers reads none: it is fixed)."""
    model.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "swiglu_limit": LIMIT}))
    return path


@pytest.fixture(scope="module")
def hf() -> transformers.PreTrainedModel:
    return build_hf()


@pytest.fixture(scope="module")
def folder(hf: transformers.PreTrainedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(hf, tmp_path_factory.mktemp("gpt-oss"))



PROMPT = random_prompts(1, (40,), VOCAB)[0]  # five sliding windows

# the Triton kernels run under the interpreter (slow: one setting)
SETTINGS = {"one-chunk": {}, "chunks-of-7": {"prefill_chunk": 7}, "exact": {"exact": True},
            "exact-chunks-of-16": {"exact": True, "prefill_chunk": 16},
            "triton-chunks-of-16": {"backend": "triton", "prefill_chunk": 16},
            "triton-exact-chunks-of-16": {"backend": "triton", "exact": True,
                                          "prefill_chunk": 16}}


def test_the_config_reads_windows_sinks_and_experts(folder: Path) -> None:
    cfg = loader.load_config(loader.resolve(folder))
    assert cfg.layer_windows == (WINDOW, 0, WINDOW, 0) and cfg.sliding_window is None
    assert cfg.sinks and cfg.qkv_bias and cfg.o_bias and cfg.router_bias and cfg.expert_bias
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.swiglu_limit == LIMIT and cfg.norm_topk_prob
    assert cfg.rope["rope_type"] == "yarn" and cfg.rope["factor"] == 32.0


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_logits_match_transformers(hf: transformers.PreTrainedModel, folder: Path,
                                   setting: str) -> None:
    ref = hf_logits(hf, PROMPT)
    assert ref.std() > 0.5, "the random model is too close to uniform to test anything"
    assert_close_logits(family_engine(folder, **SETTINGS[setting]).logits(PROMPT), ref)


def test_sinks_windows_and_the_clamp_change_the_logits(hf: transformers.PreTrainedModel,
                                                       folder: Path) -> None:
    """Each of the three is exercised: without it transformers' own logits move."""
    ref = hf_logits(hf, PROMPT)
    model = build_hf()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert (hf_logits(model, PROMPT) - ref).abs().max() > 0.1
    model = build_hf(layer_types=["full_attention"] * 4)
    assert (hf_logits(model, PROMPT) - ref).abs().max() > 0.1
    model = build_hf()
    for layer in model.model.layers:
        layer.mlp.experts.limit = 1e4
    assert (hf_logits(model, PROMPT) - ref).abs().max() > 0.1


def test_the_checkpoint_holds_fused_expert_tensors(folder: Path) -> None:
    """What transformers saves is what the table names; the layer holds gate rows, then up
    rows, as the shared MoE layer reads them."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        gate_up = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj")
        bias = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_bias")
        down = f.get_tensor("model.layers.1.mlp.experts.down_proj")
    cfg = loader.load_config(loader.resolve(folder))
    assert saved == loader.expected_shapes(cfg)
    assert saved["model.layers.1.mlp.experts.gate_up_proj"] == (4, 64, 64)
    assert saved["model.layers.1.mlp.experts.down_proj"] == (4, 32, 64)
    assert saved["model.layers.0.self_attn.sinks"] == (4,)
    layer = family_engine(folder).engine.runner.model.layers[1]
    assert torch.equal(layer.experts_gate_up[3, :32], gate_up[3, :, 0::2].T)
    assert torch.equal(layer.experts_gate_up[3, 32:], gate_up[3, :, 1::2].T)
    assert torch.equal(layer.experts_gate_up_bias[3, 32:], bias[3, 1::2])
    assert torch.equal(layer.experts_down[2], down[2].T)


def test_tensor_parallel_slices_cut_every_expert(folder: Path) -> None:
    """The experts' intermediate axis and the sink heads are cut; the slices of two ranks
    read from the file join into the whole tensors."""
    source = loader.resolve(folder)
    cfg = loader.load_config(source)
    whole = loader.load_weights(source, cfg)
    shards = [loader.load_weights(source, cfg, parallel.TPGroup(2, r)) for r in range(2)]
    assert shards[0]["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 32)
    assert shards[1]["model.layers.0.mlp.experts.down_proj"].shape == (4, 16, 64)
    assert shards[1]["model.layers.0.self_attn.sinks"].shape == (2,)
    for name, w in whole.items():
        dim = parallel.split_dim(name)
        joined = w if dim is None else torch.cat([s[name] for s in shards], dim)
        assert torch.equal(joined, w), name


@pytest.mark.parametrize("method", TINY_METHODS[1:], ids=TINY_IDS[1:])
def test_every_method_gives_plain_tokens(family_llm: LLM, family_prompts: list[list[int]],
                                         family_plain: list[list[int]], method: dict) -> None:
    outs = family_llm.generate(family_prompts, PARAMS, speculative=tiny_spec(method))
    assert [o.token_ids for o in outs] == family_plain


# The Triton backend's settings and the methods each runs (the interpreter is slow: a short
# prompt, 4 tokens): vegas's scored verify pass, quest's selector inside the draft steps.
TRITON_MODES = {"default": ({}, [{"method": "vegas"}, {"method": "quest"}]),
                "exact": ({"exact": True, "dtype": "bfloat16"}, [{"method": "vegas"}])}


@pytest.mark.parametrize("mode", list(TRITON_MODES))
def test_triton_backend_on_fixed_shapes_gives_plain_tokens(folder: Path,
                                                           family_prompts: list[list[int]],
                                                           mode: str) -> None:
    """The Triton backend's kernels with sinks, windows and gpt-oss's experts (prefill,
    decode, sparse draft, verify with scores, fused MoE) on the static shapes' buffers a GPU
    captures: the methods' tokens are plain decoding's, past the window, and in the default
    mode the torch backend's."""
    kwargs, methods = TRITON_MODES[mode]
    llm = family_engine(folder, backend="triton", static_shapes=True, max_model_len=48, **kwargs)
    short, params = [family_prompts[0][:18]], SamplingParams(max_tokens=4, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(short, params, speculative=PLAIN)]
    for method in methods:
        outs = llm.generate(short, params, speculative=tiny_spec(method))
        assert [o.token_ids for o in outs] == plain, method
    if not kwargs:
        torch_plain = family_engine(folder).generate(short, params, speculative=PLAIN)[0].token_ids
        assert plain == [torch_plain]


def test_plain_tokens_are_transformers_greedy_tokens(hf: transformers.PreTrainedModel,
                                                     folder: Path,
                                                     family_prompts: list[list[int]]) -> None:
    """Decoding past the window, token by token, as transformers' own greedy generation."""
    llm = family_engine(folder)
    ours = llm.generate(family_prompts[:1], PARAMS, speculative=PLAIN)[0].token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor(family_prompts[:1]), max_new_tokens=8, do_sample=False)
    assert ours == ref[0, len(family_prompts[0]):].tolist()


def write_config(folder: Path, tmp_path: Path, **changes: Any) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    return tmp_path


REFUSED = {
    "layer type": ({"layer_types": ["sliding_attention", "chunked_attention",
                                    "full_attention", "full_attention"]},
                   "unsupported layer_types chunked_attention; supported: sliding_attention, "
                   "full_attention"),
    "layer count": ({"layer_types": ["full_attention"] * 3},
                    "layer_types names 3 layers, num_hidden_layers is 4"),
    "quantization": ({"quantization_config": {"quant_method": "fp8"}},
                     "GptOssForCausalLM quantized as 'fp8' is not supported"),
    "top-k": ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 is more than the 4 experts"),
    "window": ({"sliding_window": 0}, "'sliding_window' must be a positive integer, got 0"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_variants_are_refused_in_one_line(folder: Path, tmp_path: Path,
                                                      case: str) -> None:
    changes, expected = REFUSED[case]
    path = write_config(folder, tmp_path, **changes)
    with pytest.raises(ConfigError) as err:
        LLM(str(path), load_format="dummy", kv_cache_bytes=1 << 20)
    assert "\n" not in str(err.value) and expected in str(err.value)


def test_every_layer_full_needs_no_window() -> None:
    config = {**TINY_OSS, "architectures": ["GptOssForCausalLM"], "sliding_window": None,
              "layer_types": ["full_attention"] * 4}
    assert ModelConfig.from_hf(config).layer_windows == (0, 0, 0, 0)


def test_weight_scores_count_the_sink_in_their_denominator() -> None:
    """vegas's verify-pass weights with sinks: each head's softmax over [sink, keys], the sink
    dropped, summed over the heads; on a sliding layer only the window's keys score."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 16, generator=gen)  # two rows, 4 heads over 2 kv heads
    k_cache, v_cache = torch.randn(16, 2, 16, generator=gen), torch.randn(16, 2, 16, generator=gen)
    table, positions = torch.tensor([[0]]), torch.tensor([[5, 6]])
    sinks = torch.tensor([3.0, -1.0, 0.5, 2.0])
    _, scores = paged_attention_ref(q, k_cache, v_cache, table, positions, 16, 7, 0.25,
                                    torch.tensor([0, 1]), "weight", sinks=sinks)
    assert scores is not None and scores.shape == (1, 2, 1, 7)
    for row, pos in enumerate((5, 6)):
        expected = torch.zeros(7)
        for h in range(4):
            logits = (k_cache[: pos + 1, h // 2] @ q[0, row, h]) * 0.25
            expected[: pos + 1] += torch.softmax(torch.cat([sinks[h:h + 1], logits]), 0)[1:]
        torch.testing.assert_close(scores[0, row, 0], expected)
    _, windowed = paged_attention_ref(q, k_cache, v_cache, table, positions, 16, 7, 0.25,
                                      torch.tensor([1]), "weight", sinks=sinks, window=3)
    assert windowed is not None and not windowed[0, 0, 0, :4].any() and windowed[0, 0, 0, 4:].all()


# --- llama.cpp's gpt-oss GGUF -----------------------------------------------------------------

GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
              "mlp.router": "ffn_gate_inp"}
EXPERT_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
BYTES = bytes_to_unicode()  # GPT-2's byte -> character map of byte-level BPE vocabularies
SPACE = BYTES[32]
# the bytes but the last three, " t" and " a" (merged), and a control token
GGUF_TOKENS = [BYTES[b] for b in range(VOCAB - 3)] + [SPACE + "t", SPACE + "a", "<|end|>"]


def gguf_tensors(model: transformers.PreTrainedModel,
                 fused: bool = False) -> dict[str, np.ndarray]:
    """model's tensors as llama.cpp's converter writes a gpt-oss GGUF: q/k not permuted, the
    sinks `attn_sinks.weight`, each layer's fused gate/up stack [E, hidden, 2I] (interleaved)
    cut into gate and up stacks [E, I, hidden] and their biases [E, I] (fused: one
    `ffn_gate_up_exps` stack [E, 2I, hidden], gate rows then up rows, and its bias), down
    [E, hidden, I]."""
    out = {"token_embd.weight": model.model.embed_tokens.weight,
           "output_norm.weight": model.model.norm.weight, "output.weight": model.lm_head.weight}
    for i, layer in enumerate(model.model.layers):
        blk = f"blk.{i}."
        for key, t in layer.state_dict().items():
            module, _, leaf = key.rpartition(".")
            if module in GGUF_NAMES:
                out[f"{blk}{GGUF_NAMES[module]}.{leaf}"] = t
        out[blk + "attn_sinks.weight"] = layer.self_attn.sinks
        experts = layer.mlp.experts
        rows = experts.gate_up_proj.transpose(1, 2)  # [E, 2I, hidden], gate and up alternating
        bias = experts.gate_up_proj_bias
        for first, part in enumerate(("ffn_gate_exps", "ffn_up_exps")):
            out[f"{blk}{part}.weight"] = rows[:, first::2]
            out[f"{blk}{part}.bias"] = bias[:, first::2]
        if fused:
            for kind in ("weight", "bias"):
                gate, up = (out.pop(f"{blk}{part}.{kind}") for part in ("ffn_gate_exps",
                                                                          "ffn_up_exps"))
                out[f"{blk}ffn_gate_up_exps.{kind}"] = torch.cat([gate, up], dim=1)
        out[blk + "ffn_down_exps.weight"] = experts.down_proj.transpose(1, 2)
        out[blk + "ffn_down_exps.bias"] = experts.down_proj_bias
    return {name: np.ascontiguousarray(t.detach().float().numpy()) for name, t in out.items()}


def write_gguf(path: Path, model: transformers.PreTrainedModel, quantized: Any = None,
               drop: str = "", fused: bool = False) -> Path:
    """model as a gpt-oss GGUF (F32 tensors; the expert stacks' weights in `quantized`, a
    GGML type, where given; without the tensor named `drop`), its clamp under a
    `swiglu_limit` key, with a byte-level BPE vocabulary as the published files have one
    (pre-tokenizer "gpt-4o"): bytes, two merged tokens and a control token, the EOS."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    gguf_model_fields(w, cfg)
    gguf_expert_fields(w, cfg.head_dim, cfg.num_local_experts, cfg.num_experts_per_tok,
                       cfg.intermediate_size)
    w.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_float32("gpt-oss.swiglu_limit", LIMIT)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(GGUF_TOKENS)
    w.add_token_merges([f"{SPACE} t", f"{SPACE} a"])
    w.add_token_types([1] * (VOCAB - 1) + [3])
    w.add_bos_token_id(1)
    w.add_eos_token_id(VOCAB - 1)
    for name, a in gguf_tensors(model, fused).items():
        if name == drop:
            continue
        if quantized is not None and name.endswith(".weight") \
                and name.split(".")[-2] in EXPERT_STACKS:
            w.add_tensor(name, gguf.quants.quantize(a, quantized), raw_dtype=quantized)
        else:
            w.add_tensor(name, a)
    close_gguf(w)
    return path


@pytest.fixture(scope="module")
def gguf_path(hf: transformers.PreTrainedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gpt-oss-gguf") / "tiny-gpt-oss.F32.gguf", hf)


def test_gguf_config_is_the_checkpoints(folder: Path, gguf_path: Path) -> None:
    """The gpt-oss keys give the checkpoint's config: windows on every other layer from the
    first, sinks and biases, the experts, YaRN without truncation, the clamp."""
    ours = loader.load_config(loader.resolve(gguf_path))
    want = loader.load_config(loader.resolve(folder))
    assert registry.by_gguf("gpt-oss") is registry.family("GptOssForCausalLM")
    for field in ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "tie_word_embeddings", "layer_windows", "sinks",
                  "qkv_bias", "o_bias", "router_bias", "expert_bias", "num_experts",
                  "experts_per_token", "moe_intermediate_size", "norm_topk_prob",
                  "swiglu_limit"):
        assert getattr(ours, field) == getattr(want, field), field
    for key in ("rope_type", "factor", "original_max_position_embeddings", "truncate"):
        assert ours.rope[key] == want.rope[key], key
    for field in ("rms_norm_eps", "rope_theta"):  # GGUF stores them as float32
        assert getattr(ours, field) == pytest.approx(getattr(want, field), rel=1e-6), field


def test_gguf_weights_are_the_checkpoints(hf: transformers.PreTrainedModel, folder: Path,
                                          gguf_path: Path, tmp_path: Path) -> None:
    """The gate and up stacks joined back into the checkpoint's fused tensors (and their
    biases), down transposed back: every tensor equal to the safetensors', TP slices too;
    likewise from the converter's fused gate/up stacks."""
    assert_gguf_weights_equal(folder, gguf_path, world=2)
    assert_gguf_weights_equal(folder, write_gguf(tmp_path / "fused.gguf", hf, fused=True))


def test_gguf_logits_match_transformers(hf: transformers.PreTrainedModel, gguf_path: Path) -> None:
    assert_close_logits(family_engine(gguf_path).logits(PROMPT), hf_logits(hf, PROMPT))


def test_mxfp4_gguf_experts_give_transformers_logits_on_their_values(
        hf: transformers.PreTrainedModel, tmp_path: Path) -> None:
    """MXFP4 expert stacks, as the published GGUF files hold them: the logits of
    transformers' model holding the dequantised values (and not those of the original)."""
    import gguf

    mx = gguf.GGMLQuantizationType.MXFP4
    path = write_gguf(tmp_path / "tiny.MXFP4.gguf", hf, quantized=mx)
    back = {name: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, mx), mx))
            for name, a in gguf_tensors(hf).items()
            if name.endswith(".weight") and name.split(".")[-2] in EXPERT_STACKS}
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            experts = layer.mlp.experts
            gate, up = back[f"blk.{i}.ffn_gate_exps.weight"], back[f"blk.{i}.ffn_up_exps.weight"]
            experts.gate_up_proj.copy_(torch.stack([gate, up], 2).flatten(1, 2).transpose(1, 2))
            experts.down_proj.copy_(back[f"blk.{i}.ffn_down_exps.weight"].transpose(1, 2))
    got = family_engine(path).logits(PROMPT)
    assert_close_logits(got, hf_logits(ref, PROMPT))
    assert not torch.allclose(got, hf_logits(hf, PROMPT), atol=1e-3, rtol=0)


def test_vegas_on_the_gguf_gives_plain_tokens(gguf_path: Path,
                                              family_prompts: list[list[int]]) -> None:
    assert_vegas_gives_plain_tokens(gguf_path, family_prompts)


def test_the_gguf_vocabulary_is_built_where_transformers_does_not_convert_it(
        gguf_path: Path) -> None:
    """transformers converts no gpt-oss vocabulary: the byte-level BPE is built from the
    file (its merges, gpt-4o's pre-tokenizer, the control token special, the EOS), every
    text round-trips, and the cached copy is the same tokenizer."""
    from vegas_spec.tokenizer import load_tokenizer

    for _ in range(2):  # converted, then read from the cache
        tok = load_tokenizer(loader.resolve(gguf_path))
        assert tok.eos_token == "<|end|>" and tok.eos_token_id == VOCAB - 1
        ids = tok("at ta<|end|>", add_special_tokens=False)["input_ids"]
        assert ids == [GGUF_TOKENS.index("a"), GGUF_TOKENS.index("t"),
                       GGUF_TOKENS.index(SPACE + "t"), GGUF_TOKENS.index("a"), VOCAB - 1]
        for text in ("a\n\n  b 12345 x!?", "Grüße, 世界"):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert max(ids) < VOCAB - 3 + 2 and tok.decode(ids) == text


def test_a_gguf_without_a_part_of_a_fused_tensor_is_refused(hf: transformers.PreTrainedModel,
                                                            tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "no-up.gguf", hf, drop="blk.1.ffn_up_exps.weight")
    with pytest.raises(loader.WeightError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj "
                                                 r"is made from tensors blk\.1\.ffn_gate_exps\."
                                                 r"weight, blk\.1\.ffn_up_exps\.weight; the file "
                                                 r"lacks blk\.1\.ffn_up_exps\.weight"):
        family_engine(path)
