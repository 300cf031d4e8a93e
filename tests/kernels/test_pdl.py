"""Programmatic dependent launch: only CUDA devices of sm_90 or later launch with it, so the
interpreter runs every kernel as before with the switch on; on such a GPU a chain of kernels
launched with it gives the bits it gives without it."""

from __future__ import annotations

import pytest
import torch

from vegas_spec.kernels import pdl
from vegas_spec.kernels.rms_norm import rms_norm
from vegas_spec.kernels.silu_mul import silu_mul
from vegas_spec.ops import rms_norm as rms_norm_reference


def test_the_interpreter_never_launches_with_it(monkeypatch) -> None:
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    x = torch.randn(4, 3, 64)
    w = torch.randn(64)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


def test_off_by_default() -> None:
    assert pdl.ENABLED is False
    assert pdl.launch(torch.device("cpu"))["launch_pdl"] is False


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability()[0] < 9, reason="needs sm_90")
def test_a_graph_of_dependent_launches_gives_the_same_bits(monkeypatch) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 2, 4096, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        h, r = x, res
        for _ in range(8):  # each kernel reads what the one before wrote
            h, r = rms_norm(h, w, 1e-6, r)
            h = silu_mul(torch.cat([h, r], dim=-1))
        return h

    want = chain()
    for enabled in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        graph = torch.cuda.CUDAGraph()
        chain()  # compile outside the capture
        with torch.cuda.graph(graph):
            out = chain()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"PDL {enabled}"
