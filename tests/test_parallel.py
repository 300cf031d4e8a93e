"""Tensor parallelism on CPU: ranks are processes joined by gloo. Logits at N ranks equal one
rank's to float32 rounding, and a model whose heads do not divide by N is refused by name."""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from conftest import (
    TINY_ENGINE,
    TINY_LLAMA,
    TINY_VOCAB,
    config_folder,
    random_prompts,
    randomize_norms_and_biases,
)

from vegas_spec import SamplingParams, SpecConfig, parallel
from vegas_spec.config import ConfigError, ModelConfig
from vegas_spec.engine import LLM
from vegas_spec.models.loader import (
    WeightError,
    dummy_weights,
    expected_shapes,
    load_config,
    load_weights,
    resolve,
)

VOCAB, CONFIG, ENGINE = TINY_VOCAB, TINY_LLAMA, TINY_ENGINE
RANK_TIMEOUT_S = 120  # a rank that dies or hangs fails the test after this, never hangs it
# TP adds o_proj's and down's partial sums (one per rank) in another order than one rank's
# matmul does, so float32 logits differ by rounding that grows with depth: measured, 1.5e-7
# of logits up to 0.57 on the tiny model (2 layers), 1.0e-4 of logits up to 33 on SmolLM2
# (30 layers, about 25 ulps); the bounds leave room for other BLAS blockings.
TOL = dict(rtol=1e-4, atol=1e-5)
SMOLLM_TOL = dict(rtol=1e-4, atol=5e-4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return config_folder(tmp_path_factory, "tiny-llama-tp", CONFIG)


def _rank(rank: int, world: int, init: str, fn: Callable[..., Any], args: tuple,
          results: Any, backend: str) -> None:
    """One rank's process: join the group (gloo; nccl on GPU `rank`), run fn(*args), put
    (rank, result)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        os.environ.update(parallel.NO_MULTICAST)
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    try:
        parallel.join(world, rank)
        out = fn(*args)
        # numpy, not a tensor: torch's queues share tensors through this process's memory,
        # which is gone once it exits
        results.put((rank, out.cpu().numpy() if isinstance(out, torch.Tensor) else out))
    except Exception as err:  # the parent reports it; a bare exit would say only "code 1"
        results.put((rank, err))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, tmp: Path, fn: Callable[..., Any], *args: Any,
              backend: str = "gloo") -> list[Any]:
    """fn(*args) on `world` ranks (spawned processes) -> each rank's result, rank 0 first;
    a rank that raises, dies or runs past RANK_TIMEOUT_S fails the test."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tmp / 'rendezvous'}"
    procs = [ctx.Process(target=_rank, args=(r, world, init, fn, args, results, backend),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        while len(got) < world:
            rank, out = results.get(timeout=RANK_TIMEOUT_S)
            if isinstance(out, Exception):
                raise out
            got[rank] = out
    except queue.Empty:
        dead = [f"rank {r}: exit code {p.exitcode}" for r, p in enumerate(procs)
                if p.exitcode not in (None, 0)]
        pytest.fail(f"tensor-parallel ranks gave no result in {RANK_TIMEOUT_S} s "
                    f"({', '.join(dead) or 'none exited'})")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [torch.from_numpy(got[r]) if hasattr(got[r], "dtype") else got[r]
            for r in range(world)]


def prompt_logits(model: str, prompt: list[int], device: str = "cpu") -> torch.Tensor:
    """Logits [n, V] of every prompt position, on this process's group."""
    return LLM(model, **ENGINE, device=device, dtype="float32").logits(prompt).cpu()


def greedy_tokens(model: str, prompts: list[list[int]], static: bool,
                  device: str = "cpu", drafts: str = "model") -> dict[str, list]:
    """Greedy tokens of plain decoding and of vegas (head-aggregated and per-KV-head
    selection) in exact mode, where speculative output is plain output bit for bit; the
    draft steps read `drafts` weights (this rank's copies of its slices)."""
    llm = LLM(model, **ENGINE, exact=True, static_shapes=static, device=device,
              dtype="float32", draft_weights=drafts)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    methods = {"plain": SpecConfig(method="vanilla"),
               "vegas": SpecConfig(method="vegas", gamma=3, ratio=0.1, min_tokens=8),
               "vegas-kv_head": SpecConfig(method="vegas", gamma=3, ratio=0.1, min_tokens=8,
                                           granularity="kv_head")}
    return {name: [o.token_ids for o in llm.generate(prompts, params, speculative=spec)]
            for name, spec in methods.items()}


def vegas_histogram(model: str, prompts: list[list[int]], device: str = "cpu") -> list:
    """Tokens per iteration of greedy vegas (exact mode, a fixed γ: adaptive speculation
    plans by measured times, which a busy machine moves), a histogram per request."""
    llm = LLM(model, **ENGINE, exact=True, device=device, dtype="float32")
    spec = SpecConfig(method="vegas", gamma=3, ratio=0.05, min_tokens=8, adaptive=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True),
                        speculative=spec)
    return [o.stats["tokens_per_iteration_histogram"] for o in outs]


def adaptive_plans(model: str, prompts: list[list[int]]) -> dict[str, Any]:
    """Adaptive vegas with the prefill pacer on every rank's engine, rank 1's rounds made
    20 ms slower: its own clock would have it plan other steps than rank 0 (and meet it in
    other collectives) -> tokens, the controller's estimates and the pacer's."""
    import torch.distributed as dist

    llm = LLM(model, **ENGINE, exact=True, prefill_pacing=2.0, dtype="float32")
    engine = llm.engine
    if dist.get_rank() == 1:
        execute = engine.runner.execute

        def slow(plan: Any) -> Any:
            if plan.decode and plan.draft != 0:  # a round (None: of γ)
                time.sleep(0.02)
            return execute(plan)

        engine.runner.execute = slow
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = llm.generate(prompts, params, speculative=SpecConfig(method="vanilla"))
    spec = SpecConfig(method="vegas", gamma=3, ratio=0.1, min_tokens=8, adaptive=True)
    outs = llm.generate(prompts, params, speculative=spec)
    control = engine.controller
    return {"plain": [o.token_ids for o in plain], "tokens": [o.token_ids for o in outs],
            "estimates": {k: ({g: e.value for g, e in b.costs.items()},
                              b.acceptance.rates(spec.gamma))
                          for k, b in control.buckets.items()},
            "steps": dict(control.chosen),
            "pacer": dataclasses.asdict(engine.pacer)}


def logits_or_exit(model: str, prompt: list[int]) -> torch.Tensor:
    """Rank 1 dies once its engine is built; rank 0 runs the prompt."""
    llm = LLM(model, **ENGINE)
    if parallel.current().rank == 1:
        os._exit(3)
    return llm.logits(prompt)


def family_logits(models: list[str], prompt: list[int]) -> torch.Tensor:
    """Logits [models, n, V] of real (safetensors) checkpoints."""
    return torch.stack([LLM(m, kv_cache_bytes=1 << 22).logits(prompt) for m in models])


def smollm_logits(model: str, prompt: list[int]) -> torch.Tensor:
    return LLM(model, kv_cache_bytes=1 << 24).logits(prompt)


# --- sizes and slices -----------------------------------------------------------------


def test_check_divisible_names_every_size_that_does_not_split() -> None:
    cfg = ModelConfig.from_hf({**CONFIG, "num_attention_heads": 9, "num_key_value_heads": 3,
                               "intermediate_size": 1536, "vocab_size": 49152,
                               "head_dim": 64})
    with pytest.raises(ConfigError, match=r"query heads \(num_attention_heads\) = 9, "
                                          r"KV heads \(num_key_value_heads\) = 3 divisible by 2"):
        parallel.check_divisible(cfg, 2)
    parallel.check_divisible(cfg, 3)
    local = parallel.shard_config(cfg, 3)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 512)
    assert local.vocab_size == 49152 and local.head_dim == 64
    with pytest.raises(ConfigError, match="vocab_size = 49152"):
        parallel.check_divisible(cfg, 5)


def test_dummy_shards_are_slices_of_the_one_rank_weights() -> None:
    """Column-parallel rows, row-parallel columns, vocabulary rows; norms whole."""
    cfg = ModelConfig.from_hf(CONFIG)
    whole = dummy_weights(cfg, torch.float32, torch.device("cpu"))
    shards = [dummy_weights(cfg, torch.float32, torch.device("cpu"),
                            tp=parallel.TPGroup(2, r)) for r in range(2)]
    shapes = parallel.shard_shapes(expected_shapes(cfg), 2)
    for name, w in whole.items():
        assert all(tuple(s[name].shape) == shapes[name] for s in shards), name
        dim = parallel.split_dim(name)
        joined = torch.cat([s[name] for s in shards], dim) if dim is not None else \
            shards[1][name]
        assert torch.equal(joined, w), name
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (64, 64)


def test_safetensors_slices_are_the_whole_tensors_slices(tmp_path: Path) -> None:
    """Read slice by slice from the file: the same slices as cutting the whole tensors."""
    source = resolve(save_family("llama-bias-untied", tmp_path))
    cfg = load_config(source)
    whole = load_weights(source, cfg)
    for rank in range(2):
        tp = parallel.TPGroup(2, rank)
        shards = load_weights(source, cfg, tp)
        assert shards.keys() == whole.keys()
        for name, w in whole.items():
            assert torch.equal(shards[name], parallel.shard_tensor(name, w, tp)), name


def test_a_mis_shaped_tensor_is_named_with_the_rank(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = Path(save_family("qwen2-tied", tmp_path))
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :100].contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    source = resolve(folder)
    with pytest.raises(WeightError, match=r"rank 1 of 2\): model.layers.1.mlp.down_proj.weight"
                                          r" has shape \(64, 50\), config says \(64, 64\)"):
        load_weights(source, load_config(source), parallel.TPGroup(2, 1))


def test_join_refuses_a_rank_outside_the_group() -> None:
    with pytest.raises(ConfigError, match="rank 2 is not in 0..1"):
        parallel.join(2, 2)
    assert parallel.current() is parallel.SINGLE


# --- logits across ranks --------------------------------------------------------------


def test_two_ranks_give_one_ranks_logits(tiny: Path, tmp_path: Path) -> None:
    prompt = random_prompts(3, (40,), VOCAB)[0]
    one = prompt_logits(str(tiny), prompt)
    ranks = run_ranks(2, tmp_path, prompt_logits, str(tiny), prompt)
    assert torch.equal(ranks[0], ranks[1])  # gathered logits: the same bits on every rank
    assert ranks[0].shape == one.shape == (40, VOCAB)
    torch.testing.assert_close(ranks[0], one, **TOL)
    assert torch.equal(ranks[0].argmax(-1), one.argmax(-1))


# Biases everywhere (o_proj's and down's added once, after the sum), q/k RMSNorm, tied and
# untied heads, a mixture of experts: each written by transformers with random norms and biases.
FAMILIES = {"llama-bias-untied": ("LlamaConfig", "LlamaForCausalLM", {
                "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}),
            "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
            "qwen3-bias": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16,
                                                               "attention_bias": True}),
            "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
                "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "norm_topk_prob": True})}


def save_family(name: str, folder: Path) -> str:
    import transformers

    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    fields = {k: CONFIG[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                     "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "max_position_embeddings")}
    config = getattr(transformers, config_cls)(**fields, **extra, initializer_range=0.1)
    model = getattr(transformers, model_cls)(config).float()
    randomize_norms_and_biases(model)
    model.save_pretrained(str(folder / name))
    return str(folder / name)


def test_two_ranks_give_one_ranks_logits_in_every_family(tmp_path: Path) -> None:
    models = [save_family(name, tmp_path) for name in FAMILIES]
    prompt = random_prompts(6, (30,), VOCAB)[0]
    one = family_logits(models, prompt)
    ranks = run_ranks(2, tmp_path, family_logits, models, prompt)
    assert torch.equal(ranks[0], ranks[1])
    for name, got, want in zip(FAMILIES, ranks[0], one, strict=True):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_two_ranks_greedy_speculative_gives_plain_tokens(tiny: Path, tmp_path: Path,
                                                         static: bool) -> None:
    """Exact mode at 2 ranks (a + b = b + a: the all_reduce is row-invariant): every
    speculative method's greedy output is plain decoding's, and every rank's is the same."""
    prompts = random_prompts(5, (60, 23), VOCAB)
    ranks = run_ranks(2, tmp_path, greedy_tokens, str(tiny), prompts, static)
    assert ranks[0] == ranks[1]
    out = ranks[0]
    assert out["vegas"] == out["plain"] and out["vegas-kv_head"] == out["plain"]
    assert all(len(t) == 10 for t in out["plain"])


def test_two_ranks_with_fp8_drafts_give_plain_tokens(tiny: Path, tmp_path: Path) -> None:
    """FP8 copies of each rank's projection slices: the draft steps' products summed over
    the ranks as the model's are, greedy output plain decoding's."""
    prompts = random_prompts(5, (60, 23), VOCAB)
    ranks = run_ranks(2, tmp_path, greedy_tokens, str(tiny), prompts, False, "cpu", "fp8")
    assert ranks[0] == ranks[1]
    assert ranks[0]["vegas"] == ranks[0]["plain"] == ranks[0]["vegas-kv_head"]


def test_two_ranks_select_what_one_rank_selects(tiny: Path, tmp_path: Path) -> None:
    """Head-aggregated scores summed over the ranks before the top-k: drafts attend to the
    positions one rank would pick, so acceptance is one rank's (with each rank's own heads'
    scores it is not: 24/9/2/0 iterations by tokens emitted against 26/7/2/0 here)."""
    prompts = random_prompts(5, (120, 90), VOCAB)
    one = vegas_histogram(str(tiny), prompts)
    ranks = run_ranks(2, tmp_path, vegas_histogram, str(tiny), prompts)
    assert ranks[0] == ranks[1] == one


def test_spmd_ranks_plan_by_rank_0s_times(tiny: Path, tmp_path: Path) -> None:
    """Every rank's engine runs adaptive speculation and the prefill pacer by rank 0's
    measured times (rank 1's own rounds are 20 ms slower): the same steps on every rank, so
    the same estimates, and plain decoding's tokens."""
    prompts = random_prompts(9, (60, 45, 30), VOCAB)
    ranks = run_ranks(2, tmp_path, adaptive_plans, str(tiny), prompts)
    assert ranks[0] == ranks[1]
    assert ranks[0]["estimates"] and sum(ranks[0]["steps"].values()) > 0
    assert ranks[0]["tokens"] == ranks[0]["plain"]


def test_three_ranks_greedy_speculative_gives_plain_tokens(tmp_path_factory: pytest.TempPathFactory,
                                                           tmp_path: Path) -> None:
    """3 ranks, where exact mode adds the row-parallel partials in rank order. (A plain
    all_reduce passes here too: the test checks the tokens, not the order of the sums.)"""
    config = {**CONFIG, "vocab_size": 258, "hidden_size": 96, "intermediate_size": 192,
              "num_attention_heads": 6, "num_key_value_heads": 3}
    folder = config_folder(tmp_path_factory, "tiny-llama-tp3", config)
    prompts = random_prompts(7, (50, 21), 258)
    ranks = run_ranks(3, tmp_path, greedy_tokens, str(folder), prompts, False)
    assert ranks[0] == ranks[1] == ranks[2]
    out = ranks[0]
    assert out["vegas"] == out["plain"] and out["vegas-kv_head"] == out["plain"]


@pytest.mark.slow
def test_smollm2_at_three_ranks_gives_one_ranks_logits(smollm_gguf: Path,
                                                       tmp_path: Path) -> None:
    """9 query / 3 KV heads: 3 query heads and 1 KV head a rank."""
    prompt = random_prompts(4, (24,), 49152)[0]
    one = smollm_logits(str(smollm_gguf), prompt)
    ranks = run_ranks(3, tmp_path, smollm_logits, str(smollm_gguf), prompt)
    assert all(torch.equal(ranks[0], r) for r in ranks[1:])
    torch.testing.assert_close(ranks[0], one, **SMOLLM_TOL)
    assert torch.equal(ranks[0].argmax(-1), one.argmax(-1))


@pytest.mark.slow
def test_smollm2_is_refused_at_two_ranks(smollm_gguf: Path, tmp_path: Path) -> None:
    """Every rank's engine refuses before it reads a weight, naming the heads."""
    with pytest.raises(ConfigError, match=r"query heads \(num_attention_heads\) = 9"):
        parallel.check_divisible(load_config(resolve(smollm_gguf)), 2)
    with pytest.raises(ConfigError, match=r"over 2 ranks needs the model's query heads "
                                          r"\(num_attention_heads\) = 9, KV heads"):
        run_ranks(2, tmp_path, smollm_logits, str(smollm_gguf), [1, 2, 3])


def test_a_rank_that_dies_fails_the_others_instead_of_hanging(tiny: Path,
                                                              tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="(?i)connection|closed|peer"):
        run_ranks(2, tmp_path, logits_or_exit, str(tiny), [5, 6, 7])


# --- NCCL on GPUs: the same checks, with the decode loop in CUDA graphs --------------------

TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@TWO_GPUS
def test_nccl_two_ranks_give_one_ranks_logits(tiny: Path, tmp_path: Path) -> None:
    prompt = random_prompts(3, (40,), VOCAB)[0]
    one = prompt_logits(str(tiny), prompt, "cuda")
    ranks = run_ranks(2, tmp_path, prompt_logits, str(tiny), prompt, "cuda", backend="nccl")
    assert torch.equal(ranks[0], ranks[1])
    torch.testing.assert_close(ranks[0], one, **TOL)


@TWO_GPUS
def test_nccl_two_ranks_greedy_speculative_gives_plain_tokens(tiny: Path,
                                                              tmp_path: Path) -> None:
    """Static shapes: each rank's rounds replay CUDA graphs with the all_reduces inside."""
    prompts = random_prompts(5, (60, 23), VOCAB)
    ranks = run_ranks(2, tmp_path, greedy_tokens, str(tiny), prompts, True, "cuda",
                      backend="nccl")
    assert ranks[0] == ranks[1]
    out = ranks[0]
    assert out["vegas"] == out["plain"] and out["vegas-kv_head"] == out["plain"]


@TWO_GPUS
def test_nccl_two_ranks_select_what_one_rank_selects(tiny: Path, tmp_path: Path) -> None:
    prompts = random_prompts(5, (120, 90), VOCAB)
    one = vegas_histogram(str(tiny), prompts, "cuda")
    ranks = run_ranks(2, tmp_path, vegas_histogram, str(tiny), prompts, "cuda",
                      backend="nccl")
    assert ranks[0] == ranks[1] == one
