"""step_profile's weight bytes of a step: of a mixture of experts only the experts its tokens
hit (the uniform-routing expectation checked against counting), of a dense model every
weight as before."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
import transformers
from conftest import benchmark_script

from vegas_spec import SpecConfig
from vegas_spec.config import ModelConfig
from vegas_spec.engine import LLM
from vegas_spec.models import loader, registry
from vegas_spec.ops import route
from vegas_spec.speculative.policies import make_policy

ROOT = Path(__file__).resolve().parents[2]
DENSE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
         "bos_token_id": 1, "eos_token_id": 2}
# tests/models/test_qwen3_moe.py's tiny model
TINY_MOE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
GAMMA = 6


@pytest.fixture(scope="module")
def sp() -> ModuleType:
    return benchmark_script("step_profile")


def dummy_engine(folder: Path) -> LLM:
    return LLM(str(folder), load_format="dummy", device="cpu", dtype="float32",
               kv_cache_bytes=1 << 20, max_model_len=96)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = tmp_path_factory.mktemp("dense")
    (folder / "config.json").write_text(json.dumps(DENSE))
    return dummy_engine(folder)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """The tiny Qwen3-MoE's config as transformers saves it, dummy weights."""
    folder = tmp_path_factory.mktemp("qwen3-moe")
    config = transformers.Qwen3MoeConfig(**TINY_MOE)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(str(folder))
    return dummy_engine(folder)


@pytest.mark.parametrize(("experts", "top_k", "tokens"), [(4, 2, 2), (5, 2, 3), (6, 3, 2),
                                                           (4, 1, 4), (3, 3, 2)])
def test_expected_experts_hit_is_the_mean_over_every_routing(
        sp: ModuleType, experts: int, top_k: int, tokens: int) -> None:
    """Every way `tokens` tokens can each pick top_k distinct experts, equally likely: the
    mean number of distinct experts hit is the formula's."""
    choices = list(itertools.combinations(range(experts), top_k))
    routings = list(itertools.product(choices, repeat=tokens))
    mean = sum(len(set(itertools.chain(*r))) for r in routings) / len(routings)
    assert sp.expected_experts_hit(experts, top_k, tokens) == pytest.approx(mean, rel=1e-12)


@pytest.mark.parametrize(("experts", "top_k", "tokens"), [(128, 8, 1), (128, 8, 7),
                                                           (128, 8, 64), (32, 4, 16)])
