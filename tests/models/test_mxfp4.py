"""MXFP4 expert weights, as gpt-oss checkpoints ship them: known codes give known values,
the dequantised stacks equal transformers' own conversion, and a checkpoint written here with
`*_blocks`/`*_scales` in place of the experts' tensors gives transformers' logits of the same
weights; a half pair is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import assert_close_logits, family_engine, hf_logits, random_prompts, tiny_spec
from safetensors.torch import load_file, save_file
from test_gpt_oss import VOCAB, build_hf, save
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from vegas_spec import quant, runner_setup
from vegas_spec.config import SamplingParams
from vegas_spec.engine import LLM
from vegas_spec.models import loader, mxfp4
from vegas_spec.models.loader import WeightError

EXPERTS = ("gate_up_proj", "down_proj")
Quantized = tuple[Path, transformers.PreTrainedModel]


def test_known_codes_give_known_values() -> None:
    """Byte 0x2F: low nibble 0xF (-6) first, high nibble 0x2 (1); scale 128: times 2."""
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0], blocks[0, 1] = 0x2F, 0x9B  # -6, 1, then 0xB (-1.5), 0x9 (-0.5)
    values = mxfp4.dequantize(blocks, torch.tensor([128], dtype=torch.uint8), torch.float32)
    assert values.shape == (32,)  # one block of 32
    assert values[:4].tolist() == [-12.0, 2.0, -3.0, -1.0] and not values[4:].any()
    half = mxfp4.dequantize(blocks, torch.tensor([126], dtype=torch.uint8), torch.float32)
    assert half[:2].tolist() == [-3.0, 0.5]


def random_pair(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """blocks [E, rows, G, 16], scales [E, rows, G] of random codes, scales 2^-4..2^0."""
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(123, 128, shape, dtype=torch.uint8, generator=gen)
    return blocks, scales


def test_expert_stacks_equal_transformers_conversion() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks, scales = random_pair((3, 10, 2), gen)
    ours = mxfp4.expert_tensor(blocks, scales)
    assert ours.shape == (3, 64, 10) and ours.dtype == torch.bfloat16
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Quantized:
    """A tiny gpt-oss checkpoint whose experts are MXFP4 pairs, and transformers' model
    holding their values."""
    model = build_hf(seed=3)
    folder = save(model, tmp_path_factory.mktemp("gpt-oss-mxfp4"))
    tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for i, layer in enumerate(model.model.layers):
        for name in EXPERTS:
            stored = getattr(layer.mlp.experts, name)  # [E, in, out]
            e, rows, cols = stored.shape
            blocks, scales = random_pair((e, cols, rows // 32), gen)
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            with torch.no_grad():
                stored.copy_(convert_moe_packed_tensors(blocks, scales).float())
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, model


def test_a_checkpoint_of_mxfp4_experts_gives_transformers_logits(quantized: Quantized) -> None:
    folder, model = quantized
    prompt = random_prompts(1, (30,), VOCAB)[0]
    ref = hf_logits(model, prompt)
    assert ref.std() > 0.5
    assert_close_logits(LLM(str(folder), kv_cache_bytes=4 << 20).logits(prompt), ref)


def test_the_loader_gives_the_dequantised_tensors(quantized: Quantized) -> None:
    folder, model = quantized
    source = loader.resolve(folder)
    weights = loader.load_weights(source, loader.load_config(source))
    assert not any(k.endswith(("_blocks", "_scales")) for k in weights)
    assert torch.equal(weights["model.layers.2.mlp.experts.down_proj"].float(),
                       model.model.layers[2].mlp.experts.down_proj)


def test_blocks_without_scales_are_refused(quantized: Quantized, tmp_path: Path) -> None:
    folder, _ = quantized
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    source = loader.resolve(tmp_path)
    with pytest.raises(WeightError, match="down_proj_blocks has no model.layers.1.mlp.experts"
                                          ".down_proj_scales"):
        loader.load_weights(source, loader.load_config(source))


def test_exact_mxfp4_values_pack_back_bit_for_bit() -> None:
    """Dequantised MXFP4 stacks (every code, scales 2^-27..2^12, zero blocks, -0.0) give
    back an `Mxfp4` whose values are theirs, in bfloat16 and float32; values that never were
    MXFP4, or need a scale past the kernel's, give None."""
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=gen)
    blocks[0, 0, 0] = 0  # an all-zero block
    blocks[0, 0, 1] = 0x88  # -0.0 everywhere
    scales = torch.randint(100, 140, (3, 8, 4), dtype=torch.uint8, generator=gen)
    for dtype in (torch.bfloat16, torch.float32):
        values = quant.mxfp4_dequantize(blocks, scales, dtype)
        packed = quant.mxfp4_exact(values)
        assert packed is not None and packed.shape == (3, 8, 128)
        again = packed.dequantize(dtype)
        assert torch.equal(again, values) and torch.equal(again.signbit(), values.signbit())
    assert quant.mxfp4_exact(torch.randn(2, 4, 64, generator=gen)) is None
    assert quant.mxfp4_exact(torch.full((1, 1, 32), 7.0)) is None  # 7 = 3.5 x 2: no code
    assert quant.mxfp4_exact(torch.full((1, 1, 32), 6.0 * 2.0 ** 113)) is not None  # scale 240
    assert quant.mxfp4_exact(torch.full((1, 1, 32), 6.0 * 2.0 ** 114)) is None  # 241
    assert quant.mxfp4_exact(torch.full((1, 1, 32), 6.0 * 2.0 ** -125)) is not None  # scale 2
    assert quant.mxfp4_exact(torch.full((1, 1, 32), 6.0 * 2.0 ** -126)) is None  # 1


