"""Tensor parallelism with one scheduler: rank 0 runs the engine, workers mirror its runner
calls. On CPU over gloo: tokens at 2 ranks equal one rank's, the CLI launches its own
workers, a dead worker is a clear error within seconds, and a model whose heads do not
divide is refused."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from conftest import TINY_LLAMA, TINY_VOCAB, config_folder, random_prompts
from test_cli import in_this_process, word_checkpoint

from vegas_spec import SamplingParams, SpecConfig, executor
from vegas_spec.config import ConfigError
from vegas_spec.engine import LLM, LLMEngine
from vegas_spec.step import Runner

VOCAB, CONFIG = TINY_VOCAB, TINY_LLAMA
ENGINE: dict[str, Any] = dict(load_format="dummy", kv_cache_bytes=1 << 22, exact=True)
TIMEOUT_S = 120  # a rank 0 that gives no result by then fails the test
METHODS = {"plain": SpecConfig(method="vanilla"),
           "vegas": SpecConfig(method="vegas", gamma=3, ratio=0.1, min_tokens=8),
           "vegas-kv_head": SpecConfig(method="vegas", gamma=3, ratio=0.1, min_tokens=8,
                                       granularity="kv_head")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return config_folder(tmp_path_factory, "tiny-llama-executor", CONFIG)


def _rank0(world: int, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    """Rank 0's process: launch the workers, run fn(*args), put its result (or error)."""
    torch.set_num_threads(1)
    ex = executor.launch(world, "cpu")
    try:
        results.put(fn(*args))
    except Exception as err:  # the test reads it
        results.put(err)
    finally:
        if ex is not None:
            ex.shutdown()