def test_expected_experts_hit_matches_the_routers_picks_on_random_logits(
        sp: ModuleType, experts: int, top_k: int, tokens: int) -> None:
    """The engine's router (`ops.route`) on independent random logits, 400 steps: the mean
    of the distinct experts each step hits is the formula's to within 4 standard errors."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([float(route(torch.randn(tokens, experts, generator=gen), top_k,
                                       True)[1].unique().numel()) for _ in range(400)])
    expected = sp.expected_experts_hit(experts, top_k, tokens)
    assert abs(counts.mean().item() - expected) <= 4 * counts.std().item() / 20 + 1e-9
    assert counts.min() >= top_k and counts.max() <= min(experts, top_k * tokens)


def test_expected_experts_hit_edges(sp: ModuleType) -> None:
    assert sp.expected_experts_hit(0, 0, 5) == 0.0  # a dense model
    assert sp.expected_experts_hit(128, 8, 0) == 0.0
    assert sp.expected_experts_hit(128, 8, 1) == pytest.approx(8)  # one token: its k
    assert sp.expected_experts_hit(32, 32, 3) == 32  # every expert a token
    # Qwen3-30B-A3B (128 experts, top-8): a plain step of 1 sequence against its verify step
    assert sp.expected_experts_hit(128, 8, GAMMA + 1) == pytest.approx(
        128 * (1 - (120 / 128) ** 7))
    assert 46.5 < sp.expected_experts_hit(128, 8, GAMMA + 1) < 46.6  # of 8 a token


def test_dense_step_bytes_are_every_weight_whatever_the_rows(sp: ModuleType,
                                                              dense: LLM) -> None:
    cfg, every = dense.model_config, sp.weight_bytes(dense)
    assert sp.expert_bytes(cfg, 4) == 0 and sp.expert_itemsize(dense) == 0
    for rows, batch in ((1, 1), (GAMMA + 1, 1), (GAMMA + 1, 64)):
        got = sp.expected_weight_bytes(cfg, every, 4, rows, batch)
        assert got == every and type(got) is int
    row = sp.step_weights(cfg, 16, GAMMA, {"plain": every, "verify": every, "draft": every - 8},
                          0, {})
    assert row == {"weight_bytes_plain": every, "weight_bytes_verify": every,
                   "weight_bytes_draft": every - 8}
    floors: dict = {**row}
    sp.set_floors(floors, {"plain": 100, "verify": 300, "draft": 10}, 1e10)
    # the floors as before: weights once and the other bytes, over the bandwidth
    assert floors["floor_plain_ms"] == 1e3 * (every + 100) / 1e10
    assert floors["floor_verify_ms"] == 1e3 * (every + 300) / 1e10
    assert floors["floor_draft_ms"] == 1e3 * (every - 8 + 10) / 1e10


def expert_params(llm: LLM) -> int:
    return sum(p.numel() * p.element_size() for layer in llm.engine.runner.model.layers
               for p in (layer.experts_gate_up, layer.experts_down))


def test_moe_step_bytes_count_only_the_experts_hit(sp: ModuleType, moe: LLM) -> None:
    cfg: ModelConfig = moe.model_config
    layers, experts, k = cfg.num_layers, cfg.num_experts, cfg.experts_per_token
    assert (layers, experts, k) == (2, 8, 2)
    every, itemsize = sp.weight_bytes(moe), sp.expert_itemsize(moe)
    per = sp.expert_bytes(cfg, itemsize)
    assert itemsize == 4 and per == 4 * 3 * 64 * 32
    assert layers * experts * per == expert_params(moe)  # the config's count, the model's
    dense_part = every - layers * experts * per
    plain = sp.expected_weight_bytes(cfg, every, itemsize, 1, 1)
    assert plain == pytest.approx(dense_part + layers * k * per)  # one token: its k experts
    by_rows = [sp.expected_weight_bytes(cfg, every, itemsize, rows, 1)
               for rows in range(1, GAMMA + 2)]
    assert all(a < b for a, b in itertools.pairwise(by_rows))  # more rows, more experts
    verify = by_rows[-1]
    assert verify == pytest.approx(dense_part + layers * per * 8 * (1 - 0.75 ** 7))
    # at a large batch every expert is hit by the plain step already: verify = plain
    wide = [sp.expected_weight_bytes(cfg, every, itemsize, rows, 512) for rows in (1, GAMMA + 1)]
    assert wide[0] == pytest.approx(every) and wide[1] == pytest.approx(every)
    assert sp.routed_weight_bytes(cfg, every, itemsize, [experts] * layers) == every
    assert sp.routed_weight_bytes(cfg, every, itemsize, [1, 3]) == dense_part + 4 * per


def step_hits(sp: ModuleType, llm: LLM, kind: str, batch: int) -> list[int]:
    """The experts each layer hits in a `kind` step (plain: one row, verify: γ+1) of `batch`
    sequences at position 40, the same seeded tokens every call."""
    cfg, rows = llm.model_config, GAMMA + 1 if kind == "verify" else 1
    pages = [llm.engine.runner.cache.allocate(40 + GAMMA + 1) for _ in range(batch)]
    try:
        tokens = torch.randint(0, cfg.vocab_size, (batch, GAMMA + 1),
                               generator=torch.Generator().manual_seed(1))[:, :rows]
        positions = (40 + torch.arange(rows))[None].repeat(batch, 1)
        spec = SpecConfig(method="vanilla" if kind == "plain" else "stream", gamma=GAMMA)
        policy = None if kind == "plain" else make_policy(spec)
        runner = sp.graph_runner(llm, spec, policy, batch)
        runner.set_rows(0, torch.tensor(pages, dtype=torch.int32))
        runner.run(kind, tokens, positions)
        return sp.experts_hit(runner, kind)
    finally:
        llm.engine.runner.use_graphs(None)
        for p in pages:
            llm.engine.runner.cache.release(p)


def test_moe_experts_hit_counted_from_the_steps_routing(sp: ModuleType, moe: LLM) -> None:
    """A plain step of one sequence hits its token's k experts in every layer; the verify
    step of the same sequence, γ+1 rows, at least those (its first row is the plain step's
    token at the same position); both within what the rows can hit."""
    cfg = moe.model_config
    plain_hits, verify_hits = step_hits(sp, moe, "plain", 1), step_hits(sp, moe, "verify", 1)
    assert plain_hits == [2, 2]
    assert len(verify_hits) == 2
    assert all(2 <= v <= 8 for v in verify_hits) and sum(verify_hits) > sum(plain_hits)
    every = sp.weight_bytes(moe)
    row = sp.step_weights(cfg, 1, GAMMA, {"plain": every, "verify": every, "draft": every - 8},
                          4, {"plain": plain_hits, "verify": verify_hits, "draft": plain_hits})
    assert row["experts_hit_plain"] == 2 and row["experts_hit_plain_expected"] == 2
    assert row["experts_hit_verify"] == sum(verify_hits) / 2
    per = sp.expert_bytes(cfg, 4)
    dense_part = every - 2 * 8 * per
    assert row["weight_bytes_plain"] == dense_part + 4 * per
    assert row["weight_bytes_draft"] == dense_part - 8 + 4 * per
    assert row["weight_bytes_verify"] == dense_part + sum(verify_hits) * per
    assert row["weight_bytes_plain"] < row["weight_bytes_verify"] <= every
    assert row["weight_bytes_verify_expected"] == pytest.approx(
        dense_part + 2 * per * 8 * (1 - 0.75 ** 7))


def config_weight_bytes(folder: Path, itemsize: int) -> tuple[ModelConfig, int]:
    """A benchmark config as the engine reads it, and the bytes `weight_bytes` counts for it
    (every tensor of its checkpoints once, but the untied input embedding), from the
    family's weight table: no weights built."""
    source = loader.resolve(str(folder))
    cfg = loader.load_config(source)
    shapes = registry.family(cfg.architecture).shapes(cfg)
    every = itemsize * sum(math.prod(shape) for shape in shapes.values())
    return cfg, every - itemsize * cfg.vocab_size * cfg.hidden_size


