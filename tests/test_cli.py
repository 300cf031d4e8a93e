"""`vegas compare`: vanilla and speculative methods side by side, with the identity check."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from vegas_spec import cli


def test_compare_runs_vanilla_then_each_method(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["compare", "--prompt", "The history of the printing press begins",
                     "--max-tokens", "8", "--ignore-eos", "--min-tokens", "4", "--methods",
                     "vegas", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert [r["method"] for r in rows] == ["vanilla", "vegas"]
    assert rows[0]["vs_vanilla"] == 1.0 and rows[0]["tokens_per_iteration"] is None
    assert rows[1]["tokens_per_iteration"] >= 1.0 and rows[1]["decode_tokens_per_s"] > 0
    assert all(r["identical"] == r["prompts"] == 1 for r in rows)
    assert all(0 < r["ttft_s"] < r["total_s"] for r in rows)  # time to first token, then all


class FakeLLM:
    """Emits other tokens for every speculative method: the comparison must say so."""

    def __init__(self, model: Any, **kwargs: Any) -> None:
        pass

    def generate(self, prompts: list, params: Any, chat: bool = False,
                 speculative: Any = None) -> list:
        tokens = [1, 2, 3] if speculative.method == "vanilla" else [1, 2, 4]
        stats = {"decode_tokens_per_s": 10.0, "tokens_per_iteration": None, "ttft_s": 0.5,
                 "total_s": 2.0}
        return [SimpleNamespace(token_ids=tokens, stats=stats) for _ in prompts]


def test_compare_fails_when_an_output_differs(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("vegas_spec.engine.LLM", FakeLLM)
    code = cli.main(["compare", "--prompt", "a", "--prompt", "b", "--methods", "stream"])
    out = capsys.readouterr().out
    assert code == 1
    assert "identical to vanilla: 0/2" in out and "identical to vanilla: 2/2" in out
    assert "first token    500.0 ms" in out


def test_compare_takes_only_speculative_methods() -> None:
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["compare", "--prompt", "a", "--methods", "vanilla"])
