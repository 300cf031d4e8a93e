"""`vegas compare`: vanilla and speculative methods side by side, with the identity check."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_errors import tiny_checkpoint

from vegas_spec import cli

# A KV pool for the few short prompts of these tests (default: half the available memory).
SMALL_KV = ["--kv-cache-gb", "0.05"]


def test_compare_runs_vanilla_then_each_method(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["compare", "--prompt", "The history of the printing press begins",
                     "--max-tokens", "8", "--ignore-eos", "--min-tokens", "4", "--methods",
                     "vegas", "--json", *SMALL_KV])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert [r["method"] for r in rows] == ["vanilla", "vegas"]
    assert rows[0]["vs_vanilla"] == 1.0 and rows[0]["tokens_per_iteration"] is None
    assert rows[1]["tokens_per_iteration"] >= 1.0 and rows[1]["decode_tokens_per_s"] > 0
    assert all(r["identical"] == r["prompts"] == 1 for r in rows)
    assert all(0 < r["ttft_s"] < r["total_s"] for r in rows)  # time to first token, then all


class FakeLLM:
    """Emits other tokens from the third on for every speculative method (the comparison
    must say so); vanilla's top-2 logit margin there is `margin`, wherever else 9."""

    margin = 3.0
    device = torch.device("cpu")

    def __init__(self, model: Any, **kwargs: Any) -> None:
        self.prompt = [5, 6]

    def generate(self, prompts: list, params: Any, chat: bool = False,
                 speculative: Any = None, **display: Any) -> list:
        tokens = [1, 2, 3] if speculative.method == "vanilla" else [1, 2, 4]
        stats = {"decode_tokens_per_s": 10.0, "tokens_per_iteration": None, "ttft_s": 0.5,
                 "total_s": 2.0}
        return [SimpleNamespace(token_ids=tokens, prompt_token_ids=self.prompt, stats=stats)
                for _ in prompts]

    def logits(self, ids: list[int]) -> torch.Tensor:
        out = torch.zeros(len(ids), 8)
        out[-1, 3] = self.margin if ids == [*self.prompt, 1, 2] else 9.0
        return out


def test_compare_fails_when_an_output_differs(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("vegas_spec.engine.LLM", FakeLLM)
    code = cli.main(["compare", "--prompt", "a", "--prompt", "b", "--methods", "stream"])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 1
    assert "identical to vanilla: 0/2 (0 near-ties, 2 mismatches)" in out
    assert "identical to vanilla: 2/2" in out and "first token    500.0 ms" in out
    assert "prompt 2 of 2: parts from vanilla at generated token 2, vanilla's top-2 margin 3 " \
        "(MISMATCH)" in out
    assert "--exact" not in captured.err


@pytest.mark.parametrize("dtype,exact,margin,code", [
    ("bfloat16", False, 0.25, 0), ("bfloat16", False, 0.75, 1), ("bfloat16", True, 0.25, 1),
    ("float32", False, 0.25, 1), ("float32", False, 2 ** -11, 0), ("float16", False, 0.0625, 0)])
def test_compare_tells_near_ties_from_mismatches(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str], dtype: str,
                                                 exact: bool, margin: float, code: int) -> None:
    """A parting where vanilla's margin is within the dtype's rounding is a near-tie: exit 0
    and a note that --exact removes it; wider, or any parting with --exact, a mismatch."""
    monkeypatch.setattr("vegas_spec.engine.LLM", FakeLLM)
    monkeypatch.setattr(FakeLLM, "margin", margin)
    argv = ["compare", "--prompt", "a", "--methods", "vegas", "--dtype", dtype, "--json"]
    assert cli.main(argv + ["--exact"] * exact) == code
    captured = capsys.readouterr()
    row = [json.loads(line) for line in captured.out.splitlines()][1]
    assert row["partings"] == [{"prompt": 0, "position": 2, "margin": margin,
                                "near_tie": code == 0}]
    assert (row["near_ties"], row["mismatches"]) == ((1, 0) if code == 0 else (0, 1))
    assert ("--exact makes every output vanilla's" in captured.err) == (code == 0)


def test_compare_takes_only_speculative_methods() -> None:
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["compare", "--prompt", "a", "--methods", "vanilla"])



