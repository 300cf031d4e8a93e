"""FP8, INT8 and INT4 draft weights (`draft_weights="fp8"`, `"int8"`, `"int4"`) end to end on
the real SmolLM2 model: the draft steps, and only they, read the copy; greedy output of the policies
that differ in what their projections see stays plain decoding's token for token, in float32
and, in exact mode, in bfloat16, on the dynamic path and the static shapes' buffers; drafts
stay useful (tokens per iteration)."""

from __future__ import annotations

import pytest
from conftest import essay_prompt, kv_bytes

from vegas_spec import LLM, SamplingParams, SpecConfig
from vegas_spec.config import ConfigError
from vegas_spec.quant import Fp8Weight, Int4Weight, Int8Weight
from vegas_spec.speculative.policies import POLICIES

KINDS = {"fp8": Fp8Weight, "int8": Int8Weight, "int4": Int4Weight}

MAX_TOKENS = 16
LENGTHS = ((300, 0), (380, 7), (460, 19))  # the prompts' tokens and first essays
# each prompt with its new tokens and a round of γ 6 resident at once
POOL = kv_bytes([n + 32 for n, _ in LENGTHS])


@pytest.fixture(scope="module")
def prompts(essays) -> list[list[int]]:
    """Tokenized by the embedded model's tokenizer alone (no engine of its own)."""
    from vegas_spec.models.loader import resolve
    from vegas_spec.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve(None))
    return [essay_prompt(tokenizer, essays, n, offset) for n, offset in LENGTHS]


def cached_engine(prompts: list[list[int]], pool: int = POOL, **kwargs: object) -> LLM:
    """The embedded model with a prefix cache that holds `prompts`, filled before any output
    is compared: every generate then prefills only a prompt's last partial page, plain
    decoding's reference and the methods' runs alike (the same prefill, so the same first
    token and KV)."""
    llm = LLM(kv_cache_bytes=pool, prefix_cache_bytes=pool, **kwargs)
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    return llm


@pytest.fixture(scope="module", params=list(KINDS))
def draft_llm(request: pytest.FixtureRequest, prompts):
    """The embedded model with FP8, INT8 or INT4 draft copies, on the static shapes' buffers
    (eager), the prompts in its prefix cache; one kind alive at a time."""
    return cached_engine(prompts, draft_weights=request.param, static_shapes=True,
                         max_model_len=1024)


@pytest.fixture(scope="module")
def plain(draft_llm, prompts):
    return draft_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


def spec(method: str) -> SpecConfig:
    # budgets of 64 positions, a fifth of the contexts or less: every draft reads a selection
    return SpecConfig(method=method, gamma=6, ratio=0.1, min_tokens=64, adaptive=False)


def test_the_copy_is_of_its_kind_per_projection(draft_llm) -> None:
    kind = draft_llm.engine.draft_weight_kind
    layers = draft_llm.engine.runner.model.layers
    layer = layers[0]
    assert layer.drafts is not None and set(layer.drafts) == {"qkv", "o_proj", "gate_up", "down"}
    for name, w in layer.drafts.items():
        assert isinstance(w, KINDS[kind]) and w.shape == getattr(layer, name).weight.shape
    total = sum(w.nbytes for lay in layers for w in lay.drafts.values())
    # the weights, each float32 here
    model = sum(getattr(lay, name).weight.numel() for lay in layers for name in layer.drafts)
    assert draft_llm.engine.draft_weight_bytes == total > 0
    # a byte (FP8, INT8) or half a byte (INT4) a weight, and their scales (INT8 and INT4: 4
    # bytes a group of 64 or 128 inputs), against four
    assert total < {"fp8": 0.26, "int8": 0.27, "int4": 0.15}[kind] * 4 * model


def test_only_draft_steps_read_the_copy(draft_llm, prompts, plain,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    kind = KINDS[draft_llm.engine.draft_weight_kind]
    real = kind.ref

    def counted(weight, x, bias=None):  # noqa: ANN001, ANN202
        calls.append(x.shape[-2] if x.dim() > 2 else 1)
        return real(weight, x, bias)

    monkeypatch.setattr(kind, "ref", counted)
    draft_llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    assert not calls  # plain decoding and prefill: the model's weights
    draft_llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True),
                       speculative=spec("vegas"))
    assert calls and set(calls) == {1}  # one-row draft steps only, never the verify's 7