@pytest.mark.parametrize(("name", "sizes", "total_gb", "plain_gb", "verify_gb"), [
    ("qwen3-30b-a3b", (48, 2048, 32, 4, 128, 128, 8, 768), 60.44, 6.08, 23.54),
    ("gpt-oss-20b", (24, 2880, 64, 8, 64, 32, 4, 2880), 40.67, 7.22, 25.66)])
def test_benchmark_moe_configs_and_their_bf16_step_bytes(
        sp: ModuleType, name: str, sizes: tuple[int, ...], total_gb: float, plain_gb: float,
        verify_gb: float) -> None:
    """benchmarks/configs' MoE models read on CPU, and the bf16 weight bytes of one
    sequence's plain and verify (γ+1 rows) steps under uniform routing."""
    cfg, every = config_weight_bytes(ROOT / "benchmarks" / "configs" / name, 2)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == sizes
    assert every / 1e9 == pytest.approx(total_gb, abs=0.01)
    plain = sp.expected_weight_bytes(cfg, every, 2, 1, 1)
    verify = sp.expected_weight_bytes(cfg, every, 2, GAMMA + 1, 1)
    assert plain / 1e9 == pytest.approx(plain_gb, abs=0.01)
    assert verify / 1e9 == pytest.approx(verify_gb, abs=0.01)
    # 64 sequences: the plain step hits nearly every expert already
    wide = sp.expected_weight_bytes(cfg, every, 2, 1, 64)
    assert 0.98 * every < wide < every


def test_benchmark_gpt_oss_config_is_the_published_layout() -> None:
    cfg, _ = config_weight_bytes(ROOT / "benchmarks" / "configs" / "gpt-oss-20b", 2)
    assert cfg.layer_windows == (128, 0) * 12 and cfg.sinks and cfg.qkv_bias and cfg.o_bias
    assert cfg.rope["rope_type"] == "yarn" and cfg.rope["factor"] == 32
    assert cfg.rope["original_max_position_embeddings"] == 4096
    assert (cfg.swiglu_limit, cfg.router_bias, cfg.expert_bias) == (7.0, True, True)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (201088, 131072)
    qwen, _ = config_weight_bytes(ROOT / "benchmarks" / "configs" / "qwen3-30b-a3b", 2)
    assert qwen.qk_norm and qwen.norm_topk_prob and qwen.rope_theta == 1e6
    assert (qwen.vocab_size, qwen.max_position_embeddings) == (151936, 40960)


