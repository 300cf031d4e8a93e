"""The tuning steps, the option parsing and the settings file, without a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vegas_spec.bench import analysis, options, tune
from vegas_spec.bench.runner import Cell
from vegas_spec.config import ConfigError, SpecConfig
from vegas_spec.config_file import read_config, write_config


def test_plateau_is_the_smallest_ratio_near_the_best() -> None:
    points = [(0.01, 3.0), (0.02, 4.5), (0.05, 5.4), (0.1, 5.5), (0.2, 5.45)]
    assert tune.plateau(points, 0.03) == 0.05
    assert tune.plateau(points, 0.0) == 0.1
    assert tune.fine_ratios(0.05, [0.5, 2.0, 40.0]) == [0.025, 0.05, 0.1]


def _row(gamma: int, ratio: float, speed: float, tpi: float) -> dict[str, Any]:
    cell = Cell("essays", 100, 1, "vegas", gamma, ratio, 8)
    return {"key": cell.key, "group": cell.group, "method": "vegas", "gamma": gamma,
            "ratio": ratio, "decode_tokens_per_s": speed, "tokens_per_iteration": tpi,
            "token_ids": [[1]]}


def test_three_steps_recommend_the_fastest_cell_and_run_each_once() -> None:
    # tokens/iter plateau at 0.05; γ 4 fastest there; 0.04 fastest at γ 4
    speed = {(6, 0.02): 90, (6, 0.05): 100, (6, 0.1): 95, (2, 0.05): 80, (4, 0.05): 120,
             (4, 0.04): 130, (4, 0.0625): 110}
    tpi = {0.02: 4.0, 0.05: 5.4, 0.1: 5.5}
    ran: list[str] = []

    def run(cells: list[Cell]) -> list[dict[str, Any]]:
        rows = []
        for c in cells:
            if c.method == "vanilla":
                rows.append({"key": c.key, "method": "vanilla", "decode_tokens_per_s": 50})
                continue
            ran.append(c.key)
            rows.append(_row(c.gamma, c.ratio, speed[(c.gamma, c.ratio)],
                             tpi.get(c.ratio, 5.0)))
        return rows

    base = Cell("essays", 100, 1, "vegas", 6, 0.05, 8)
    result = tune.three_steps(base, [0.02, 0.05, 0.1], [2, 4, 6], [0.8, 1.25], 0.03, run)
    assert result.plateau_ratio == 0.05 and result.best_gamma == 4
    assert (result.recommended["gamma"], result.recommended["ratio"]) == (4, 0.04)
    assert result.reference["decode_tokens_per_s"] == 100


def test_lossless_verdicts() -> None:
    base = {"method": "vanilla", "group": "g", "token_ids": [[1, 2], [3, 4]]}
    row = {"method": "vegas", "group": "g", "token_ids": [[1, 2], [3, 5]],
           "partings": [{"prompt": 1, "position": 1, "margin": 0.25}]}
    assert analysis.lossless(row, base, "bfloat16") == {"identical": 1, "largest_margin": 0.25,
                                                        "verdict": "near-ties"}
    assert analysis.lossless(row, base, "float32")["verdict"] == "DIFFERS"
    same = {**row, "token_ids": base["token_ids"], "partings": []}
    assert analysis.lossless(same, base, "float32")["verdict"] == "identical"
    assert analysis.speedup({"decode_tokens_per_s": 30.0}, {"decode_tokens_per_s": 20.0}) == 1.5
    assert analysis.request_speedup({"total_s": 2.0}, {"total_s": 3.0}) == 1.5
    assert analysis.request_speedup({"total_s": 2.0}, None) is None
    assert analysis.request_speedup({"total_s": 2.0}, {}) is None


@pytest.mark.parametrize(("text", "value"), [("7500", 7500), ("2k", 2000), ("7.5k", 7500)])
def test_context_sizes(text: str, value: int) -> None:
    assert options.context(text) == value


def test_methods_put_vanilla_first_and_refuse_duplicates() -> None:
    assert options.methods("stream, vegas,vanilla") == ["vanilla", "stream", "vegas"]
    with pytest.raises(ConfigError, match="lists a value twice"):
        options.methods("vegas,vegas")


def test_settings_file_round_trip(tmp_path: Path) -> None:
    spec = SpecConfig(method="lastq", gamma=4, ratio=0.03, min_tokens=128)
    write_config(tmp_path / "c.json", spec, {"decode_tokens_per_s": 1.0})
    assert read_config(tmp_path / "c.json") == spec
    (tmp_path / "bad.json").write_text('{"format": "vegas-config", "version": 1, '
                                       '"speculative": {"gamma": 0}}')
    with pytest.raises(ConfigError, match=r"bad\.json: gamma must be an integer"):
        read_config(tmp_path / "bad.json")


@pytest.mark.parametrize(("text", "value"), [("max", None), ("MAX", None), ("12", 12)])
def test_generation_tokens_take_an_integer_or_max(text: str, value: int | None) -> None:
    assert options.generation_tokens(text) == value


@pytest.mark.parametrize("text", ["0", "-3", "1.5", "lots", ""])
def test_generation_tokens_refuse_anything_else(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^--generation-tokens must be an integer >= 1 or max"):
        options.generation_tokens(text)


def test_generation_tokens_fit_the_context_after_the_longest_prompt() -> None:
    assert options.fit_generation(None, 100, 1024, "the model's context") == 924
    assert options.fit_generation(924, 100, 1024, "the model's context") == 924
    assert options.fit_generation(5, 100, 1024, "the model's context") == 5
    with pytest.raises(ConfigError, match=r"^--generation-tokens 925 does not fit "
                                          r"--max-model-len of 1024 after the longest prompt "
                                          r"of 100 tokens \(at most 924, or max\)$"):
        options.fit_generation(925, 100, 1024, "--max-model-len")
    with pytest.raises(ConfigError, match=r"longest prompt has 64 tokens: nothing is left"):
        options.fit_generation(None, 64, 64, "--max-model-len")


def test_acceptance_table_lists_every_draft_position() -> None:
    from vegas_spec.bench import report

    def line(method: str, gamma: int, acc: list[float]) -> dict[str, Any]:
        return {"workload": "generation", "context": None, "batch": 2, "method": method,
                "gamma": gamma, "ratio": 0.05, "acceptance_per_position": acc}

    adaptive = {**line("vegas", 3, [0.9, 0.5, 0.25]), "draft_lengths": [2, 0, 7],
                "plain_steps": 4}
    table = report.acceptance_section([line("vanilla", 6, []), adaptive,
                                       line("stream", 2, [0.75, 0.125])])
    assert table[4] == "| workload | context | batch | method | γ | ratio | @1 | @2 | @3 | " \
        "plain steps; rounds × draft length |"
    assert table[6:8] == [
        "| generation | - | 2 | vegas | 3 | 0.05 | 0.90 | 0.50 | 0.25 | 4; 7 × 3, 2 × 1 |",
        "| generation | - | 2 | stream | 2 | 0.05 | 0.75 | 0.12 | - | - |"]  # results before
    assert report.acceptance_section([line("vanilla", 6, [])]) == []


def test_the_header_states_the_sampling() -> None:
    from vegas_spec.bench import report

    sampled = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "seed": 1}
    assert report.sampling(sampled) == "sampled at temperature 0.6, top-p 0.95, top-k 20, seed 1"
    assert report.sampling({**sampled, "top_p": 1.0, "top_k": 0}) == \
        "sampled at temperature 0.6, top-p 1, top-k off, seed 1"
    assert report.sampling({**sampled, "temperature": 0.0}) == "greedy"
