"""`policies.register_method`: a policy of one's own under its own method name, accepted by
SpecConfig with the settings of the method it derives from (or its own), run by the engine
(lossless, as every method); taken names and non-policies refused."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_ENGINE, TINY_LLAMA, TINY_VOCAB, config_folder, random_prompts

from vegas_spec import config
from vegas_spec.config import ConfigError, QuestOptions, SamplingParams, SpecConfig, VegasOptions
from vegas_spec.engine import LLM
from vegas_spec.speculative import policies
from vegas_spec.speculative.policies import SelectionInput, Vegas, make_policy, register_method


class FirstRow(Vegas):
    """vegas from the verify pass's first row only."""

    name = "vegas-first-row"
    calls = 0

    def score_rows(self, n: int, prefill: bool) -> list[int]:
        return [n - 1] if prefill else [0]

    def indices(self, inp: SelectionInput, rankable: torch.Tensor,
                k: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().indices(inp, rankable, k)


@pytest.fixture(autouse=True)
def registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a test registers is forgotten after it (the registries as they were)."""
    monkeypatch.setattr(config, "POLICY_OPTIONS", dict(config.POLICY_OPTIONS))
    monkeypatch.setattr(policies, "POLICIES", dict(policies.POLICIES))


def test_a_registered_policy_is_a_method_with_its_bases_settings() -> None:
    with pytest.raises(ConfigError, match="unknown method"):
        SpecConfig(method=FirstRow.name)
    assert register_method(FirstRow) is FirstRow
    assert register_method(FirstRow) is FirstRow  # again: nothing changes
    assert FirstRow.name in config.POLICY_OPTIONS and FirstRow.name not in config.METHODS
    spec = SpecConfig(method=FirstRow.name, window=8, collect="all")
    assert isinstance(spec.options, VegasOptions) and spec.options.window == 8
    assert type(make_policy(spec)) is FirstRow
    with pytest.raises(ConfigError, match="no setting 'page'"):
        SpecConfig(method=FirstRow.name, page=8)


def test_register_method_takes_settings_and_refuses_taken_names() -> None:
    class Paged(Vegas):
        name = "vegas-paged"

    register_method(Paged, QuestOptions)
    assert SpecConfig(method="vegas-paged", page=8).options == QuestOptions(page=8)

    class Other(Vegas):
        name = "vegas"

    for cls in (Other, type("Again", (Vegas,), {"name": "vegas-paged"})):
        with pytest.raises(ConfigError, match="is taken"):
            register_method(cls)
    with pytest.raises(ConfigError, match="Policy subclass"):
        register_method(int)  # type: ignore[arg-type]
    assert policies.POLICIES["vegas"] is Vegas


def test_the_engine_runs_a_registered_method(tmp_path_factory: pytest.TempPathFactory) -> None:
    register_method(FirstRow)
    llm = LLM(str(config_folder(tmp_path_factory, "tiny", TINY_LLAMA)), **TINY_ENGINE)
    prompts = random_prompts(3, (40, 23), TINY_VOCAB)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = llm.generate(prompts, params, speculative=SpecConfig(method="vanilla"))
    spec = SpecConfig(method=FirstRow.name, gamma=3, ratio=0.1, min_tokens=8, adaptive=False,
                      window=0)
    FirstRow.calls = 0
    outs = llm.generate(prompts, params, speculative=spec)
    assert FirstRow.calls > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert outs[0].stats["method"] == FirstRow.name and outs[0].stats["iterations"] >= 1