# --- every bad input: one line `vegas: error: ...`, exit code 2 ------------------------------

WORDS = 70  # the test model's context is 64 tokens, one token a word
LONG = " ".join(["w5"] * WORDS)


def word_checkpoint(folder: Path) -> Path:
    """The tiny random checkpoint with a word-level tokenizer (one token per word, w1..w127)
    in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tiny_checkpoint(folder)
    words = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, 128)}},
                                       unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return word_checkpoint(tmp_path_factory.mktemp("cli") / "model")


@pytest.fixture(scope="module")
def files(model: Path) -> dict[str, str]:
    """Bad and good inputs beside the model, by name."""
    root = model.parent
    (root / "binary.txt").write_bytes(b"\xff\xfe\x00 prompt")
    (root / "folder.txt").mkdir()
    (root / "short.txt").write_text("w1 w2 w3")
    (root / "long.txt").write_text(LONG)
    (root / "random.gguf").write_bytes(bytes(range(256)) * 4)
    (root / "notjson").mkdir()
    (root / "notjson" / "config.json").write_text("{'single': 'quotes'}")
    (root / "badweights").mkdir()
    (root / "badweights" / "config.json").write_text((model / "config.json").read_text())
    (root / "badweights" / "model.safetensors").write_bytes(b"not safetensors")
    return {p.name.replace(".", "_"): str(p) for p in root.iterdir()}


BAD_COMMANDS = [
    ("prompt-file-binary", "generate --prompt-file {binary_txt}",
     r"prompt file .*binary\.txt is not UTF-8 text \(byte 0xff at offset 0\); convert it"),
    ("prompt-file-directory", "generate --prompt-file {folder_txt}",
     r"prompt file .*folder\.txt is a directory, not a file$"),
    ("kv-cache-negative", "generate --prompt a --kv-cache-gb -1",
     "--kv-cache-gb must be a positive number of GiB, got -1$"),
    ("kv-cache-beyond-memory", "generate --model {model} --prompt a --kv-cache-gb 1e9",
     r"a KV cache of 976562\.5 TiB does not fit in the .* of memory available on cpu"),
    ("config-not-json", "generate --model {notjson} --prompt a",
     r"notjson/config\.json is not valid JSON: Expecting property name enclosed in double "
     r"quotes at line 1 column 2$"),
    ("gguf-random-bytes", "generate --model {random_gguf} --prompt a",
     r"random\.gguf is not a GGUF file"),
    ("weights-not-safetensors", "generate --model {badweights} --prompt a",
     r"badweights/model\.safetensors is not a readable safetensors file"),
    ("batch-file-too-long",
     "generate --model {model} --prompt-file {short_txt} --prompt-file {long_txt} "
     "--kv-cache-gb 0.01",
     rf"prompt 2 of 2 \(.*long\.txt\) has {WORDS} tokens but the model's context is 64: "
     "nothing is left to generate$"),
    ("file-too-long", "generate --model {model} --prompt-file {long_txt} --kv-cache-gb 0.01",
     rf"prompt file .*long\.txt has {WORDS} tokens but the model's context is 64"),
    ("batch-prompt-too-long", "compare --model {model} --prompt w1 --prompt w2 --prompt {LONG} "
     "--kv-cache-gb 0.01",
     rf"prompt 3 of 3 has {WORDS} tokens but the model's context is 64"),
    ("gamma-zero", "compare --model {model}/nowhere --prompt a --gamma 0",
     r"gamma must be an integer in \[1, 32\], got 0$"),
    ("pool-even", "generate --model {model}/nowhere --prompt a --method vegas --pool 4",
     r"pool must be an odd integer >= 1 \(1: no pooling\), got 4$"),
    ("another-methods-setting", "generate --model {model}/nowhere --prompt a --method stream "
     "--page 32", r"method 'stream' has no setting 'page' \(its own: sink; methods that have "
     r"it: quest\)$"),
    ("setting-of-no-compared-method", "compare --model {model}/nowhere --prompt a --methods "
     "stream quest --pool 3", r"--pool is a setting of none of the methods compared "
     r"\(stream, quest\)$"),
    ("window-negative", "compare --model {model}/nowhere --prompt a --window -1",
     "window must be an integer >= 0, got -1$"),
    ("empty-prompt", "generate --model {model} --kv-cache-gb 0.01 --prompt=",
     r"prompt is empty \(no tokens\)$"),
    ("triton-without-gpu", "generate --model {model}/nowhere --prompt a --backend triton",
     "backend triton runs its kernels on a GPU"),
]


def _argv(command: str, files: dict[str, str]) -> list[str]:
    return [part.format(LONG=LONG, **files) for part in command.split()]


# Bad commands also run as processes of their own through `python -m vegas_spec.cli` (the
# others run `cli.main` in this process, as the entry point does: each process spends
# seconds importing torch).
IN_PROCESSES = ("prompt-file-binary", "kv-cache-beyond-memory")


def in_this_process(argv: list[str]) -> subprocess.CompletedProcess:
    """`cli.main(argv)` with its output captured and its exit code, as the entry point
    returns it (argparse's own errors exit with theirs)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def bad_runs(files: dict[str, str]) -> dict[str, subprocess.CompletedProcess]:
    """Every bad command through the command line as on a machine without a GPU (no Triton
    interpreter): `cli.main` in this process, and IN_PROCESSES through the real command line,
    each in its own process too."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    procs = {name: subprocess.Popen([sys.executable, "-m", "vegas_spec.cli",
                                     *_argv(command, files)], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, command, _ in BAD_COMMANDS if name in IN_PROCESSES}
    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        for name, command, _ in BAD_COMMANDS:
            runs[name] = in_this_process(_argv(command, files))
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        runs[f"{name} (process)"] = subprocess.CompletedProcess(proc.args, proc.returncode,
                                                                out, err)
    return runs


BAD_RUNS = [(c[0], c[2]) for c in BAD_COMMANDS] + [
    (f"{c[0]} (process)", c[2]) for c in BAD_COMMANDS if c[0] in IN_PROCESSES]


@pytest.mark.parametrize(("name", "message"), BAD_RUNS, ids=[r[0] for r in BAD_RUNS])
def test_bad_input_is_one_line(bad_runs: dict[str, subprocess.CompletedProcess], name: str,
                               message: str) -> None:
    run = bad_runs[name]
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and not run.stdout
    (line,) = run.stderr.splitlines()
    assert line.startswith("vegas: error: ") and re.search(message, line), line


def test_max_tokens_beyond_the_context_is_capped_and_said(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["generate", "--model", str(model), "--prompt", "w1 w2", "--max-tokens",
                     "1000000000", "--ignore-eos", "--json", *SMALL_KV])
    out, err = capsys.readouterr()
    assert code == 0
    assert err.splitlines() == ["vegas: warning: prompt leaves room for 62 new tokens in the "
                                "model's context of 64: max_tokens 1000000000 is capped to 62"]
    row = json.loads(out)
    assert row["finish_reason"] == "length" and len(row["token_ids"]) == 62
    (tmp_path / "a.txt").write_text("w1")
    (tmp_path / "b.txt").write_text(" ".join(["w2"] * 60))
    code = cli.main(["generate", "--model", str(model), "--prompt-file", str(tmp_path / "a.txt"),
                     "--prompt-file", str(tmp_path / "b.txt"), "--max-tokens", "5", *SMALL_KV])
    assert code == 0
    assert capsys.readouterr().err.splitlines() == [
        f"vegas: warning: prompt 2 of 2 ({tmp_path / 'b.txt'}) leaves room for 4 new tokens in "
        "the model's context of 64: max_tokens 5 is capped to 4"]


def test_json_statistics_of_short_and_plain_runs(model: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    for max_tokens, rate in ((1, False), (2, False), (5, True)):
        assert cli.main(["generate", "--model", str(model), "--prompt", "w1 w2", "--ignore-eos",
                         "--max-tokens", str(max_tokens), "--json", *SMALL_KV]) == 0
        stats = json.loads(capsys.readouterr().out)["stats"]
        assert (stats["decode_tokens_per_s"] is not None) == rate, stats
        # vanilla: one decode step per token after the prefill's
        assert stats["iterations"] == stats["sequence"]["iterations"] == max_tokens - 1


def test_stats_follow_the_text(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "--model", str(model), "--prompt", "w1 w2", "--prompt", "w3",
                     "--ignore-eos", "--max-tokens", "5", "--method", "vegas", "--stats",
                     *SMALL_KV]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "--- vegas (prompt 1 of 2): 2 prompt tokens, 5 generated (finish: length)"
    assert lines[2].startswith("    batch: prefill ") and lines[2].endswith(" tokens/s)")
    assert re.fullmatch(r"    \d+ iterations?, [\d.]+ tokens per iteration; acceptance per "
                        r"draft position: [\d. ]+; mean budget \d+ tokens", lines[3])
    rest = lines[4:]
    if rest[0].startswith("    plain steps where a round would not pay: "):  # adaptive
        assert re.fullmatch(r"    plain steps where a round would not pay: \d+% of the "
                            r"batch's row iterations", rest[0]), rest[0]
        rest = rest[1:]
    assert rest[0].startswith("    dense drafts for every decoded token: ")  # 2 + 5 < 256
    assert rest[2].startswith("--- vegas (prompt 2 of 2): 1 prompt tokens")
    assert cli.main(["generate", "--model", str(model), "--prompt", "w1 w2", "--ignore-eos",
                     "--max-tokens", "9", "--method", "vegas", "--stats", "--fixed-gamma",
                     *SMALL_KV]) == 0
    assert "plain steps" not in capsys.readouterr().out  # a round every iteration


@pytest.mark.parametrize("command", ["generate", "compare", "bench", "tune", "serve"])
def test_window_and_pool_reach_the_settings(command: str, tmp_path: Path) -> None:
    """--window and --pool of every command, and a settings file's window and pool as
    their defaults (a file written before they existed: the pure top-k's)."""
    import json as json_

    from vegas_spec.config import DEFAULT_POOL, DEFAULT_WINDOW, VEGAS_WINDOW, SpecConfig
    from vegas_spec.config_file import read_config, write_config

    needed = {"generate": ["--prompt", "a"], "compare": ["--prompt", "a"],
              "bench": ["--out", str(tmp_path)], "tune": ["--out", str(tmp_path)]}

    def spec(*argv: str) -> SpecConfig:
        given = [*argv, *needed.get(command, [])]
        args = cli._parser(cli._settings_file(given)).parse_args([command, *given])
        return cli._spec(args, "lastq")

    def window_pool(s: SpecConfig) -> tuple[int, int]:
        return s.options.window, s.options.pool

    assert window_pool(spec()) == (DEFAULT_WINDOW, DEFAULT_POOL)
    assert window_pool(spec("--window", "64", "--pool", "7")) == (64, 7)
    path = tmp_path / "config.json"
    write_config(path, SpecConfig(window=32, pool=3), {})
    assert read_config(path) == SpecConfig(window=32, pool=3)
    got = spec("--config", str(path)), spec("--config", str(path), "--pool", "5")
    assert [window_pool(s) for s in got] == [(32, 3), (32, 5)]
    data = json_.loads(path.read_text())
    del data["speculative"]["window"], data["speculative"]["pool"]
    path.write_text(json_.dumps(data))
    assert read_config(path).method == "vegas"  # whose window is its own default
    assert window_pool(read_config(path)) == (VEGAS_WINDOW, DEFAULT_POOL)


@pytest.mark.parametrize("command", ["generate", "compare"])
def test_every_option_explains_itself(command: str) -> None:
    sub = next(a for a in cli._parser()._actions if a.dest == "command").choices[command]
    formatter = sub.formatter_class("vegas")
    for action in sub._actions:
        if not action.option_strings or action.dest == "help":
            continue
        text = formatter._get_help_string(action) % vars(action)
        assert len(action.help or "") > 10, action.option_strings
        if action.default is not None and action.default is not False and action.default != []:
            shown = " ".join(action.default) if isinstance(action.default, list) \
                else action.default
            assert text.endswith(f"(default: {shown})"), (action.option_strings, text)
    text = " ".join(sub.format_help().split())
    assert "(default: 64)" in text and "(default: float32)" in text
    if command == "generate":
        assert "0 decodes greedily (default: 0.0)" in text
    assert "weight = softmax probability per head" in text and "logit = raw q.k" in text
    assert "2 = the first and the last row (the default), all = all gamma+1 rows" in text
    assert "layer = one selection per layer shared by all heads (the default), kv_head = one " \
        "per KV head" in text
    for flag, methods in (("--window", "vegas, lastq, specextend:"), ("--page", "quest:"),
                          ("--chunk", "specextend:"), ("--pool", "vegas, lastq:")):
        assert f"{flag} {flag[2:].upper()} {methods}" in text  # which methods take it


# --- through the console entry point: exit codes, one line, no traceback ----------------------

def _vegas(*args: str, **kwargs: Any) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vegas_spec.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a shell's background jobs ignore SIGINT; a terminal's do not
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            **kwargs)


def test_console_error_is_one_line(files: dict[str, str]) -> None:
    proc = _vegas("generate", "--model", files["random_gguf"], "--prompt", "a")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and not out
    assert err.splitlines() == [f"vegas: error: {files['random_gguf']} is not a GGUF file: it "
                                "does not start with the bytes 'GGUF'"]


def test_ctrl_c_is_one_line_and_exit_code_130(model: Path, tmp_path: Path) -> None:
    # random weights and a long context: decoding would go on for minutes
    config = json.loads((model / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config,
                                                      "max_position_embeddings": 1 << 16}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model / name).read_bytes())
    proc = _vegas("generate", "--model", str(tmp_path), "--load-format", "dummy", "--prompt",
                  "w1", "--max-tokens", "30000", "--ignore-eos", "--kv-cache-gb", "0.01")
    try:
        proc.communicate(timeout=2.5)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.splitlines() == ["vegas: interrupted"] and not out


