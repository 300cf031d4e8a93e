"""FP8 draft weights (`draft_weights="fp8"`) end to end on the real SmolLM2 model: the draft
steps, and only they, read the FP8 copy; greedy output of every method stays plain
decoding's token for token, in float32 and, in exact mode, in bfloat16, on the dynamic path
and the static shapes' buffers; drafts stay useful (tokens per iteration)."""

from __future__ import annotations

import pytest
from conftest import essay_prompt, kv_bytes

from vegas_spec import LLM, SamplingParams, SpecConfig
from vegas_spec.attention import backend as backend_module
from vegas_spec.config import ConfigError
from vegas_spec.quant import Fp8Weight

METHODS = ["vegas", "lastq", "stream", "quest", "specextend", "full"]
MAX_TOKENS = 16
LENGTHS = ((900, 0), (1200, 7), (1500, 19))  # the prompts' tokens and first essays
# each prompt with its new tokens and a round of γ 6 resident at once
POOL = kv_bytes([n + 32 for n, _ in LENGTHS])


@pytest.fixture(scope="module")
def prompts(llm, essays) -> list[list[int]]:
    return [essay_prompt(llm.tokenizer, essays, n, offset) for n, offset in LENGTHS]


@pytest.fixture(scope="module")
def fp8_llm():
    """The embedded model with FP8 draft copies, on the static shapes' buffers (eager)."""
    return LLM(kv_cache_bytes=POOL, draft_weights="fp8", static_shapes=True,
               max_model_len=2048)


@pytest.fixture(scope="module")
def plain(fp8_llm, prompts):
    return fp8_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


def spec(method: str) -> SpecConfig:
    return SpecConfig(method=method, gamma=6, ratio=0.05, min_tokens=64, adaptive=False)


def test_the_copy_is_fp8_per_projection(fp8_llm) -> None:
    layer = fp8_llm.engine.runner.model.layers[0]
    assert layer.drafts is not None and set(layer.drafts) == {"qkv", "o_proj", "gate_up", "down"}
    for name, w in layer.drafts.items():
        assert isinstance(w, Fp8Weight) and w.shape == getattr(layer, name).weight.shape
    total = sum(w.nbytes for lay in fp8_llm.engine.runner.model.layers for w in lay.drafts.values())
    assert fp8_llm.engine.runner.draft_weight_bytes == total > 0


def test_only_draft_steps_read_the_copy(fp8_llm, prompts, plain,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = backend_module.fp8_linear_ref

    def counted(x, weight, bias=None):  # noqa: ANN001, ANN202
        calls.append(x.shape[-2] if x.dim() > 2 else 1)
        return real(x, weight, bias)

    monkeypatch.setattr(backend_module, "fp8_linear_ref", counted)
    fp8_llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    assert not calls  # plain decoding and prefill: the model's weights
    fp8_llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True),
                     speculative=spec("vegas"))
    assert calls and set(calls) == {1}  # one-row draft steps only, never the verify's 7


@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_with_fp8_drafts_is_plain(fp8_llm, prompts, plain, method: str) -> None:
    outs = fp8_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                            speculative=spec(method))
    for out, ref in zip(outs, plain):
        assert out.token_ids == ref.token_ids
    # full drafts read the model's weights (the oracle): every draft accepted
    floor = 6.9 if method == "full" else 1.5
    assert outs[0].stats["tokens_per_iteration"] >= floor


def test_dynamic_path_fp8_drafts(prompts, plain) -> None:
    llm = LLM(kv_cache_bytes=POOL, draft_weights="fp8")
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                        speculative=spec("vegas"))
    assert llm.engine.runner.graphs is None
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


@pytest.mark.parametrize("method", ["vegas", "quest"])
def test_bfloat16_exact_mode_fp8_drafts(prompts, method: str) -> None:
    """In bfloat16 the verify step and a plain step may round a near-tie apart unless exact
    mode makes every row batch-independent: then FP8 drafts change nothing either."""
    llm = LLM(kv_cache_bytes=POOL // 2, dtype="bfloat16", exact=True, draft_weights="fp8")
    short = [p[-400:] for p in prompts[:2]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = llm.generate(short, params)
    outs = llm.generate(short, params, speculative=SpecConfig(
        method=method, gamma=4, ratio=0.1, min_tokens=32, adaptive=False))
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def test_model_drafts_make_no_copy_and_bad_values_are_refused() -> None:
    with pytest.raises(ConfigError, match="draft_weights"):
        LLM(draft_weights="int3")
