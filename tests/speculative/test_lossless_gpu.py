"""On a CUDA GPU: the greedy losslessness check with the Triton backend in bfloat16.

In bf16 a multi-token verify pass and a one-token step round differently, so a speculative run
may part from the plain run at a near-tie. A parting is accepted only where the plain run's
top-2 logit margin is below MARGIN; anything else is a bug."""

from __future__ import annotations

import pytest
import torch
from conftest import essay_prompt

from vegas_spec import LLM, SamplingParams, SpecConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MARGIN = 0.5  # logits; bf16 rounding moves SmolLM2's logits by well under this
METHODS = ["vegas", "stream", "quest", "lastq", "specextend", "full"]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def gpu_llm():
    return LLM(None, device="cuda", dtype="bfloat16", backend="triton",
               kv_cache_bytes=4 << 30, prefix_cache_bytes=2 << 30)


@pytest.fixture(scope="module")
def prompts(gpu_llm, essays):
    return [essay_prompt(gpu_llm.tokenizer, essays, n, off)
            for n, off in ((2000, 0), (4000, 7), (7500, 19))]


@pytest.fixture(scope="module")
def plain(gpu_llm, prompts):
    return gpu_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


def _margin(llm: LLM, prompt: list[int], generated: list[int], index: int) -> float:
    top = llm.logits(prompt + generated[:index])[-1].float().topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("method", METHODS)
def test_bf16_triton_matches_plain_up_to_near_ties(gpu_llm, prompts, plain, method) -> None:
    outs = gpu_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                            speculative=SpecConfig(method=method))
    for prompt, out, ref in zip(prompts, outs, plain):
        diff = [i for i, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)) if a != b]
        if diff:
            margin = _margin(gpu_llm, prompt, ref.token_ids, diff[0])
            assert margin < MARGIN, f"{method} parted at {diff[0]} with margin {margin:.3f}"
    if method == "full":
        assert outs[0].stats["tokens_per_iteration"] > 6.0


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_bf16_drafts_from_byte_copies_match_plain_up_to_near_ties(prompts, plain, kind) -> None:
    """Drafts from FP8 or INT8 copies of the projections (`skinny_matmul` on the GPU, CUDA
    graphs; a draft every iteration) leave the output plain decoding's: only the acceptance
    may move."""
    llm = LLM(None, device="cuda", dtype="bfloat16", backend="triton", draft_weights=kind,
              kv_cache_bytes=4 << 30, prefix_cache_bytes=0)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                        speculative=SpecConfig(method="vegas", adaptive=False))
    for prompt, out, ref in zip(prompts, outs, plain):
        diff = [i for i, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)) if a != b]
        if diff:
            margin = _margin(llm, prompt, ref.token_ids, diff[0])
            assert margin < MARGIN, f"{kind} drafts parted at {diff[0]} with margin {margin:.3f}"
    assert outs[0].stats["tokens_per_iteration"] > 2.0