def test_stats_say_how_many_iterations_were_plain_steps() -> None:
    from types import SimpleNamespace

    seq = {"iterations": 4, "tokens_per_iteration": 3.5,
           "acceptance_rate_per_position": [0.75, 0.5]}
    stats = {"method": "vegas", "prefill_s": 0.1, "decode_s": 0.2, "decode_tokens_per_s": 70.0,
             "plain_steps": 4, "speculative_share": 0.5, "sequence": seq}
    out = SimpleNamespace(stats=stats, prompt_token_ids=[1, 2], token_ids=[3] * 14,
                          finish_reason="length")
    lines = cli._stats_text(out, 0, 1).splitlines()
    assert lines[-1] == "    plain steps where a round would not pay: 50% of the batch's row " \
        "iterations"
    assert "plain steps" not in cli._stats_text(
        SimpleNamespace(**{**vars(out), "stats": {**stats, "plain_steps": 0}}), 0, 1)
    assert "draft length" not in "".join(lines)  # every round drafted γ
    shorter = {**stats, "sequence": {**seq, "draft_length_histogram": [3, 0, 0, 0, 0, 1]}}
    lines = cli._stats_text(SimpleNamespace(**{**vars(out), "stats": shorter}), 0, 1)
    assert "    rounds by draft length: 3 of 1, 1 of 6" in lines.splitlines()


