"""The kernels' tuning tables: one per kernel module, keyed by device class, read through the
module's `tuning(device)`; `kernels.tuned` sets fields for a block of code."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import vegas_spec.kernels as kernels
from vegas_spec.kernels import paged_attention as pa
from vegas_spec.kernels import split_merge, tuned

TUNED = ["exact_matmul", "fused_moe", "paged_attention", "prefill_attention", "quest_scores",
         "skinny_matmul", "sparse_attention", "split_merge", "topk"]


@pytest.mark.parametrize("name", TUNED)
def test_every_table_has_the_default_and_the_interpreter(name: str) -> None:
    module = importlib.import_module(f"vegas_spec.kernels.{name}")
    table = module.TUNING
    assert {"sm90", "default", "interpreter"} <= set(table)
    kinds = {type(entry) for entry in table.values()}
    assert len(kinds) == 1 and dataclasses.is_dataclass(kinds.pop())
    assert module.tuning(torch.device("cpu")) is table["interpreter"]


def test_a_gpu_not_listed_reads_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernels.device_class(torch.device("cpu")) == "interpreter"
    monkeypatch.setattr(kernels, "device_class", lambda device: "sm999")
    assert pa.tuning(torch.device("cuda", 0)) is pa.TUNING["default"]
    monkeypatch.setattr(kernels, "device_class", lambda device: "sm90")
    assert pa.tuning(torch.device("cuda", 0)) is pa.TUNING["sm90"]


def test_tuned_sets_a_field_in_every_entry_and_restores_the_table() -> None:
    before = dict(split_merge.TUNING)
    with tuned(split_merge, merge_tile=512, max_lanes=32):
        assert {entry.merge_tile for entry in split_merge.TUNING.values()} == {512}
        assert split_merge.tuning(torch.device("cpu")).max_lanes == 32
    assert split_merge.TUNING == before
    assert all(split_merge.TUNING[key] is entry for key, entry in before.items())


def test_tuned_refuses_unknown_names() -> None:
    for bad in ({"merge_tiles": 1}, {"SCORE_TILES": {}}, {"tuning": None}):
        with pytest.raises(KeyError):
            with tuned(split_merge, **bad):
                pass
    assert split_merge.TUNING["sm90"].merge_tile == 4096
