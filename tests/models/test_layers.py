"""The dense layer's draft step as four projections with their neighbours
(`DecoderLayer.draft_forward` through `Ops.draft_linear`): the hidden states of every draft
step are those of the layer's unfused steps, bit for bit, with either ops (the composed
steps round as the unfused ones do), and the engine takes the fused path only where the ops
allow it."""

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
        patch.setattr(Ops, "fuses_drafts", property(lambda self: fused and not self.exact))
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


def test_exact_mode_and_tensor_parallelism_keep_the_unfused_steps() -> None:
    from vegas_spec.compute.base import make_ops
    from vegas_spec.parallel import TPGroup

    assert make_ops("torch").fuses_drafts
    assert not make_ops("torch", exact=True).fuses_drafts

    class TwoRanks(TPGroup):
        world_size = 2

    group = TwoRanks.__new__(TwoRanks)
    assert not make_ops("torch", tp=group).fuses_drafts
