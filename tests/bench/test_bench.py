"""`vegas bench` and `vegas tune` at a tiny setting (a two-layer random model with SmolLM2's
tokenizer, prompts of about a hundred tokens, a few new tokens): every requested cell is
measured and reported, the plots are PNG files, speedups are ratios of measured throughputs,
--resume runs nothing twice, tune recommends the fastest cell of its own sweep, and bad
arguments end in one line and exit code 2 before a model loads (there, the embedded SmolLM2:
its context of 8192 is what a bad --context exceeds)."""

from __future__ import annotations

import json
import re
import shutil
from itertools import product
from pathlib import Path
from typing import Any

import pytest
from test_errors import tiny_checkpoint

from vegas_spec import cli
from vegas_spec.bench import runner

PNG = b"\x89PNG\r\n\x1a\n"
WORKLOADS, CONTEXTS, BATCHES, METHODS = ("essays", "needle"), (96, 128), (1, 2), ("vegas",)
BENCH = ["bench", "--workload", "essays,needle,generation", "--context", "96,128",
         "--batch", "1,2", "--methods", "vegas", "--max-tokens", "4", "--generation-tokens",
         "5", "--min-tokens", "8", "--depths", "0.2,0.8", "--no-progress"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Two layers of random weights behind SmolLM2's tokenizer: real essay and needle prompts,
    decoded in milliseconds."""
    from vegas_spec.models.loader import resolve
    from vegas_spec.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve(None))
    folder = tiny_checkpoint(tmp_path_factory.mktemp("bench") / "model",
                             vocab_size=len(tokenizer), max_position_embeddings=1024)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "mine.jsonl"
    path.write_text('{"prompt": "The history of the printing press begins"}\n\n'
                    '"Rivers carry sediment to the sea, where"\n')
    return path


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory: pytest.TempPathFactory, model: str) -> Path:
    out = tmp_path_factory.mktemp("bench") / "out"
    assert cli.main([*BENCH, "--model", model, "--out", str(out)]) == 0
    return out


def _results(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "results.json").read_text())


def _requested() -> list[tuple[str, int | None, int, str]]:
    sized = list(product(WORKLOADS, CONTEXTS, BATCHES, ("vanilla", *METHODS)))
    own = list(product(("generation",), (None,), BATCHES, ("vanilla", *METHODS)))
    return sized + own


def test_every_requested_cell_is_in_results_and_report(bench_dir: Path) -> None:
    data = _results(bench_dir)
    cells = {(c["workload"], c["context"], c["batch"], c["method"]): c for c in data["cells"]}
    assert sorted(cells, key=str) == sorted(_requested(), key=str)
    report = (bench_dir / "report.md").read_text()
    for workload, context, batch, method in _requested():
        cell = cells[(workload, context, batch, method)]
        assert len(cell["token_ids"]) == batch
        want = 5 if workload == "generation" else 4
        assert all(len(ids) == want for ids in cell["token_ids"])
        assert cell["decode_tokens_per_s"] > 0
        row = f"| {workload} | {'-' if context is None else context} | {batch} | {method} |"
        assert row in report, row
    if_sized = [c for c in data["cells"] if c["context"] is not None]
    assert all(n == c["context"] for c in if_sized for n in c["prompt_lengths"])
    # greedy float32: every method's output is vanilla's, and the report says so
    assert "- **vegas**: identical to vanilla in all 15 outputs." in report
    needle = [c for c in data["cells"] if c["workload"] == "needle" and c["batch"] == 2]
    assert all([n["depth"] for n in c["needle"]] == [0.2, 0.8] for c in needle)
    assert re.search(r"\| 128 \| 2 \| vegas \| \d/1 \| \d/1 \| yes \|", report)


def test_plots_are_png_files_embedded_in_the_report(bench_dir: Path) -> None:
    from matplotlib.image import imread

    report = (bench_dir / "report.md").read_text()
    names = ["throughput.png", "speedup_vs_context.png", "tokens_per_iteration.png",
             "acceptance.png", "time_split.png"]
    for name in names:
        data = (bench_dir / name).read_bytes()
        assert data.startswith(PNG), name
        height, width = imread(bench_dir / name).shape[:2]
        assert height > 100 and width > 100
        assert f"]({name})" in report


def test_speedups_are_ratios_of_measured_throughputs(bench_dir: Path) -> None:
    data = _results(bench_dir)
    speed = {c["key"]: c["decode_tokens_per_s"] for c in data["cells"]}
    total = {c["key"]: c["total_s"] for c in data["cells"]}
    lines = {line["key"]: line for line in data["summary"]}
    report = (bench_dir / "report.md").read_text()
    checked = 0
    for cell in data["cells"]:
        base = speed[f"{cell['group']}|vanilla"]
        assert lines[cell["key"]]["speedup"] == pytest.approx(speed[cell["key"]] / base,
                                                              rel=1e-12)
        ratio = f"{speed[cell['key']] / base:.2f}x"
        # the whole request, prefill included: vanilla's time over this cell's
        whole = total[f"{cell['group']}|vanilla"] / total[cell["key"]]
        assert lines[cell["key"]]["request_speedup"] == pytest.approx(whole, rel=1e-12)
        assert total[cell["key"]] >= cell["prefill_s"] + cell["decode_s"] > 0
        assert (f"| {speed[cell['key']]:.1f} | {ratio} | {total[cell['key']]:.3f} | "
                f"{whole:.2f}x |") in report
        checked += cell["method"] != "vanilla"
    assert checked == 10


def test_resume_runs_nothing_twice(bench_dir: Path, tmp_path: Path, prompts_file: Path,
                                   model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "again"
    shutil.copytree(bench_dir, out)
    before = {c["key"]: c["wall_s"] for c in _results(out)["cells"]}
    ran: list[str] = []
    real = runner.run_cell

    def counted(llm: Any, cell: runner.Cell, *args: Any) -> dict[str, Any]:
        ran.append(cell.key)
        return real(llm, cell, *args)

    monkeypatch.setattr(runner, "run_cell", counted)
    # one workload more (the user's prompts): only its cells run
    argv = [*BENCH, "--model", model, "--workload", "essays,needle,generation,prompts",
            "--prompts", str(prompts_file), "--out", str(out), "--resume"]
    assert cli.main(argv) == 0
    assert sorted(ran) == [f"prompts|-|{b}|{m}" for b in BATCHES
                           for m in ("vanilla", "vegas|g6|r0.05")]
    data = _results(out)
    mine = [c for c in data["cells"] if c["workload"] == "prompts" and c["batch"] == 2]
    assert len(mine) == 2 and all(len(set(c["prompt_lengths"])) == 2 for c in mine)
    assert "| prompts | - | 2 | vegas |" in (out / "report.md").read_text()
    after = {c["key"]: c["wall_s"] for c in data["cells"]}
    assert {k: after[k] for k in before} == before  # nothing measured again
    # all done: nothing runs and no model loads
    ran.clear()
    monkeypatch.setattr("vegas_spec.engine.LLM", _no_model)
    assert cli.main(argv) == 0
    assert ran == []


def _no_model(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a model was loaded")


TUNE = ["tune", "--context", "96", "--batch", "1", "--max-tokens", "6", "--min-tokens", "4",
        "--gamma", "3", "--ratio", "0.05", "--ratios", "0.05,0.3", "--gammas", "2,4",
        "--fine", "0.5", "--no-progress"]


def test_tune_recommends_the_best_cell_of_its_sweep(tmp_path: Path, model: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tune"
    assert cli.main([*TUNE, "--model", model, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    cells = _results(out)["cells"]
    keys = [c["key"] for c in cells]
    assert len(keys) == len(set(keys))  # a cell shared by two steps ran once
    spec = [c for c in cells if c["method"] != "vanilla"]
    assert {(c["gamma"], c["ratio"]) for c in spec} >= {(3, 0.05), (3, 0.3)}
    fastest = max(spec, key=lambda c: c["decode_tokens_per_s"])
    config = json.loads((out / "config.json").read_text())
    chosen = config["speculative"]
    assert (chosen["method"], chosen["gamma"], chosen["ratio"]) == \
        ("vegas", fastest["gamma"], fastest["ratio"])
    assert chosen["min_tokens"] == 4
    assert config["measured"]["decode_tokens_per_s"] == fastest["decode_tokens_per_s"]
    assert f"--gamma {fastest['gamma']} --ratio {fastest['ratio']:g}" in printed
    for name in ("tune_ratio.png", "tune_gamma.png", "tune_fine.png"):
        assert (out / name).read_bytes().startswith(PNG)
    assert "## 2. γ sweep" in (out / "tune.md").read_text()
    # the saved setting is what generate and compare then run with; options still win
    argv = ["--model", model, "--prompt", "The capital of France is", "--max-tokens", "3",
            "--config", str(out / "config.json")]
    assert cli.main(["generate", *argv, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert (stats["method"], stats["gamma"]) == ("vegas", fastest["gamma"])
    assert cli.main(["generate", *argv, "--json", "--gamma", "5", "--method", "lastq"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert (stats["method"], stats["gamma"]) == ("lastq", 5)
    args = cli._parser(cli._settings_file(["compare", *argv])).parse_args(["compare", *argv])
    assert args.methods == ["vegas"] and args.ratio == fastest["ratio"]


# --- bad arguments: one line, exit code 2, no model loaded ----------------------------------

def _bad(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "file").write_text("x")
    (tmp / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": 3}\n')
    (tmp / "notsettings.json").write_text('{"gamma": 3}')
    (tmp / "config_only").mkdir()
    (tmp / "config_only" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}))
    out = ["--out", str(tmp / "out")]
    return [
        (["bench", "--methods", "vegas,warp", *out], r"unknown method 'warp'; choose from"),
        (["bench", "--batch", "", *out], r"--batch needs a comma-separated list"),
        (["bench", "--methods", "vegas,,stream", *out], r"--methods needs a comma-separated"),
        (["bench", "--batch", "0,1", *out], r"--batch values must be integers >= 1, got '0'"),
        (["bench", "--context", "9k", *out],
         r"--context 9000 with 64 new tokens needs 9064 positions but the model's context is "
         r"8192$"),
        (["bench", "--context", "lots", *out], r"--context values are token counts like"),
        (["bench", "--out", str(tmp / "file")], r"--out .*file is a file; it must be a dir"),
        (["bench", "--workload", "prompts", *out], r"--workload prompts needs --prompts FILE"),
        (["bench", "--workload", "prompts", "--prompts", str(tmp / "bad.jsonl"), *out],
         r"bad\.jsonl line 2: expected a non-empty JSON string or an object"),
        (["bench", "--workload", "poems", *out], r"unknown workload 'poems'"),
        (["bench", "--max-tokens", "0", *out], r"--max-tokens must be >= 1, got 0$"),
        (["tune", "--method", "vanilla", *out], r"--method must be a speculative method"),
        (["tune", "--context", "2k,4k", *out], r"--context takes one value in vegas tune"),
        (["tune", "--gammas", "2,40", *out], r"--gammas values must be at most 32, got 40"),
        (["generate", "--prompt", "a", "--config", str(tmp / "notsettings.json")],
         r"notsettings\.json is not a settings file written by `vegas tune`"),
        (["bench", "--config", str(tmp / "missing.json"), *out], r"config file not found"),
        (["bench", "--model", str(tmp / "config_only"), *out],
         r"config_only has no tokenizer files; the workloads' prompts are built with"),
    ]


def test_bad_arguments_are_one_line_before_a_model_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("vegas_spec.engine.LLM", _no_model)
    for argv, message in _bad(tmp_path):
        assert cli.main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert not out
        (line,) = err.splitlines()
        assert line.startswith("vegas: error: ") and re.search(message, line), (argv, line)
    assert not (tmp_path / "out").exists()


def test_resume_refuses_results_of_other_settings(bench_dir: Path, tmp_path: Path, model: str,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("vegas_spec.engine.LLM", _no_model)
    out = tmp_path / "other"
    shutil.copytree(bench_dir, out)
    assert cli.main([*BENCH, "--model", model, "--out", str(out), "--resume", "--dtype",
                     "bfloat16"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert re.search(r"--resume: .*results\.json was measured with other settings \(dtype "
                     r"'float32' vs 'bfloat16'\)", line), line


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_every_option_explains_itself(command: str) -> None:
    sub = next(a for a in cli._parser()._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert len(action.help or "") > 10, action.option_strings


def test_code_prompts_are_windows_of_the_standard_library(model: str) -> None:
    from transformers import AutoTokenizer

    from vegas_spec.bench.workloads import CODE_CUES, essay_prompts

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = essay_prompts(tokenizer, 120, 2, "code")
    assert [len(p.ids) for p in prompts] == [120, 120] and prompts[0].ids != prompts[1].ids
    assert tokenizer.decode(prompts[1].ids).endswith(CODE_CUES[1])
