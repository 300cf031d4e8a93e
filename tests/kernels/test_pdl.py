"""Programmatic dependent launch: off for CPU tensors, so that the interpreter never meets
griddepcontrol, and on a GPU only with VEGAS_SPEC_PDL=1, so that a run can be compared
with plain stream order."""

from __future__ import annotations

import pytest
import torch

from vegas_spec.kernels import pdl


def test_off_for_cpu_tensors() -> None:
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_for_hopper_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    monkeypatch.setenv("VEGAS_SPEC_PDL", "1")
    assert pdl.enabled(device) == hopper
    assert pdl.launch_options(device) == ({"launch_pdl": True} if hopper else {})
    monkeypatch.setenv("VEGAS_SPEC_PDL", "0")
    assert not pdl.enabled(device) and pdl.launch_options(device) == {}


def test_off_for_cpu_tensors_even_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VEGAS_SPEC_PDL", "1")
    assert not pdl.enabled(torch.device("cpu"))