def test_experts_kept_in_mxfp4_give_the_same_tokens_and_logits(
        quantized: Quantized, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the engine keeps an MXFP4 checkpoint's experts as stored (forced here on the
    CPU, whose Triton backend runs the kernels in the interpreter), every MoE layer holds
    them packed, the logits are transformers' and the dense stacks' bit for bit, and vegas's
    greedy tokens are plain decoding's."""
    folder, model = quantized
    prompt = random_prompts(4, (30,), VOCAB)[0]
    dense = family_engine(folder, backend="triton", static_shapes=True)
    monkeypatch.setattr(runner_setup, "keeps_mxfp4", lambda *args: True)
    packed = family_engine(folder, backend="triton", static_shapes=True)
    layers = packed.engine.runner.model.layers
    assert all(layer.packed is not None and layer.experts_gate_up is None for layer in layers)
    logits = packed.logits(prompt)
    assert torch.equal(logits, dense.logits(prompt))
    assert_close_logits(logits, hf_logits(model, prompt))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = packed.generate([prompt], params, speculative=tiny_spec(None))[0].token_ids
    vegas = packed.generate([prompt], params, speculative=tiny_spec({"method": "vegas"}))
    assert vegas[0].token_ids == plain


def test_the_engine_keeps_mxfp4_only_where_the_kernel_reads_it() -> None:
    """On a GPU with the Triton backend; not on the CPU or the torch backend."""
    from types import SimpleNamespace

    triton, torch_backend = (SimpleNamespace(resolved_backend=b) for b in ("triton", "torch"))
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert runner_setup.keeps_mxfp4(triton, gpu)
    assert not runner_setup.keeps_mxfp4(triton, cpu)
    assert not runner_setup.keeps_mxfp4(torch_backend, gpu)


def test_a_ranks_slices_pack_where_they_hold_whole_blocks() -> None:
    """Tensor parallelism slices gate/up by output rows and down by inputs: row slices and
    input slices of whole blocks of 32 pack exactly; an input slice that cuts blocks (whose
    halves then share no scale) stays dense."""
    gen = torch.Generator().manual_seed(9)
    blocks = torch.randint(0, 256, (2, 6, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 130, (2, 6, 4), dtype=torch.uint8, generator=gen)
    whole = quant.mxfp4_dequantize(blocks, scales)  # [2, 6, 128]
    for part in (whole[:, :3], whole[:, 3:], whole[..., :64], whole[..., 64:]):
        packed = quant.mxfp4_exact(part.contiguous())
        assert packed is not None and torch.equal(packed.dequantize(torch.bfloat16), part)
    scales[:, :, 1] = scales[:, :, 0] + 4  # neighbouring blocks 16x apart
    blocks[:, :, 0] = 0x77  # block 0 all 6.0, its largest
    cut = quant.mxfp4_dequantize(blocks, scales)[..., 16:48]  # half of block 0, half of 1
    assert quant.mxfp4_exact(cut.contiguous()) is None
