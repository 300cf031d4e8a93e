"""`runner_setup.draft_kind`: what "auto" draft weights become for a model on a device
(FP8 copies for dense models whose layers are large enough, on GPUs with FP8 conversions and
room for the copies), and what an explicit choice is refused on."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from vegas_spec import runner_setup
from vegas_spec.config import ConfigError, EngineConfig, ModelConfig
from vegas_spec.models.loader import load_config, resolve
from vegas_spec.models.registry import family

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
GPU = torch.device("cuda", 0)


def shape(name: str) -> ModelConfig:
    return load_config(resolve(str(CONFIGS / name)))


def on_gpu(monkeypatch: pytest.MonkeyPatch, fp8: bool = True, gib: int = 80) -> None:
    """A GPU of `gib` GiB, with FP8 conversions or without, as far as `draft_kind` asks."""
    monkeypatch.setattr(runner_setup, "fp8_supported", lambda device: fp8)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=gib << 30))


def kind(cfg: ModelConfig, draft_weights: str = "auto", device: torch.device = GPU) -> str:
    config = EngineConfig(draft_weights=draft_weights, dtype="bfloat16")
    return runner_setup.draft_kind(config, device, cfg)


def test_auto_takes_fp8_copies_for_8b_layers_and_the_models_weights_for_small_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    on_gpu(monkeypatch)
    llama, smol = shape("llama-3.1-8b"), shape("smollm2-135m")
    # q/k/v, o_proj, gate/up and down, from the families' weight tables
    assert family(llama.architecture).projection_params(llama) == 218_103_808  # 436 MB in bf16
    assert family(smol.architecture).projection_params(smol) == 3_538_944  # 7 MB
    assert kind(llama) == kind(shape("qwen3-8b")) == "fp8"
    assert kind(smol) == "model"


def test_auto_keeps_the_models_weights_for_experts_without_fp8_or_without_room(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert kind(shape("llama-3.1-8b"), device=torch.device("cpu")) == "model"
    on_gpu(monkeypatch)
    assert kind(shape("qwen3-30b-a3b")) == kind(shape("gpt-oss-20b")) == "model"
    on_gpu(monkeypatch, gib=24)  # 7 GB of copies: more than a quarter of 24 GiB
    assert kind(shape("llama-3.1-8b")) == "model"
    on_gpu(monkeypatch, fp8=False)
    assert kind(shape("llama-3.1-8b")) == "model"


def test_explicit_choices_stand_and_fp8_without_conversions_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    on_gpu(monkeypatch)
    smol = shape("smollm2-135m")
    assert kind(smol, "fp8") == "fp8" and kind(smol, "int4") == "int4"
    assert kind(shape("llama-3.1-8b"), "model") == "model"
    on_gpu(monkeypatch, fp8=False)
    with pytest.raises(ConfigError, match="FP8 conversions"):
        kind(smol, "fp8")
    assert kind(smol, "int8") == "int8"  # integers convert on any GPU
