"""On a CUDA GPU, exact mode in bfloat16 with the Triton kernels and CUDA graphs: greedy
output of every method and variant is plain decoding's token for token on a batch of long
essay prompts (no near-tie allowance), and a prompt gives the same tokens alone and inside a
batch of 64."""

from __future__ import annotations

import pytest
import torch
from conftest import SPEC_VARIANTS, essay_prompt

from vegas_spec import LLM, SamplingParams, SpecConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_TOKENS = 96
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
PLAIN = SpecConfig(method="vanilla")
# (tokens, first essay) of the prompts every method runs on
LONG = [(7500, 0), (6000, 3), (4000, 7), (7000, 11), (2000, 19), (5000, 23), (7500, 29),
        (3000, 31)]
ALONE = [0, 5, 17, 63]  # the prompts of the batch of 64 that also run alone


@pytest.fixture(scope="module")
def exact_llm():
    return LLM(None, device="cuda", dtype="bfloat16", backend="triton", exact=True,
               kv_cache_bytes=12 << 30)


@pytest.fixture(scope="module")
def prompts(exact_llm, essays) -> list[list[int]]:
    return [essay_prompt(exact_llm.tokenizer, essays, n, off) for n, off in LONG]


@pytest.fixture(scope="module")
def plain(exact_llm, prompts) -> list[list[int]]:
    return [o.token_ids for o in exact_llm.generate(prompts, PARAMS, speculative=PLAIN)]


@pytest.mark.parametrize("variant", SPEC_VARIANTS,
                         ids=["-".join(map(str, v.values())) for v in SPEC_VARIANTS])
def test_every_method_gives_plain_tokens_in_bf16(exact_llm, prompts, plain,
                                                 variant: dict) -> None:
    outs = exact_llm.generate(prompts, PARAMS, speculative=SpecConfig(**variant))
    for i, (out, ref) in enumerate(zip(outs, plain, strict=True)):
        diff = next((j for j, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), None)
        assert out.token_ids == ref, f"prompt {i} parts from plain decoding at token {diff}"
    if variant == {"method": "full"}:
        assert outs[0].stats["tokens_per_iteration"] > 6.0


def test_a_prompt_gives_the_same_tokens_alone_and_in_a_batch_of_64(exact_llm, essays) -> None:
    """Plain decoding and vegas: 64 prompts of 1K-7.5K tokens (the batch's prefill chunks
    pack and cut them differently from a prompt alone; the decode steps run in the
    64-row bucket), against four of them alone."""
    batch = [essay_prompt(exact_llm.tokenizer, essays, 1000 + (i * 997) % 6500, i % 40)
             for i in range(64)]
    for spec in (PLAIN, SpecConfig(method="vegas")):
        together = [o.token_ids for o in exact_llm.generate(batch, PARAMS, speculative=spec)]
        for i in ALONE:
            alone = exact_llm.generate([batch[i]], PARAMS, speculative=spec)[0].token_ids
            assert alone == together[i], (spec, i)
