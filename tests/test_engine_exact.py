"""Exact mode end to end on a tiny random model in bfloat16 on CPU: greedy output of every
speculative method is plain decoding's token for token, and a prompt gives the same tokens
alone and inside a batch (cut into other prefill chunks, on padded batch buckets), with the
plain-PyTorch backend and with the Triton kernels under the interpreter."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SPEC_VARIANTS, TINY_IDS, TINY_METHODS, config_folder, random_prompts, tiny_spec

from vegas_spec import SamplingParams, SpecConfig
from vegas_spec.engine import LLM

VOCAB = 256
CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
          "bos_token_id": 1, "eos_token_id": 2}
ENGINE: dict[str, Any] = dict(load_format="dummy", kv_cache_bytes=1 << 22, dtype="bfloat16",
                              exact=True)
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
PLAIN = SpecConfig(method="vanilla")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return config_folder(tmp_path_factory, "tiny-exact", CONFIG)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(4, (70, 23, 48), VOCAB)


@pytest.fixture(scope="module")
def torch_llm(tiny: Path) -> LLM:
    return LLM(str(tiny), backend="torch", **ENGINE)


@pytest.fixture(scope="module")
def plain(torch_llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in torch_llm.generate(prompts, PARAMS, speculative=PLAIN)]


@pytest.mark.parametrize("method", TINY_METHODS[1:], ids=TINY_IDS[1:])
def test_every_method_gives_plain_tokens(torch_llm: LLM, prompts: list[list[int]],
                                         plain: list[list[int]], method: dict) -> None:
    outs = torch_llm.generate(prompts, PARAMS, speculative=tiny_spec(method))
    assert [o.token_ids for o in outs] == plain


def test_a_prompt_alone_gives_its_tokens_in_a_batch(tiny: Path, torch_llm: LLM,
                                                    prompts: list[list[int]],
                                                    plain: list[list[int]]) -> None:
    """Alone (prefilled in chunks of 16 tokens) against the batch above (one chunk) and a
    batch on fixed-shape buffers, whose bucket pads 3 rows to 4."""
    chunked = LLM(str(tiny), backend="torch", prefill_chunk=16, **ENGINE)
    alone = [chunked.generate([p], PARAMS, speculative=PLAIN)[0].token_ids for p in prompts]
    assert alone == plain
    static = LLM(str(tiny), backend="torch", static_shapes=True, **ENGINE)
    assert [o.token_ids for o in static.generate(prompts, PARAMS, speculative=PLAIN)] == plain


SAMPLED = [SamplingParams(temperature=t, top_k=k, top_p=tp, seed=seed, max_tokens=10,
                          ignore_eos=True)
           for t, k, tp, seed in ((0.8, 20, 0.95, 11), (1.0, 0, 1.0, 12), (0.6, 0, 0.9, 13))]


@pytest.mark.parametrize("method", ["vanilla", "vegas", "quest"])
def test_a_seeded_sampled_prompt_gives_its_tokens_alone_in_a_batch_and_static(
        tiny: Path, torch_llm: LLM, prompts: list[list[int]], method: str) -> None:
    """Counter-based draws: each row's tokens depend on its seed and positions only, so a
    seeded request samples the same tokens alone, beside others, and on the fixed-shape
    buffers (the path a GPU captures as one graph per round)."""
    spec = tiny_spec({"method": method})
    batch = [o.token_ids for o in torch_llm.generate(prompts, SAMPLED, speculative=spec)]
    alone = [torch_llm.generate([p], [s], speculative=spec)[0].token_ids
             for p, s in zip(prompts, SAMPLED)]
    assert alone == batch
    static = LLM(str(tiny), backend="torch", static_shapes=True, **ENGINE)
    assert [o.token_ids for o in static.generate(prompts, SAMPLED, speculative=spec)] == batch
    other = [dataclasses.replace(s, seed=s.seed + 100) for s in SAMPLED]
    moved = [o.token_ids for o in torch_llm.generate(prompts, other, speculative=spec)]
    assert moved != batch  # the seed, not the batch, decides


@pytest.mark.parametrize("method", ["vegas", "stream"])
def test_greedy_rows_beside_sampled_rows_give_plain_tokens(tiny: Path, prompts: list[list[int]],
                                                           plain: list[list[int]],
                                                           method: str) -> None:
    """A round of mixed rows (one sampled graph on the fixed-shape path): the greedy rows are
    plain decoding's, token for token."""
    params = [PARAMS, SAMPLED[0], PARAMS]
    for static in (False, True):
        llm = LLM(str(tiny), backend="torch", static_shapes=static, **ENGINE)
        outs = llm.generate(prompts, params, speculative=tiny_spec({"method": method}))
        assert [outs[0].token_ids, outs[2].token_ids] == [plain[0], plain[2]]


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU tensors reach Triton only through its interpreter (no CUDA)")
def test_triton_kernels_in_exact_mode(tmp_path: Path, prompts: list[list[int]]) -> None:
    """The kernels that run on a GPU (the interpreter is slow: one layer, vegas, two short
    prompts)
    against plain decoding, and a prompt alone against the batch."""
    folder = tmp_path / "one-layer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 1}))
    llm = LLM(str(folder), backend="triton", **ENGINE)
    short, params = [p[:18] for p in prompts[:2]], SamplingParams(max_tokens=6, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(short, params, speculative=PLAIN)]
    outs = llm.generate(short, params, speculative=tiny_spec(SPEC_VARIANTS[0]))
    assert [o.token_ids for o in outs] == plain
    assert llm.generate(short[1:], params, speculative=PLAIN)[0].token_ids == plain[1]