def test_kv_bytes_of_sliding_window_layers_are_their_windows(sp: ModuleType) -> None:
    """K and V a step reads: every position on a full layer; on gpt-oss's sliding layers
    (128) the rows' window, and on a dense model every layer whole, as before."""
    oss, _ = config_weight_bytes(ROOT / "benchmarks" / "configs" / "gpt-oss-20b", 2)
    qwen, _ = config_weight_bytes(ROOT / "benchmarks" / "configs" / "qwen3-30b-a3b", 2)
    token = sp.kv_bytes_per_token(oss, 2)
    per_layer = 2 * oss.num_kv_heads * oss.head_dim * 2
    # 12 full layers of 32K keys, 12 sliding ones of 128 (one row) or 134 (7 rows)
    assert sp.kv_read_bytes(oss, 4, 32768, 1, token) == 4 * per_layer * 12 * (32768 + 128)
    assert sp.kv_read_bytes(oss, 4, 32768, 7, token) == 4 * per_layer * 12 * (32768 + 134)
    # a context inside the window: every position on every layer
    assert sp.kv_read_bytes(oss, 2, 100, 1, token) == 2 * 100 * token
    # a draft step: the budget on full layers, the window of the context on sliding ones
    assert sp.kv_read_bytes(oss, 1, 300, 1, token, 32768) == per_layer * 12 * (300 + 128)
    assert sp.kv_read_bytes(qwen, 3, 5000, 7, sp.kv_bytes_per_token(qwen, 2)) == \
        3 * 5000 * sp.kv_bytes_per_token(qwen, 2)


def test_spread_biases_routes_dummy_gpt_oss_tokens_apart(sp: ModuleType,
                                                         tmp_path: Path) -> None:
    """gpt-oss's dummy biases are ones: the o_proj bias swamps the random residual stream and
    every token of a verify step routes to the same k experts; drawn as weights, they
    spread."""
    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2)
    config.architectures = ["GptOssForCausalLM"]
    config.save_pretrained(str(tmp_path))
    llm = dummy_engine(tmp_path)
    assert step_hits(sp, llm, "verify", 2) == [2, 2]  # 14 tokens, the same 2 experts
    sp.spread_biases(llm.engine.runner.model)
    biases = [p for n, p in llm.engine.runner.model.named_parameters() if n.endswith("bias")]
    assert biases and all(abs(float(b.std()) - 0.02) < 0.01 for b in biases)
    assert sum(step_hits(sp, llm, "verify", 2)) > 4


def test_experts_kept_in_mxfp4_count_their_packed_bytes(
        sp: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gpt-oss config that ships MXFP4 experts draws them as MXFP4 values, the engine keeps
    them packed where it may (forced here on the CPU), and the step profile counts their
    packed bytes: half a byte a value and a scale byte a 32."""
    from vegas_spec import runner_setup

    config = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
        quantization_config={"quant_method": "mxfp4"})
    config.architectures = ["GptOssForCausalLM"]
    config.save_pretrained(str(tmp_path))
    monkeypatch.setattr(runner_setup, "keeps_mxfp4", lambda *args: True)
    llm = dummy_engine(tmp_path)
    cfg = llm.model_config
    assert cfg.mxfp4_experts
    layers = llm.engine.runner.model.layers
    assert all(layer.packed is not None for layer in layers)
    assert sp.expert_itemsize(llm) == 17 / 32
    packed = sum(w.blocks.nbytes + w.scales.nbytes for layer in layers for w in layer.packed)
    assert packed == 2 * 4 * 3 * 64 * 32 * 17 // 32  # layers x experts x values x 17/32
    rest = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    embed = llm.engine.runner.model.embed.weight
    assert sp.weight_bytes(llm) == rest + packed - embed.numel() * embed.element_size()