# --- argparse's own errors: one line, exit code 2, no torch imported -----------------------

ARGPARSE_ERRORS = [
    (["generate", "--prompt", "a", "--max-tokens", "abc"],
     "vegas generate: error: argument --max-tokens: invalid int value: 'abc' "
     "(see vegas generate --help)"),
    (["generate", "--prompt", "a", "--gamma", "2.5"], "argument --gamma: invalid int value"),
    (["generate", "--prompt", "a", "--method", "nonsense"], "argument --method: invalid choice"),
    (["compare", "--prompt", "a", "--dtype", "int8"], "argument --dtype: invalid choice"),
    (["generate"], "one of the arguments --prompt --prompt-file is required"),
    (["generate", "--prompt", "a", "--prompt-file", "b"],
     "argument --prompt-file: not allowed with argument --prompt"),
    (["generate", "--prompt", "a", "--json", "--stats"], "not allowed with argument --json"),
    (["frobnicate"], "vegas: error: argument command: invalid choice: 'frobnicate'"),
    ([], "vegas: error: the following arguments are required: command (see vegas --help)"),
    (["generate", "--prompt", "a", "--config"], "argument --config: expected one argument"),
    (["bench", "--out"], "vegas bench: error: argument --out: expected one argument"),
]


@pytest.mark.parametrize(("argv", "message"), ARGPARSE_ERRORS,
                         ids=[" ".join(a) or "nothing" for a, _ in ARGPARSE_ERRORS])