@pytest.mark.parametrize("rows", [0, 1])
def test_draft_steps_wider_than_the_copys_rows_read_the_models_weights(
        draft_llm, prompts, plain, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-row draft step reads the copy where `quant.DRAFT_COPY_ROWS` allows one row, and
    the model's weights where it allows none (on a GPU, wide steps: the bf16 product is the
    faster there); greedy output stays plain decoding's either way. The choice is the
    runner's, whatever the copy's kind: FP8 stands for both."""
    import vegas_spec.quant as quant

    if draft_llm.engine.draft_weight_kind != "fp8":
        pytest.skip("the runner's choice of weights, the same for every kind of copy")

    calls: list[int] = []
    kind = KINDS[draft_llm.engine.draft_weight_kind]
    real = kind.ref

    def counted(weight, x, bias=None):  # noqa: ANN001, ANN202
        calls.append(x.shape[0])
        return real(weight, x, bias)

    monkeypatch.setattr(kind, "ref", counted)
    monkeypatch.setattr(quant, "DRAFT_COPY_ROWS", rows)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    out = draft_llm.generate(prompts[:1], params, speculative=spec("vegas"))[0]
    assert out.token_ids == plain[0].token_ids[:8]
    assert set(calls) == ({1} if rows else set())


# A draft weight is read by the projections alone, the same for every policy: FP8 and INT8
# copies run every policy; vegas alone for INT4, whose copy sits behind the same seam.
# (`tests/speculative/test_lossless.py` holds every policy to plain output on the model's
# weights.)
METHODS = tuple(POLICIES)  # every registered policy
QUANTISED_METHODS = {"int8": METHODS, "fp8": METHODS, "int4": ("vegas",)}


@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_with_quantised_drafts_is_plain(draft_llm, prompts, plain,
                                                      method: str) -> None:
    if method not in QUANTISED_METHODS[draft_llm.engine.draft_weight_kind]:
        pytest.skip("policies whose projections the others already hold to plain output")
    outs = draft_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                            speculative=spec(method))
    for out, ref in zip(outs, plain):
        assert out.token_ids == ref.token_ids
    # full drafts read the model's weights (the oracle): every draft accepted
    floor = 6.9 if method == "full" else 1.5
    assert outs[0].stats["tokens_per_iteration"] >= floor


@pytest.mark.parametrize("kind", ["fp8"])  # the path's, not the kind's: INT4 runs the same
def test_dynamic_path_quantised_drafts(prompts, kind: str) -> None:
    two = [p[-300:] for p in prompts[:2]]  # budgets of 64 of 300-316 positions
    llm = cached_engine(two, draft_weights=kind)
    plain = llm.generate(two, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    outs = llm.generate(two, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                        speculative=spec("vegas"))
    assert llm.engine.runner.graphs is None
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


@pytest.mark.parametrize("kind,method", [("fp8", "vegas"), ("int8", "vegas"), ("int4", "vegas")])
def test_bfloat16_exact_mode_quantised_drafts(prompts, kind: str, method: str) -> None:
    """In bfloat16 the verify step and a plain step may round a near-tie apart unless exact
    mode makes every row batch-independent: then quantised drafts change nothing either."""
    short = [p[-64:] for p in prompts[:2]]  # budgets of 16 of 64-72 positions
    llm = cached_engine(short, POOL // 2, dtype="bfloat16", exact=True, draft_weights=kind)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = llm.generate(short, params)
    outs = llm.generate(short, params, speculative=SpecConfig(
        method=method, gamma=4, ratio=0.1, min_tokens=16, adaptive=False))
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def test_model_drafts_make_no_copy_and_bad_values_are_refused() -> None:
    with pytest.raises(ConfigError, match="draft_weights"):
        LLM(draft_weights="int3")
