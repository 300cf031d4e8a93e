"""The model registry: a family is its file (a weight table over the shared layers) and one
registry entry, and its table is the one place its tensor names are written: the loader's
expected shapes and GGUF names, the dummy weights, the tensor-parallel splits and the
model's parameters all come from it."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_LLAMA, TINY_VOCAB, random_prompts
from safetensors.torch import save_file

from vegas_spec import parallel
from vegas_spec.config import ConfigError, ModelConfig
from vegas_spec.engine import LLM
from vegas_spec.models import decoder, family, layers, loader, registry
from vegas_spec.models.decoder import build_model
from vegas_spec.models.family import COLUMNS, ROWS, Family, Switches, Weight, dims, untied

# --- a family of Meta's original Llama checkpoint names: the whole of its "file" ----------

META_MODEL = (
    Weight("tok_embeddings.weight", "embed.weight", dims("vocab", "hidden"), ROWS,
           "token_embd.weight"),
    Weight("norm.weight", "norm", dims("hidden"), None, "output_norm.weight"),
    Weight("output.weight", "lm_head.weight", dims("vocab", "hidden"), ROWS, "output.weight",
           untied),
)
META_LAYER = (
    Weight("attention.wq.weight", "qkv.weight", dims("q", "hidden"), ROWS, "attn_q.weight"),
    Weight("attention.wk.weight", "qkv.weight", dims("kv", "hidden"), ROWS, "attn_k.weight"),
    Weight("attention.wv.weight", "qkv.weight", dims("kv", "hidden"), ROWS, "attn_v.weight"),
    Weight("attention.wo.weight", "o_proj.weight", dims("hidden", "q"), COLUMNS,
           "attn_output.weight"),
    Weight("feed_forward.w1.weight", "gate_up.weight", dims("ffn", "hidden"), ROWS,
           "ffn_gate.weight"),
    Weight("feed_forward.w3.weight", "gate_up.weight", dims("ffn", "hidden"), ROWS,
           "ffn_up.weight"),
    Weight("feed_forward.w2.weight", "down.weight", dims("hidden", "ffn"), COLUMNS,
           "ffn_down.weight"),
    Weight("attention_norm.weight", "input_norm", dims("hidden"), None, "attn_norm.weight"),
    Weight("ffn_norm.weight", "post_norm", dims("hidden"), None, "ffn_norm.weight"),
)
META = Family("MetaLlamaForCausalLM", "meta_llama", layers.DecoderLayer, META_MODEL,
              META_LAYER, lambda hf: Switches(), layer_prefix="layers.{i}.")

META_CONFIG = {**TINY_LLAMA, "architectures": [META.architecture], "tie_word_embeddings": False}


@pytest.fixture
def meta(monkeypatch: pytest.MonkeyPatch) -> Family:
    """META registered (its registry entry) for one test."""
    monkeypatch.setitem(registry.FAMILIES, META.architecture, META)
    return META


def checkpoint(folder: Path, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def meta_names(llama_cfg: ModelConfig) -> dict[str, str]:
    """Llama's HF names -> META's, row by row (the two tables list a layer in one order)."""
    llama = registry.family("LlamaForCausalLM")

    def pairs(theirs: tuple[Weight, ...], ours: tuple[Weight, ...]) -> list[tuple[str, str]]:
        rows = list(zip([r for r in theirs if r.when(llama_cfg)], ours, strict=True))
        assert all(a.param == b.param for a, b in rows)
        return [(a.hf, b.hf) for a, b in rows]

    out = dict(pairs(llama.weights, META.weights))
    for i in range(llama_cfg.num_layers):
        out.update({llama.layer_prefix.format(i=i) + a: META.layer_prefix.format(i=i) + b
                    for a, b in pairs(llama.layer_weights, META.layer_weights)})
    return out


def test_a_registered_family_loads_shards_and_runs(meta: Family, tmp_path: Path) -> None:
    """The same weights under Llama's names and under META's give the same logits; META's
    loader shapes, dummy weights and tensor-parallel slices are those of its table."""
    llama_hf = {**TINY_LLAMA, "tie_word_embeddings": False}
    llama_cfg = ModelConfig.from_hf(llama_hf)
    weights = loader.dummy_weights(llama_cfg, torch.float32, torch.device("cpu"), seed=3)
    names = meta_names(llama_cfg)
    llama_dir = checkpoint(tmp_path / "llama", llama_hf, weights)
    meta_dir = checkpoint(tmp_path / "meta", META_CONFIG,
                          {names[k]: v for k, v in weights.items()})
    source = loader.resolve(meta_dir)
    cfg = loader.load_config(source)
    assert cfg.architecture == META.architecture
    assert set(loader.expected_shapes(cfg)) == set(names.values())
    whole = loader.load_weights(source, cfg)
    for rank in range(2):
        tp = parallel.TPGroup(2, rank)
        shards = loader.load_weights(source, cfg, tp)
        assert shards.keys() == whole.keys()
        assert shards["layers.1.attention.wo.weight"].shape == (64, 32)  # its columns
        assert shards["tok_embeddings.weight"].shape == (TINY_VOCAB // 2, 64)  # vocab rows
        for name, w in whole.items():
            assert torch.equal(shards[name], parallel.shard(w, META.split_dim(name), tp)), name
            assert torch.equal(shards[name], parallel.shard_tensor(name, w, tp)), name
    prompt = random_prompts(1, (24,), TINY_VOCAB)[0]
    ours = LLM(str(meta_dir), kv_cache_bytes=1 << 22).logits(prompt)
    theirs = LLM(str(llama_dir), kv_cache_bytes=1 << 22).logits(prompt)
    assert torch.equal(ours, theirs)


def test_an_unregistered_architecture_names_the_registered_ones(meta: Family) -> None:
    with pytest.raises(ConfigError, match=r"unsupported architecture Foo; supported: "
                                          r"LlamaForCausalLM, .*, MetaLlamaForCausalLM$"):
        ModelConfig.from_hf({**META_CONFIG, "architectures": ["Foo"]})
    assert ModelConfig.from_hf({**META_CONFIG, "architectures": None,
                                "model_type": "meta_llama"}).architecture == META.architecture


def test_without_its_entry_a_family_is_unknown() -> None:
    assert META.architecture not in registry.FAMILIES
    with pytest.raises(ConfigError, match="unsupported architecture MetaLlamaForCausalLM"):
        ModelConfig.from_hf(META_CONFIG)


# --- every family's table is the single source of its names ----------------------------

def every_switch(architecture: str) -> ModelConfig:
    """A config of the family with every optional tensor its config can switch on (and
    experts' sizes, which only a mixture of experts reads)."""
    return ModelConfig.from_hf({**TINY_LLAMA, "architectures": [architecture],
                                "attention_bias": True, "mlp_bias": True,
                                "tie_word_embeddings": False, "head_dim": 16,
                                "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32})


@pytest.mark.parametrize("architecture", list(registry.FAMILIES))
def test_shapes_splits_and_gguf_names_come_from_the_table(architecture: str) -> None:
    fam = registry.family(architecture)
    cfg = every_switch(architecture)
    shapes = loader.expected_shapes(cfg)
    rows = [(name, fam.entry(name)) for name in shapes]
    assert all(row is not None and shapes[name] == row.shape(cfg) for name, row in rows)
    assert len(shapes) == sum(r.when(cfg) for r in fam.weights) + \
        cfg.num_layers * sum(len(r.names(cfg)) for r in fam.layer_weights if r.when(cfg))
    halves = parallel.shard_shapes(shapes, 2)
    for name, row in rows:
        assert row is not None
        assert parallel.split_dim(name) == fam.split_dim(name) == row.split
        assert halves[name] == parallel.shard_shape(shapes[name], row.split, 2)
        block = "" if name in {r.hf for r in fam.weights} else f"blk.{name.split('.')[2]}."
        if row.gguf is None:  # llama.cpp holds it in parts, which a join puts together
            join = next(j for j in fam.gguf_joins if name == block.replace(
                "blk.", "model.layers.") + j.hf)
            assert all(fam.gguf_join(block + p)[:2] == (name, join) for p in join.parts)
        elif not row.per_expert:  # llama.cpp stacks the experts: no name of one expert's
            assert fam.from_gguf(block + row.gguf) == name
    weights = loader.dummy_weights(cfg, torch.float32, torch.device("cpu"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == shapes


@pytest.mark.parametrize("architecture", list(registry.FAMILIES))
def test_the_table_fills_every_parameter(architecture: str) -> None:
    """Every parameter of the built model is one a table row fills: no weight is loaded
    from anywhere else."""
    fam = registry.family(architecture)
    cfg = every_switch(architecture)
    model = build_model(cfg, loader.dummy_weights(cfg, torch.float32, torch.device("cpu")),
                        torch.float32, torch.device("cpu"))
    filled = {r.param for r in fam.weights if r.when(cfg)} | {
        f"layers.{i}.{r.param}" for i in range(cfg.num_layers)
        for r in fam.layer_weights if r.when(cfg)}
    assert {n for n, _ in model.named_parameters()} == filled


def test_tensor_names_are_written_only_in_the_family_files() -> None:
    for module in (loader, parallel, decoder, layers, family, registry):
        source = inspect.getsource(module)
        for name in ("q_proj", "gate_proj", "embed_tokens", "input_layernorm", "attn_q"):
            assert name not in source, f"{module.__name__} names {name}"
