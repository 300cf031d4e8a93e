"""The dense layer's draft step as four projections with their neighbours
(`DecoderLayer.draft_forward` through `Ops.draft_linear`): the hidden states of every draft
step are those of the layer's unfused steps, bit for bit, with either ops (the composed
steps round as the unfused ones do), and the engine takes the fused path only where the ops
allow it; the fused kernels inside the model (under the interpreter) keep the tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_errors import tiny_checkpoint

from vegas_spec import SamplingParams, SpecConfig
from vegas_spec.compute.base import Ops
from vegas_spec.engine import LLM
from vegas_spec.models.decoder import Decoder
from vegas_spec.models.layers import DecoderLayer

ENGINE: dict[str, Any] = dict(kv_cache_bytes=1 << 20, page_size=8)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41, 42]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_hidden_layers=3)


def draft_states(llm: LLM, monkeypatch: pytest.MonkeyPatch,
                 fused: bool) -> tuple[list[torch.Tensor], list[list[int]], int]:
    """(every draft step's final hidden states, the greedy tokens, draft_forward calls) of a
    vegas run with the layers' fused draft path on or off."""
    states: list[torch.Tensor] = []
    calls = [0]
    forward, draft_forward = Decoder.forward, DecoderLayer.draft_forward

    def recording(self: Decoder, input_ids: torch.Tensor, ctx: Any, *args: Any) -> torch.Tensor:
        out = forward(self, input_ids, ctx, *args)
        if ctx.draft:
            states.append(out.clone())
        return out

    def counting(self: DecoderLayer, *args: Any) -> torch.Tensor:
        calls[0] += 1
        return draft_forward(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(Decoder, "forward", recording)
        patch.setattr(DecoderLayer, "draft_forward", counting)
        fuses = Ops.fuses_draft
        patch.setattr(Ops, "fuses_draft", lambda self, x, w: fused and fuses(self, x, w))
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True),
                            speculative=SpecConfig(method="vegas", gamma=3, ratio=0.5,
                                                   min_tokens=4, adaptive=False))
    return states, [o.token_ids for o in outs], calls[0]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_draft_steps_give_the_unfused_hidden_states(
        tiny: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(tiny), backend=backend, device="cpu", **ENGINE)  # CPU: the composed steps
    fused, tokens, calls = draft_states(llm, monkeypatch, True)
    unfused, tokens_unfused, calls_unfused = draft_states(llm, monkeypatch, False)
    assert calls > 0 and calls_unfused == 0  # the fused path ran, and only when allowed
    assert len(fused) == len(unfused) > 0
    for a, b in zip(fused, unfused, strict=True):
        assert torch.equal(a, b)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    assert tokens == tokens_unfused == [o.token_ids for o in plain]


def test_the_fused_kernels_in_the_model_keep_the_tokens(
        tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The skinny kernel's fused launches inside the model (on CPU under the interpreter, as
    a GPU runs them; a Qwen2 layout for the q/k/v bias): each draft step's hidden states
    those of the unfused steps to float32 rounding (the products summed in the kernel's
    order), and the tokens plain decoding's."""
    import transformers

    import vegas_spec.compute.triton_ops as triton_ops

    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # biases that count (transformers starts them at zero)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    folder = tiny.parent / "qwen2"
    model.save_pretrained(str(folder))
    llm = LLM(str(folder), backend="triton", device="cpu", **ENGINE)
    unfused, _, _ = draft_states(llm, monkeypatch, False)
    launched = [0]

    def everywhere(x: torch.Tensor, weight: Any) -> bool:
        launched[0] += 1
        return True

    monkeypatch.setattr(triton_ops, "fused", everywhere)
    fused, tokens, calls = draft_states(llm, monkeypatch, True)
    assert calls > 0 and launched[0] >= 4 * calls  # four fused projections a layer's step
    assert len(fused) == len(unfused) > 0
    for a, b in zip(fused, unfused, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    assert tokens == [o.token_ids for o in plain]


def test_exact_mode_and_tensor_parallelism_keep_the_unfused_steps() -> None:
    from vegas_spec.compute.base import make_ops
    from vegas_spec.parallel import TPGroup

    x, w = torch.ones(2, 1, 8), [torch.ones(8, 8)]
    assert make_ops("torch").fuses_draft(x, w) and make_ops("triton").fuses_draft(x, w)
    assert not make_ops("torch", exact=True).fuses_draft(x, w)

    class TwoRanks(TPGroup):
        world_size = 2

    group = TwoRanks.__new__(TwoRanks)
    assert not make_ops("torch", tp=group).fuses_draft(x, w)


def test_on_a_gpu_only_fp8_copies_fuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """`skinny_matmul.fused` (a CUDA tensor's metadata on the meta device stands in for
    one): FP8 copies at any row count; not the model's own weights, small or large (cuBLAS
    and the neighbours' own kernels are faster there), nor INT4 copies; nothing on CPU."""
    import vegas_spec.kernels.skinny_matmul as skinny
    from vegas_spec.quant import quantize_fp8, quantize_int4

    fp8 = quantize_fp8(torch.randn(64, 576))
    x32, x128 = torch.empty(32, 1, 576), torch.empty(128, 1, 576)
    assert not skinny.fused(x32, fp8)  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    small = torch.empty(3072, 576, dtype=torch.bfloat16)  # SmolLM2's gate_up: 3.5 MB
    big = torch.empty(6144, 576 * 8, dtype=torch.bfloat16)  # 57 MB
    assert not skinny.fused(x32, small) and not skinny.fused(x32, big)
    assert skinny.fused(x32, fp8) and skinny.fused(x128, fp8)
    assert not skinny.fused(x32, quantize_int4(torch.randn(64, 576), 64))