def run_rank0(world: int, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a fresh process that is rank 0 of `world` (its workers started by
    `executor.launch`) -> its result or the exception it raised."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_rank0, args=(world, fn, args, results), daemon=True)
    proc.start()
    try:
        return results.get(timeout=TIMEOUT_S)
    except queue.Empty:
        pytest.fail(f"rank 0 gave no result in {TIMEOUT_S} s (exit code {proc.exitcode})")
    finally:
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()


def greedy_tokens(model: str, prompts: list[list[int]]) -> dict[str, list]:
    """Greedy tokens of every method (exact mode); the second prompt stops early, so rows
    leave the batch while others decode."""
    llm = LLM(model, **ENGINE)
    params = [SamplingParams(max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=4, ignore_eos=True)]
    return {name: [o.token_ids for o in llm.generate(prompts, params, speculative=spec)]
            for name, spec in METHODS.items()}


def engine_with_abort(model: str, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Three requests stepped by hand; the second is aborted after two steps."""
    engine = LLMEngine(model, speculative=METHODS["vegas"], **ENGINE)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.delta_token_ids
        steps += 1
        if steps == 2:
            engine.abort(ids[1])
    return out


def preempted_tokens(model: str, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy vegas over a pool that cannot hold every request to its end, pages asked for
    a few tokens ahead -> each request's tokens and how many preemptions it took."""
    probe = LLM(model, **ENGINE)
    page_bytes = probe.engine.runner.pages.bytes_per_page
    del probe
    engine = LLMEngine(model, speculative=METHODS["vegas"], max_num_seqs=3,
                       **{**ENGINE, "kv_cache_bytes": 10 * page_bytes})
    engine.scheduler.grow_tokens = 4
    ids = [engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
           for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.delta_token_ids
    return list(out.values()), engine.num_preemptions


def kill_a_worker(model: str, prompt: list[int]) -> tuple[str, float]:
    """Rank 1 killed between two steps -> rank 0's error and the seconds it took."""
    engine = LLMEngine(model, **ENGINE)
    engine.add_request(prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    ex = executor.active()
    assert ex is not None
    ex.procs[0].kill()
    started = time.perf_counter()
    try:
        while engine.has_unfinished():
            engine.step()
    except executor.ExecutorError as err:
        return str(err), time.perf_counter() - started
    return "no error", time.perf_counter() - started


def runs_the_interface(model: str) -> bool:
    """The engine's runner at rank 0 is a ParallelRunner and a `step.Runner`."""
    runner = LLMEngine(model, **ENGINE).runner
    return isinstance(runner, executor.ParallelRunner) and isinstance(runner, Runner)


def refused(model: str) -> str:
    try:
        LLM(model, **ENGINE)
    except ConfigError as err:
        return str(err)
    return "accepted"


def engine_runs(model: str, three_heads: str, prompts: list[list[int]],
                abort_prompts: list[list[int]], kill_prompt: list[int]) -> dict[str, Any]:
    """Everything the engine tests check, in one rank 0 (one launch, one start-up); the
    worker is killed last, when every other check has run."""
    return {"greedy": greedy_tokens(model, prompts),
            "abort": engine_with_abort(model, abort_prompts), "refused": refused(three_heads),
            "interface": runs_the_interface(model),
            "preempted": preempted_tokens(model, abort_prompts),
            "killed": kill_a_worker(model, kill_prompt)}


PROMPTS, ABORT_PROMPTS = random_prompts(5, (60, 23), VOCAB), random_prompts(8, (30, 40, 17), VOCAB)
KILL_PROMPT = random_prompts(9, (20,), VOCAB)[0]


@pytest.fixture(scope="module")
def three_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return config_folder(tmp_path_factory, "tiny-llama-3-heads",
                         {**CONFIG, "hidden_size": 48, "num_attention_heads": 3,
                          "num_key_value_heads": 3})


@pytest.fixture(scope="module")
def two_ranks(tiny: Path, three_heads: Path) -> dict[str, Any]:
    got = run_rank0(2, engine_runs, str(tiny), str(three_heads), PROMPTS, ABORT_PROMPTS,
                    KILL_PROMPT)
    assert not isinstance(got, BaseException), got
    return got


# --- through the engine ---------------------------------------------------------------


def test_two_ranks_one_scheduler_give_one_ranks_greedy_tokens(tiny: Path,
                                                              two_ranks: dict) -> None:
    one, two = greedy_tokens(str(tiny), PROMPTS), two_ranks["greedy"]
    assert one["vegas"] == one["plain"]
    assert all(two[name] == one["plain"] for name in METHODS), two
    assert [len(t) for t in two["plain"]] == [10, 4]


def test_an_abort_is_mirrored(tiny: Path, two_ranks: dict) -> None:
    one, two = engine_with_abort(str(tiny), ABORT_PROMPTS), two_ranks["abort"]
    assert list(two.values()) == list(one.values())
    assert [len(t) for t in two.values()][::2] == [8, 8]


def test_a_preemption_is_mirrored(tiny: Path, two_ranks: dict) -> None:
    """Preempted sequences restart on every rank (their output so far prefilled again) and
    their grown pages reach the workers: the tokens are one rank's."""
    one, two = preempted_tokens(str(tiny), ABORT_PROMPTS), two_ranks["preempted"]
    assert one[1] > 0 and two[1] > 0  # how many: as adaptive speculation's timings fall
    assert two[0] == one[0] and all(len(t) == 40 for t in two[0])


def test_a_killed_worker_is_a_clear_error_within_seconds(two_ranks: dict) -> None:
    message, seconds = two_ranks["killed"]
    assert "worker rank 1 exited with code -9" in message
    assert seconds < 10


def test_heads_that_do_not_divide_are_refused(two_ranks: dict) -> None:
    message = two_ranks["refused"]
    assert "query heads (num_attention_heads) = 3, KV heads (num_key_value_heads) = 3 " \
           "divisible by 2" in message


def test_the_parallel_runner_is_the_runner_interface_and_no_proxy() -> None:
    """`ParallelRunner` has the members of `step.Runner` and forwards nothing else: no
    attribute lookup or assignment reaches rank 0's runner (its `local`)."""
    members = {n for n in dir(Runner) if not n.startswith("_")}
    assert {n for n in dir(executor.ParallelRunner) if not n.startswith("_")} == members
    assert "__getattr__" not in vars(executor.ParallelRunner)
    assert "__setattr__" not in vars(executor.ParallelRunner)


def test_rank_0s_runner_is_a_parallel_runner(two_ranks: dict) -> None:
    assert two_ranks["interface"]


def test_cuda_ranks_need_as_many_gpus() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    want = max(count + 1, 2)
    with pytest.raises(ConfigError, match=f"over {want} ranks on cuda needs {want} visible "
                                          f"GPUs, found {count}"):
        executor.check_devices(want, "cuda")
    executor.check_devices(4, "cpu")


# --- through the command line ---------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return word_checkpoint(tmp_path_factory.mktemp("tp-cli") / "model")


def vegas(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "-m", "vegas_spec.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def one_rank(monkeypatch: pytest.MonkeyPatch, *args: str) -> subprocess.CompletedProcess:
    """`vegas *args` on one rank, in this process (no torchrun variables, as `vegas` runs
    its processes)."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return in_this_process(list(args))


def test_cli_tensor_parallel_prints_one_ranks_text(model: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    common = ["generate", "--model", str(model), "--device", "cpu", "--prompt", "w5 w9 w3 w7",
              "--prompt", "w1 w2", "--max-tokens", "8", "--ignore-eos", "--exact",
              "--kv-cache-gb", "0.01"]
    one = one_rank(monkeypatch, *common, "--method", "vanilla")
    two = vegas(*common, "--method", "vegas", "--gamma", "2", "--tensor-parallel", "2")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and len(one.stdout.splitlines()) == 2


def test_cli_refuses_heads_that_do_not_divide(model: Path) -> None:
    run = vegas("generate", "--model", str(model), "--prompt", "w1", "--tensor-parallel", "3",
                "--kv-cache-gb", "0.01")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "vegas: error: tensor parallelism over 3 ranks needs the model's query heads "
        "(num_attention_heads) = 4, KV heads (num_key_value_heads) = 2, intermediate_size = "
        "64, vocab_size = 128 divisible by 3")


@pytest.mark.slow
def test_cli_smollm2_runs_at_three_ranks(smollm_gguf: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """9 query / 3 KV heads split over 3 ranks: vegas prints one rank's text. (Two ranks are
    refused: test_parallel's test_smollm2_is_refused_at_two_ranks checks every rank's
    refusal of this model, and test_cli_refuses_heads_that_do_not_divide the CLI's exit code
    2 and message for such a refusal.)"""
    common = ["generate", "--model", str(smollm_gguf), "--prompt", "The capital of France is",
              "--max-tokens", "6", "--kv-cache-gb", "0.05"]
    one = one_rank(monkeypatch, *common)
    three = vegas(*common, "--method", "vegas", "--tensor-parallel", "3", timeout=300)
    assert one.returncode == 0 and three.returncode == 0, three.stderr
    assert three.stdout == one.stdout
