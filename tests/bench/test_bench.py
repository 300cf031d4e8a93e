"""`vegas bench` and `vegas tune` at a tiny setting (a two-layer random model with SmolLM2's
tokenizer, prompts of about a hundred tokens, a few new tokens): every requested cell is
measured and reported, the plots are PNG files, speedups are ratios of measured throughputs,
--resume runs nothing twice, tune recommends the fastest cell of its own sweep, and bad
arguments end in one line and exit code 2 before a model loads (there, the embedded SmolLM2:
its context of 8192 is what a bad --context exceeds)."""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
from itertools import product
from pathlib import Path
from typing import Any

import pytest
from test_errors import tiny_checkpoint

from vegas_spec import SamplingParams, SpecConfig, cli
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
            "--config", str(out / "config.json"), "--kv-cache-gb", "0.05"]
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
        (["bench", "--workload", "generation", "--generation-tokens", "0", *out],
         r"--generation-tokens must be an integer >= 1 or max, got '0'$"),
        (["bench", "--workload", "generation", "--generation-tokens", "8190", *out],
         r"--generation-tokens 8190 does not fit the model's context of 8192 after the longest "
         r"prompt of \d+ tokens \(at most \d+, or max\)$"),
        (["bench", "--top-p", "1.5", *out], r"--top-p must be a number in \(0, 1\], got 1\.5$"),
        (["bench", "--top-p", "0", *out], r"--top-p must be a number in \(0, 1\], got 0\.0$"),
        (["bench", "--top-k", "-1", *out],
         r"--top-k must be an integer >= 0 \(0 disables it\), got -1$"),
        (["bench", "--temperature", "-0.5", *out], r"--temperature must be >= 0, got -0\.5$"),
        (["bench", "--temperature", "nan", *out],
         r"--temperature must be a finite number, got nan$"),
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


