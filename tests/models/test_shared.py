"""One model per checkpoint, dtype and device in a process: engines that load the same one
share the first engine's weights, read-only, until the last of them is gone; another dtype,
FP8 drafts, or a checkpoint rewritten in place gets a model of its own."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from test_errors import tiny_checkpoint

from vegas_spec import SamplingParams
from vegas_spec.engine import LLM
from vegas_spec.models import shared
from vegas_spec.models.loader import resolve

ENGINE = dict(kv_cache_bytes=1 << 20, page_size=8)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return tiny_checkpoint(tmp_path / "tiny")


def test_engines_of_one_checkpoint_share_its_weights(tiny: Path) -> None:
    first, second = LLM(str(tiny), **ENGINE), LLM(str(tiny), max_num_seqs=2, **ENGINE)
    assert second.engine.runner.model is first.engine.runner.model
    assert second.engine.runner.cache is not first.engine.runner.cache  # each engine's own KV pool
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert second.generate([[5, 6, 7]], params)[0].token_ids == \
        first.generate([[5, 6, 7]], params)[0].token_ids


def test_another_dtype_or_fp8_drafts_is_a_model_of_its_own(tiny: Path) -> None:
    plain = LLM(str(tiny), **ENGINE)
    half = LLM(str(tiny), dtype="bfloat16", **ENGINE)
    fp8 = LLM(str(tiny), draft_weights="fp8", **ENGINE)
    models = [llm.engine.runner.model for llm in (plain, half, fp8)]
    assert len(set(map(id, models))) == 3
    assert models[1].layers[0].qkv.weight.dtype == torch.bfloat16
    assert models[0].layers[0].drafts is None and models[2].layers[0].drafts is not None
    again = LLM(str(tiny), draft_weights="fp8", **ENGINE)
    assert again.engine.runner.model is models[2]
    assert plain.engine.draft_weight_bytes == 0 < fp8.engine.draft_weight_bytes


def test_a_rewritten_checkpoint_is_read_again(tiny: Path) -> None:
    old = LLM(str(tiny), **ENGINE)
    weights = tiny / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert LLM(str(tiny), **ENGINE).engine.runner.model is not old.engine.runner.model


def test_the_model_goes_with_the_last_engine_that_holds_it(tiny: Path) -> None:
    key_files = shared.file_stamps(resolve(str(tiny)))
    held = lambda: [k for k in shared._MODELS.keys() if k.files == key_files]  # noqa: E731
    first, second = LLM(str(tiny), **ENGINE), LLM(str(tiny), **ENGINE)
    assert len(held()) == 1
    del first
    gc.collect()
    assert len(held()) == 1 and second.engine.runner.model is not None
    del second
    gc.collect()
    assert not held()


def test_stamps_name_the_files_a_model_is_read_from(tiny: Path) -> None:
    names = [Path(path).name for path, _, _ in shared.file_stamps(resolve(str(tiny)))]
    assert names == sorted(names) and "config.json" in names and "model.safetensors" in names