def test_argparse_errors_are_one_line(argv: list[str], message: str) -> None:
    run = in_this_process(argv)
    assert run.returncode == 2 and not run.stdout
    (line,) = run.stderr.splitlines()
    assert re.fullmatch(r"vegas( \w+)?: error: .+ \(see vegas( \w+)? --help\)", line), line
    assert message in line


def _imported(*argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """`python -m vegas_spec ARGV` -> the process and the modules it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "vegas_spec", *argv],
                          capture_output=True, text=True, timeout=120)
    modules = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
               if line.startswith("import time:")}
    return done, modules


def test_help_and_argument_errors_do_not_import_torch() -> None:
    """torch takes seconds to import: `vegas --help`, a subcommand's help and an argument
    error answer without it."""
    for argv, code in ((["--help"], 0), (["generate", "--help"], 0),
                       (["bench", "--help"], 0),
                       (["generate", "--prompt", "a", "--max-tokens", "abc"], 2)):
        done, modules = _imported(*argv)
        assert done.returncode == code, done.stderr[-2000:]
        assert "vegas_spec.cli" in modules
        heavy = modules & {"torch", "numpy", "transformers", "triton", "matplotlib"}
        assert not heavy, (argv, heavy)
    assert "--max-tokens" in subprocess.run([sys.executable, "-m", "vegas_spec", "generate",
                                             "--help"], capture_output=True, text=True).stdout


def test_closed_stdout_is_one_line_before_the_model_loads(tmp_path: Path) -> None:
    """`vegas generate ... >&-`: refused in one line (the model, here missing, never loads)."""
    done = subprocess.run([sys.executable, "-m", "vegas_spec", "generate", "--model",
                           str(tmp_path / "nowhere"), "--prompt", "a"], capture_output=False,
                          stderr=subprocess.PIPE, text=True, timeout=120,
                          preexec_fn=lambda: os.close(1))
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["vegas: error: standard output is closed: there is "
                                        "nowhere to write the output"]


def test_a_reader_that_left_ends_the_stream_quietly(model: Path) -> None:
    """`vegas generate ... | head -c1`: the streamed text meets a closed pipe; exit code 141
    (128 + SIGPIPE), nothing on stderr."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first token
    try:
        done = subprocess.run([sys.executable, "-m", "vegas_spec", "generate", "--model",
                               str(model), "--prompt", "w1 w2", "--max-tokens", "40",
                               "--ignore-eos", *SMALL_KV], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == ""


def _no_model(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a model was loaded")


def test_a_port_in_use_is_refused_before_the_model_loads(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    pytest.importorskip("fastapi")
    monkeypatch.setattr("vegas_spec.engine.LLMEngine", _no_model)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"vegas: error: cannot listen on 127.0.0.1 port {port}: Address already in use"]
    assert cli.main(["serve", "--host", "192.0.2.1"]) == 2  # an address of no interface here
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("vegas: error: cannot listen on 192.0.2.1 port 8000: ")


def test_a_prompt_file_too_large_for_the_context_is_refused_unread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """50 MB cannot be 8192 tokens of SmolLM2 (its longest token has 81 characters, a
    character at most 4 bytes): refused from its size, before reading and loading."""
    monkeypatch.setattr("vegas_spec.engine.LLM", _no_model)
    big = tmp_path / "big.txt"
    with big.open("wb") as f:
        f.truncate(50_000_000)  # sparse: no disk, and reading it would take seconds
    assert cli.main(["generate", "--prompt-file", str(big)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"vegas: error: prompt file {big} has 50,000,000 bytes, more than any 8192-token "
        "context holds (at most 2,654,208 bytes)"]


def test_standard_input_is_read_up_to_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from vegas_spec.config import ConfigError

    monkeypatch.setattr(cli, "READ_FREELY", 8)
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(b"w1 " * 30)))
    with pytest.raises(ConfigError, match=r"^standard input has more than 20 bytes, more than "
                                          r"any 5-token context holds \(at most 20 bytes\)$"):
        cli._read_prompt(cli.STDIN, lambda: (5, 20))
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(b"w1 " * 6)))
    assert cli._read_prompt(cli.STDIN, lambda: (5, 20)) == "w1 " * 6