def _resumable_copy(bench_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the bench's results to --resume from, with no model to load (a refusal must
    come before one)."""
    monkeypatch.setattr("vegas_spec.engine.LLM", _no_model)
    out = tmp_path / "other"
    shutil.copytree(bench_dir, out)
    return out


def test_resume_refuses_results_of_other_settings(bench_dir: Path, tmp_path: Path, model: str,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = _resumable_copy(bench_dir, tmp_path, monkeypatch)
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


# --- the generation workload, sampling flags, acceptance per position ----------------------

@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from vegas_spec.models.loader import resolve
    from vegas_spec.tokenizer import load_tokenizer

    return load_tokenizer(resolve(None))


def _chat_lengths(tokenizer: Any, count: int) -> list[int]:
    """Prompt lengths of the first `count` questions, templated as `vegas generate --chat`
    encodes a prompt."""
    from vegas_spec.bench.workloads import QUESTIONS
    from vegas_spec.tokenizer import encode

    return [len(encode(tokenizer, QUESTIONS[i % len(QUESTIONS)], chat=True))
            for i in range(count)]


def test_generation_questions_are_distinct_chat_turns_under_the_prompt_room(
        smollm2_tokenizer: Any) -> None:
    from vegas_spec.bench import workloads as w

    questions = w.QUESTIONS
    assert len(questions) >= 32 and len(set(questions)) == len(questions)
    assert all(len(kind) >= 8 for kind in (w.MATH, w.CODE, w.EXPLANATIONS, w.STORIES))
    assert all("step by step" in q for q in w.MATH)
    assert set(questions) == set(w.MATH + w.CODE + w.EXPLANATIONS + w.STORIES)
    # the first four of a batch are one of each kind
    assert questions[:4] == (w.MATH[0], w.CODE[0], w.EXPLANATIONS[0], w.STORIES[0])
    n = len(questions)
    prompts = w.generation_prompts(smollm2_tokenizer, n + 3)
    for question, prompt in zip(questions, prompts):
        want = smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
        text = smollm2_tokenizer.decode(prompt.ids)
        assert text == want and text.endswith("<|im_start|>assistant\n"), text
        assert f"<|im_start|>user\n{question}<|im_end|>" in text
        assert len(prompt.ids) < w.PROMPT_ROOM, (len(prompt.ids), question)
    assert len({tuple(p.ids) for p in prompts[:n]}) == n
    # past the last question the batch starts over from the first
    assert [p.ids for p in prompts[n:]] == [p.ids for p in prompts[:3]]
    assert [p.ids for p in w.generation_prompts(smollm2_tokenizer, 5)] == \
        [p.ids for p in prompts[:5]]


def test_max_generation_tokens_fill_the_context(tmp_path: Path, model: str) -> None:
    from transformers import AutoTokenizer

    lengths = _chat_lengths(AutoTokenizer.from_pretrained(model), 6)
    assert max(lengths) > lengths[0]  # the two batches leave different room
    max_len = max(lengths) + 4  # batch 6 has room for 4 new tokens, batch 1 for more
    out = tmp_path / "max"
    assert cli.main(["bench", "--model", model, "--workload", "generation", "--batch", "1,6",
                     "--methods", "vegas", "--min-tokens", "8", "--max-model-len",
                     str(max_len), "--no-progress", "--out", str(out)]) == 0
    cells = {(c["batch"], c["method"]): c for c in _results(out)["cells"]}
    assert sorted(cells) == [(1, "vanilla"), (1, "vegas"), (6, "vanilla"), (6, "vegas")]
    for (batch, _), cell in cells.items():
        room = 4 if batch == 6 else max_len - lengths[0]
        assert cell["prompt_lengths"] == lengths[:batch] and cell["max_tokens"] == room
        assert [len(ids) for ids in cell["token_ids"]] == [room] * batch


def test_generation_tokens_past_the_context_are_refused_in_one_line(
        tmp_path: Path, smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("vegas_spec.engine.LLM", _no_model)
    longest = max(_chat_lengths(smollm2_tokenizer, 4))  # batch 4's longest prompt
    argv = ["bench", "--workload", "generation", "--batch", "1,4", "--out", str(tmp_path / "o")]
    fits = 200 - longest
    assert cli.main([*argv, "--max-model-len", "200", "--generation-tokens", str(fits + 1)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"vegas: error: --generation-tokens {fits + 1} does not fit --max-model-len "
                    f"of 200 after the longest prompt of {longest} tokens (at most {fits}, or "
                    "max)")
    assert not (tmp_path / "o").exists()


def test_setting_records_the_sampling_and_resume_refuses_another_top_p(
        bench_dir: Path, tmp_path: Path, model: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    setting = _results(bench_dir)["meta"]["setting"]
    assert (setting["temperature"], setting["top_p"], setting["top_k"], setting["seed"]) == \
        (0.0, 1.0, 0, 0)
    assert setting["narrowest_span"] == 2048  # the engine's default key widths
    assert "Decoding: greedy," in (bench_dir / "report.md").read_text()
    out = _resumable_copy(bench_dir, tmp_path, monkeypatch)
    assert cli.main([*BENCH, "--model", model, "--out", str(out), "--resume", "--top-p",
                     "0.9"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert re.search(r"was measured with other settings \(top_p 1\.0 vs 0\.9\)", line), line
    assert cli.main([*BENCH, "--model", model, "--out", str(out), "--resume", "--top-k",
                     "20"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert re.search(r"other settings \(top_k 0 vs 20\)", line), line


def test_report_has_acceptance_per_draft_position(bench_dir: Path) -> None:
    data = _results(bench_dir)
    report = (bench_dir / "report.md").read_text()
    table = report.split("## Acceptance per draft position")[1].split("\n## ")[0]
    assert "| workload | context | batch | method | γ | ratio | @1 | @2 | @3 | @4 | @5 | @6 | " \
        "plain steps; rounds × draft length |" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    spec = [c for c in data["cells"] if c["method"] != "vanilla"]
    assert len(rows) == 1 + len(spec) == 11 and "| vanilla |" not in table
    for cell in spec:
        # draft j is accepted in the iterations that emitted more than j tokens
        # of the rounds that drafted it (adaptive speculation may draft fewer than γ)
        hist, lengths = cell["tokens_per_iteration_histogram"], cell["draft_length_histogram"]
        assert sum(lengths) == sum(hist)
        want = [sum(hist[j:]) / sum(lengths[j - 1:]) for j in range(1, cell["gamma"] + 1)]
        assert cell["acceptance_rate_per_position"] == pytest.approx(want, abs=1e-12)
        rounds = ", ".join(f"{n} × {g}" for g, n in reversed(list(enumerate(lengths, 1))) if n)
        line = (f"| {cell['workload']} | {cell['context'] or '-'} | {cell['batch']} | vegas | "
                f"6 | 0.05 | " + " | ".join(f"{a:.2f}" for a in want)
                + f" | {cell['plain_steps']}; {rounds} |")
        assert line in rows, line
    summary = {line["key"]: line for line in data["summary"]}
    assert all(summary[c["key"]]["acceptance_per_position"] ==
               c["acceptance_rate_per_position"] for c in spec)


def test_report_shows_each_cells_slowest_row(bench_dir: Path) -> None:
    """The least tokens an iteration of any sequence: at most the cell's own, in the table."""
    data = _results(bench_dir)
    summary = {line["key"]: line for line in data["summary"]}
    report = (bench_dir / "report.md").read_text()
    assert "| tokens/iter | slowest row | accept@1 |" in report and "`slowest row`" in report
    for cell in data["cells"]:
        slowest = summary[cell["key"]]["slowest_row_tokens_per_iteration"]
        if cell["method"] == "vanilla":
            assert slowest is None
            continue
        assert slowest == min(cell["per_prompt_tokens_per_iteration"])
        assert 1.0 <= slowest <= cell["tokens_per_iteration"] + 1e-9
        assert f"| {cell['tokens_per_iteration']:.2f} | {slowest:.2f} |" in report


@pytest.mark.slow
def test_sampled_generation_bench_on_the_embedded_model(
        tmp_path: Path, smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[Any] = []
    real = runner.SamplingParams

    def recorded(**kwargs: Any) -> Any:
        params = real(**kwargs)
        timed.append(params)
        return params

    monkeypatch.setattr(runner, "SamplingParams", recorded)
    seeds: list[int] = []
    real_timed = runner._timed

    def timed_run(llm: Any, ids: Any, params: SamplingParams, spec: SpecConfig) -> Any:
        seeds.append(params.seed)
        return real_timed(llm, ids, params, spec)

    monkeypatch.setattr(runner, "_timed", timed_run)
    out = tmp_path / "sampled"
    assert cli.main(["bench", "--workload", "generation", "--batch", "2", "--methods", "vegas",
                     "--generation-tokens", "6", "--min-tokens", "16", "--temperature", "0.6",
                     "--top-p", "0.95", "--top-k", "20", "--seed", "3", "--repeats", "2",
                     "--no-progress", "--out", str(out)]) == 0
    data = _results(out)
    setting = data["meta"]["setting"]
    assert (setting["temperature"], setting["top_p"], setting["top_k"], setting["seed"]) == \
        (0.6, 0.95, 20, 3)
    assert [c["method"] for c in data["cells"]] == ["vanilla", "vegas"]
    lengths = _chat_lengths(smollm2_tokenizer, 2)
    for cell in data["cells"]:
        assert cell["prompt_lengths"] == lengths
        assert [len(ids) for ids in cell["token_ids"]] == [6, 6]
        assert all(text.strip() for text in cell["texts"])
    # the timed run of each cell samples as asked (its warm-up is a copy, 2 tokens long)
    assert [(p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens, p.ignore_eos)
            for p in timed] == [(0.6, 0.95, 20, 3, 6, True)] * 2
    # each method's repeats draw with seed + i: two sampled texts a cell, the same two seeds
    assert seeds == [3, 4, 3, 4]
    vanilla, vegas = data["cells"]
    assert vanilla["repeats"] == vegas["repeats"] == 2
    report = (out / "report.md").read_text()
    assert "Sampled run i draws with seed + i" in report
    assert "Decoding: sampled at temperature 0.6, top-p 0.95, top-k 20, seed 3," in report
    assert "- **vegas**: sampled, not compared token for token" in report


# --- repeats, and a progress bar on a terminal only -----------------------------------------

def test_repeats_give_the_median_and_the_range_of_each_speedup(
        tmp_path: Path, model: str, bench_dir: Path) -> None:
    out = tmp_path / "repeats"
    assert cli.main(["bench", "--model", model, "--context", "96", "--methods", "vegas",
                     "--max-tokens", "6", "--min-tokens", "8", "--repeats", "3",
                     "--no-progress", "--out", str(out)]) == 0
    data = _results(out)
    assert data["meta"]["repeats"] == 3
    cells = {c["method"]: c for c in data["cells"]}
    for cell in cells.values():
        runs = cell["decode_tokens_per_s_runs"]
        assert cell["repeats"] == 3 and len(runs) == len(cell["total_s_runs"]) == 3
        assert cell["decode_tokens_per_s"] == sorted(runs)[1]  # the median run's figures
    lines = {line["method"]: line for line in data["summary"]}
    assert lines["vanilla"]["speedup_range"] is None and lines["vanilla"]["noise"] is None
    vegas, plain = cells["vegas"], cells["vanilla"]
    low = min(vegas["decode_tokens_per_s_runs"]) / max(plain["decode_tokens_per_s_runs"])
    high = max(vegas["decode_tokens_per_s_runs"]) / min(plain["decode_tokens_per_s_runs"])
    line = lines["vegas"]
    assert line["speedup_range"] == pytest.approx([low, high], rel=1e-12)
    assert low <= line["speedup"] <= high and line["noise"] == (low <= 1.0 <= high)
    assert line["request_noise"] is not None
    shown = f"| {line['speedup']:.2f}x ({low:.2f}-{high:.2f}){' ~' if line['noise'] else ''} |"
    report = (out / "report.md").read_text()
    assert shown in report and "Each cell was timed 3 times" in report
    assert "graph" not in report  # a CPU run replays none
    # on a CPU a cell runs once by default: no range to judge a speedup by
    once = _results(bench_dir)
    assert once["meta"]["repeats"] == 1
    assert all(line["noise"] is None for line in once["summary"])
    assert "Each cell was timed once" in (bench_dir / "report.md").read_text()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tune_shows_one_bar_over_its_steps_on_a_terminal_only(
        tmp_path: Path, model: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*[a for a in TUNE if a != "--no-progress"], "--model", model]
    assert cli.main([*argv, "--out", str(tmp_path / "quiet")]) == 0
    assert capsys.readouterr().err == ""  # stderr is no terminal here: no bar
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    assert cli.main([*argv, "--out", str(tmp_path / "shown")]) == 0
    shown = err.getvalue()
    for step in ("vanilla", "reference", "step 1/3 (ratio)", "step 2/3 (γ)", "step 3/3 (ratio)"):
        assert f"{step}: essays 96 tok ×1 " in shown, step
    shares = [int(p) for p in re.findall(r"\| *(\d+)% \[", shown)]
    assert shares == sorted(shares) and shares[-1] == 100  # one bar, never started again


def test_without_the_bench_extra_a_run_writes_its_report_and_no_plots(
        tmp_path: Path, model: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """matplotlib and tqdm are the `bench` extra: without them (found by no import) a bench
    on a terminal writes its results and report, says once why there are no plots, and shows
    no bar."""
    import importlib.util

    from vegas_spec.bench import plots

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("matplotlib", "tqdm") else real(name, *a))
    monkeypatch.setattr(sys, "stderr", Terminal())
    out = tmp_path / "plain"
    argv = ["bench", "--workload", "essays", "--context", "96", "--batch", "1", "--methods",
            "vegas", "--max-tokens", "4", "--min-tokens", "8", "--model", model]
    assert cli.main([*argv, "--out", str(out)]) == 0
    assert (out / "results.json").is_file() and "| essays |" in (out / "report.md").read_text()
    assert not list(out.glob("*.png"))
    err = sys.stderr.getvalue()
    assert err.count(plots.MISSING) == 1 and "%" not in err
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("device,rows,tokens", [("cuda", 3, 2 * 6 + 3), ("cpu", 1, 2)])
def test_warm_up_runs_the_whole_batch_on_cuda(device: str, rows: int, tokens: int) -> None:
    """`vegas bench` and `vegas compare` warm up before timing: on CUDA the whole batch for
    two rounds (the timed run captures no graphs), on CPU one prompt for two tokens; with the
    run's sampling and method."""
    import torch

    calls: list[tuple[list[Any], SamplingParams, SpecConfig, bool]] = []

    where = torch.device(device)

    class Engine:
        device = where

        def generate(self, prompts: list[Any], params: SamplingParams, *, chat: bool,
                     speculative: SpecConfig) -> None:
            calls.append((prompts, params, speculative, chat))

    params = SamplingParams(temperature=0.6, top_k=20, max_tokens=100, seed=3)
    spec = SpecConfig(method="vegas", gamma=6)
    runner.warm_up(Engine(), ["a", "b", "c"], params, spec, chat=True)
    (prompts, warm, used, chat), = calls
    assert prompts == ["a", "b", "c"][:rows] and used == spec and chat
    assert warm.max_tokens == tokens and (warm.temperature, warm.top_k, warm.seed) == (0.6, 20, 3)


def test_each_sampled_repeat_draws_with_its_own_seed() -> None:
    """Greedy runs repeat the same text; sampled run i draws with seed + i; an unseeded run
    stays unseeded."""
    greedy = SamplingParams(max_tokens=4, seed=5)
    sampled = SamplingParams(temperature=0.6, max_tokens=4, seed=5)
    unseeded = SamplingParams(temperature=0.6, max_tokens=4)
    assert [runner.repeat_params(greedy, i).seed for i in range(3)] == [5, 5, 5]
    assert [runner.repeat_params(sampled, i).seed for i in range(3)] == [5, 6, 7]
    assert [runner.repeat_params(unseeded, i).seed for i in range(3)] == [None] * 3
    assert runner.repeat_params(sampled, 2).temperature == 0.6