# --- prompts from standard input, the seed ------------------------------------------------

def test_prompt_file_dash_reads_standard_input(model: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", str(model), "--max-tokens", "6", "--json", *SMALL_KV]
    assert cli.main([*argv, "--prompt", "w1 w2 w3"]) == 0
    want = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"w1 w2 w3")))
    assert cli.main([*argv, "--prompt-file", "-"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
    assert cli.main([*argv, "--prompt-file", "-", "--prompt-file", "-"]) == 2
    assert "--prompt-file - (standard input) can be given once" in capsys.readouterr().err


def test_seed_minus_one_draws_a_seed_that_the_statistics_give(
        model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", str(model), "--prompt", "w1 w2", "--max-tokens", "8",
            "--ignore-eos", "--temperature", "1.0", "--json", *SMALL_KV]
    assert cli.main([*argv, "--seed", "-1"]) == 0
    first = json.loads(capsys.readouterr().out)
    seed = first["stats"]["seed"]
    assert isinstance(seed, int) and seed >= 0
    assert cli.main(argv) == 0  # -1 is the default: another random seed
    assert json.loads(capsys.readouterr().out)["stats"]["seed"] != seed
    assert cli.main([*argv, "--seed", str(seed)]) == 0  # plain decoding repeats it
    again = json.loads(capsys.readouterr().out)
    assert again["token_ids"] == first["token_ids"] and again["stats"]["seed"] == seed
    assert cli.main([*argv[:-3], "--stats", "--seed", str(seed), *SMALL_KV]) == 0
    assert f"    sampled with seed {seed}" in capsys.readouterr().out.splitlines()
    assert cli.main([*argv, "--seed", "-2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "vegas: error: --seed must be an integer >= 0, or -1 for a random seed; got -2"]
    argv[argv.index("1.0")] = "0"  # greedy: no seed to give
    assert cli.main(argv) == 0
    assert "seed" not in json.loads(capsys.readouterr().out)["stats"]


# --- what generate and compare show as they go ----------------------------------------------

class Terminal(io.StringIO):
    """A stream that says it is a terminal, recording each write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


@pytest.mark.parametrize("extra", [[], ["--method", "vegas"], ["--stop", "STOP"]],
                         ids=["vanilla", "vegas", "stop"])
def test_a_single_prompt_streams_the_text_of_the_plain_path(
        model: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]) -> None:
    """The text arrives in pieces as it is decoded, and what was written is the text that
    LLM.generate returns without streaming, token for token (greedy)."""
    from vegas_spec.config import SamplingParams
    from vegas_spec.engine import LLM

    prompt = "w1 w2 w3"
    plain = LLM(str(model), kv_cache_bytes=1 << 22).generate(
        prompt, SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    if extra == ["--stop", "STOP"]:  # a stop string in the middle of the output
        extra = ["--stop", plain.split()[len(plain.split()) // 2]]
    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main(["generate", "--model", str(model), "--prompt", prompt, "--max-tokens",
                     "40", "--ignore-eos", "--min-tokens", "4", *extra, *SMALL_KV]) == 0
    want = plain if not extra or extra[0] != "--stop" else plain[:plain.index(extra[1])]
    assert out.getvalue() == want + "\n"
    pieces = [w for w in out.writes if w]
    assert len(pieces) > 3, pieces  # streamed, not written at the end


def test_stats_follow_a_streamed_text(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", str(model), "--prompt", "w1 w2", "--max-tokens", "6",
            "--ignore-eos", "--method", "vegas", *SMALL_KV]
    assert cli.main([*argv, "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert cli.main([*argv, "--stats"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == text
    assert lines[1] == "--- vegas: 2 prompt tokens, 6 generated (finish: length)"
    # a context under --min-tokens (256): every draft read all of it, and the stats say so
    assert lines[-1] == ("    dense drafts for every decoded token: drafts read the whole "
                         "context while it is at most --min-tokens (256) tokens long, so nearly "
                         "all are accepted; a longer prompt drafts from a selection")
    assert cli.main([*argv, "--stats", "--min-tokens", "4", "--max-tokens", "20"]) == 0
    assert "    dense drafts for 2 of 19 tokens: " in capsys.readouterr().out
    assert cli.main([*argv, "--json", "--min-tokens", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["dense_draft_tokens"] == 2


def test_a_batch_shows_its_progress_on_a_terminal_only(
        model: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", str(model), "--prompt", "w1 w2", "--prompt", "w3",
            "--max-tokens", "30", "--ignore-eos", *SMALL_KV]
    monkeypatch.setattr("vegas_spec.terminal.EVERY_S", 0.0)
    assert cli.main(argv) == 0
    plain = capsys.readouterr()
    assert plain.err == ""  # stderr is no terminal here
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == plain.out  # the output is the same
    shown = [w for w in err.writes if w != "\r\033[K"]
    assert shown and all(re.fullmatch(r"\r\033\[K\d+/60 tokens(, [\d.,]+ tokens/s)?", w)
                         for w in shown), shown
    assert err.writes[-1] == "\r\033[K"  # the line is erased at the end
    err.writes.clear()
    assert cli.main([*argv, "--json"]) == 0
    assert err.writes == []
    assert cli.main(["compare", "--model", str(model), "--prompt", "w1 w2", "--prompt", "w3",
                     "--max-tokens", "30", "--ignore-eos", "--min-tokens", "4", *SMALL_KV]) == 0
    labels = {w.split(":")[0] for w in err.writes if w != "\r\033[K"}
    assert labels == {"\r\033[Kvanilla", "\r\033[Kvegas"}


def test_long_prompts_show_the_prefill_progress() -> None:
    from vegas_spec.engine import Progress
    from vegas_spec.terminal import Display

    err = Terminal()
    display = Display(None, err)
    display(Progress(0, 3000, 0, 64, []))
    display(Progress(2048, 3000, 0, 64, []))
    display(Progress(3000, 3000, 1, 64, []))
    assert err.writes[0] == "\r\033[Kprefill 0/3,000 tokens"
    assert err.writes[1] == "\r\033[K1/64 tokens"  # the next at most every EVERY_S seconds
    display.clear()
    short = Terminal()
    Display(None, short)(Progress(0, 500, 0, 64, []))  # a short prompt: no prefill line
    assert short.writes == []


# --- honest figures -----------------------------------------------------------------------

def test_time_to_first_token_counts_from_arrival_and_loading_apart(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first call loads the tokenizer (here made to take a second): that is load_s, not
    part of the request's time to first token or its total."""
    import time

    from vegas_spec import engine as engine_module
    from vegas_spec.config import SamplingParams

    real = engine_module.load_tokenizer

    def slow(source: Any) -> Any:
        time.sleep(1.0)
        return real(source)

    monkeypatch.setattr(engine_module, "load_tokenizer", slow)
    llm = engine_module.LLM(str(model), kv_cache_bytes=1 << 22)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = llm.generate("w1 w2", params)[0].stats
    assert first["load_s"] >= 1.0
    assert 0 < first["ttft_s"] <= first["total_s"] < 1.0
    second = llm.generate("w1 w2", params)[0].stats
    assert second["load_s"] < 0.1  # loaded once


def test_serve_on_a_cpu_says_nothing_of_graphs(model: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("fastapi")
    monkeypatch.setattr("vegas_spec.serve.app.serve", lambda *args: "stopped")
    assert cli.main(["serve", "--model", str(model), "--port", "0", *SMALL_KV]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == ["vegas: draft weights: the model's", "vegas: stopped"], err


def test_serve_says_what_its_drafts_read(model: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """INT4 draft copies (the CPU runs their reference): their kind and bytes, one line."""
    pytest.importorskip("fastapi")
    monkeypatch.setattr("vegas_spec.serve.app.serve", lambda *args: "stopped")
    argv = ["serve", "--model", str(model), "--port", "0", "--draft-weights", "int4", *SMALL_KV]
    assert cli.main(argv) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert re.fullmatch(r"vegas: draft weights: int4, [\d.]+ [KMG]i?B beside the model's",
                        first), first
